//! Bidirectional copy between two streams, with half-close and no per-stream buffer while idle.
//!
//! Each direction reads into a per-thread scratch buffer and writes straight on; only when the
//! writer cannot take everything does the rest move into a buffer owned by the stream, which is
//! freed as soon as it drains. An idle tunnelled connection therefore holds no copy buffers, which
//! matters with 100,000 mostly idle streams. End-of-stream on one side becomes a write shutdown
//! (half-close) on the other, so request/response protocols that shut down writing keep working.

use std::cell::RefCell;
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes read per call; matches the multiplexer's largest data frame.
const SCRATCH_SIZE: usize = 256 * 1024;
/// Reads per direction before yielding to the other direction and other tasks.
const READS_PER_POLL: usize = 16;

thread_local! {
    static SCRATCH: RefCell<Box<[u8]>> = RefCell::new(vec![0u8; SCRATCH_SIZE].into_boxed_slice());
}

/// Which way bytes moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the first stream to the second.
    AToB,
    /// From the second stream to the first.
    BToA,
}

/// Bytes moved in each direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpliceStats {
    /// From the first stream to the second.
    pub a_to_b: u64,
    /// From the second stream to the first.
    pub b_to_a: u64,
}

/// Copies both ways until both directions have reached end-of-stream, or one fails.
///
/// `on_bytes` is called for every chunk moved, for live byte counters.
pub async fn splice<A, B, F>(a: &mut A, b: &mut B, mut on_bytes: F) -> Result<SpliceStats, SpliceError>
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
    F: FnMut(Direction, usize),
{
    let mut a_to_b = Pump::default();
    let mut b_to_a = Pump::default();
    poll_fn(|cx| {
        let forward = a_to_b
            .poll(cx, &mut *a, &mut *b, &mut |n| on_bytes(Direction::AToB, n))
            .map_err(|e| SpliceError { direction: Direction::AToB, error: e })?;
        let backward = b_to_a
            .poll(cx, &mut *b, &mut *a, &mut |n| on_bytes(Direction::BToA, n))
            .map_err(|e| SpliceError { direction: Direction::BToA, error: e })?;
        if forward.is_ready() && backward.is_ready() {
            Poll::Ready(Ok(SpliceStats { a_to_b: a_to_b.total, b_to_a: b_to_a.total }))
        } else {
            Poll::Pending
        }
    })
    .await
}

/// A failed copy, with the direction in which it failed.
#[derive(Debug, thiserror::Error)]
#[error("copy {direction:?} failed: {error}")]
pub struct SpliceError {
    /// The direction that failed.
    pub direction: Direction,
    /// The I/O error.
    pub error: io::Error,
}

/// One direction of the copy.
#[derive(Default)]
struct Pump {
    /// Bytes read but not yet written; only present while the writer is behind.
    pending: Option<Box<[u8]>>,
    pos: usize,
    read_done: bool,
    shut_down: bool,
    needs_flush: bool,
    total: u64,
}

impl Pump {
    fn poll<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        reader: &mut R,
        writer: &mut W,
        on_bytes: &mut dyn FnMut(usize),
    ) -> Poll<io::Result<()>>
    where
        R: AsyncRead + Unpin + ?Sized,
        W: AsyncWrite + Unpin + ?Sized,
    {
        if self.shut_down {
            return Poll::Ready(Ok(()));
        }
        for _ in 0..READS_PER_POLL {
            if let Some(pending) = &self.pending {
                while self.pos < pending.len() {
                    let n = ready!(Pin::new(&mut *writer).poll_write(cx, &pending[self.pos..]))?;
                    if n == 0 {
                        return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                    }
                    self.pos += n;
                    self.needs_flush = true;
                }
                self.pending = None;
                self.pos = 0;
            }
            if self.read_done {
                ready!(Pin::new(&mut *writer).poll_shutdown(cx))?;
                self.shut_down = true;
                return Poll::Ready(Ok(()));
            }
            match self.read_and_write(cx, reader, writer, on_bytes) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    if self.needs_flush
                        && let Poll::Ready(result) = Pin::new(&mut *writer).poll_flush(cx)
                    {
                        result?;
                        self.needs_flush = false;
                    }
                    return Poll::Pending;
                }
            }
        }
        // Plenty of data is flowing: give the other direction and other tasks a turn.
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// Reads one chunk into the scratch buffer and writes what the writer takes at once.
    fn read_and_write<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        reader: &mut R,
        writer: &mut W,
        on_bytes: &mut dyn FnMut(usize),
    ) -> Poll<io::Result<()>>
    where
        R: AsyncRead + Unpin + ?Sized,
        W: AsyncWrite + Unpin + ?Sized,
    {
        SCRATCH.with(|scratch| match scratch.try_borrow_mut() {
            Ok(mut scratch) => self.move_chunk(cx, reader, writer, on_bytes, &mut scratch),
            // Never expected (polls do not nest), but a private buffer is always correct.
            Err(_) => self.move_chunk(cx, reader, writer, on_bytes, &mut vec![0u8; 16 * 1024]),
        })
    }

    fn move_chunk<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        reader: &mut R,
        writer: &mut W,
        on_bytes: &mut dyn FnMut(usize),
        scratch: &mut [u8],
    ) -> Poll<io::Result<()>>
    where
        R: AsyncRead + Unpin + ?Sized,
        W: AsyncWrite + Unpin + ?Sized,
    {
        let mut buf = ReadBuf::new(scratch);
        ready!(Pin::new(&mut *reader).poll_read(cx, &mut buf))?;
        let data = buf.filled();
        if data.is_empty() {
            self.read_done = true;
            return Poll::Ready(Ok(()));
        }
        on_bytes(data.len());
        self.total += data.len() as u64;
        let mut written = 0;
        while written < data.len() {
            match Pin::new(&mut *writer).poll_write(cx, &data[written..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => {
                    written += n;
                    self.needs_flush = true;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => break,
            }
        }
        if written < data.len() {
            self.pending = Some(data[written..].into());
            self.pos = 0;
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn copies_both_ways_and_propagates_half_close() {
        let (mut client, mut a) = tokio::io::duplex(1024);
        let (mut b, mut server) = tokio::io::duplex(1024);
        let mut counted = SpliceStats::default();
        let splicer = tokio::spawn(async move {
            let stats = splice(&mut a, &mut b, |d, n| match d {
                Direction::AToB => counted.a_to_b += n as u64,
                Direction::BToA => counted.b_to_a += n as u64,
            })
            .await
            .unwrap();
            (stats, counted)
        });
        let request = vec![5u8; 100_000];
        let response = vec![9u8; 300_000];
        let server_side = {
            let response = response.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                server.read_to_end(&mut got).await.unwrap();
                server.write_all(&response).await.unwrap();
                server.shutdown().await.unwrap();
                got
            })
        };
        client.write_all(&request).await.unwrap();
        client.shutdown().await.unwrap();
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, response, "the response arrives after the client shut down writing");
        assert_eq!(server_side.await.unwrap(), request);
        let (stats, counted) = splicer.await.unwrap();
        assert_eq!(stats, SpliceStats { a_to_b: 100_000, b_to_a: 300_000 });
        assert_eq!(counted, stats);
    }

    #[tokio::test]
    async fn a_failing_side_ends_the_splice_with_an_error() {
        let (mut client, mut a) = tokio::io::duplex(64);
        let (mut b, server) = tokio::io::duplex(64);
        drop(server);
        client.write_all(b"data").await.unwrap();
        let err = splice(&mut a, &mut b, |_, _| {}).await.unwrap_err();
        assert_eq!(err.direction, Direction::AToB);
    }
}
