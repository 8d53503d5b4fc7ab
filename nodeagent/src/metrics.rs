//! Metric names and descriptions. Labels come from small fixed sets.

/// Live sessions to gateway replicas.
pub const SESSIONS: &str = "tether_agent_sessions";
/// 1 while the agent is busy (its sessions move `pool.busy_mib_per_second` or more, or did within
/// `pool.busy_linger`): it then holds `pool.busy_sessions_per_replica` sessions to each replica.
pub const BUSY: &str = "tether_agent_busy";
/// Connection attempts by result.
pub const CONNECTS: &str = "tether_agent_connects_total";
/// Dials served by result.
pub const DIALS: &str = "tether_agent_dials_total";
/// Time to connect to node-side targets.
pub const DIAL_DURATION: &str = "tether_agent_dial_duration_seconds";
/// Tunnelled connections open.
pub const STREAMS_OPEN: &str = "tether_agent_streams_open";
/// Bytes by direction (`to_target`, `from_target`).
pub const BYTES: &str = "tether_agent_bytes_total";
/// Token refreshes sent on live sessions by result.
pub const TOKEN_REFRESHES: &str = "tether_agent_token_refreshes_total";
/// Drain requests received from gateways.
pub const DRAINS: &str = "tether_agent_drains_total";
/// 1 while the token file holds a token worth presenting, 0 while the agent waits for one.
pub const TOKEN_USABLE: &str = "tether_agent_token_usable";
/// The `exp` of the token last read from the token file (Unix seconds).
pub const TOKEN_EXPIRY: &str = "tether_agent_token_expiry_timestamp_seconds";

/// Tasks alive on the agent's runtime (read at each scrape); back to its idle level once the
/// load ends.
pub const RUNTIME_TASKS: &str = "tether_agent_runtime_tasks";
/// Worker threads of the runtime (`runtime.worker_threads`, or one per CPU).
pub const RUNTIME_WORKERS: &str = "tether_agent_runtime_workers";

/// Forwarded connections (node -> control plane) by target and result.
pub const FORWARDS: &str = "tether_agent_forwards_total";
/// Forwarded connections open, by target.
pub const FORWARDS_OPEN: &str = "tether_agent_forwards_open";
/// Forwarded bytes by target and direction (`to_controlplane`, `from_controlplane`).
pub const FORWARD_BYTES: &str = "tether_agent_forward_bytes_total";
/// Time from accepting a node-side connection to the gateway's answer, by target.
pub const FORWARD_CONNECT_DURATION: &str = "tether_agent_forward_connect_duration_seconds";

/// Registers descriptions so `/metrics` carries HELP lines.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(SESSIONS, "Live sessions to gateway replicas.");
    describe_gauge!(
        BUSY,
        "1 while the agent is busy (traffic at the busy rate, or within the busy linger) and holds its busy sessions."
    );
    describe_gauge!(RUNTIME_TASKS, "Tasks alive on the runtime, read at each scrape.");
    describe_gauge!(RUNTIME_WORKERS, "Worker threads of the runtime.");
    describe_counter!(CONNECTS, "Connection attempts to the gateway by result.");
    describe_counter!(DIALS, "Dials served by result.");
    describe_histogram!(DIAL_DURATION, Unit::Seconds, "Time to connect to node-side targets.");
    describe_gauge!(STREAMS_OPEN, "Tunnelled connections open.");
    describe_counter!(BYTES, Unit::Bytes, "Bytes tunnelled by direction.");
    describe_counter!(TOKEN_REFRESHES, "Token refreshes sent on live sessions by result.");
    describe_counter!(DRAINS, "Drain requests received from gateways.");
    describe_gauge!(TOKEN_USABLE, "1 while the token file holds a usable token, 0 while the agent waits for one.");
    describe_gauge!(TOKEN_EXPIRY, Unit::Seconds, "Expiry (exp, Unix time) of the token last read from the token file.");
    describe_counter!(FORWARDS, "Forwarded connections (node to control plane) by target and result.");
    describe_gauge!(FORWARDS_OPEN, "Forwarded connections open.");
    describe_counter!(FORWARD_BYTES, Unit::Bytes, "Forwarded bytes by direction.");
    describe_histogram!(
        FORWARD_CONNECT_DURATION,
        Unit::Seconds,
        "Time from a node-side connection to the gateway's answer."
    );
    metrics::gauge!(SESSIONS).set(0.0);
    metrics::gauge!(BUSY).set(0.0);
}
