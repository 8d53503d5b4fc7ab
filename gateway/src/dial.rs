//! Dialing a node-side target through one of the tenant's agents.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use tether_tunnel::framed::{read_frame, write_frame};
use tether_tunnel::mux::{MuxError, MuxStream};
use tether_tunnel::protocol::{DialRequest, ErrorCode, MAX_STREAM_FRAME, StreamOpen, StreamResult};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::OwnedSemaphorePermit;

use crate::config::RoutingStrategy;
use crate::server::Shared;

use crate::metrics::{DIAL_DURATION, DIALS, STREAMS_OPEN};
use crate::registry::{AgentSession, StreamGuard};
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
            Self::TooManyPending(_) => 429,
            Self::Refused { code: ErrorCode::NotAllowed, .. } => 403,
            Self::Refused { code: ErrorCode::Timeout, .. } | Self::Timeout(_) => 504,
            Self::Refused { code: ErrorCode::LimitExceeded | ErrorCode::Draining, .. } => 503,
            Self::Refused { .. } | Self::Tunnel(_) => 502,
        }
    }

    /// Bounded label for the dials metric.
    pub fn label(&self) -> &'static str {
        match self {
            Self::NoAgent(_) => "no_agent",
            Self::TooManyPending(_) => "too_many_pending",
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

/// Dials `target` for `tenant`: each routing strategy is tried on this replica's agents first,
/// then on peer replicas whose agents match (one hop). Records the outcome in metrics.
pub async fn dial(shared: &Shared, tenant: &Tenant, target: &DialTarget) -> Result<Dialed, DialError> {
    let started = Instant::now();
    let result = dial_routed(shared, tenant, target).await;
    let label = match &result {
        Ok(_) => "ok",
        Err(e) => e.label(),
    };
    metrics::counter!(DIALS, "tenant" => tenant.name.to_string(), "result" => label).increment(1);
    metrics::histogram!(DIAL_DURATION, "tenant" => tenant.name.to_string()).record(started.elapsed().as_secs_f64());
    result
}

async fn dial_routed(shared: &Shared, tenant: &Tenant, target: &DialTarget) -> Result<Dialed, DialError> {
    let config = tenant.config();
    let Some(peers) = shared.peers.as_ref() else {
        return dial_local(tenant, target, &config.routing).await;
    };
    match dial_through_replicas(tenant, target, peers, &config).await {
        Err(DialError::NoAgent(_)) => {
            // Inventories may be stale (this replica just started, or agents just moved): look
            // again once before giving up. A dial fails only if no replica holds a suitable agent.
            peers.refresh_if_older_than(Duration::from_millis(100)).await;
            dial_through_replicas(tenant, target, peers, &config).await
        }
        other => other,
    }
}

async fn dial_through_replicas(
    tenant: &Tenant,
    target: &DialTarget,
    peers: &crate::peers::PeerSet,
    config: &crate::config::TenantConfig,
) -> Result<Dialed, DialError> {
    let timeout = config.limits.dial_timeout.0;
    for strategy in &config.routing {
        if tenant.registry.pick_for(target, std::slice::from_ref(strategy)).is_some() {
            match dial_local(tenant, target, std::slice::from_ref(strategy)).await {
                // The local session broke or left (the agent is moving): its other sessions are
                // on the peers.
                Err(DialError::Tunnel(_) | DialError::NoAgent(_)) => {}
                other => return other,
            }
        }
        for (addr, server_id) in peers.candidates(&tenant.name, *strategy, target).into_iter().take(2) {
            let permit = tenant.streams.try_acquire().ok_or(DialError::TooManyStreams(config.limits.max_streams))?;
            match peers.client().forward(addr, &tenant.name, *strategy, target, timeout).await {
                Ok(stream) => {
                    tracing::debug!(tenant = %tenant.name, %target, peer = %server_id, "dial forwarded to a peer replica");
                    return Ok(Dialed {
                        stream: DialedStream::Peer(Box::new(stream)),
                        carrier: format!("via {server_id}"),
                        _load: None,
                        _permit: permit,
                        _open: OpenStreamGauge::new(&tenant.name),
                    });
                }
                // The peer's agents no longer match, or the peer is unreachable: try another.
                Err(DialError::NoAgent(_) | DialError::Tunnel(_)) => continue,
                Err(other) => return Err(other),
            }
        }
    }
    Err(DialError::NoAgent(target.to_string()))
}

/// Dials `target` through this replica's own agents only, trying `chain` in order.
pub async fn dial_local(tenant: &Tenant, target: &DialTarget, chain: &[RoutingStrategy]) -> Result<Dialed, DialError> {
    let config = tenant.config();
    let limits = &config.limits;
    let permit = tenant.streams.try_acquire().ok_or(DialError::TooManyStreams(limits.max_streams))?;
    let _pending = tenant.pending_dials.try_acquire().ok_or(DialError::TooManyPending(limits.max_pending_dials))?;
    let request_id = REQUEST_IDS.fetch_add(1, Ordering::Relaxed);
    let timeout = limits.dial_timeout.0;
    let request = StreamOpen::Dial(DialRequest {
        target: target.to_string(),
        timeout_ms: Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)),
        request_id,
    });

    // A session that broke since it was picked is skipped once in favour of another agent.
    let mut last_error = None;
    for _attempt in 0..2 {
        let agent = tenant.registry.pick_for(target, chain).ok_or_else(|| DialError::NoAgent(target.to_string()))?;
        let load = agent.stream_guard();
        let attempt = tokio::time::timeout(timeout + ANSWER_MARGIN, open_and_ask(&agent, &request)).await;
        match attempt {
            Err(_) => return Err(DialError::Timeout(timeout)),
            Ok(Ok(stream)) => {
                tracing::debug!(tenant = %tenant.name, %target, request_id, agent = %agent.agent_id, "dial established");
                return Ok(Dialed {
                    stream: DialedStream::Local(stream),
                    carrier: agent.agent_id.clone(),
                    _load: Some(load),
                    _permit: permit,
                    _open: OpenStreamGauge::new(&tenant.name),
                });
            }
            Ok(Err(AttemptError::Answer(result))) => {
                let code = result.code.unwrap_or(ErrorCode::Other);
                let message = result.message.unwrap_or_else(|| code.to_string());
                return Err(DialError::Refused { code, message, agent: agent.agent_id.clone() });
            }
            Ok(Err(AttemptError::Session(e))) => {
                tracing::debug!(tenant = %tenant.name, %target, request_id, agent = %agent.agent_id, error = %e, "session failed during dial; trying another agent");
                if matches!(e, MuxError::Closed) {
                    agent.set_draining();
                }
                last_error = Some(e.to_string());
            }
            Ok(Err(AttemptError::Stream(e))) => last_error = Some(e),
        }
    }
    Err(DialError::Tunnel(last_error.unwrap_or_default()))
}

enum AttemptError {
    Session(MuxError),
    Stream(String),
    Answer(StreamResult),
}

async fn open_and_ask(agent: &AgentSession, request: &StreamOpen) -> Result<MuxStream, AttemptError> {
    let mut stream = agent.session.open().await.map_err(AttemptError::Session)?;
    write_frame(&mut stream, request, MAX_STREAM_FRAME).await.map_err(|e| AttemptError::Stream(e.to_string()))?;
    let result: StreamResult =
        read_frame(&mut stream, MAX_STREAM_FRAME).await.map_err(|e| AttemptError::Stream(e.to_string()))?;
    if result.ok { Ok(stream) } else { Err(AttemptError::Answer(result)) }
}
