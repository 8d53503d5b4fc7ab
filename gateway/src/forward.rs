//! Node -> control-plane traffic (KEP-2025): a forward stream names a target; the gateway maps
//! the name through the tenant's allow list, resolves it, checks every resolved address against
//! the target's allowed networks, connects, and splices raw bytes (TLS is never terminated, so
//! clients see the control plane's own certificate). Nothing is allowed unless listed.

use std::net::IpAddr;
use std::time::{Duration, Instant};
use tether_tunnel::untrusted::printable;

use tether_tunnel::bulk_window::BulkWindow;
use tether_tunnel::connect::{AllowedConnectError, connect_allowed};
use tether_tunnel::framed::write_frame;
use tether_tunnel::mux::MuxStream;
use tether_tunnel::protocol::{ErrorCode, MAX_STREAM_FRAME, StreamResult};
use tether_tunnel::splice::{Direction, splice_mux};
use tokio::net::TcpStream;

use crate::audit;
use crate::config::ForwardTarget;
use crate::metrics::{FORWARD_BYTES, FORWARD_CONNECT_DURATION, FORWARDS, FORWARDS_OPEN};
use crate::target::{DialTarget, TargetHost};
use crate::tenant::Tenant;

/// Serves one forward stream from an agent of `tenant`; one audit line for it.
pub async fn serve(mut stream: MuxStream, tenant: &Tenant, requested: &str, agent_id: &str, replica: &str) {
    let config = tenant.config();
    let shown = printable(requested, 64);
    let listed = config.node_to_controlplane.as_ref().and_then(|n2c| n2c.targets.iter().find(|t| t.name == requested));
    // Metric labels: configured names only; anything else an agent sends is "unlisted".
    let label = listed.map(|t| t.name.clone()).unwrap_or_else(|| "unlisted".into());
    let started = Instant::now();
    let address = listed.map(|t| t.address.as_str()).unwrap_or_default();
    let audit = |result: &str, to_cp: u64, from_cp: u64| {
        audit::forward(&audit::Forward {
            tenant: &tenant.name,
            agent: agent_id,
            target: &shown,
            address,
            replica,
            result,
            bytes_to_controlplane: to_cp,
            bytes_from_controlplane: from_cp,
            started,
        });
    };
    let outcome = match listed {
        Some(target) => connect(tenant, target).await,
        None if config.node_to_controlplane.is_none() => Err(StreamResult::refused(
            ErrorCode::NotAllowed,
            format!("cluster {} allows no node-to-control-plane traffic (no node_to_controlplane list)", tenant.name),
        )),
        None => Err(StreamResult::refused(
            ErrorCode::NotAllowed,
            format!("{shown:?} is not on cluster {}'s node_to_controlplane list", tenant.name),
        )),
    };
    let result_label = match &outcome {
        Ok(_) => "ok",
        Err(refusal) => refusal.code.map(|c| c.as_str()).unwrap_or("other"),
    };
    metrics::counter!(FORWARDS, "tenant" => tenant.name.to_string(), "target" => label.clone(), "result" => result_label)
        .increment(1);
    let (mut upstream, _permit) = match outcome {
        Ok((upstream, permit)) => (BulkWindow::new(upstream), permit),
        Err(refusal) => {
            tracing::info!(
                tenant = %tenant.name,
                agent = %agent_id,
                target = %shown,
                reason = refusal.message.as_deref().unwrap_or_default(),
                "forward refused"
            );
            audit(result_label, 0, 0);
            let _ = write_frame(&mut stream, &refusal, MAX_STREAM_FRAME).await;
            return;
        }
    };
    metrics::histogram!(FORWARD_CONNECT_DURATION, "tenant" => tenant.name.to_string(), "target" => label.clone())
        .record(started.elapsed().as_secs_f64());
    if write_frame(&mut stream, &StreamResult::ok(), MAX_STREAM_FRAME).await.is_err() {
        audit("tunnel_error", 0, 0);
        return;
    }
    let (sent, received) = (audit::ByteCount::default(), audit::ByteCount::default());
    let open = metrics::gauge!(FORWARDS_OPEN, "tenant" => tenant.name.to_string(), "target" => label.clone());
    open.increment(1.0);
    let to_cp = metrics::counter!(FORWARD_BYTES, "tenant" => tenant.name.to_string(), "target" => label.clone(), "direction" => "to_controlplane");
    let from_cp = metrics::counter!(FORWARD_BYTES, "tenant" => tenant.name.to_string(), "target" => label, "direction" => "from_controlplane");
    let copied = splice_mux(&mut upstream, &mut stream, |direction, n| match direction {
        Direction::AToB => {
            from_cp.increment(n as u64);
            received.add(n);
        }
        Direction::BToA => {
            to_cp.increment(n as u64);
            sent.add(n);
        }
    })
    .await;
    open.decrement(1.0);
    audit("ok", sent.get(), received.get());
    if let Err(e) = copied {
        tracing::debug!(tenant = %tenant.name, agent = %agent_id, error = %e, "forwarded connection ended with an error");
    }
}

/// Resolves and connects to a listed target, within the tenant's limits.
async fn connect(
    tenant: &Tenant,
    target: &ForwardTarget,
) -> Result<(TcpStream, tokio::sync::OwnedSemaphorePermit), StreamResult> {
    let config = tenant.config();
    let limits = &config.limits;
    let permit = tenant.streams.try_acquire().ok_or_else(|| {
        StreamResult::refused(
            ErrorCode::LimitExceeded,
            format!("cluster stream limit ({}) reached", limits.max_streams),
        )
    })?;
    let _pending = tenant.pending_dials.try_acquire().ok_or_else(|| {
        StreamResult::refused(
            ErrorCode::LimitExceeded,
            format!("cluster pending-dial limit ({}) reached", limits.max_pending_dials),
        )
    })?;
    let timeout = limits.dial_timeout.0;
    let parsed = DialTarget::parse(&target.address).map_err(|e| {
        StreamResult::refused(ErrorCode::DialFailed, format!("target {} is misconfigured: {e}", target.name))
    })?;
    let host = match &parsed.host {
        TargetHost::Ip(ip) => ip.to_string(),
        TargetHost::Name(name) => name.clone(),
    };
    let upstream = connect_allowed(&host, parsed.port, timeout, |ip| address_allowed(target, &parsed, ip))
        .await
        .map_err(|e| match e {
            AllowedConnectError::NotAllowed { .. } => StreamResult::refused(
                ErrorCode::NotAllowed,
                format!(
                    "target {} resolves to {} which is outside its allowed networks",
                    target.name,
                    e.shown_addresses()
                ),
            ),
            AllowedConnectError::TimedOut(_) => StreamResult::refused(
                ErrorCode::Timeout,
                format!("connecting to {} timed out after {} ms", target.name, timeout.as_millis()),
            ),
            AllowedConnectError::Resolve { host, reason } => {
                StreamResult::refused(ErrorCode::DialFailed, format!("cannot resolve {host}: {reason}"))
            }
            AllowedConnectError::Failed(last) => {
                StreamResult::refused(ErrorCode::DialFailed, format!("cannot connect to {}: {last}", target.name))
            }
        })?;
    Ok((upstream, permit))
}

/// An IP literal target allows exactly itself; a DNS name allows addresses in its networks.
fn address_allowed(target: &ForwardTarget, parsed: &DialTarget, ip: IpAddr) -> bool {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    };
    match parsed.host {
        TargetHost::Ip(listed) => listed == ip || target.allowed_networks.iter().any(|n| n.contains(&ip)),
        TargetHost::Name(_) => target.allowed_networks.iter().any(|n| n.contains(&ip)),
    }
}

/// How long forward streams may take to send their header (also used by the session).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
