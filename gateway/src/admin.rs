//! The admin endpoint: liveness, readiness and Prometheus metrics, on its own port so it can be
//! firewalled apart from the agent and frontend ports.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::server::Shared;

#[derive(Clone)]
struct AdminState {
    shared: Arc<Shared>,
    metrics: Option<PrometheusHandle>,
}

/// The admin routes.
pub fn router(shared: Arc<Shared>, metrics: Option<PrometheusHandle>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/readyz/tenant/{name}", get(tenant_ready))
        .route("/metrics", get(render_metrics))
        .with_state(AdminState { shared, metrics })
}

/// Ready while every listener is up and the gateway is not draining; the body says why not.
async fn readyz(State(state): State<AdminState>) -> (StatusCode, String) {
    let shared = &state.shared;
    if shared.unready.load(std::sync::atomic::Ordering::Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n".into());
    }
    if !shared.listeners_up.load(std::sync::atomic::Ordering::Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, "listeners not up yet\n".into());
    }
    let mut body = String::from("ready\n");
    for tenant in shared.tenants.load().iter() {
        body.push_str(&format!("tenant {}: {} agent sessions\n", tenant.name, tenant.registry.len()));
    }
    (StatusCode::OK, body)
}

/// Whether this replica can serve dials for one tenant: through its own agents, or through a
/// peer replica that holds some.
async fn tenant_ready(
    State(state): State<AdminState>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> (StatusCode, String) {
    let shared = &state.shared;
    if shared.unready.load(std::sync::atomic::Ordering::Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n".into());
    }
    let Some(tenant) = shared.tenants.load().by_name(&name) else {
        return (StatusCode::NOT_FOUND, format!("no cluster named {name}\n"));
    };
    let local = tenant.registry.len();
    if local > 0 {
        return (StatusCode::OK, format!("ready: {local} local agent sessions\n"));
    }
    if shared.peers.as_ref().is_some_and(|p| p.tenant_served_elsewhere(&name)) {
        return (StatusCode::OK, "ready: agents reachable through a peer replica\n".into());
    }
    (StatusCode::SERVICE_UNAVAILABLE, format!("no agent of cluster {name} on this or any peer replica\n"))
}

async fn render_metrics(State(state): State<AdminState>) -> (StatusCode, [(&'static str, &'static str); 1], String) {
    let content_type = [("content-type", "text/plain; version=0.0.4; charset=utf-8")];
    match &state.metrics {
        Some(handle) => (StatusCode::OK, content_type, handle.render()),
        None => (StatusCode::NOT_FOUND, content_type, "metrics are not enabled in this process\n".into()),
    }
}
