//! Opening the routes the router chooses: a stream on one of this replica's agent sessions (a
//! dial request, then the agent's answer), or a connection to a peer replica that dials through
//! its own agent. Where a dial goes is decided in [`crate::router`]; here a failure that left the
//! target untouched (`DialError::is_retryable`) moves on to the router's next route.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tether_tunnel::framed::{read_frame, write_frame};
use tether_tunnel::mux::{MuxError, MuxStream};
use tether_tunnel::protocol::{DialRequest, ErrorCode, MAX_STREAM_FRAME, StreamOpen, StreamResult};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::OwnedSemaphorePermit;

use crate::metrics::{DIAL_DURATION, DIALS, STREAMS_OPEN};
use crate::peers::PeerSet;
use crate::peers::client::ForwardError;
use crate::registry::{AgentSession, StreamGuard};
use crate::router::{Route, Router, Scope};
use crate::target::DialTarget;
use crate::tenant::Tenant;

/// Extra time the gateway waits for the agent's answer beyond the agent's own dial timeout.
const ANSWER_MARGIN: Duration = Duration::from_secs(2);

/// Why a dial failed, with the HTTP status the CONNECT client gets.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// No connected agent can serve the target.
    #[error("no agent available for {0}")]
    NoAgent(String),
    /// The tenant has too many dials in flight.
    #[error("too many pending dials for this cluster (limit {0}); retry shortly")]
    TooManyPending(usize),
    /// The tenant opens new dials faster than `limits.dials_per_second`.
    #[error("too many new dials for this cluster (limit {0} per second); retry shortly")]
    RateLimited(u32),
    /// The tenant has too many open streams.
    #[error("too many open tunnelled connections for this cluster (limit {0})")]
    TooManyStreams(usize),
    /// The agent refused or failed the dial.
    #[error("agent {agent}: {message}")]
    Refused {
        /// Why.
        code: ErrorCode,
        /// The agent's reason.
        message: String,
        /// The agent that answered.
        agent: String,
    },
    /// No answer within the dial timeout.
    #[error("dial timed out after {} ms", .0.as_millis())]
    Timeout(Duration),
    /// The tunnel to the agent broke during the dial.
    #[error("tunnel to agent failed: {0}")]
    Tunnel(String),
}

impl DialError {
    /// HTTP status for a CONNECT client, following Konnectivity's mapping.
    pub fn status(&self) -> u16 {
        match self {
            Self::NoAgent(_) | Self::TooManyStreams(_) => 503,
            Self::TooManyPending(_) | Self::RateLimited(_) => 429,
            Self::Refused { code: ErrorCode::NotAllowed, .. } => 403,
            Self::Refused { code: ErrorCode::Timeout, .. } | Self::Timeout(_) => 504,
            Self::Refused { code: ErrorCode::LimitExceeded | ErrorCode::Draining, .. } => 503,
            Self::Refused { .. } | Self::Tunnel(_) => 502,
        }
    }

    /// Whether another route may still serve the dial: nothing reached the target (the session
    /// broke before the agent answered, or the peer no longer holds a suitable agent). An agent's
    /// own refusal, a timeout or a limit is final.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Tunnel(_) | Self::NoAgent(_))
    }

    /// Bounded label for the dials metric.
    pub fn label(&self) -> &'static str {
        match self {
            Self::NoAgent(_) => "no_agent",
            Self::TooManyPending(_) => "too_many_pending",
            Self::RateLimited(_) => "rate_limited",
            Self::TooManyStreams(_) => "too_many_streams",
            Self::Refused { code, .. } => code.as_str(),
            Self::Timeout(_) => "timeout",
            Self::Tunnel(_) => "tunnel_error",
        }
    }
}

/// The tunnelled stream: through one of this replica's agents, or through a peer replica.
pub enum DialedStream {
    /// A stream on a local agent session.
    Local(MuxStream),
    /// A connection to a peer replica that dialed through its agent.
    Peer(Box<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>),
}

impl AsyncRead for DialedStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Local(s) => Pin::new(s).poll_read(cx, buf),
            Self::Peer(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for DialedStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Local(s) => Pin::new(s).poll_write(cx, buf),
            Self::Peer(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Local(s) => Pin::new(s).poll_flush(cx),
            Self::Peer(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Local(s) => Pin::new(s).poll_shutdown(cx),
            Self::Peer(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// An open tunnelled stream to a target, with the bookkeeping that must live as long as it.
pub struct Dialed {
    /// The stream; raw bytes to and from the target.
    pub stream: DialedStream,
    /// Who carries it: an agent id, or `via <replica>`.
    pub carrier: String,
    /// The agent, when this replica's own agent carries it.
    pub agent: Option<String>,
    /// The peer replica it goes through, if any.
    pub via_replica: Option<String>,
    _load: Option<StreamGuard>,
    _permit: OwnedSemaphorePermit,
    _open: OpenStreamGauge,
}

struct OpenStreamGauge(Arc<str>);

impl OpenStreamGauge {
    fn new(tenant: &Arc<str>) -> Self {
        metrics::gauge!(STREAMS_OPEN, "tenant" => tenant.to_string()).increment(1.0);
        Self(tenant.clone())
    }
}

impl Drop for OpenStreamGauge {
    fn drop(&mut self) {
        metrics::gauge!(STREAMS_OPEN, "tenant" => self.0.to_string()).decrement(1.0);
    }
}

static REQUEST_IDS: AtomicU64 = AtomicU64::new(1);

/// Opens dials along the routes a [`Router`] chooses.
#[derive(Clone, Default)]
pub struct Dialer {
    router: Router,
    peers: Option<Arc<PeerSet>>,
}

impl Dialer {
    /// A dialer over this replica's agents and, when configured, its peers.
    pub fn new(peers: Option<Arc<PeerSet>>) -> Self {
        Self { router: Router::new(peers.clone()), peers }
    }

    /// Dials `target` for `tenant` along the whole routing chain, here and through peers; records
    /// the outcome in metrics, labelled with the frontend's `protocol` (`http-connect`, `grpc`).
    pub async fn dial(
        &self,
        tenant: &Tenant,
        target: &DialTarget,
        protocol: &'static str,
    ) -> Result<Dialed, DialError> {
        let started = Instant::now();
        // Counted once, where the dial enters the gateways (a peer-forwarded dial is not).
        let result = if tenant.dial_rate.try_take() {
            self.dial_scoped(tenant, target, Scope::Everywhere).await
        } else {
            Err(DialError::RateLimited(tenant.dial_rate.rate()))
        };
        let label = match &result {
            Ok(_) => "ok",
            Err(e) => e.label(),
        };
        metrics::counter!(DIALS, "tenant" => tenant.name.to_string(), "result" => label, "protocol" => protocol)
            .increment(1);
        metrics::histogram!(DIAL_DURATION, "tenant" => tenant.name.to_string(), "protocol" => protocol)
            .record(started.elapsed().as_secs_f64());
        result
    }

    /// Dials within `scope`, within the tenant's limits: the routes are tried in the router's order
    /// while failures are retryable.
    pub async fn dial_scoped(&self, tenant: &Tenant, target: &DialTarget, scope: Scope) -> Result<Dialed, DialError> {
        let config = tenant.config();
        let limits = &config.limits;
        let permit = tenant.streams.try_acquire().ok_or(DialError::TooManyStreams(limits.max_streams))?;
        let _pending = tenant.pending_dials.try_acquire().ok_or(DialError::TooManyPending(limits.max_pending_dials))?;
        let timeout = limits.dial_timeout.0;
        let request = StreamOpen::Dial(DialRequest {
            target: target.to_string(),
            timeout_ms: Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)),
            request_id: REQUEST_IDS.fetch_add(1, Ordering::Relaxed),
        });
        let deadline = tokio::time::Instant::now() + timeout;
        let mut routes = self.router.route(tenant, target, scope, deadline);
        let mut last_error = None;
        while let Some(route) = routes.next().await {
            match self.open(tenant, &route, &request, target, timeout).await {
                Ok((stream, load)) => {
                    tracing::debug!(tenant = %tenant.name, %target, carrier = %route.carrier(), "dial established");
                    let (agent, via_replica) = route.parties();
                    return Ok(Dialed {
                        stream,
                        carrier: route.carrier(),
                        agent,
                        via_replica,
                        _load: load,
                        _permit: permit,
                        _open: OpenStreamGauge::new(&tenant.name),
                    });
                }
                Err(e) if e.is_retryable() => {
                    tracing::debug!(tenant = %tenant.name, %target, carrier = %route.carrier(), error = %e, "route failed before reaching the target; trying the next");
                    last_error = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last_error.unwrap_or_else(|| DialError::NoAgent(target.to_string())))
    }

    async fn open(
        &self,
        tenant: &Tenant,
        route: &Route,
        request: &StreamOpen,
        target: &DialTarget,
        timeout: Duration,
    ) -> Result<(DialedStream, Option<StreamGuard>), DialError> {
        match route {
            Route::Local(agent) => {
                let load = agent.stream_guard();
                let stream = open_on_session(agent, request, timeout).await?;
                Ok((DialedStream::Local(stream), Some(load)))
            }
            Route::Peer { addr, strategy, .. } => {
                let Some(peers) = &self.peers else { return Err(DialError::NoAgent(target.to_string())) };
                let stream = peers
                    .client()
                    .forward(*addr, &tenant.name, *strategy, target, timeout)
                    .await
                    .map_err(|e| forward_error(e, target, timeout))?;
                Ok((DialedStream::Peer(Box::new(stream)), None))
            }
        }
    }
}

/// Opens a stream on `agent`'s session, sends the dial request and reads the agent's answer.
async fn open_on_session(
    agent: &AgentSession,
    request: &StreamOpen,
    timeout: Duration,
) -> Result<MuxStream, DialError> {
    let attempt = async {
        let mut stream = agent.session.open().await.map_err(|e| {
            if matches!(e, MuxError::Closed) {
                // The session ended since it was picked: route elsewhere from now on.
                agent.set_draining();
            }
            DialError::Tunnel(e.to_string())
        })?;
        write_frame(&mut stream, request, MAX_STREAM_FRAME).await.map_err(|e| DialError::Tunnel(e.to_string()))?;
        let result: StreamResult =
            read_frame(&mut stream, MAX_STREAM_FRAME).await.map_err(|e| DialError::Tunnel(e.to_string()))?;
        if result.ok {
            return Ok(stream);
        }
        let code = result.code.unwrap_or(ErrorCode::Other);
        let message = result.message.unwrap_or_else(|| code.to_string());
        Err(DialError::Refused { code, message, agent: agent.agent_id.clone() })
    };
    tokio::time::timeout(timeout + ANSWER_MARGIN, attempt).await.map_err(|_| DialError::Timeout(timeout))?
}

/// The dial error a peer's answer stands for, from its status and `Tether-Dial-Error` label.
fn forward_error(error: ForwardError, target: &DialTarget, timeout: Duration) -> DialError {
    let (status, label, message) = match error {
        ForwardError::Unreachable(reason) => return DialError::Tunnel(format!("peer: {reason}")),
        ForwardError::TimedOut => return DialError::Timeout(timeout),
        ForwardError::Refused { status, label, message } => (status, label, message),
    };
    match (status, label.as_deref()) {
        // The peer's session to the agent broke before the agent answered: nothing reached the
        // target, so another replica may serve the dial.
        (_, Some("tunnel_error")) => DialError::Tunnel(format!("peer: {message}")),
        (403, _) => DialError::Refused { code: ErrorCode::NotAllowed, message, agent: "peer".into() },
        (502, _) => DialError::Refused { code: ErrorCode::DialFailed, message, agent: "peer".into() },
        (504, _) => DialError::Timeout(timeout),
        (429, _) => DialError::TooManyPending(0),
        (503, _) => DialError::NoAgent(target.to_string()),
        (other, _) => DialError::Tunnel(format!("peer answered {other}: {message}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_session_on_the_peer_is_retryable_and_a_refusal_is_final() {
        let target = DialTarget::parse("10.0.0.5:10250").unwrap();
        let timeout = Duration::from_secs(5);
        let err = |status, label: Option<&str>| {
            let refused = ForwardError::Refused { status, label: label.map(str::to_owned), message: "why".into() };
            forward_error(refused, &target, timeout)
        };
        // Both 502: only the label tells them apart.
        assert!(matches!(err(502, Some("tunnel_error")), DialError::Tunnel(_)));
        assert!(matches!(err(502, Some("dial_failed")), DialError::Refused { code: ErrorCode::DialFailed, .. }));
        // An older peer without the header: the status alone decides, as before.
        assert!(matches!(err(502, None), DialError::Refused { .. }));
        assert!(matches!(err(503, Some("no_agent")), DialError::NoAgent(_)));
        assert!(matches!(err(403, None), DialError::Refused { code: ErrorCode::NotAllowed, .. }));
        assert!(matches!(err(504, None), DialError::Timeout(_)));
        assert!(matches!(err(418, None), DialError::Tunnel(_)));
        assert!(err(502, Some("tunnel_error")).is_retryable() && err(503, None).is_retryable());
        assert!(!err(403, None).is_retryable() && !err(504, None).is_retryable() && !err(429, None).is_retryable());
        assert!(forward_error(ForwardError::Unreachable("refused".into()), &target, timeout).is_retryable());
    }
}
