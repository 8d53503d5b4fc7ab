//! The agent's admin endpoint: liveness, readiness (a live session to the gateway) and metrics.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::connection::AgentState;

#[derive(Clone)]
struct AdminState {
    agent: Arc<AgentState>,
    metrics: Option<PrometheusHandle>,
}

/// The admin routes.
pub fn router(agent: Arc<AgentState>, metrics: Option<PrometheusHandle>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .with_state(AdminState { agent, metrics })
}

async fn readyz(State(state): State<AdminState>) -> (StatusCode, String) {
    let live = state.agent.live_sessions();
    let servers = state.agent.server_ids().join(", ");
    if state.agent.is_ready() {
        (StatusCode::OK, format!("ready: {live} session(s) to {servers}\n"))
    } else if live > 0 {
        let wanted = state.agent.server_count();
        (StatusCode::SERVICE_UNAVAILABLE, format!("connected to {live} of {wanted} gateway replicas ({servers})\n"))
    } else {
        let reason =
            state.agent.token_problem().or_else(|| state.agent.last_error()).unwrap_or_else(|| "connecting".into());
        (StatusCode::SERVICE_UNAVAILABLE, format!("not connected to the gateway: {reason}\n"))
    }
}

async fn render_metrics(State(state): State<AdminState>) -> (StatusCode, [(&'static str, &'static str); 1], String) {
    use crate::metrics::{RUNTIME_TASKS, RUNTIME_WORKERS};
    tether_tunnel::telemetry::metrics_response(state.metrics.as_ref(), RUNTIME_TASKS, RUNTIME_WORKERS)
}
