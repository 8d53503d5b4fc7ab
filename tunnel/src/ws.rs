//! WebSocket byte-stream adapter: turns a WebSocket connection into an `AsyncRead + AsyncWrite`
//! byte stream for the multiplexer, and keeps the connection alive with pings.
//!
//! Writes are gathered in one `BytesMut` and go out as one binary message per flush (or when the
//! buffer reaches a threshold), never one message per write: the multiplexer writes a frame's
//! header and body separately and flushes after each frame. The buffer is frozen into `Bytes` for
//! the message, so no per-write allocation or copy is made beyond the one into the buffer.
//!
//! Keepalive: a ping goes out every `ping_interval`; if nothing at all (data, ping or pong) arrives
//! for `ping_interval + ping_timeout`, reads fail with `TimedOut` and the session ends. Load
//! balancers and proxies with idle timeouts (60 s is common) see traffic on idle tunnels.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use futures::{Sink, Stream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self, Message};

/// Tuning of the WebSocket layer.
#[derive(Debug, Clone)]
pub struct WsSettings {
    /// Bytes read from the transport at a time; also the initial read buffer.
    pub read_buffer_size: usize,
    /// Largest message accepted from the peer.
    pub max_message_size: usize,
    /// Buffered bytes that trigger sending a message before the next flush.
    pub send_threshold: usize,
    /// Accept unmasked frames from a client (saves a pass over every byte when both ends are ours).
    pub accept_unmasked_frames: bool,
    /// Keepalive; `None` disables pings and dead-peer detection.
    pub keepalive: Option<KeepaliveSettings>,
    /// Send on the next read attempt instead of at each flush, so frames of many streams written
    /// in one round of the multiplexer go out as one message, one TLS record and one syscall.
    /// The multiplexer's driver always reads once it has nothing more to write, so nothing waits
    /// longer than that round. Only for a driver that behaves that way (yamux does).
    pub coalesce_flushes: bool,
}

impl Default for WsSettings {
    fn default() -> Self {
        Self {
            read_buffer_size: 16 * 1024,
            max_message_size: 4 * 1024 * 1024,
            send_threshold: 256 * 1024,
            accept_unmasked_frames: false,
            keepalive: Some(KeepaliveSettings::default()),
            coalesce_flushes: true,
        }
    }
}

impl WsSettings {
    /// The settings of the WebSocket data path ([`crate::ws_link::WsLink`]).
    pub fn link_settings(&self) -> crate::ws_link::WsLinkSettings {
        crate::ws_link::WsLinkSettings {
            max_frame_size: self.max_message_size,
            read_size: self.read_buffer_size,
            accept_unmasked_frames: self.accept_unmasked_frames,
            keepalive: self.keepalive,
        }
    }

    /// The tungstenite configuration these settings imply.
    pub fn tungstenite_config(&self) -> WebSocketConfig {
        WebSocketConfig::default()
            .read_buffer_size(self.read_buffer_size)
            // Messages are already batched here; tungstenite writes each frame straight through.
            .write_buffer_size(0)
            .max_write_buffer_size(self.max_message_size.saturating_mul(2).max(1))
            .max_message_size(Some(self.max_message_size))
            .max_frame_size(Some(self.max_message_size))
            .accept_unmasked_frames(self.accept_unmasked_frames)
    }
}

/// Ping interval and how long a silent peer is tolerated after a ping.
#[derive(Debug, Clone, Copy)]
pub struct KeepaliveSettings {
    /// How often a ping is sent.
    pub ping_interval: Duration,
    /// How long past a ping interval a silent peer is still alive.
    pub ping_timeout: Duration,
}

impl KeepaliveSettings {
    /// How long the peer may stay silent before it is declared dead.
    fn silence_limit(&self) -> Duration {
        self.ping_interval + self.ping_timeout
    }
}

impl Default for KeepaliveSettings {
    fn default() -> Self {
        Self { ping_interval: Duration::from_secs(20), ping_timeout: Duration::from_secs(20) }
    }
}

/// Keepalive timers of a WebSocket link: when to ping, and when a silent peer is dead.
///
/// This runs on every receive attempt of a busy link, so it touches the timer wheel only when a
/// timer fires: hearing from the peer records the time, and the dead-peer timer is moved up to it
/// when it fires; while the timers are registered with the task that polls them, a poll only reads
/// whether they have fired.
pub(crate) struct Keepalive {
    settings: KeepaliveSettings,
    next_ping: Pin<Box<Sleep>>,
    dead_at: Pin<Box<Sleep>>,
    /// When the peer was last heard from.
    heard: Instant,
    /// The waker both timers were last polled with.
    registered: Option<Waker>,
}

impl Keepalive {
    pub(crate) fn new(settings: KeepaliveSettings) -> Self {
        let now = Instant::now();
        Self {
            settings,
            next_ping: Box::pin(tokio::time::sleep_until(now + settings.ping_interval)),
            dead_at: Box::pin(tokio::time::sleep_until(now + settings.silence_limit())),
            heard: now,
            registered: None,
        }
    }

    /// Anything arrived from the peer: it is alive.
    pub(crate) fn heard_from_peer(&mut self) {
        self.heard = Instant::now();
    }

    /// Fails once the peer has been silent too long; otherwise answers whether a ping is due now
    /// (the timer is rearmed for the next one, and this task will wake for it).
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> io::Result<bool> {
        if self.registered.as_ref().is_some_and(|w| w.will_wake(cx.waker()))
            && !self.dead_at.is_elapsed()
            && !self.next_ping.is_elapsed()
        {
            return Ok(false);
        }
        self.registered = Some(cx.waker().clone());
        let silent = self.settings.silence_limit();
        while self.dead_at.as_mut().poll(cx).is_ready() {
            let deadline = self.heard + silent;
            if deadline <= Instant::now() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("peer sent nothing for {} s (not even a pong); declaring it dead", silent.as_secs()),
                ));
            }
            self.dead_at.as_mut().reset(deadline);
        }
        if self.next_ping.as_mut().poll(cx).is_pending() {
            return Ok(false);
        }
        let next = Instant::now() + self.settings.ping_interval;
        self.next_ping.as_mut().reset(next);
        let _ = self.next_ping.as_mut().poll(cx);
        Ok(true)
    }
}

/// A WebSocket connection seen as a byte stream. See the module documentation.
pub struct WsByteStream<S> {
    ws: WebSocketStream<S>,
    read_buf: Bytes,
    write_buf: BytesMut,
    send_threshold: usize,
    keepalive: Option<Keepalive>,
    needs_flush: bool,
    coalesce: bool,
    flush_deferred: bool,
    read_eof: bool,
}

impl<S> WsByteStream<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    /// Wraps an established WebSocket connection.
    pub fn new(ws: WebSocketStream<S>, settings: &WsSettings) -> Self {
        Self {
            ws,
            read_buf: Bytes::new(),
            write_buf: BytesMut::new(),
            send_threshold: settings.send_threshold.max(1),
            keepalive: settings.keepalive.map(Keepalive::new),
            needs_flush: false,
            coalesce: settings.coalesce_flushes,
            flush_deferred: false,
            read_eof: false,
        }
    }

    /// The underlying transport.
    pub fn get_ref(&self) -> &S {
        self.ws.get_ref()
    }

    /// Moves the buffered bytes into one binary message.
    fn poll_send_buffered(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.write_buf.is_empty() {
            return Poll::Ready(Ok(()));
        }
        ready!(Pin::new(&mut self.ws).poll_ready(cx)).map_err(ws_to_io)?;
        let message = Message::Binary(self.write_buf.split().freeze());
        Pin::new(&mut self.ws).start_send(message).map_err(ws_to_io)?;
        self.needs_flush = true;
        Poll::Ready(Ok(()))
    }

    /// Sends the buffered bytes as one message and flushes the transport.
    fn poll_send_and_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_send_buffered(cx))?;
        ready!(Pin::new(&mut self.ws).poll_flush(cx)).map_err(ws_to_io)?;
        self.needs_flush = false;
        self.flush_deferred = false;
        Poll::Ready(Ok(()))
    }

    /// Sends what a deferred flush left in the buffer; a full transport is retried on a later
    /// read (it must not stop reads, or two peers could wait on each other).
    fn poll_deferred_flush(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if !self.flush_deferred {
            return Ok(());
        }
        if let Poll::Ready(result) = self.poll_send_and_flush(cx) {
            result?;
        }
        Ok(())
    }

    /// Sends pings when due and fails once the peer has been silent for too long.
    fn poll_keepalive(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let Some(keepalive) = self.keepalive.as_mut() else {
            return Ok(());
        };
        if keepalive.poll(cx)? {
            // A connection too busy to take a ping now is visibly alive; skip this one.
            if Pin::new(&mut self.ws).poll_ready(cx).is_ready() {
                Pin::new(&mut self.ws).start_send(Message::Ping(Bytes::new())).map_err(ws_to_io)?;
                self.needs_flush = true;
            }
        }
        if self.needs_flush
            && let Poll::Ready(result) = Pin::new(&mut self.ws).poll_flush(cx)
        {
            result.map_err(ws_to_io)?;
            self.needs_flush = false;
        }
        Ok(())
    }
}

impl<S> AsyncRead for WsByteStream<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        this.poll_deferred_flush(cx)?;
        loop {
            if !this.read_buf.is_empty() {
                let n = this.read_buf.len().min(buf.remaining());
                buf.put_slice(&this.read_buf[..n]);
                this.read_buf.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.read_eof {
                return Poll::Ready(Ok(()));
            }
            this.poll_keepalive(cx)?;
            let message = match ready!(Pin::new(&mut this.ws).poll_next(cx)) {
                None => {
                    this.read_eof = true;
                    continue;
                }
                Some(Err(e)) => return Poll::Ready(Err(ws_to_io(e))),
                Some(Ok(message)) => message,
            };
            if let Some(keepalive) = this.keepalive.as_mut() {
                keepalive.heard_from_peer();
            }
            match message {
                Message::Binary(data) => this.read_buf = data,
                // tungstenite answers pings itself; pongs only prove the peer is alive.
                Message::Ping(_) | Message::Pong(_) => {}
                Message::Close(_) => this.read_eof = true,
                Message::Text(_) | Message::Frame(_) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "peer sent a text message; the tunnel carries binary messages only",
                    )));
                }
            }
        }
    }
}

impl<S> AsyncWrite for WsByteStream<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.write_buf.len() >= this.send_threshold {
            ready!(this.poll_send_buffered(cx))?;
        }
        this.write_buf.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.coalesce {
            this.flush_deferred = true;
            return Poll::Ready(Ok(()));
        }
        this.poll_send_and_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        ready!(this.poll_send_buffered(cx))?;
        match ready!(Pin::new(&mut this.ws).poll_close(cx)) {
            Ok(()) | Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => {
                Poll::Ready(Ok(()))
            }
            Err(e) => Poll::Ready(Err(ws_to_io(e))),
        }
    }
}

/// The production link under a multiplexer session: a chunk is one binary message's payload, a
/// batch goes out as one binary message, and the keepalive runs on every receive attempt.
impl<S> crate::mux::Link for WsByteStream<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<BytesMut>>> {
        loop {
            if let Err(e) = self.poll_keepalive(cx) {
                return Poll::Ready(Some(Err(e)));
            }
            let message = match ready!(Pin::new(&mut self.ws).poll_next(cx)) {
                None => return Poll::Ready(None),
                Some(Err(e)) => return Poll::Ready(Some(Err(ws_to_io(e)))),
                Some(Ok(message)) => message,
            };
            if let Some(keepalive) = self.keepalive.as_mut() {
                keepalive.heard_from_peer();
            }
            match message {
                // No copy when the message's buffer is not shared.
                Message::Binary(data) if !data.is_empty() => return Poll::Ready(Some(Ok(BytesMut::from(data)))),
                // tungstenite answers pings itself; pongs only prove the peer is alive.
                Message::Binary(_) | Message::Ping(_) | Message::Pong(_) => {}
                Message::Close(_) => return Poll::Ready(None),
                Message::Text(_) | Message::Frame(_) => {
                    return Poll::Ready(Some(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "peer sent a text message; the tunnel carries binary messages only",
                    ))));
                }
            }
        }
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.ws).poll_ready(cx).map_err(ws_to_io)
    }

    fn start_send(&mut self, batch: crate::mux::Batch) -> io::Result<()> {
        Pin::new(&mut self.ws).start_send(Message::Binary(batch.concat().freeze())).map_err(ws_to_io)
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(Pin::new(&mut self.ws).poll_flush(cx)).map_err(ws_to_io)?;
        self.needs_flush = false;
        Poll::Ready(Ok(()))
    }

    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match ready!(Pin::new(&mut self.ws).poll_close(cx)) {
            Ok(()) | Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => {
                Poll::Ready(Ok(()))
            }
            Err(e) => Poll::Ready(Err(ws_to_io(e))),
        }
    }
}

/// Maps a WebSocket error to the I/O error the multiplexer understands.
fn ws_to_io(e: tungstenite::Error) -> io::Error {
    match e {
        tungstenite::Error::Io(e) => e,
        tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed => {
            io::Error::new(io::ErrorKind::BrokenPipe, "websocket closed")
        }
        other => io::Error::new(io::ErrorKind::InvalidData, other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
    use tokio_tungstenite::tungstenite::protocol::Role;

    async fn pair(settings: &WsSettings) -> (WsByteStream<DuplexStream>, WebSocketStream<DuplexStream>) {
        let (a, b) = tokio::io::duplex(1 << 20);
        let client = WebSocketStream::from_raw_socket(a, Role::Client, Some(settings.tungstenite_config())).await;
        let server = WebSocketStream::from_raw_socket(b, Role::Server, Some(settings.tungstenite_config())).await;
        (WsByteStream::new(client, settings), server)
    }

    fn no_keepalive() -> WsSettings {
        WsSettings { keepalive: None, coalesce_flushes: false, ..WsSettings::default() }
    }

    #[tokio::test]
    async fn coalesced_flushes_go_out_as_one_message_at_the_next_read() {
        let settings = WsSettings { keepalive: None, ..WsSettings::default() };
        let (mut bytes, mut raw) = pair(&settings).await;
        // Three frames from three streams, each followed by a flush, in one multiplexer round.
        for frame in [&b"first "[..], b"second ", b"third"] {
            bytes.write_all(frame).await.unwrap();
            bytes.flush().await.unwrap();
        }
        // The round ends with a read attempt, which sends everything as one message.
        let mut buf = [0u8; 8];
        let read = tokio::time::timeout(Duration::from_millis(50), bytes.read(&mut buf)).await;
        assert!(read.is_err(), "nothing to read yet");
        let message = raw.next().await.unwrap().unwrap();
        assert_eq!(message, Message::Binary(Bytes::from_static(b"first second third")));
    }

    #[tokio::test]
    async fn writes_are_batched_into_one_message_per_flush() {
        let (mut bytes, mut raw) = pair(&no_keepalive()).await;
        // A multiplexer frame: 12-byte header, then the body, then a flush.
        bytes.write_all(&[1u8; 12]).await.unwrap();
        bytes.write_all(&[2u8; 1000]).await.unwrap();
        bytes.write_all(&[3u8; 5]).await.unwrap();
        bytes.flush().await.unwrap();
        bytes.write_all(b"second").await.unwrap();
        bytes.flush().await.unwrap();

        let first = raw.next().await.unwrap().unwrap();
        assert_eq!(first.len(), 1017, "header and body travel in one message");
        let second = raw.next().await.unwrap().unwrap();
        assert_eq!(second, Message::Binary(Bytes::from_static(b"second")));
    }

    #[tokio::test]
    async fn a_full_buffer_is_sent_without_waiting_for_a_flush() {
        let settings = WsSettings { send_threshold: 100, ..no_keepalive() };
        let (mut bytes, mut raw) = pair(&settings).await;
        for _ in 0..3 {
            bytes.write_all(&[7u8; 60]).await.unwrap();
        }
        // 60 + 60 reached the threshold before the third write, so one message is out already.
        let first = raw.next().await.unwrap().unwrap();
        assert_eq!(first.len(), 120);
        bytes.flush().await.unwrap();
        assert_eq!(raw.next().await.unwrap().unwrap().len(), 60);
    }

    #[tokio::test]
    async fn reads_span_messages_and_partial_buffers() {
        let (mut bytes, mut raw) = pair(&no_keepalive()).await;
        use futures::SinkExt;
        raw.send(Message::Binary(Bytes::from_static(b"hello "))).await.unwrap();
        raw.send(Message::Binary(Bytes::from_static(b"world"))).await.unwrap();
        let mut small = [0u8; 4];
        bytes.read_exact(&mut small).await.unwrap();
        assert_eq!(&small, b"hell");
        let mut rest = [0u8; 7];
        bytes.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"o world");
    }

    #[tokio::test]
    async fn close_is_end_of_stream_and_shutdown_sends_close() {
        let (mut bytes, mut raw) = pair(&no_keepalive()).await;
        use futures::SinkExt;
        raw.send(Message::Binary(Bytes::from_static(b"last"))).await.unwrap();
        raw.close(None).await.unwrap();
        let mut all = Vec::new();
        bytes.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"last");

        let (mut bytes, mut raw) = pair(&no_keepalive()).await;
        bytes.write_all(b"bye").await.unwrap();
        bytes.shutdown().await.unwrap();
        assert_eq!(raw.next().await.unwrap().unwrap(), Message::Binary(Bytes::from_static(b"bye")));
        assert!(matches!(raw.next().await.unwrap().unwrap(), Message::Close(_)));
    }

    #[tokio::test]
    async fn text_messages_are_rejected() {
        let (mut bytes, mut raw) = pair(&no_keepalive()).await;
        use futures::SinkExt;
        raw.send(Message::Text("hi".into())).await.unwrap();
        let err = bytes.read(&mut [0u8; 8]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[tokio::test(start_paused = true)]
    async fn pings_are_sent_and_a_silent_peer_is_declared_dead() {
        let settings = WsSettings {
            keepalive: Some(KeepaliveSettings {
                ping_interval: Duration::from_secs(20),
                ping_timeout: Duration::from_secs(10),
            }),
            ..WsSettings::default()
        };
        let (mut bytes, mut raw) = pair(&settings).await;
        let reader = tokio::spawn(async move {
            let started = Instant::now();
            let err = bytes.read(&mut [0u8; 8]).await.unwrap_err();
            (err, started.elapsed())
        });
        // The raw peer sees pings but (not being polled for the pong) never answers in time.
        let first = raw.next().await.unwrap().unwrap();
        assert!(matches!(first, Message::Ping(_)), "{first:?}");
        let (err, after) = reader.await.unwrap();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(after, Duration::from_secs(30));
    }

    #[tokio::test(start_paused = true)]
    async fn an_answering_peer_stays_alive() {
        let settings = WsSettings {
            keepalive: Some(KeepaliveSettings {
                ping_interval: Duration::from_secs(5),
                ping_timeout: Duration::from_secs(5),
            }),
            ..WsSettings::default()
        };
        let (mut bytes, mut raw) = pair(&settings).await;
        // Reading on the raw side makes tungstenite answer every ping with a pong.
        let answering = tokio::spawn(async move { while let Some(Ok(_)) = raw.next().await {} });
        let read = tokio::time::timeout(Duration::from_secs(120), bytes.read(&mut [0u8; 8])).await;
        assert!(read.is_err(), "the read must still be waiting after 120 s of pings: {read:?}");
        answering.abort();
    }
}
