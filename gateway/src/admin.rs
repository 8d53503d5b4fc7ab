//! The admin endpoint: liveness, readiness and Prometheus metrics, on its own port so it can be
//! firewalled apart from the agent and frontend ports.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::lifecycle::Lifecycle;
use crate::peers::PeerSet;
use crate::tenant::TenantSet;

/// What the admin endpoint reports on.
#[derive(Clone)]
pub struct AdminState {
    /// Readiness.
    pub lifecycle: Arc<Lifecycle>,
    /// The tenants in force.
    pub tenants: Arc<TenantSet>,
    /// The other replicas, when configured.
    pub peers: Option<Arc<PeerSet>>,
    /// The metrics exporter, when installed.
    pub metrics: Option<PrometheusHandle>,
}

/// The admin routes.
pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/readyz/tenant/{name}", get(tenant_ready))
        .route("/metrics", get(render_metrics))
        .with_state(state)
}

/// Ready while every listener is up, the gateway is not draining and every tenant has signing
/// keys (or a TokenReview API) to check its agents' tokens; the body says why not.
async fn readyz(State(state): State<AdminState>) -> (StatusCode, String) {
    if let Some(reason) = state.lifecycle.not_ready_reason() {
        return (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n"));
    }
    let tenants = state.tenants.load();
    let without_keys: Vec<String> =
        tenants.iter().filter(|t| !t.verifier().has_keys()).map(|t| no_keys(&t.name)).collect();
    if !without_keys.is_empty() {
        return (StatusCode::SERVICE_UNAVAILABLE, without_keys.concat());
    }
    let mut body = String::from("ready\n");
    for tenant in tenants.iter() {
        body.push_str(&format!(
            "tenant {}: {} agent sessions, {} agents\n",
            tenant.name,
            tenant.registry.len(),
            tenant.registry.agents()
        ));
    }
    (StatusCode::OK, body)
}

/// Whether this replica can serve dials for one tenant: through its own agents, or through a
/// peer replica that holds some.
async fn tenant_ready(
    State(state): State<AdminState>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> (StatusCode, String) {
    if state.lifecycle.not_ready_reason() == Some("draining") {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n".into());
    }
    let Some(tenant) = state.tenants.load().by_name(&name) else {
        return (StatusCode::NOT_FOUND, format!("no cluster named {name}\n"));
    };
    if !tenant.verifier().has_keys() {
        return (StatusCode::SERVICE_UNAVAILABLE, no_keys(&tenant.name));
    }
    let local = tenant.registry.len();
    if local > 0 {
        return (StatusCode::OK, format!("ready: {local} local agent sessions, {} agents\n", tenant.registry.agents()));
    }
    if state.peers.as_ref().is_some_and(|p| p.tenant_served_elsewhere(&name)) {
        return (StatusCode::OK, "ready: agents reachable through a peer replica\n".into());
    }
    (StatusCode::SERVICE_UNAVAILABLE, format!("no agent of cluster {name} on this or any peer replica\n"))
}

fn no_keys(tenant: &str) -> String {
    format!("tenant {tenant}: no signing keys loaded yet (issuer unreachable or its JWKS invalid; see the log)\n")
}

async fn render_metrics(State(state): State<AdminState>) -> (StatusCode, [(&'static str, &'static str); 1], String) {
    use crate::metrics::{RUNTIME_TASKS, RUNTIME_WORKERS};
    tether_tunnel::telemetry::metrics_response(state.metrics.as_ref(), RUNTIME_TASKS, RUNTIME_WORKERS)
}
