//! What a session runs over: a [`Link`] delivers the peer's bytes in chunks and sends ours in
//! batches. [`crate::ws::WsByteStream`] is the production link (a chunk is a WebSocket message);
//! [`ByteLink`] adapts any byte stream (tests, in-memory pipes, plain TCP).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite};

/// A message-oriented transport under a multiplexer session.
pub trait Link: Send + Unpin + 'static {
    /// The next chunk of the peer's byte stream; `None` once the peer has closed the link.
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>>;
    /// Ready when the link can take another batch.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    /// Queues a batch; call only after [`poll_ready`](Self::poll_ready) was ready. The batch is
    /// the link's to change (a WebSocket client masks it in place).
    fn start_send(&mut self, batch: BytesMut) -> io::Result<()>;
    /// Pushes queued batches out.
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    /// Flushes and closes the link.
    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
}

/// Bytes asked from a byte stream per read.
const READ_SIZE: usize = 64 * 1024;

/// A byte stream as a [`Link`]: reads go into a buffer without zero-filling it first.
pub struct ByteLink<T> {
    io: T,
    read: BytesMut,
    write: Bytes,
}

impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> ByteLink<T> {
    /// Wraps `io`.
    pub fn new(io: T) -> Self {
        Self { io, read: BytesMut::new(), write: Bytes::new() }
    }

    fn poll_write_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.write.is_empty() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.write))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.write.advance(n);
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Link for ByteLink<T> {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        if self.read.capacity() - self.read.len() < READ_SIZE / 4 {
            self.read.reserve(READ_SIZE);
        }
        match ready!(tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.read)) {
            Ok(0) => Poll::Ready(None),
            Ok(_) => Poll::Ready(Some(Ok(self.read.split().freeze()))),
            Err(e) => Poll::Ready(Some(Err(e))),
        }
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_write_pending(cx)
    }

    fn start_send(&mut self, batch: BytesMut) -> io::Result<()> {
        debug_assert!(self.write.is_empty());
        self.write = batch.freeze();
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
