//! Makes HTTP/2 requests with a socket path as `:authority` acceptable.
//!
//! kube-apiserver dials its egress Unix socket through grpc-go with the socket's path as target,
//! so its requests carry the path (percent-encoded, or as is in older releases) as `:authority`,
//! as Python's grpcio does on Unix sockets. That is not a valid URI authority, and the HTTP/2
//! implementation resets such streams with PROTOCOL_ERROR (hyperium/h2 #487). grpc-go servers,
//! konnectivity-server among them, accept it. So the client's bytes pass through this adapter
//! first: header blocks are decoded (HPACK, with the client's table), an invalid `:authority` is
//! replaced by `localhost` (what grpc-go itself sends for `unix:` targets), and the block is
//! encoded again for the server; every other frame passes untouched. The authority is not used
//! for anything: the frontend's tenant is the socket's.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, BytesMut};
use loona_hpack::{Decoder, Encoder};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
/// The server's SETTINGS_MAX_FRAME_SIZE (the default, which the frontend keeps).
const MAX_FRAME: usize = 16_384;
/// Largest header block gathered (a gRPC request's headers are a few hundred bytes).
const MAX_BLOCK: usize = 64 * 1024;
/// The server's SETTINGS_HEADER_TABLE_SIZE (the default): the most the client's encoder may use.
const TABLE_SIZE: usize = 4096;

const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

enum State {
    Preface,
    Frames,
    /// Not HTTP/2 with the client preface, or the stream broke: bytes pass as they are.
    Passthrough,
}

/// A header block being gathered from HEADERS and CONTINUATION frames.
struct Block {
    stream_id: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// The client side of an HTTP/2 connection, with header blocks made acceptable to the server.
pub struct AuthorityFix<S> {
    inner: S,
    input: BytesMut,
    output: BytesMut,
    state: State,
    block: Option<Block>,
    decoder: Decoder<'static>,
    encoder: Encoder<'static>,
    eof: bool,
}

impl<S> AuthorityFix<S> {
    /// Wraps the client's stream.
    pub fn new(inner: S) -> Self {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(TABLE_SIZE);
        Self {
            inner,
            input: BytesMut::new(),
            output: BytesMut::new(),
            state: State::Preface,
            block: None,
            decoder,
            encoder: Encoder::new(),
            eof: false,
        }
    }

    /// Moves what can be handled from `input` to `output`; false when more input is needed.
    fn process(&mut self) -> io::Result<bool> {
        match self.state {
            State::Passthrough => {
                if self.input.is_empty() {
                    return Ok(false);
                }
                let all = self.input.split();
                self.output.extend_from_slice(&all);
                Ok(true)
            }
            State::Preface => {
                let n = self.input.len().min(PREFACE.len());
                if self.input[..n] != PREFACE[..n] {
                    self.state = State::Passthrough;
                    return Ok(true);
                }
                if n < PREFACE.len() {
                    return Ok(false);
                }
                let preface = self.input.split_to(PREFACE.len());
                self.output.extend_from_slice(&preface);
                self.state = State::Frames;
                Ok(true)
            }
            State::Frames => self.process_frame(),
        }
    }

    fn process_frame(&mut self) -> io::Result<bool> {
        if self.input.len() < FRAME_HEADER {
            return Ok(false);
        }
        let len = usize::from(self.input[0]) << 16 | usize::from(self.input[1]) << 8 | usize::from(self.input[2]);
        let kind = self.input[3];
        let flags = self.input[4];
        let stream_id = u32::from_be_bytes([self.input[5], self.input[6], self.input[7], self.input[8]]) & 0x7fff_ffff;
        if len > MAX_FRAME {
            // The server answers this with FRAME_SIZE_ERROR; nothing more to rewrite.
            self.state = State::Passthrough;
            return Ok(true);
        }
        if self.input.len() < FRAME_HEADER + len {
            return Ok(false);
        }
        let frame = self.input.split_to(FRAME_HEADER + len);
        let payload = &frame[FRAME_HEADER..];
        match (kind, self.block.as_mut()) {
            (HEADERS, None) => {
                let Some((priority, fragment)) = headers_fragment(flags, payload) else {
                    self.output.extend_from_slice(&frame);
                    self.state = State::Passthrough;
                    return Ok(true);
                };
                self.block = Some(Block { stream_id, flags, priority, fragment: fragment.to_vec() });
            }
            (CONTINUATION, Some(block)) if block.stream_id == stream_id => {
                if block.fragment.len() + payload.len() > MAX_BLOCK {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "HTTP/2 header block too large"));
                }
                block.fragment.extend_from_slice(payload);
                block.flags |= flags & END_HEADERS;
            }
            (_, Some(_)) => {
                // The server rejects a header block interrupted by another frame.
                self.flush_block_raw();
                self.output.extend_from_slice(&frame);
                self.state = State::Passthrough;
                return Ok(true);
            }
            _ => {
                self.output.extend_from_slice(&frame);
                return Ok(true);
            }
        }
        if self.block.as_ref().is_some_and(|b| b.flags & END_HEADERS != 0) {
            self.rewrite_block()?;
        }
        Ok(true)
    }

    /// Decodes the gathered block, fixes `:authority`, and writes it out as frames again.
    fn rewrite_block(&mut self) -> io::Result<()> {
        let Some(block) = self.block.take() else { return Ok(()) };
        let mut headers = self
            .decoder
            .decode(&block.fragment)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("HTTP/2 header block: {e}")))?;
        for (name, value) in &mut headers {
            if name.as_slice() == b":authority" && http::uri::Authority::try_from(value.as_slice()).is_err() {
                tracing::trace!(authority = %String::from_utf8_lossy(value), "replacing an invalid :authority with localhost");
                *value = b"localhost".to_vec();
            }
        }
        let encoded = self.encoder.encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let head_room = if block.priority.is_some() { 5 } else { 0 };
        let first = encoded.len().min(MAX_FRAME - head_room);
        let mut flags = block.flags & (END_STREAM | PRIORITY);
        if first == encoded.len() {
            flags |= END_HEADERS;
        }
        self.put_frame_header(first + head_room, HEADERS, flags, block.stream_id);
        if let Some(priority) = block.priority {
            self.output.extend_from_slice(&priority);
        }
        self.output.extend_from_slice(&encoded[..first]);
        let mut rest = &encoded[first..];
        while !rest.is_empty() {
            let n = rest.len().min(MAX_FRAME);
            let flags = if n == rest.len() { END_HEADERS } else { 0 };
            self.put_frame_header(n, CONTINUATION, flags, block.stream_id);
            self.output.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
        }
        Ok(())
    }

    /// Gives up on a block that cannot be rewritten: the server sees the client's frames as
    /// they were (one HEADERS frame carrying the gathered fragment) and answers the error.
    fn flush_block_raw(&mut self) {
        if let Some(block) = self.block.take() {
            let len = block.fragment.len().min(MAX_FRAME);
            self.put_frame_header(len, HEADERS, block.flags & END_STREAM, block.stream_id);
            self.output.extend_from_slice(&block.fragment[..len]);
        }
    }

    fn put_frame_header(&mut self, len: usize, kind: u8, flags: u8, stream_id: u32) {
        let len = u32::try_from(len).unwrap_or(0);
        self.output.extend_from_slice(&len.to_be_bytes()[1..]);
        self.output.put_u8(kind);
        self.output.put_u8(flags);
        self.output.put_u32(stream_id);
    }
}

/// A HEADERS payload's priority fields and header block fragment, without padding.
fn headers_fragment(flags: u8, payload: &[u8]) -> Option<(Option<[u8; 5]>, &[u8])> {
    let mut rest = payload;
    let mut pad = 0;
    if flags & PADDED != 0 {
        pad = usize::from(*rest.first()?);
        rest = &rest[1..];
    }
    let mut priority = None;
    if flags & PRIORITY != 0 {
        let fields: [u8; 5] = rest.get(..5)?.try_into().ok()?;
        priority = Some(fields);
        rest = &rest[5..];
    }
    let end = rest.len().checked_sub(pad)?;
    Some((priority, &rest[..end]))
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if !this.output.is_empty() {
                let n = this.output.len().min(buf.remaining());
                buf.put_slice(&this.output[..n]);
                this.output.advance(n);
                return Poll::Ready(Ok(()));
            }
            if matches!(this.state, State::Passthrough) && this.input.is_empty() {
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            if this.process()? {
                continue;
            }
            if this.eof {
                // A truncated frame: hand over what there is; the server sees the end.
                let rest = this.input.split();
                this.output.extend_from_slice(&rest);
                if this.output.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            if this.input.capacity() - this.input.len() < 4096 {
                this.input.reserve(MAX_FRAME + FRAME_HEADER);
            }
            let n = ready!(tokio_util::io::poll_read_buf(Pin::new(&mut this.inner), cx, &mut this.input))?;
            if n == 0 {
                this.eof = true;
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
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
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[kind, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    async fn through(input: Vec<u8>) -> Vec<u8> {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        client.write_all(&input).await.unwrap();
        drop(client);
        let mut out = Vec::new();
        AuthorityFix::new(server).read_to_end(&mut out).await.unwrap();
        out
    }

    fn headers_of(bytes: &[u8]) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut decoder = Decoder::new();
        let mut rest = &bytes[PREFACE.len()..];
        let mut blocks = Vec::new();
        let mut block = Vec::new();
        while !rest.is_empty() {
            let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
            let (kind, flags) = (rest[3], rest[4]);
            let payload = &rest[9..9 + len];
            if kind == HEADERS || kind == CONTINUATION {
                let (_, fragment) =
                    if kind == HEADERS { headers_fragment(flags, payload).unwrap() } else { (None, payload) };
                block.extend_from_slice(fragment);
                if flags & END_HEADERS != 0 {
                    blocks.push(decoder.decode(&block).unwrap());
                    block.clear();
                }
            }
            rest = &rest[9 + len..];
        }
        blocks
    }

    #[tokio::test]
    async fn a_socket_path_authority_becomes_localhost_and_the_rest_is_kept() {
        let mut client = Encoder::new();
        let request = |authority: &[u8], client: &mut Encoder<'_>| {
            client.encode([
                (&b":method"[..], &b"POST"[..]),
                (b":scheme", b"http"),
                (b":path", b"/ProxyService/Proxy"),
                (b":authority", authority),
                (b"content-type", b"application/grpc"),
                (b"te", b"trailers"),
            ])
        };
        let first = request(b"%2Fetc%2Fkubernetes%2Fkonnectivity.socket", &mut client);
        let second = request(b"/etc/kubernetes/konnectivity.socket", &mut client);
        let third = request(b"localhost:8131", &mut client);
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
        // Padded, with priority, split over a CONTINUATION.
        let mut padded = vec![3u8, 0, 0, 0, 0, 16];
        padded.extend_from_slice(&first[..10]);
        padded.extend_from_slice(&[0, 0, 0]);
        input.extend(frame(HEADERS, PADDED | PRIORITY, 1, &padded));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, &first[10..]));
        input.extend(frame(0x0, 0, 1, b"\0\0\0\0\x02\x08\x04"));
        input.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &second));
        input.extend(frame(HEADERS, END_HEADERS, 5, &third));
        let out = through(input).await;
        assert!(out.starts_with(PREFACE));
        let blocks = headers_of(&out);
        let authorities: Vec<&[u8]> =
            blocks.iter().map(|b| b.iter().find(|(n, _)| n == b":authority").unwrap().1.as_slice()).collect();
        assert_eq!(authorities, [&b"localhost"[..], b"localhost", b"localhost:8131"]);
        assert_eq!(blocks[0].len(), 6);
        assert!(blocks[0].contains(&(b"te".to_vec(), b"trailers".to_vec())));
        // The DATA frame is passed on as it was.
        assert!(out.windows(16).any(|w| w == frame(0x0, 0, 1, b"\0\0\0\0\x02\x08\x04").as_slice()));
    }

    #[tokio::test]
    async fn anything_else_passes_unchanged() {
        let connect = b"CONNECT 10.0.0.1:10250 HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
        assert_eq!(through(connect.clone()).await, connect);
        let garbage = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\xff\xff\xff\x01\x00".to_vec();
        assert_eq!(through(garbage.clone()).await, garbage, "an oversized frame is left to the server");
        let truncated = [PREFACE, &frame(HEADERS, END_HEADERS, 1, b"\x82\x86")[..6]].concat();
        assert_eq!(through(truncated.clone()).await, truncated);
    }
}
