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

use bytes::BytesMut;
use tether_tunnel::bulk_window::BulkWindow;
use tether_tunnel::framed::{read_frame, write_frame};
use tether_tunnel::mux::MuxStream;
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

/// A node-side socket on its way to its session's task.
enum ClientSocket {
    /// Registered with this runtime, which also runs the session.
    Here(TcpStream),
    /// Taken off this runtime, to be registered on the session's thread.
    Moving(std::net::TcpStream),
}

/// Most bytes sent ahead of the gateway's answer.
const EARLY_DATA_MAX: usize = 64 * 1024;

/// Early data: waits for the gateway's answer or the client's first bytes, whichever comes first,
/// and sends the bytes behind the open frame (at most [`EARLY_DATA_MAX`]). A client that speaks
/// first (an HTTP request, a TLS ClientHello) then does not wait a round trip through the tunnel
/// for the answer before its bytes leave; the gateway leaves them in the stream until it has
/// connected, and drops them with the stream when it refuses. `taken` counts the bytes read from
/// the client (set before they are sent: a forward that took any cannot be retried elsewhere). A
/// failing client is left to the splice to notice.
async fn send_early_data(client: &mut TcpStream, stream: &mut MuxStream, taken: &mut usize) -> std::io::Result<()> {
    tokio::select! {
        biased;
        () = stream.readable() => Ok(()),
        ready = client.readable() => {
            if ready.is_err() {
                return Ok(());
            }
            let mut buf = BytesMut::with_capacity(EARLY_DATA_MAX);
            match client.try_read_buf(&mut buf) {
                Ok(n) if n > 0 => {
                    *taken = n;
                    // The buffer becomes the frame's body as it is (no copy into the session).
                    while !buf.is_empty() {
                        std::future::poll_fn(|cx| stream.poll_send_owned(cx, &mut buf)).await?;
                    }
                    Ok(())
                }
                // End of stream, a spurious wake-up or a failing client: the splice sees it again.
                _ => Ok(()),
            }
        }
    }
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
                ctx.tasks.spawn(forward(client, peer, target, ctx2, slot));
            }
            Err(e) => {
                tracing::warn!(target = %listener.target, error = %e, "forward listener accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Opens a forward stream for `client` on a live session, then splices them on the session's own
/// task. `slot` is the listener's connection slot, held until the connection ends.
async fn forward(
    mut client: TcpStream,
    peer: SocketAddr,
    target: Arc<str>,
    ctx: ForwardContext,
    slot: tokio::sync::OwnedSemaphorePermit,
) {
    let started = Instant::now();
    let label = target.to_string();
    let count = |result: &'static str| {
        metrics::counter!(FORWARDS, "target" => label.clone(), "result" => result).increment(1);
    };
    // A session may be dying unnoticed (its gateway just went away): a stream that breaks before
    // the gateway answers is retried on the next live session until the wait is over.
    let deadline = tokio::time::Instant::now() + ctx.wait;
    let mut early = 0;
    let (mut stream, picked) = loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let Some(picked) = ctx.state.wait_for_session(left).await else {
            count("no_session");
            tracing::warn!(%target, %peer, wait_ms = ctx.wait.as_millis() as u64, "no session to the gateway; closing the node-side connection");
            return;
        };
        let session = &picked.session;
        let opened = async {
            let mut stream = session.open().await.map_err(|e| ("tunnel_error", e.to_string()))?;
            let request = StreamOpen::Forward(ForwardRequest { target: target.to_string() });
            write_frame(&mut stream, &request, MAX_STREAM_FRAME).await.map_err(|e| ("tunnel_error", e.to_string()))?;
            send_early_data(&mut client, &mut stream, &mut early).await.map_err(|e| ("tunnel_error", e.to_string()))?;
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
            Ok(Ok(stream)) => break (stream, picked),
            // Bytes already taken from the client cannot be sent again on another session.
            Ok(Err(("tunnel_error", reason))) if early == 0 && tokio::time::Instant::now() < deadline => {
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
    let to_cp = metrics::counter!(FORWARD_BYTES, "target" => label.clone(), "direction" => "to_controlplane");
    let from_cp = metrics::counter!(FORWARD_BYTES, "target" => label, "direction" => "from_controlplane");
    to_cp.increment(early as u64);
    // On the session's own task: the bytes then pass between the client's socket and the tunnel
    // without a hand-over between tasks.
    let client = if picked.on_thread {
        match client.into_std() {
            Ok(client) => ClientSocket::Moving(client),
            Err(e) => {
                tracing::warn!(%target, %peer, error = %e, "node-side connection closed: cannot move it to its session's thread");
                return;
            }
        }
    } else {
        ClientSocket::Here(client)
    };
    picked.session.spawn_local(ctx.tasks.track_future(async move {
        // Registered with the I/O driver of the thread that runs the session's task.
        let client = match client {
            ClientSocket::Here(client) => client,
            ClientSocket::Moving(client) => match TcpStream::from_std(client) {
                Ok(client) => client,
                Err(e) => {
                    tracing::warn!(%target, %peer, error = %e, "node-side connection closed: cannot register its socket");
                    return;
                }
            },
        };
        let mut client = BulkWindow::new(client);
        open.increment(1.0);
        let copied = splice_mux(&mut client, &mut stream, |direction, n| match direction {
            Direction::AToB => to_cp.increment(n as u64),
            Direction::BToA => from_cp.increment(n as u64),
        })
        .await;
        open.decrement(1.0);
        drop(slot);
        if let Err(e) = copied {
            tracing::debug!(%target, %peer, error = %e, "forwarded connection ended with an error");
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connection::{LiveSession, PoolMode};
    use tether_tunnel::mux::{self, ByteLink, Incoming, MuxSettings, Role};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(10), future).await.unwrap_or_else(|_| panic!("timed out: {what}"))
    }

    /// A listener for target `api` over an in-memory session; the test plays the gateway.
    async fn forwarding() -> (SocketAddr, Incoming, LiveSession, CancellationToken) {
        let (a, b) = tokio::io::duplex(1 << 20);
        let (agent, _agent_in, agent_driver) = mux::start(ByteLink::new(a), Role::Client, &MuxSettings::default());
        let (_gateway, gateway_in, gateway_driver) =
            mux::start(ByteLink::new(b), Role::Server, &MuxSettings::default());
        tokio::spawn(agent_driver);
        tokio::spawn(gateway_driver);
        let state = Arc::new(AgentState::new(PoolMode::All, 1, 1, u64::MAX));
        let live = LiveSession::new(state.clone(), "gateway-0".into(), agent, false);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ctx = ForwardContext { state, wait: Duration::from_secs(5), tasks: TaskTracker::new() };
        let stop = CancellationToken::new();
        tokio::spawn(serve(ForwardListener::new(listener, "api", 8), ctx, stop.clone()));
        (addr, gateway_in, live, stop)
    }

    /// Early data: the client's first bytes reach the gateway before it has answered the open
    /// frame, so a client that speaks first saves a round trip through the tunnel.
    #[tokio::test]
    async fn a_clients_first_bytes_travel_before_the_gateway_answers() {
        let (addr, mut gateway_in, _live, stop) = forwarding().await;
        let mut client = TcpStream::connect(addr).await.unwrap();
        client.write_all(b"GET /healthz HTTP/1.1\r\n\r\n").await.unwrap();

        let mut stream = within("the forward stream", gateway_in.accept()).await.unwrap();
        let open: StreamOpen = read_frame(&mut stream, MAX_STREAM_FRAME).await.unwrap();
        assert_eq!(open, StreamOpen::Forward(ForwardRequest { target: "api".into() }));
        let mut request = [0u8; 25];
        within("the request, before any answer", stream.read_exact(&mut request)).await.unwrap();
        assert_eq!(&request, b"GET /healthz HTTP/1.1\r\n\r\n");

        write_frame(&mut stream, &StreamResult::ok(), MAX_STREAM_FRAME).await.unwrap();
        stream.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        stream.shutdown().await.unwrap();
        let mut response = Vec::new();
        within("the response", client.read_to_end(&mut response)).await.unwrap();
        assert_eq!(response, b"HTTP/1.1 200 OK\r\n\r\n");
        // The rest of the exchange is an ordinary splice.
        client.write_all(b"more").await.unwrap();
        let mut more = [0u8; 4];
        within("later bytes", stream.read_exact(&mut more)).await.unwrap();
        assert_eq!(&more, b"more");
        stop.cancel();
    }

    /// A refused forward drops what the client sent early and closes its connection; a client
    /// that waits for the server to speak first is forwarded as before.
    #[tokio::test]
    async fn early_bytes_die_with_a_refusal_and_a_silent_client_is_forwarded() {
        let (addr, mut gateway_in, _live, stop) = forwarding().await;
        let mut refused = TcpStream::connect(addr).await.unwrap();
        refused.write_all(b"hello").await.unwrap();
        let mut stream = within("the forward stream", gateway_in.accept()).await.unwrap();
        let _: StreamOpen = read_frame(&mut stream, MAX_STREAM_FRAME).await.unwrap();
        let refusal = StreamResult::refused(tether_tunnel::protocol::ErrorCode::DialFailed, "connection refused");
        write_frame(&mut stream, &refusal, MAX_STREAM_FRAME).await.unwrap();
        drop(stream);
        let mut rest = Vec::new();
        let _ = within("the refused client is closed", refused.read_to_end(&mut rest)).await;
        assert!(rest.is_empty());

        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut stream = within("the second forward stream", gateway_in.accept()).await.unwrap();
        let _: StreamOpen = read_frame(&mut stream, MAX_STREAM_FRAME).await.unwrap();
        write_frame(&mut stream, &StreamResult::ok(), MAX_STREAM_FRAME).await.unwrap();
        stream.write_all(b"220 ready\r\n").await.unwrap();
        let mut greeting = [0u8; 11];
        within("the server speaks first", silent.read_exact(&mut greeting)).await.unwrap();
        assert_eq!(&greeting, b"220 ready\r\n");
        silent.write_all(b"QUIT\r\n").await.unwrap();
        let mut quit = [0u8; 6];
        within("the client's answer", stream.read_exact(&mut quit)).await.unwrap();
        assert_eq!(&quit, b"QUIT\r\n");
        stop.cancel();
    }
}
