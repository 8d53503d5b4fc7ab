//! The WebSocket data path (RFC 6455) after the upgrade: binary frames in, binary frames out, as
//! the [`Link`] under a multiplexer session - without a general WebSocket library in the way.
//!
//! Bytes are read from the transport into one buffer without zero-filling it; a frame's payload is
//! unmasked in place and handed on as a slice of that buffer, so the only user-space copy on the
//! way in is the transport's own (TLS decryption into the buffer). On the way out a batch from the
//! multiplexer becomes one frame: the header is written with the payload in one vectored write,
//! and a client masks the payload in place (eight bytes at a time) instead of copying it. Frames
//! stay RFC 6455 on the wire - client frames masked, control frames answered (ping -> pong,
//! close -> close) - so load balancers, ingresses and proxies pass them as before.
//!
//! Keepalive: a ping goes out every `ping_interval`; if nothing at all (data, ping or pong)
//! arrives for `ping_interval + ping_timeout`, the link fails with `TimedOut`.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::mux::link::{MAX_SLICES, advance_segments};
use crate::mux::{Batch, Link};
use crate::ws::{Keepalive, KeepaliveSettings};

/// Which side of the WebSocket this is: clients mask what they send, servers do not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WsRole {
    /// The side that sent the upgrade request (the agent).
    Client,
    /// The side that accepted it (the gateway).
    Server,
}

/// Tuning of the WebSocket data path.
#[derive(Debug, Clone)]
pub struct WsLinkSettings {
    /// Largest frame accepted from the peer.
    pub max_frame_size: usize,
    /// Bytes asked from the transport per read at first; the size doubles (up to 256 KiB) while
    /// reads fill it. An idle link holds no read buffer: a quiet one gives it up as soon as it has
    /// read everything, a busy one (at least 64 reads since the last keepalive ping) at
    /// the next ping, so that request/response traffic does not allocate a buffer per message.
    pub read_size: usize,
    /// Accept unmasked frames from a client (both ends are ours; saves a pass over every byte).
    pub accept_unmasked_frames: bool,
    /// Keepalive; `None` disables pings and dead-peer detection.
    pub keepalive: Option<KeepaliveSettings>,
}

impl Default for WsLinkSettings {
    fn default() -> Self {
        Self {
            max_frame_size: 4 * 1024 * 1024,
            read_size: 64 * 1024,
            accept_unmasked_frames: false,
            keepalive: Some(KeepaliveSettings::default()),
        }
    }
}

/// Largest read asked from the transport.
const MAX_READ_SIZE: usize = 256 * 1024;

/// Reads per keepalive interval from which a link keeps its read buffer while it waits for more.
/// Below it (an agent that only pings, or a few messages a minute) the buffer goes as soon as the
/// link is idle; at or above it (request/response traffic), freeing and allocating it again for
/// every message cost about 1,500 instructions per message in each process (docs/benchmarks.md),
/// so it stays until a keepalive ping finds the link quiet. Links without keepalive always free it.
const BUSY_READS: u32 = 64;

const OP_CONTINUATION: u8 = 0x0;
const OP_TEXT: u8 = 0x1;
const OP_BINARY: u8 = 0x2;
const OP_CLOSE: u8 = 0x8;
const OP_PING: u8 = 0x9;
const OP_PONG: u8 = 0xA;
/// Control frames carry at most this much (RFC 6455 5.5).
const MAX_CONTROL_PAYLOAD: usize = 125;

/// A frame header being parsed, or the frame whose payload is arriving.
#[derive(Debug, Clone, Copy)]
struct InFrame {
    opcode: u8,
    left: u64,
    mask: Option<[u8; 4]>,
    /// Payload bytes already unmasked (the mask's phase).
    offset: usize,
}

/// A frame to send: its header and payload.
struct OutFrame {
    header: [u8; 14],
    header_len: usize,
    header_sent: usize,
    payload: VecDeque<BytesMut>,
}

impl OutFrame {
    fn new(opcode: u8, mut payload: Batch, mask: Option<[u8; 4]>) -> Self {
        let mut header = [0u8; 14];
        header[0] = 0x80 | opcode;
        let len = payload.len();
        let mut at = 2;
        if len < 126 {
            header[1] = len as u8;
        } else if len <= usize::from(u16::MAX) {
            header[1] = 126;
            header[2..4].copy_from_slice(&(len as u16).to_be_bytes());
            at = 4;
        } else {
            header[1] = 127;
            header[2..10].copy_from_slice(&(len as u64).to_be_bytes());
            at = 10;
        }
        if let Some(key) = mask {
            header[1] |= 0x80;
            header[at..at + 4].copy_from_slice(&key);
            at += 4;
            let mut offset = 0;
            for segment in payload.segments_mut() {
                apply_mask(segment, key, offset);
                offset += segment.len();
            }
        }
        let payload = payload.into_segments();
        Self { header, header_len: at, header_sent: 0, payload }
    }

    fn is_done(&self) -> bool {
        self.header_sent == self.header_len && self.payload.iter().all(BytesMut::is_empty)
    }
}

/// XORs `data` with `key`, as if `data` started `offset` bytes into the masked payload. Works on
/// 64-byte blocks (fixed-size arrays, so the compiler emits vector instructions without bounds
/// checks) against a repeated key.
pub fn apply_mask(data: &mut [u8], key: [u8; 4], offset: usize) {
    let mut key = key;
    key.rotate_left(offset % 4);
    let mut block = [0u8; 64];
    for (i, byte) in block.iter_mut().enumerate() {
        *byte = key[i % 4];
    }
    let mut chunks = data.chunks_exact_mut(64);
    for chunk in &mut chunks {
        if let Ok(chunk) = <&mut [u8; 64]>::try_from(chunk) {
            for (byte, mask) in chunk.iter_mut().zip(block) {
                *byte ^= mask;
            }
        }
    }
    // The rest starts at a multiple of 64, so the block lines up with it from its start.
    for (byte, mask) in chunks.into_remainder().iter_mut().zip(block.iter()) {
        *byte ^= *mask;
    }
}

/// A WebSocket connection after the upgrade, as a multiplexer [`Link`].
pub struct WsLink<S> {
    io: S,
    role: WsRole,
    settings: WsLinkSettings,
    read: BytesMut,
    /// The size of the next read (see [`WsLinkSettings::read_size`]).
    read_size: usize,
    /// Reads since the last keepalive ping (saturating): whether an idle link keeps `read`.
    reads_since_ping: u32,
    frame: Option<InFrame>,
    /// A control frame's payload being collected.
    control: BytesMut,
    /// The data frame being written.
    out: Option<OutFrame>,
    /// Control frames to send at the next frame boundary (pongs, pings, close).
    control_out: VecDeque<OutFrame>,
    keepalive: Option<Keepalive>,
    read_eof: bool,
    close_sent: bool,
    rng: fastrand::Rng,
}

impl<S> WsLink<S>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    /// The data path over `io`, after an upgrade that left `read_ahead` (bytes the handshake read
    /// past the response head) unconsumed.
    pub fn new(io: S, role: WsRole, settings: WsLinkSettings, read_ahead: BytesMut) -> Self {
        let keepalive = settings.keepalive.map(Keepalive::new);
        Self {
            io,
            role,
            read_size: settings.read_size.clamp(1024, MAX_READ_SIZE),
            reads_since_ping: 0,
            settings,
            read: read_ahead,
            frame: None,
            control: BytesMut::new(),
            out: None,
            control_out: VecDeque::new(),
            keepalive,
            read_eof: false,
            close_sent: false,
            rng: fastrand::Rng::new(),
        }
    }

    /// The underlying transport.
    pub fn get_ref(&self) -> &S {
        &self.io
    }

    fn mask_key(&mut self) -> Option<[u8; 4]> {
        (self.role == WsRole::Client).then(|| self.rng.u32(..).to_ne_bytes())
    }

    fn queue_control(&mut self, opcode: u8, payload: BytesMut) {
        let mask = self.mask_key();
        self.control_out.push_back(OutFrame::new(opcode, Batch::from(payload), mask));
    }

    /// Writes queued frames: a data frame in progress first (frames never interleave), then
    /// control frames, then the next data frame.
    fn poll_write_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            // A data frame that has started goes on; otherwise control frames go first.
            let data_started = self.out.as_ref().is_some_and(|f| f.header_sent > 0);
            let use_control = !data_started && !self.control_out.is_empty();
            let frame = if use_control { self.control_out.front_mut() } else { self.out.as_mut() };
            let Some(frame) = frame else { return Poll::Ready(Ok(())) };
            let header = &frame.header[frame.header_sent..frame.header_len];
            let mut slices = [IoSlice::new(&[]); MAX_SLICES];
            let mut count = 0;
            if !header.is_empty() {
                slices[0] = IoSlice::new(header);
                count = 1;
            }
            for segment in frame.payload.iter().take(MAX_SLICES - count) {
                slices[count] = IoSlice::new(segment);
                count += 1;
            }
            let mut n = ready!(Pin::new(&mut self.io).poll_write_vectored(cx, &slices[..count]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            let from_header = n.min(frame.header_len - frame.header_sent);
            frame.header_sent += from_header;
            n -= from_header;
            advance_segments(&mut frame.payload, n);
            if frame.is_done() {
                if use_control {
                    self.control_out.pop_front();
                } else {
                    self.out = None;
                }
            }
        }
    }

    /// Sends pings when due and fails once the peer has been silent too long.
    fn poll_keepalive(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let Some(keepalive) = self.keepalive.as_mut() else { return Ok(()) };
        if keepalive.poll(cx)? {
            // A new interval: the link has to earn keeping its read buffer again.
            self.reads_since_ping = 0;
            // A link that is still busy sending is visibly alive; skip this ping.
            if self.control_out.is_empty() {
                self.queue_control(OP_PING, BytesMut::new());
            }
        }
        if !self.control_out.is_empty()
            && let Poll::Ready(result) = self.poll_write_out(cx)
        {
            result?;
            if let Poll::Ready(result) = Pin::new(&mut self.io).poll_flush(cx) {
                result?;
            }
        }
        Ok(())
    }

    /// Accounts for a read of `n` bytes into `spare` free bytes: one more read this keepalive
    /// interval, and the next read twice as large if this one filled the buffer.
    fn count_read(&mut self, n: usize, spare: usize) {
        self.reads_since_ping = self.reads_since_ping.saturating_add(1);
        if n >= spare {
            self.read_size = (self.read_size * 2).min(MAX_READ_SIZE);
        }
    }

    /// Whether an idle link keeps its (empty) read buffer for the next message: only while it is
    /// busy, and only when a keepalive ping will come to find it quiet and free it.
    fn keeps_read_buffer(&self) -> bool {
        self.keepalive.is_some() && self.reads_since_ping >= BUSY_READS
    }

    /// Parses a frame header from the read buffer, if a whole one is there.
    fn parse_header(&mut self) -> io::Result<Option<InFrame>> {
        let buf = &self.read[..];
        if buf.len() < 2 {
            return Ok(None);
        }
        let (b0, b1) = (buf[0], buf[1]);
        if b0 & 0x70 != 0 {
            return Err(invalid("reserved bits set in a WebSocket frame (no extension was negotiated)"));
        }
        let opcode = b0 & 0x0f;
        let fin = b0 & 0x80 != 0;
        let masked = b1 & 0x80 != 0;
        let (len, mut at) = match b1 & 0x7f {
            126 if buf.len() >= 4 => (u64::from(u16::from_be_bytes([buf[2], buf[3]])), 4),
            127 if buf.len() >= 10 => {
                let mut be = [0u8; 8];
                be.copy_from_slice(&buf[2..10]);
                (u64::from_be_bytes(be), 10)
            }
            126 | 127 => return Ok(None),
            small => (u64::from(small), 2),
        };
        let mask = if masked {
            if buf.len() < at + 4 {
                return Ok(None);
            }
            let key = [buf[at], buf[at + 1], buf[at + 2], buf[at + 3]];
            at += 4;
            Some(key)
        } else {
            None
        };
        match opcode {
            OP_CONTINUATION | OP_BINARY => {}
            OP_TEXT => return Err(invalid("peer sent a text message; the tunnel carries binary messages only")),
            OP_CLOSE | OP_PING | OP_PONG => {
                if !fin || len > MAX_CONTROL_PAYLOAD as u64 {
                    return Err(invalid("fragmented or oversized WebSocket control frame"));
                }
            }
            other => return Err(invalid(&format!("unknown WebSocket opcode {other:#x}"))),
        }
        if len > self.settings.max_frame_size as u64 {
            return Err(invalid(&format!(
                "WebSocket frame of {len} bytes is larger than {}",
                self.settings.max_frame_size
            )));
        }
        match (self.role, masked) {
            (WsRole::Server, false) if !self.settings.accept_unmasked_frames => {
                return Err(invalid("client frame not masked (RFC 6455 5.1)"));
            }
            (WsRole::Client, true) => return Err(invalid("server frame masked (RFC 6455 5.1)")),
            _ => {}
        }
        self.read.advance(at);
        Ok(Some(InFrame { opcode, left: len, mask, offset: 0 }))
    }

    /// Handles a complete control frame; returns whether the peer closed.
    fn on_control(&mut self, opcode: u8) -> bool {
        let payload = std::mem::take(&mut self.control);
        match opcode {
            OP_PING => self.queue_control(OP_PONG, payload),
            OP_CLOSE => {
                if !self.close_sent {
                    self.close_sent = true;
                    // Echo the status code, as RFC 6455 5.5.1 asks.
                    let echo = BytesMut::from(&payload[..payload.len().min(2)]);
                    self.queue_control(OP_CLOSE, echo);
                }
                return true;
            }
            _ => {}
        }
        false
    }
}

fn invalid(reason: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, reason.to_owned())
}

impl<S> Link for WsLink<S>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<BytesMut>>> {
        if let Err(e) = self.poll_keepalive(cx) {
            return Poll::Ready(Some(Err(e)));
        }
        loop {
            if self.read_eof {
                return Poll::Ready(None);
            }
            if self.frame.is_none() {
                match self.parse_header() {
                    Ok(Some(frame)) => {
                        if let Some(keepalive) = self.keepalive.as_mut() {
                            keepalive.heard_from_peer();
                        }
                        self.frame = Some(frame);
                    }
                    Ok(None) => {}
                    Err(e) => return Poll::Ready(Some(Err(e))),
                }
            }
            if let Some(frame) = self.frame {
                let data = frame.opcode == OP_BINARY || frame.opcode == OP_CONTINUATION;
                // Gather more of a data frame's payload while the transport has it at once (TLS
                // hands over one record per read), so the multiplexer gets large chunks: one of its
                // frames that straddles two chunks costs a copy.
                let spare = self.read.capacity() - self.read.len();
                if data && (self.read.len() as u64) < frame.left && spare > 0 {
                    match tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.read) {
                        Poll::Ready(Ok(n)) if n > 0 => {
                            self.count_read(n, spare);
                            continue;
                        }
                        Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e))),
                        // End of stream (seen again by the next read) or nothing more yet.
                        Poll::Ready(Ok(_)) | Poll::Pending => {}
                    }
                }
            }
            if let Some(frame) = self.frame.as_mut() {
                let take = usize::try_from(frame.left).unwrap_or(usize::MAX).min(self.read.len());
                let data = frame.opcode == OP_BINARY || frame.opcode == OP_CONTINUATION;
                if take > 0 || frame.left == 0 {
                    let mut payload = self.read.split_to(take);
                    if let Some(key) = frame.mask {
                        apply_mask(&mut payload, key, frame.offset);
                    }
                    frame.offset += take;
                    frame.left -= take as u64;
                    let opcode = frame.opcode;
                    if frame.left == 0 {
                        self.frame = None;
                    }
                    if data {
                        if !payload.is_empty() {
                            return Poll::Ready(Some(Ok(payload)));
                        }
                        continue;
                    }
                    self.control.extend_from_slice(&payload);
                    if self.frame.is_none() && self.on_control(opcode) {
                        self.read_eof = true;
                        // Best effort: the close echo goes out now if the transport takes it.
                        let _ = self.poll_write_out(cx);
                        let _ = Pin::new(&mut self.io).poll_flush(cx);
                        return Poll::Ready(None);
                    }
                    if !self.control_out.is_empty() {
                        // Answer pings promptly, even while the peer keeps sending data.
                        let _ = self.poll_write_out(cx);
                        let _ = Pin::new(&mut self.io).poll_flush(cx);
                    }
                    continue;
                }
            }
            // More bytes are needed.
            if self.read.capacity() - self.read.len() < self.read_size / 4 {
                self.read.reserve(self.read_size);
            }
            let spare = self.read.capacity() - self.read.len();
            let read = match tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.read) {
                Poll::Pending => {
                    if self.read.is_empty() && !self.keeps_read_buffer() {
                        // Idle: keep no buffer (this matters with tens of thousands of agents).
                        self.read = BytesMut::new();
                        self.read_size = self.settings.read_size.clamp(1024, MAX_READ_SIZE);
                    }
                    return Poll::Pending;
                }
                Poll::Ready(read) => read,
            };
            if let Ok(n @ 1..) = read {
                self.count_read(n, spare);
            }
            match read {
                Ok(0) => {
                    if self.frame.is_some() || !self.read.is_empty() {
                        return Poll::Ready(Some(Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the connection ended inside a WebSocket frame",
                        ))));
                    }
                    self.read_eof = true;
                    return Poll::Ready(None);
                }
                Ok(_) => {}
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
        }
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_write_out(cx))?;
        Poll::Ready(Ok(()))
    }

    fn start_send(&mut self, batch: Batch) -> io::Result<()> {
        if self.close_sent {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "websocket closed"));
        }
        let mask = self.mask_key();
        self.out = Some(OutFrame::new(OP_BINARY, batch, mask));
        Ok(())
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_write_out(cx))?;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.close_sent {
            self.close_sent = true;
            // Normal closure (1000).
            self.queue_control(OP_CLOSE, BytesMut::from(&1000u16.to_be_bytes()[..]));
        }
        ready!(self.poll_write_out(cx))?;
        ready!(Pin::new(&mut self.io).poll_flush(cx))?;
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use futures::{SinkExt, StreamExt};
    use std::time::Duration;
    use tokio_tungstenite::WebSocketStream;
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::protocol::Role;

    fn quiet() -> WsLinkSettings {
        WsLinkSettings { keepalive: None, ..WsLinkSettings::default() }
    }

    /// Keepalive every `interval` s, a silent peer dead `timeout` s after that.
    fn pinging(interval: u64, timeout: u64) -> WsLinkSettings {
        let keepalive = KeepaliveSettings {
            ping_interval: Duration::from_secs(interval),
            ping_timeout: Duration::from_secs(timeout),
        };
        WsLinkSettings { keepalive: Some(keepalive), ..WsLinkSettings::default() }
    }

    /// Our link on one end, tungstenite (an independent RFC 6455 implementation) on the other.
    async fn against_tungstenite(
        role: WsRole,
    ) -> (WsLink<tokio::io::DuplexStream>, WebSocketStream<tokio::io::DuplexStream>) {
        let (a, b) = tokio::io::duplex(1 << 20);
        let theirs = match role {
            WsRole::Client => Role::Server,
            WsRole::Server => Role::Client,
        };
        let peer = WebSocketStream::from_raw_socket(b, theirs, None).await;
        (WsLink::new(a, role, quiet(), BytesMut::new()), peer)
    }

    async fn recv<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(
        link: &mut WsLink<S>,
    ) -> Option<io::Result<BytesMut>> {
        futures::future::poll_fn(|cx| link.poll_recv(cx)).await
    }

    /// Sends `data` as one batch of uneven segments, so masking has to carry its phase across them.
    async fn send<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(link: &mut WsLink<S>, data: &[u8]) {
        futures::future::poll_fn(|cx| link.poll_ready(cx)).await.unwrap();
        let mut batch = Batch::new();
        let mut rest = data;
        for size in [3usize, 61, 1000, 70_001].into_iter().cycle() {
            if rest.is_empty() {
                break;
            }
            let (segment, after) = rest.split_at(size.min(rest.len()));
            batch.push(BytesMut::from(segment));
            rest = after;
        }
        link.start_send(batch).unwrap();
        futures::future::poll_fn(|cx| link.poll_flush(cx)).await.unwrap();
    }

    #[test]
    fn masking_matches_the_bytewise_definition_at_any_offset() {
        let key = [0x37, 0xfa, 0x21, 0x3d];
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        for offset in [0, 1, 2, 3, 5, 8] {
            let mut fast = data.clone();
            apply_mask(&mut fast, key, offset);
            let slow: Vec<u8> = data.iter().enumerate().map(|(i, b)| b ^ key[(i + offset) % 4]).collect();
            assert_eq!(fast, slow, "offset {offset}");
        }
    }

    #[tokio::test]
    async fn frames_interoperate_with_another_implementation_both_ways_and_any_size() {
        for role in [WsRole::Client, WsRole::Server] {
            let (mut ours, mut theirs) = against_tungstenite(role).await;
            for size in [1usize, 125, 126, 65_535, 65_536, 300_000] {
                let payload: Vec<u8> = (0..size).map(|i| (i % 253) as u8).collect();
                send(&mut ours, &payload).await;
                let got = theirs.next().await.unwrap().unwrap();
                assert_eq!(got, Message::Binary(payload.clone().into()), "{role:?} sends {size}");
                theirs.send(Message::Binary(payload.clone().into())).await.unwrap();
                let mut received = Vec::new();
                while received.len() < size {
                    received.extend_from_slice(&recv(&mut ours).await.unwrap().unwrap());
                }
                assert_eq!(received, payload, "{role:?} receives {size}");
            }
        }
    }

    #[tokio::test]
    async fn pings_are_answered_and_close_is_echoed_then_the_end() {
        let (mut ours, mut theirs) = against_tungstenite(WsRole::Client).await;
        theirs.send(Message::Ping(Bytes::from_static(b"are you there"))).await.unwrap();
        theirs.send(Message::Binary(Bytes::from_static(b"data"))).await.unwrap();
        assert_eq!(&recv(&mut ours).await.unwrap().unwrap()[..], b"data");
        assert_eq!(theirs.next().await.unwrap().unwrap(), Message::Pong(Bytes::from_static(b"are you there")));
        theirs.close(None).await.unwrap();
        assert!(recv(&mut ours).await.is_none(), "a close ends the link");
        assert!(matches!(theirs.next().await, Some(Ok(Message::Close(_))) | None));
    }

    #[tokio::test]
    async fn protocol_violations_are_errors() {
        // Unmasked frames to a server, text messages, masked frames to a client.
        let (mut ours, mut theirs) = against_tungstenite(WsRole::Client).await;
        theirs.send(Message::Text("hi".into())).await.unwrap();
        assert_eq!(recv(&mut ours).await.unwrap().unwrap_err().kind(), io::ErrorKind::InvalidData);
        let (a, mut b) = tokio::io::duplex(1024);
        let mut server = WsLink::new(a, WsRole::Server, quiet(), BytesMut::new());
        use tokio::io::AsyncWriteExt;
        b.write_all(&[0x82, 0x03, b'a', b'b', b'c']).await.unwrap();
        assert_eq!(recv(&mut server).await.unwrap().unwrap_err().kind(), io::ErrorKind::InvalidData);
        let (a, mut b) = tokio::io::duplex(1024);
        let mut server = WsLink::new(a, WsRole::Server, quiet(), BytesMut::new());
        b.write_all(&[0x82, 0xff, 0, 0, 0, 1, 0, 0, 0, 0, 1, 2, 3, 4]).await.unwrap();
        let err = recv(&mut server).await.unwrap().unwrap_err();
        assert!(err.to_string().contains("larger than"), "{err}");
    }

    #[tokio::test]
    async fn bytes_read_past_the_handshake_are_not_lost() {
        let (a, b) = tokio::io::duplex(1024);
        let mut theirs = WebSocketStream::from_raw_socket(b, Role::Server, None).await;
        // An unmasked server frame carrying "early", as if it arrived with the 101 response.
        let read_ahead = BytesMut::from(&[0x82, 0x05, b'e', b'a', b'r', b'l', b'y'][..]);
        let mut ours = WsLink::new(a, WsRole::Client, quiet(), read_ahead);
        assert_eq!(&recv(&mut ours).await.unwrap().unwrap()[..], b"early");
        theirs.send(Message::Binary(Bytes::from_static(b"later"))).await.unwrap();
        assert_eq!(&recv(&mut ours).await.unwrap().unwrap()[..], b"later");
    }

    /// Polls once more after everything was read: the link waits (Pending) for the next message.
    fn wait_idle<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(link: &mut WsLink<S>) {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(link.poll_recv(&mut cx).is_pending(), "nothing more was sent");
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_link_keeps_its_read_buffer_between_messages_until_a_ping_finds_it_quiet() {
        let settings = pinging(20, 20);
        let (a, b) = tokio::io::duplex(1 << 20);
        let mut theirs = WebSocketStream::from_raw_socket(b, Role::Server, None).await;
        let mut ours = WsLink::new(a, WsRole::Client, settings, BytesMut::new());
        // One message at a time, as request/response traffic comes.
        let one_message = async |ours: &mut WsLink<_>, theirs: &mut WebSocketStream<_>| {
            theirs.send(Message::Binary(Bytes::from_static(b"request"))).await.unwrap();
            assert_eq!(&recv(ours).await.unwrap().unwrap()[..], b"request");
            wait_idle(ours);
            ours.read.capacity()
        };
        // A quiet link gives its buffer up as soon as it waits.
        assert_eq!(one_message(&mut ours, &mut theirs).await, 0, "a quiet link holds no buffer");
        let mut held = Vec::new();
        for _ in 0..2 * BUSY_READS {
            held.push(one_message(&mut ours, &mut theirs).await);
        }
        assert!(held[..BUSY_READS as usize - 2].iter().all(|&c| c == 0), "{held:?}");
        assert!(held[BUSY_READS as usize..].iter().all(|&c| c > 0), "a busy link keeps its buffer: {held:?}");
        // The next ping finds the link quiet since the last one: the buffer goes.
        tokio::time::advance(Duration::from_secs(21)).await;
        wait_idle(&mut ours);
        assert_eq!(ours.read.capacity(), 0, "the ping after the traffic stopped frees the buffer");
        assert!(matches!(theirs.next().await.unwrap().unwrap(), Message::Ping(_)));
        // Without keepalive nothing would come to free it, so such a link never keeps it.
        let (a, b) = tokio::io::duplex(1 << 20);
        let mut theirs = WebSocketStream::from_raw_socket(b, Role::Server, None).await;
        let mut ours = WsLink::new(a, WsRole::Client, quiet(), BytesMut::new());
        for _ in 0..2 * BUSY_READS {
            assert_eq!(one_message(&mut ours, &mut theirs).await, 0, "no keepalive, no buffer kept");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_peer_is_declared_dead_and_pings_keep_an_answering_one_alive() {
        let settings = pinging(20, 10);
        let (a, b) = tokio::io::duplex(1 << 16);
        let mut theirs = WebSocketStream::from_raw_socket(b, Role::Server, None).await;
        let mut ours = WsLink::new(a, WsRole::Client, settings.clone(), BytesMut::new());
        let started = tokio::time::Instant::now();
        let reader = tokio::spawn(async move { (recv(&mut ours).await.unwrap().unwrap_err(), started.elapsed()) });
        // The peer sees the ping but, not being polled again, never answers it.
        assert!(matches!(theirs.next().await.unwrap().unwrap(), Message::Ping(_)));
        let (err, after) = reader.await.unwrap();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(after, Duration::from_secs(30));

        let (a, b) = tokio::io::duplex(1 << 16);
        let mut theirs = WebSocketStream::from_raw_socket(b, Role::Server, None).await;
        let mut ours = WsLink::new(a, WsRole::Client, settings, BytesMut::new());
        // Reading makes tungstenite answer each ping with a pong.
        let answering = tokio::spawn(async move { while let Some(Ok(_)) = theirs.next().await {} });
        let read = tokio::time::timeout(Duration::from_secs(120), recv(&mut ours)).await;
        assert!(read.is_err(), "still waiting after 120 s of pings: {:?}", read.map(|r| r.map(|x| x.map(|b| b.len()))));
        answering.abort();
    }
}
