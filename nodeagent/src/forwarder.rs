//! Node -> control-plane listeners (KEP-2025): the agent accepts TCP on a host-scoped address
//! (e.g. `100.64.0.1:6443`, where the `kubernetes` Service endpoints point) and carries the raw
//! bytes over a forward stream that names a control-plane target. TLS is never terminated here:
//! clients talk to the control plane's own certificate, with their own SNI.
//!
//! Listeners stay bound while the gateway is unreachable; a connection waits a bounded time for a
//! session, so clients ride out a gateway restart.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tether_tunnel::framed::{read_frame, write_frame};
use tether_tunnel::protocol::{ForwardRequest, MAX_STREAM_FRAME, StreamOpen, StreamResult};
use tether_tunnel::splice::{Direction, splice_mux};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::connection::AgentState;
use crate::metrics::{FORWARD_BYTES, FORWARD_CONNECT_DURATION, FORWARDS, FORWARDS_OPEN};

/// A bound listener and the target it forwards to.
pub struct ForwardListener {
    /// The bound socket.
    pub listener: TcpListener,
    /// The target name sent to the gateway.
    pub target: Arc<str>,
    /// Connections open at once (`max_connections`).
    slots: Arc<Semaphore>,
}

impl ForwardListener {
    /// Forwards what `listener` accepts to `target`, at most `max_connections` at once.
    pub fn new(listener: TcpListener, target: &str, max_connections: usize) -> Self {
        Self { listener, target: target.into(), slots: Arc::new(Semaphore::new(max_connections.max(1))) }
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }
}

/// What forwarding needs from the rest of the agent.
#[derive(Clone)]
pub struct ForwardContext {
    /// Live sessions.
    pub state: Arc<AgentState>,
    /// How long a node-side connection waits for a session.
    pub wait: Duration,
    /// Connection tasks (waited for at shutdown).
    pub tasks: TaskTracker,
}

/// Accepts node-side connections until `stop` is cancelled.
pub async fn serve(listener: ForwardListener, ctx: ForwardContext, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.listener.accept() => accepted,
            () = stop.cancelled() => return,
        };
        match accepted {
            Ok((client, peer)) => {
                let Ok(slot) = listener.slots.clone().try_acquire_owned() else {
                    metrics::counter!(FORWARDS, "target" => listener.target.to_string(), "result" => "too_many_connections")
                        .increment(1);
                    tracing::debug!(target = %listener.target, %peer, "node-side connection closed: max_connections reached");
                    continue;
                };
                let _ = client.set_nodelay(true);
                let (target, ctx2) = (listener.target.clone(), ctx.clone());
                ctx.tasks.spawn(async move {
                    forward(client, peer, target, ctx2).await;
                    drop(slot);
                });
            }
            Err(e) => {
                tracing::warn!(target = %listener.target, error = %e, "forward listener accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn forward(mut client: TcpStream, peer: SocketAddr, target: Arc<str>, ctx: ForwardContext) {
    let started = Instant::now();
    let label = target.to_string();
    let count = |result: &'static str| {
        metrics::counter!(FORWARDS, "target" => label.clone(), "result" => result).increment(1);
    };
    // A session may be dying unnoticed (its gateway just went away): a stream that breaks before
    // the gateway answers is retried on the next live session until the wait is over.
    let deadline = tokio::time::Instant::now() + ctx.wait;
    let mut stream = loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let Some(session) = ctx.state.wait_for_session(left).await else {
            count("no_session");
            tracing::warn!(%target, %peer, wait_ms = ctx.wait.as_millis() as u64, "no session to the gateway; closing the node-side connection");
            return;
        };
        let opened = async {
            let mut stream = session.open().await.map_err(|e| ("tunnel_error", e.to_string()))?;
            let request = StreamOpen::Forward(ForwardRequest { target: target.to_string() });
            write_frame(&mut stream, &request, MAX_STREAM_FRAME).await.map_err(|e| ("tunnel_error", e.to_string()))?;
            let result: StreamResult =
                read_frame(&mut stream, MAX_STREAM_FRAME).await.map_err(|e| ("tunnel_error", e.to_string()))?;
            if result.ok {
                Ok(stream)
            } else {
                let code = result.code.map(|c| c.as_str()).unwrap_or("other");
                Err((code, result.message.unwrap_or_default()))
            }
        };
        match tokio::time::timeout(ctx.wait + Duration::from_secs(10), opened).await {
            Ok(Ok(stream)) => break stream,
            Ok(Err(("tunnel_error", reason))) if tokio::time::Instant::now() < deadline => {
                tracing::debug!(%target, %peer, %reason, "session broke before the gateway answered; retrying");
                // Until the broken session is noticed, it may be picked again; pace the retries.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok(Err((code, reason))) => {
                count(code);
                tracing::warn!(%target, %peer, code, %reason, "forward refused by the gateway");
                return;
            }
            Err(_) => {
                count("timeout");
                tracing::warn!(%target, %peer, "forward timed out waiting for the gateway");
                return;
            }
        }
    };
    count("ok");
    metrics::histogram!(FORWARD_CONNECT_DURATION, "target" => label.clone()).record(started.elapsed().as_secs_f64());
    let open = metrics::gauge!(FORWARDS_OPEN, "target" => label.clone());
    open.increment(1.0);
    let to_cp = metrics::counter!(FORWARD_BYTES, "target" => label.clone(), "direction" => "to_controlplane");
    let from_cp = metrics::counter!(FORWARD_BYTES, "target" => label, "direction" => "from_controlplane");
    let copied = splice_mux(&mut client, &mut stream, |direction, n| match direction {
        Direction::AToB => to_cp.increment(n as u64),
        Direction::BToA => from_cp.increment(n as u64),
    })
    .await;
    open.decrement(1.0);
    if let Err(e) = copied {
        tracing::debug!(%target, %peer, error = %e, "forwarded connection ended with an error");
    }
}
