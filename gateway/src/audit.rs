//! The audit log: one line per dial (kube-apiserver -> node) and per node -> control-plane
//! forward, at `info` under the log target `audit`, written when the connection ends (or is
//! refused). The field names and their meaning are a stable interface (docs/operations.md, "Audit
//! log"): add fields, never rename or remove them. Every field is always present, empty when it
//! does not apply, so log pipelines can rely on the shape.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The log target of audit lines (`RUST_LOG=warn,audit=info` keeps them with a quieter log).
pub const TARGET: &str = "audit";

/// Bytes one way, counted by the splice as they pass.
#[derive(Debug, Default)]
pub struct ByteCount(AtomicU64);

impl ByteCount {
    /// Adds `n` bytes.
    pub fn add(&self, n: usize) {
        self.0.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// The total so far.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// One dial, from CONNECT to close.
#[derive(Debug)]
pub struct Dial<'a> {
    /// The tenant.
    pub tenant: &'a str,
    /// `unix`, `tcp`, `tcp+tls`, `tcp+mtls` or `shared` (the shared mutual-TLS frontend).
    pub frontend: &'static str,
    /// `http-connect` or `grpc`.
    pub protocol: &'static str,
    /// The client's address (empty on a Unix socket).
    pub peer: &'a str,
    /// The client certificate's first DNS name, on mutual-TLS frontends.
    pub client_name: Option<&'a str>,
    /// `host:port` as requested.
    pub target: &'a str,
    /// This replica.
    pub replica: &'a str,
    /// The agent that carried it (empty when it went through a peer replica or nowhere).
    pub agent: Option<&'a str>,
    /// The peer replica it went through, if any.
    pub via_replica: Option<&'a str>,
    /// `ok` or the failure label of `tether_gateway_dials_total`.
    pub result: &'a str,
    /// The HTTP status of the CONNECT answer; in gRPC mode the status the same outcome has there
    /// (the `DIAL_RSP` carries its reason), and 499 for a dial the client cancelled.
    pub status: u16,
    /// Bytes towards the node.
    pub bytes_to_node: u64,
    /// Bytes from the node.
    pub bytes_from_node: u64,
    /// When the CONNECT request was read.
    pub started: Instant,
}

/// Writes the line for a dial.
pub fn dial(d: &Dial<'_>) {
    tracing::info!(
        target: TARGET,
        event = "dial",
        tenant = d.tenant,
        frontend = d.frontend,
        protocol = d.protocol,
        peer = d.peer,
        client_name = d.client_name.unwrap_or_default(),
        destination = d.target,
        replica = d.replica,
        agent = d.agent.unwrap_or_default(),
        via_replica = d.via_replica.unwrap_or_default(),
        result = d.result,
        status = d.status,
        bytes_to_node = d.bytes_to_node,
        bytes_from_node = d.bytes_from_node,
        duration_ms = u64::try_from(d.started.elapsed().as_millis()).unwrap_or(u64::MAX),
        "dial"
    );
}

/// One node -> control-plane forward, from the agent's request to close.
#[derive(Debug)]
pub struct Forward<'a> {
    /// The tenant.
    pub tenant: &'a str,
    /// The agent (node) that forwarded.
    pub agent: &'a str,
    /// The target name the agent asked for (made printable).
    pub target: &'a str,
    /// The address it maps to (empty when refused before).
    pub address: &'a str,
    /// This replica.
    pub replica: &'a str,
    /// `ok` or the refusal code.
    pub result: &'a str,
    /// Bytes towards the control plane.
    pub bytes_to_controlplane: u64,
    /// Bytes from the control plane.
    pub bytes_from_controlplane: u64,
    /// When the request arrived.
    pub started: Instant,
}

/// Writes the line for a forward.
pub fn forward(f: &Forward<'_>) {
    tracing::info!(
        target: TARGET,
        event = "forward",
        tenant = f.tenant,
        agent = f.agent,
        destination = f.target,
        address = f.address,
        replica = f.replica,
        result = f.result,
        bytes_to_controlplane = f.bytes_to_controlplane,
        bytes_from_controlplane = f.bytes_from_controlplane,
        duration_ms = u64::try_from(f.started.elapsed().as_millis()).unwrap_or(u64::MAX),
        "forward"
    );
}
