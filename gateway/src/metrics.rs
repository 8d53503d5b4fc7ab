//! Metric names and descriptions. Labels are bounded: tenant names, results and reasons from
//! fixed sets, never one series per agent or per target.

/// Agent sessions connected, by tenant.
pub const AGENT_SESSIONS: &str = "tether_gateway_agent_sessions";
/// Agents with at least one session (an agent may hold several per replica).
pub const AGENTS: &str = "tether_gateway_agents";
/// Agent connection attempts by tenant and result (`ok` or an auth/limit reason).
pub const AGENT_CONNECTS: &str = "tether_gateway_agent_connects_total";
/// Tunnelled streams open, by tenant.
pub const STREAMS_OPEN: &str = "tether_gateway_streams_open";
/// Dials by tenant, result and frontend protocol (`http-connect`, `grpc`); `cancelled` counts
/// gRPC dials the client abandoned with `DIAL_CLS` or by going away.
pub const DIALS: &str = "tether_gateway_dials_total";
/// Time from the dial request (CONNECT or `DIAL_REQ`) to the agent's answer, by tenant and protocol.
pub const DIAL_DURATION: &str = "tether_gateway_dial_duration_seconds";
/// Bytes tunnelled by tenant and direction (`to_agent`, `from_agent`).
pub const BYTES: &str = "tether_gateway_bytes_total";
/// Token refreshes on live sessions by tenant and result.
pub const TOKEN_REFRESHES: &str = "tether_gateway_token_refreshes_total";
/// Sessions closed by tenant and reason.
pub const SESSIONS_CLOSED: &str = "tether_gateway_sessions_closed_total";
/// Forward streams (node -> control plane) by tenant, target and result.
pub const FORWARDS: &str = "tether_gateway_forwards_total";
/// Forwarded connections open, by tenant and target.
pub const FORWARDS_OPEN: &str = "tether_gateway_forwards_open";
/// Forwarded bytes by tenant, target and direction (`to_controlplane`, `from_controlplane`).
pub const FORWARD_BYTES: &str = "tether_gateway_forward_bytes_total";
/// Time to connect to a control-plane target, by tenant and target.
pub const FORWARD_CONNECT_DURATION: &str = "tether_gateway_forward_connect_duration_seconds";
/// Dials served for peer replicas, by tenant and result.
pub const PEER_DIALS: &str = "tether_gateway_peer_dials_total";
/// Replicas serving, this one included (from peer discovery).
pub const REPLICAS: &str = "tether_gateway_replicas";
/// Configuration reloads by result.
pub const CONFIG_RELOADS: &str = "tether_gateway_config_reloads_total";
/// 1 if the last configuration reload succeeded, 0 if it failed (the old one stays in force).
pub const CONFIG_LAST_RELOAD_OK: &str = "tether_gateway_config_last_reload_success";
/// 1 while the gateway is draining.
pub const DRAINING: &str = "tether_gateway_draining";
/// Agent claims (addresses, networks, host names, default route) refused, by tenant and reason.
pub const CLAIMS_REFUSED: &str = "tether_gateway_claims_refused_total";
/// Agent connections closed before their handshake, by reason (`too_many_handshakes`,
/// `source_rate`).
pub const CONNECTIONS_REFUSED: &str = "tether_gateway_connections_refused_total";
/// Tasks alive on the gateway's runtime (read at each scrape): connections, streams, timers and
/// background work; it returns to its idle level when the load ends, so a rise that stays is a leak.
pub const RUNTIME_TASKS: &str = "tether_gateway_runtime_tasks";
/// Worker threads of the runtime (`runtime.worker_threads`, or one per CPU).
pub const RUNTIME_WORKERS: &str = "tether_gateway_runtime_workers";
/// Build information.
pub const BUILD_INFO: &str = "tether_gateway_build_info";

/// Registers descriptions so `/metrics` carries HELP lines.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(AGENT_SESSIONS, "Agent sessions connected.");
    describe_gauge!(AGENTS, "Agents connected (with one or more sessions).");
    describe_gauge!(RUNTIME_TASKS, "Tasks alive on the runtime, read at each scrape.");
    describe_gauge!(RUNTIME_WORKERS, "Worker threads of the runtime.");
    describe_counter!(AGENT_CONNECTS, "Agent connection attempts by result.");
    describe_gauge!(STREAMS_OPEN, "Tunnelled streams open.");
    describe_counter!(DIALS, "Dials by result.");
    describe_histogram!(
        DIAL_DURATION,
        Unit::Seconds,
        "Time from the dial request (CONNECT or DIAL_REQ) to the agent's answer."
    );
    describe_counter!(BYTES, Unit::Bytes, "Bytes tunnelled by direction.");
    describe_counter!(TOKEN_REFRESHES, "Token refreshes on live sessions by result.");
    describe_counter!(SESSIONS_CLOSED, "Agent sessions closed by reason.");
    describe_counter!(FORWARDS, "Forward streams (node to control plane) by target and result.");
    describe_gauge!(FORWARDS_OPEN, "Forwarded connections open.");
    describe_counter!(FORWARD_BYTES, Unit::Bytes, "Forwarded bytes by direction.");
    describe_histogram!(FORWARD_CONNECT_DURATION, Unit::Seconds, "Time to connect to a control-plane target.");
    describe_counter!(PEER_DIALS, "Dials served for peer replicas by result.");
    describe_gauge!(REPLICAS, "Gateway replicas serving, this one included.");
    describe_counter!(CONFIG_RELOADS, "Configuration reloads by result.");
    describe_gauge!(CONFIG_LAST_RELOAD_OK, "1 if the last configuration reload succeeded.");
    describe_gauge!(DRAINING, "1 while the gateway is draining.");
    describe_counter!(
        CLAIMS_REFUSED,
        "Agent claims refused because another node holds them or the configuration does not allow them."
    );
    describe_counter!(CONNECTIONS_REFUSED, "Agent connections closed before their handshake (admission limits).");
    describe_gauge!(BUILD_INFO, "Build information.");
    metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    metrics::gauge!(DRAINING).set(0.0);
    metrics::gauge!(CONFIG_LAST_RELOAD_OK).set(1.0);
}
