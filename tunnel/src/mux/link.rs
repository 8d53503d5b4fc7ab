//! What a session runs over: a [`Link`] delivers the peer's bytes in chunks and sends ours in
//! batches. [`crate::ws::WsByteStream`] is the production link (a chunk is a WebSocket message);
//! [`ByteLink`] adapts any byte stream (tests, in-memory pipes, plain TCP).

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite};

/// A message-oriented transport under a multiplexer session.
pub trait Link: Send + Unpin + 'static {
    /// The next chunk of the peer's byte stream; `None` once the peer has closed the link.
    /// Chunks that continue each other in one buffer let frames across them pass without a copy.
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<BytesMut>>>;
    /// Ready when the link can take another batch.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    /// Queues a batch; call only after [`poll_ready`](Self::poll_ready) was ready. The batch is
    /// the link's to change (a WebSocket client masks it in place).
    fn start_send(&mut self, batch: Batch) -> io::Result<()>;
    /// Pushes queued batches out.
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    /// Flushes and closes the link.
    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
}

/// Queued frames handed to a link at once: segments in order, as the session's streams queued them.
/// Large data bodies stay in the buffers they were read into (a splice reads a socket straight into
/// one); small frames share segments. The link sends them as one message (one vectored write).
#[derive(Debug, Default)]
pub struct Batch {
    segments: VecDeque<BytesMut>,
    len: usize,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a segment (empty ones are dropped).
    pub fn push(&mut self, segment: BytesMut) {
        if !segment.is_empty() {
            self.len += segment.len();
            self.segments.push_back(segment);
        }
    }

    /// Removes and returns the first segment.
    pub fn pop(&mut self) -> Option<BytesMut> {
        let segment = self.segments.pop_front()?;
        self.len -= segment.len();
        Some(segment)
    }

    /// The last segment, to append small frames to when it has room.
    pub(crate) fn back_mut(&mut self) -> Option<&mut BytesMut> {
        self.segments.back_mut()
    }

    /// Records `n` bytes appended to the last segment through [`back_mut`](Self::back_mut).
    pub(crate) fn grew(&mut self, n: usize) {
        self.len += n;
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the batch holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The segments, in order.
    pub fn segments_mut(&mut self) -> impl Iterator<Item = &mut BytesMut> {
        self.segments.iter_mut()
    }

    /// The segments, in order, to send.
    pub fn into_segments(self) -> VecDeque<BytesMut> {
        self.segments
    }

    /// All bytes in one buffer (copies unless there is a single segment).
    pub fn concat(mut self) -> BytesMut {
        if self.segments.len() == 1 {
            return self.segments.pop_front().unwrap_or_default();
        }
        let mut all = BytesMut::with_capacity(self.len);
        for segment in &self.segments {
            all.extend_from_slice(segment);
        }
        all
    }
}

impl From<BytesMut> for Batch {
    fn from(segment: BytesMut) -> Self {
        let mut batch = Self::new();
        batch.push(segment);
        batch
    }
}

/// Bytes asked from a byte stream per read.
const READ_SIZE: usize = 64 * 1024;

/// A byte stream as a [`Link`]: reads go into a buffer without zero-filling it first.
pub struct ByteLink<T> {
    io: T,
    read: BytesMut,
    write: VecDeque<Bytes>,
}

impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> ByteLink<T> {
    /// Wraps `io`.
    pub fn new(io: T) -> Self {
        Self { io, read: BytesMut::new(), write: VecDeque::new() }
    }

    fn poll_write_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.write.is_empty() {
            let slices: Vec<IoSlice<'_>> = self.write.iter().take(MAX_SLICES).map(|s| IoSlice::new(s)).collect();
            let n = ready!(Pin::new(&mut self.io).poll_write_vectored(cx, &slices))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            advance_segments(&mut self.write, n);
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Link for ByteLink<T> {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<BytesMut>>> {
        if self.read.capacity() - self.read.len() < READ_SIZE / 4 {
            self.read.reserve(READ_SIZE);
        }
        match ready!(tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.read)) {
            Ok(0) => Poll::Ready(None),
            Ok(_) => Poll::Ready(Some(Ok(self.read.split()))),
            Err(e) => Poll::Ready(Some(Err(e))),
        }
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_write_pending(cx)
    }

    fn start_send(&mut self, batch: Batch) -> io::Result<()> {
        debug_assert!(self.write.is_empty());
        self.write = batch.into_segments().into_iter().map(BytesMut::freeze).collect();
        Ok(())
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_write_pending(cx))?;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_flush(cx))?;
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Most slices handed to one vectored write.
pub(crate) const MAX_SLICES: usize = 64;

/// Drops the first `n` bytes of `segments` (what a vectored write took).
pub(crate) fn advance_segments<B: Buf>(segments: &mut VecDeque<B>, mut n: usize) {
    while n > 0 {
        let Some(front) = segments.front_mut() else { return };
        let k = n.min(front.remaining());
        front.advance(k);
        n -= k;
        if !front.has_remaining() {
            segments.pop_front();
        }
    }
    while segments.front().is_some_and(|s| !s.has_remaining()) {
        segments.pop_front();
    }
}
