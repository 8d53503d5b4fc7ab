//! Serving the streams the gateway opens: check the target against the allow list, connect with
//! a timeout, answer, then copy bytes both ways with half-close.

use std::sync::Arc;
use std::time::{Duration, Instant};
use tether_tunnel::untrusted::printable;

use tether_tunnel::bulk_window::BulkWindow;
use tether_tunnel::connect::{AllowedConnectError, connect_allowed};
use tether_tunnel::framed::{read_raw_frame, write_frame};
use tether_tunnel::mux::MuxStream;
use tether_tunnel::protocol::{self, DialRequest, ErrorCode, MAX_STREAM_FRAME, StreamOpen, StreamResult};
use tether_tunnel::splice::{Direction, splice_mux};
use tokio::net::TcpStream;

use crate::allowlist::AllowList;
use crate::metrics::{BYTES, DIAL_DURATION, DIALS, STREAMS_OPEN};

/// How long the gateway has to send a stream's header.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// What serving a dial needs.
pub struct DialPolicy {
    /// What may be dialed.
    pub allow: AllowList,
    /// Upper bound on connect time.
    pub max_timeout: Duration,
}

/// Serves one stream the gateway opened.
pub async fn serve_stream(mut stream: MuxStream, policy: Arc<DialPolicy>) {
    let raw = match tokio::time::timeout(HEADER_TIMEOUT, read_raw_frame(&mut stream, MAX_STREAM_FRAME)).await {
        Ok(Ok(raw)) => raw,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "stream closed before its header");
            return;
        }
        Err(_) => {
            tracing::debug!("stream sent no header in time");
            return;
        }
    };
    let request = match protocol::decode::<StreamOpen>(&raw, MAX_STREAM_FRAME) {
        Ok(Some((StreamOpen::Dial(request), _))) => request,
        Ok(Some((StreamOpen::Unknown, _))) => {
            let kind = protocol::stream_kind_name(&raw);
            let refusal = StreamResult::refused(ErrorCode::Unsupported, format!("unknown stream kind {kind:?}"));
            let _ = write_frame(&mut stream, &refusal, MAX_STREAM_FRAME).await;
            return;
        }
        Ok(Some(_)) => {
            let refusal = StreamResult::refused(ErrorCode::Unsupported, "the agent only accepts dial streams");
            let _ = write_frame(&mut stream, &refusal, MAX_STREAM_FRAME).await;
            return;
        }
        Ok(None) | Err(_) => {
            let refusal = StreamResult::refused(ErrorCode::BadRequest, "malformed stream header");
            let _ = write_frame(&mut stream, &refusal, MAX_STREAM_FRAME).await;
            return;
        }
    };
    let started = Instant::now();
    // The gateway resets the stream when its client gives up on the dial (a cancelled gRPC dial,
    // a CONNECT client gone): stop connecting at once instead of holding a half-open attempt.
    let outcome = tokio::select! {
        outcome = connect(&request, &policy) => outcome,
        () = stream.abandoned() => {
            metrics::counter!(DIALS, "result" => "abandoned").increment(1);
            tracing::debug!(request_id = request.request_id, "dial abandoned by the gateway");
            return;
        }
    };
    metrics::histogram!(DIAL_DURATION).record(started.elapsed().as_secs_f64());
    let mut target = match outcome {
        Ok(target) => BulkWindow::new(target),
        Err(refusal) => {
            let label = refusal.code.map(|c| c.as_str()).unwrap_or("other");
            metrics::counter!(DIALS, "result" => label).increment(1);
            tracing::info!(
                request_id = request.request_id,
                target = %printable(&request.target, 260),
                reason = refusal.message.as_deref().unwrap_or_default(),
                "dial refused"
            );
            let _ = write_frame(&mut stream, &refusal, MAX_STREAM_FRAME).await;
            return;
        }
    };
    metrics::counter!(DIALS, "result" => "ok").increment(1);
    if write_frame(&mut stream, &StreamResult::ok(), MAX_STREAM_FRAME).await.is_err() {
        return;
    }
    tracing::debug!(request_id = request.request_id, target = %request.target, "dial established");
    let _open = OpenStream::new();
    let to_target = metrics::counter!(BYTES, "direction" => "to_target");
    let from_target = metrics::counter!(BYTES, "direction" => "from_target");
    let copied = splice_mux(&mut target, &mut stream, |direction, n| match direction {
        Direction::AToB => from_target.increment(n as u64),
        Direction::BToA => to_target.increment(n as u64),
    })
    .await;
    if let Err(e) = copied {
        tracing::debug!(request_id = request.request_id, error = %e, "tunnelled connection ended with an error");
    }
}

/// Resolves and connects to the target if the allow list permits it.
async fn connect(request: &DialRequest, policy: &DialPolicy) -> Result<TcpStream, StreamResult> {
    let (host, port) = split_target(&request.target).ok_or_else(|| {
        StreamResult::refused(ErrorCode::BadRequest, format!("{:?} is not host:port", printable(&request.target, 260)))
    })?;
    if !policy.allow.allows_port(port) {
        return Err(StreamResult::refused(
            ErrorCode::NotAllowed,
            format!("port {port} is not on this agent's allow list"),
        ));
    }
    let timeout = request.timeout_ms.map(Duration::from_millis).unwrap_or(policy.max_timeout).min(policy.max_timeout);
    connect_allowed(host, port, timeout, |ip| policy.allow.allows(ip, port)).await.map_err(|e| match e {
        AllowedConnectError::NotAllowed { resolved } => {
            let shown: Vec<String> = resolved.iter().take(4).map(ToString::to_string).collect();
            StreamResult::refused(
                ErrorCode::NotAllowed,
                format!("{} ({}) is not on this agent's allow list", printable(&request.target, 260), shown.join(", ")),
            )
        }
        AllowedConnectError::TimedOut(_) => StreamResult::refused(
            ErrorCode::Timeout,
            format!("connecting to {} timed out after {} ms", request.target, timeout.as_millis()),
        ),
        AllowedConnectError::Resolve { host, reason } => {
            StreamResult::refused(ErrorCode::DialFailed, format!("cannot resolve {host}: {reason}"))
        }
        AllowedConnectError::Failed(last) => {
            StreamResult::refused(ErrorCode::DialFailed, format!("cannot connect to {}: {last}", request.target))
        }
    })
}

/// `host:port` or `[v6]:port` -> (host, port).
fn split_target(target: &str) -> Option<(&str, u16)> {
    let (host, port) =
        if let Some(rest) = target.strip_prefix('[') { rest.split_once("]:")? } else { target.rsplit_once(':')? };
    let port: u16 = port.parse().ok()?;
    (!host.is_empty() && port != 0).then_some((host, port))
}

struct OpenStream;

impl OpenStream {
    fn new() -> Self {
        metrics::gauge!(STREAMS_OPEN).increment(1.0);
        Self
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        metrics::gauge!(STREAMS_OPEN).decrement(1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::split_target;

    #[test]
    fn targets_split_into_host_and_port() {
        assert_eq!(split_target("10.0.0.5:10250"), Some(("10.0.0.5", 10250)));
        assert_eq!(split_target("[fd00::1]:22"), Some(("fd00::1", 22)));
        assert_eq!(split_target("node-1:443"), Some(("node-1", 443)));
        assert_eq!(split_target("node-1"), None);
        assert_eq!(split_target(":80"), None);
        assert_eq!(split_target("a:0"), None);
    }
}
