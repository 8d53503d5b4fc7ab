//! Metric names and descriptions. Labels come from small fixed sets.

/// Live sessions to gateway replicas.
pub const SESSIONS: &str = "tether_agent_sessions";
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

/// Registers descriptions so `/metrics` carries HELP lines.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(SESSIONS, "Live sessions to gateway replicas.");
    describe_counter!(CONNECTS, "Connection attempts to the gateway by result.");
    describe_counter!(DIALS, "Dials served by result.");
    describe_histogram!(DIAL_DURATION, Unit::Seconds, "Time to connect to node-side targets.");
    describe_gauge!(STREAMS_OPEN, "Tunnelled connections open.");
    describe_counter!(BYTES, Unit::Bytes, "Bytes tunnelled by direction.");
    describe_counter!(TOKEN_REFRESHES, "Token refreshes sent on live sessions by result.");
    describe_counter!(DRAINS, "Drain requests received from gateways.");
    metrics::gauge!(SESSIONS).set(0.0);
}
