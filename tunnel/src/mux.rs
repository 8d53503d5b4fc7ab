//! The multiplexer session: many independent, flow-controlled streams over one byte stream.
//!
//! This is the only module that knows the multiplexer crate (yamux). Everything else sees
//! [`Session`] (open streams, close), [`Incoming`] (accept streams) and [`MuxStream`] (a tokio
//! `AsyncRead + AsyncWrite`), so the implementation can be swapped after measuring.
//!
//! yamux is poll-based and needs one task that keeps polling the connection: [`start`] returns
//! that task as a future ([`Driver`]) for the caller to spawn. Opening a stream is a request to
//! the driver over a bounded channel; accepted streams come out of a bounded queue, and a stream
//! that arrives while the queue is full is reset rather than buffered without bound.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use futures::future::poll_fn;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, oneshot};
use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt, TokioAsyncReadCompatExt};
use tokio_util::sync::CancellationToken;

/// Which end of the session this is. The agent is the client, the gateway the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The end that dialed the connection.
    Client,
    /// The end that accepted it.
    Server,
}

/// Multiplexer tuning.
#[derive(Debug, Clone)]
pub struct MuxSettings {
    /// Most concurrent streams on one session.
    pub max_streams: usize,
    /// Largest data frame sent; bigger writes are split. Larger frames mean fewer messages,
    /// TLS records and syscalls per byte.
    pub split_send_size: usize,
    /// Inbound streams queued for the acceptor before new ones are reset.
    pub accept_backlog: usize,
    /// How far, in bytes and in total, the session's streams may grow their receive windows
    /// beyond yamux's initial 256 KiB each. yamux doubles a stream's window while the peer fills
    /// it within two round trips, so a stream converges on the link's bandwidth-delay product; a
    /// stream kept at 256 KiB moves at most 256 KiB per round trip (12.5 MiB/s at 20 ms). A window
    /// is credit, not an allocation: bytes are buffered only while the local reader lags.
    pub window_growth: usize,
}

/// Default of [`MuxSettings::window_growth`]: a 32 MiB window, 1.6 GiB/s per stream at 20 ms.
pub const DEFAULT_WINDOW_GROWTH: usize = 32 * 1024 * 1024;

impl Default for MuxSettings {
    fn default() -> Self {
        // 64 KiB frames: yamux only grows a stream's 256 KiB window when half of it is used within
        // two measured round trips, which a loopback-speed tunnel rarely sees, so with 256 KiB
        // frames a transfer becomes stop-and-wait. Measured +22-32 % throughput (benchmarks.md).
        Self {
            max_streams: 8192,
            split_send_size: 64 * 1024,
            accept_backlog: 1024,
            window_growth: DEFAULT_WINDOW_GROWTH,
        }
    }
}

impl MuxSettings {
    fn yamux_config(&self) -> yamux::Config {
        let max_streams = self.max_streams.max(1);
        let mut config = yamux::Config::default();
        // Both setters assert window >= 256 KiB x streams against the other's current value:
        // raise the window above both the old and new stream counts, set the count, then the
        // final window. yamux lets streams grow only into what the connection window holds
        // beyond 256 KiB x streams: without `window_growth` on top, no stream ever grows.
        let window = max_streams.saturating_mul(256 * 1024).saturating_add(self.window_growth);
        config.set_max_connection_receive_window(None);
        config.set_max_num_streams(max_streams);
        config.set_max_connection_receive_window(Some(window));
        config.set_split_send_size(self.split_send_size.clamp(16 * 1024, 1024 * 1024));
        config
    }
}

/// Why a stream could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum MuxError {
    /// The session is closed or broken.
    #[error("tunnel session is closed")]
    Closed,
    /// The session holds its maximum number of streams.
    #[error("tunnel session has reached its stream limit")]
    TooManyStreams,
    /// Any other multiplexer failure.
    #[error("tunnel session error: {0}")]
    Other(String),
}

type OpenReply = oneshot::Sender<Result<MuxStream, MuxError>>;

struct Shared {
    closed: CancellationToken,
    close_requested: CancellationToken,
    open_streams: AtomicUsize,
}

/// A handle to a running session; cheap to clone.
#[derive(Clone)]
pub struct Session {
    open_tx: mpsc::Sender<OpenReply>,
    shared: Arc<Shared>,
}

impl Session {
    /// Opens a new outbound stream.
    pub async fn open(&self) -> Result<MuxStream, MuxError> {
        let (tx, rx) = oneshot::channel();
        self.open_tx.send(tx).await.map_err(|_| MuxError::Closed)?;
        rx.await.map_err(|_| MuxError::Closed)?
    }

    /// Asks the driver to close the session gracefully (streams are reset).
    pub fn close(&self) {
        self.shared.close_requested.cancel();
    }

    /// Whether the session has ended.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.is_cancelled()
    }

    /// Resolves when the session has ended.
    pub async fn closed(&self) {
        self.shared.closed.cancelled().await;
    }

    /// Streams currently open on this session, both directions.
    pub fn open_streams(&self) -> usize {
        self.shared.open_streams.load(Ordering::Relaxed)
    }
}

/// The receiving end for streams the peer opens.
pub struct Incoming {
    // Boxed: a channel allocates its slots in blocks up front, so small slots keep an idle
    // session small (this matters with tens of thousands of agents).
    rx: mpsc::Receiver<Box<MuxStream>>,
}

impl Incoming {
    /// The next stream opened by the peer; `None` once the session has ended.
    pub async fn accept(&mut self) -> Option<MuxStream> {
        self.rx.recv().await.map(|stream| *stream)
    }
}

/// The task that drives the session; spawn it. It resolves when the session ends.
pub type Driver = Pin<Box<dyn Future<Output = Result<(), MuxError>> + Send>>;

/// Starts a session over `io` and returns its handle, its inbound streams and its driver.
pub fn start<T>(io: T, role: Role, settings: &MuxSettings) -> (Session, Incoming, Driver)
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mode = match role {
        Role::Client => yamux::Mode::Client,
        Role::Server => yamux::Mode::Server,
    };
    let mut connection = yamux::Connection::new(io.compat(), settings.yamux_config(), mode);
    let (open_tx, mut open_rx) = mpsc::channel::<OpenReply>(256);
    let (in_tx, in_rx) = mpsc::channel(settings.accept_backlog.max(1));
    let shared = Arc::new(Shared {
        closed: CancellationToken::new(),
        close_requested: CancellationToken::new(),
        open_streams: AtomicUsize::new(0),
    });
    let session = Session { open_tx, shared: shared.clone() };

    let driver = async move {
        let close_requested = shared.close_requested.clone();
        let mut waiting: Option<OpenReply> = None;
        let io = poll_fn(|cx| {
            // Serve open requests, one at a time (yamux bounds streams awaiting an ACK).
            loop {
                if waiting.is_none() {
                    match open_rx.poll_recv(cx) {
                        Poll::Ready(Some(reply)) => waiting = Some(reply),
                        Poll::Ready(None) | Poll::Pending => break,
                    }
                }
                let Some(reply) = waiting.take() else { break };
                if reply.is_closed() {
                    continue;
                }
                match connection.poll_new_outbound(cx) {
                    Poll::Ready(Ok(stream)) => {
                        let _ = reply.send(Ok(MuxStream::new(stream, &shared)));
                    }
                    Poll::Ready(Err(yamux::ConnectionError::TooManyStreams)) => {
                        let _ = reply.send(Err(MuxError::TooManyStreams));
                    }
                    Poll::Ready(Err(e)) => {
                        let _ = reply.send(Err(MuxError::Other(e.to_string())));
                        return Poll::Ready(Err(MuxError::Other(e.to_string())));
                    }
                    Poll::Pending => {
                        waiting = Some(reply);
                        break;
                    }
                }
            }
            // Drive all I/O and take the peer's new streams.
            loop {
                match connection.poll_next_inbound(cx) {
                    Poll::Ready(Some(Ok(stream))) => {
                        if let Err(mpsc::error::TrySendError::Full(refused)) =
                            in_tx.try_send(Box::new(MuxStream::new(stream, &shared)))
                        {
                            tracing::warn!("inbound stream backlog full; resetting a new stream");
                            drop(refused);
                        }
                    }
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(MuxError::Other(e.to_string()))),
                    Poll::Ready(None) => return Poll::Ready(Ok(())),
                    Poll::Pending => return Poll::Pending,
                }
            }
        });
        let result = tokio::select! {
            result = io => result,
            () = close_requested.cancelled() => Ok(()),
        };
        // The connection is dropped while active rather than closed gracefully: yamux's graceful
        // close leaves open streams waiting forever, while dropping marks every stream closed and
        // wakes it (reads see end-of-stream, writes fail). The peer sees the transport end.
        drop(connection);
        shared.closed.cancel();
        result
    };
    (session, Incoming { rx: in_rx }, Box::pin(driver))
}

/// One stream of a session: a tokio `AsyncRead + AsyncWrite`. `shutdown` half-closes (the peer
/// reads end-of-stream and can still write); dropping without shutdown resets the stream.
pub struct MuxStream {
    inner: Compat<yamux::Stream>,
    shared: Arc<Shared>,
}

impl MuxStream {
    fn new(stream: yamux::Stream, shared: &Arc<Shared>) -> Self {
        shared.open_streams.fetch_add(1, Ordering::Relaxed);
        Self { inner: stream.compat(), shared: shared.clone() }
    }
}

impl Drop for MuxStream {
    fn drop(&mut self) {
        self.shared.open_streams.fetch_sub(1, Ordering::Relaxed);
    }
}

impl AsyncRead for MuxStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for MuxStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn pair(settings: &MuxSettings) -> ((Session, Incoming), (Session, Incoming)) {
        let (a, b) = tokio::io::duplex(1 << 20);
        let (client, client_in, client_driver) = start(a, Role::Client, settings);
        let (server, server_in, server_driver) = start(b, Role::Server, settings);
        tokio::spawn(client_driver);
        tokio::spawn(server_driver);
        ((client, client_in), (server, server_in))
    }

    #[tokio::test]
    async fn streams_open_both_ways_and_half_close() {
        let ((client, mut client_in), (server, mut server_in)) = pair(&MuxSettings::default());
        let mut out = client.open().await.unwrap();
        out.write_all(b"ping").await.unwrap();
        out.shutdown().await.unwrap();
        let mut inbound = server_in.accept().await.unwrap();
        let mut got = Vec::new();
        inbound.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"ping");
        // Half-closed by the client, the stream still carries the answer back.
        inbound.write_all(b"pong").await.unwrap();
        inbound.shutdown().await.unwrap();
        let mut answer = Vec::new();
        out.read_to_end(&mut answer).await.unwrap();
        assert_eq!(answer, b"pong");

        let mut reverse = server.open().await.unwrap();
        reverse.write_all(b"x").await.unwrap();
        let mut at_client = client_in.accept().await.unwrap();
        let mut one = [0u8; 1];
        at_client.read_exact(&mut one).await.unwrap();
        assert_eq!(&one, b"x");
        assert!(client.open_streams() >= 1);
    }

    #[tokio::test]
    async fn a_stalled_stream_does_not_block_the_others() {
        let ((client, _), (_server, mut server_in)) = pair(&MuxSettings::default());
        // Stream 1: the receiver never reads; the sender fills the stream window and blocks.
        let mut stalled = client.open().await.unwrap();
        let stalled_writer = tokio::spawn(async move {
            let chunk = vec![1u8; 64 * 1024];
            loop {
                if stalled.write_all(&chunk).await.is_err() {
                    break;
                }
            }
        });
        let _unread = server_in.accept().await.unwrap();
        // Stream 2 still moves 8 MiB.
        let mut busy = client.open().await.unwrap();
        let payload = vec![2u8; 8 << 20];
        let sender = tokio::spawn(async move {
            busy.write_all(&payload).await.unwrap();
            busy.shutdown().await.unwrap();
        });
        let mut other = server_in.accept().await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), other.read_to_end(&mut got)).await.unwrap().unwrap();
        assert_eq!(got.len(), 8 << 20);
        sender.await.unwrap();
        assert!(!stalled_writer.is_finished(), "the stalled stream is still blocked on its own window");
        stalled_writer.abort();
    }

    #[tokio::test]
    async fn the_stream_limit_is_enforced() {
        let settings = MuxSettings { max_streams: 2, ..MuxSettings::default() };
        let ((client, _), (_server, mut server_in)) = pair(&settings);
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut s = client.open().await.unwrap();
            s.write_all(b"x").await.unwrap();
            held.push(s);
            held.push(server_in.accept().await.unwrap());
        }
        assert!(matches!(client.open().await, Err(MuxError::TooManyStreams)));
    }

    #[tokio::test]
    async fn closing_ends_the_session_on_both_sides() {
        let ((client, _client_in), (server, mut server_in)) = pair(&MuxSettings::default());
        client.close();
        tokio::time::timeout(Duration::from_secs(5), client.closed()).await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), server.closed()).await.unwrap();
        assert!(server_in.accept().await.is_none());
        assert!(matches!(client.open().await, Err(MuxError::Closed)));
    }
}
