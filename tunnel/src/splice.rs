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

use std::collections::VecDeque;
use std::io::IoSlice;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::mux::MuxStream;
use crate::mux::link::{MAX_SLICES, advance_segments};

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
        let forward = a_to_b.poll(cx, &mut *a, &mut *b, &mut |n| on_bytes(Direction::AToB, n));
        let backward = b_to_a.poll(cx, &mut *b, &mut *a, &mut |n| on_bytes(Direction::BToA, n));
        both_directions(forward, backward).map_ok(|()| SpliceStats { a_to_b: a_to_b.total, b_to_a: b_to_a.total })
    })
    .await
}

/// One poll of each direction, combined: done when both are, failed when either fails.
fn both_directions(forward: Poll<io::Result<()>>, backward: Poll<io::Result<()>>) -> Poll<Result<(), SpliceError>> {
    match (forward, backward) {
        (Poll::Ready(Err(error)), _) => Poll::Ready(Err(SpliceError { direction: Direction::AToB, error })),
        (_, Poll::Ready(Err(error))) => Poll::Ready(Err(SpliceError { direction: Direction::BToA, error })),
        (Poll::Ready(Ok(())), Poll::Ready(Ok(()))) => Poll::Ready(Ok(())),
        _ => Poll::Pending,
    }
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

/// Like [`splice`], between any stream and a multiplexer stream, with no copy in user space: bytes
/// read from `a` land in a fresh buffer that becomes a frame body as it is, and bytes received on
/// `mux` are written to `a` straight from the message they arrived in (several per vectored write).
/// An idle splice holds no buffer either way.
pub async fn splice_mux<A, F>(a: &mut A, mux: &mut MuxStream, mut on_bytes: F) -> Result<SpliceStats, SpliceError>
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    F: FnMut(Direction, usize),
{
    let mut into_mux = IntoMux::default();
    let mut from_mux = FromMux::default();
    poll_fn(|cx| {
        let forward = into_mux.poll(cx, &mut *a, &mut *mux, &mut |n| on_bytes(Direction::AToB, n));
        let backward = from_mux.poll(cx, &mut *mux, &mut *a, &mut |n| on_bytes(Direction::BToA, n));
        both_directions(forward, backward).map_ok(|()| SpliceStats { a_to_b: into_mux.total, b_to_a: from_mux.total })
    })
    .await
}

/// First read size into a multiplexer stream; doubles while reads fill it.
const MIN_OWNED_READ: usize = 16 * 1024;
/// Largest read into a multiplexer stream (a few frames' worth).
const MAX_OWNED_READ: usize = 256 * 1024;
/// Received bytes gathered into one write toward the stream.
const MAX_GATHER: usize = 256 * 1024;

/// Stream -> multiplexer: reads into buffers handed over to the multiplexer.
///
/// After a small read (and at the start, and after idling) the next read goes into the thread's
/// scratch buffer instead of a new buffer of its own: a small read is copied into the session's
/// output, which it would be anyway (the multiplexer copies bodies under
/// [`OWNED_BODY_MIN`](crate::mux::OWNED_BODY_MIN)), so a request/response exchange allocates no read
/// buffer per message. A large read moves into a buffer of its own, and the reads after it fill
/// such buffers directly, which become frame bodies without a copy.
struct IntoMux {
    /// Read, not yet taken by the multiplexer; the spare capacity takes the next read.
    buf: BytesMut,
    read_size: usize,
    /// The last read was small (or there was none yet).
    small: bool,
    read_done: bool,
    shut_down: bool,
    total: u64,
}

impl Default for IntoMux {
    fn default() -> Self {
        Self {
            buf: BytesMut::new(),
            read_size: MIN_OWNED_READ,
            small: true,
            read_done: false,
            shut_down: false,
            total: 0,
        }
    }
}

impl IntoMux {
    fn poll<R>(
        &mut self,
        cx: &mut Context<'_>,
        reader: &mut R,
        mux: &mut MuxStream,
        on_bytes: &mut dyn FnMut(usize),
    ) -> Poll<io::Result<()>>
    where
        R: AsyncRead + Unpin + ?Sized,
    {
        if self.shut_down {
            return Poll::Ready(Ok(()));
        }
        for _ in 0..READS_PER_POLL {
            while !self.buf.is_empty() {
                ready!(mux.poll_send_owned(cx, &mut self.buf))?;
            }
            if self.read_done {
                mux.finish();
                self.shut_down = true;
                return Poll::Ready(Ok(()));
            }
            let read = match self.small.then(|| self.poll_read_scratch(cx, reader, mux)).flatten() {
                Some(read) => read,
                None => self.poll_read_owned(cx, reader),
            };
            match read {
                Poll::Pending => {
                    // Idle: hold no buffer.
                    self.buf = BytesMut::new();
                    return Poll::Pending;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(0)) => self.read_done = true,
                Poll::Ready(Ok(n)) => {
                    on_bytes(n);
                    self.total += n as u64;
                    self.small = n < crate::mux::OWNED_BODY_MIN;
                }
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// Reads into a buffer of the stream's own, which is handed over as it is.
    fn poll_read_owned<R>(&mut self, cx: &mut Context<'_>, reader: &mut R) -> Poll<io::Result<usize>>
    where
        R: AsyncRead + Unpin + ?Sized,
    {
        if self.buf.capacity() < MIN_OWNED_READ / 4 {
            self.buf = BytesMut::with_capacity(self.read_size);
        }
        let spare = self.buf.capacity();
        let read = ready!(tokio_util::io::poll_read_buf(Pin::new(&mut *reader), cx, &mut self.buf))?;
        if read == spare {
            self.read_size = (self.read_size * 2).min(MAX_OWNED_READ);
        }
        Poll::Ready(Ok(read))
    }

    /// Reads into the thread's scratch buffer: what the session takes at once is copied into its
    /// output, the rest moves into `buf`. `None` when the scratch buffer is in use.
    fn poll_read_scratch<R>(
        &mut self,
        cx: &mut Context<'_>,
        reader: &mut R,
        mux: &mut MuxStream,
    ) -> Option<Poll<io::Result<usize>>>
    where
        R: AsyncRead + Unpin + ?Sized,
    {
        SCRATCH
            .try_with(|scratch| {
                let mut scratch = scratch.try_borrow_mut().ok()?;
                let limit = self.read_size.min(scratch.len());
                let mut read = ReadBuf::new(&mut scratch[..limit]);
                Some(match Pin::new(&mut *reader).poll_read(cx, &mut read) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                    Poll::Ready(Ok(())) => {
                        let filled = read.filled();
                        let mut sent = 0;
                        if filled.len() < crate::mux::OWNED_BODY_MIN {
                            while sent < filled.len() {
                                match Pin::new(&mut *mux).poll_write(cx, &filled[sent..]) {
                                    Poll::Ready(Ok(k)) => sent += k,
                                    // Kept for the next poll, which meets the error or the wait.
                                    Poll::Ready(Err(_)) | Poll::Pending => break,
                                }
                            }
                        }
                        if sent < filled.len() {
                            self.buf = BytesMut::with_capacity(self.read_size.max(filled.len() - sent));
                            self.buf.extend_from_slice(&filled[sent..]);
                        }
                        Poll::Ready(Ok(filled.len()))
                    }
                })
            })
            .ok()
            .flatten()
    }
}

/// Multiplexer -> stream: writes received chunks as they are.
#[derive(Default)]
struct FromMux {
    chunks: VecDeque<Bytes>,
    read_done: bool,
    shut_down: bool,
    needs_flush: bool,
    total: u64,
}

impl FromMux {
    fn poll<W>(
        &mut self,
        cx: &mut Context<'_>,
        mux: &mut MuxStream,
        writer: &mut W,
        on_bytes: &mut dyn FnMut(usize),
    ) -> Poll<io::Result<()>>
    where
        W: AsyncWrite + Unpin + ?Sized,
    {
        if self.shut_down {
            return Poll::Ready(Ok(()));
        }
        for _ in 0..READS_PER_POLL {
            // Gather what has arrived, then write it in one go.
            let mut gathered: usize = self.chunks.iter().map(Bytes::len).sum();
            let mut waiting = false;
            while !self.read_done && gathered < MAX_GATHER && self.chunks.len() < MAX_SLICES {
                match mux.poll_recv_chunk(cx, MAX_GATHER - gathered) {
                    Poll::Ready(Ok(Some(chunk))) => {
                        on_bytes(chunk.len());
                        self.total += chunk.len() as u64;
                        gathered += chunk.len();
                        self.chunks.push_back(chunk);
                    }
                    Poll::Ready(Ok(None)) => self.read_done = true,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {
                        waiting = true;
                        break;
                    }
                }
            }
            while !self.chunks.is_empty() {
                let slices: Vec<IoSlice<'_>> = self.chunks.iter().map(|c| IoSlice::new(c)).collect();
                match Pin::new(&mut *writer).poll_write_vectored(cx, &slices) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                    Poll::Ready(Ok(n)) => {
                        advance_segments(&mut self.chunks, n);
                        self.needs_flush = true;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return Poll::Pending,
                }
            }
            if self.read_done {
                ready!(Pin::new(&mut *writer).poll_shutdown(cx))?;
                self.shut_down = true;
                return Poll::Ready(Ok(()));
            }
            if waiting {
                if self.needs_flush
                    && let Poll::Ready(result) = Pin::new(&mut *writer).poll_flush(cx)
                {
                    result?;
                    self.needs_flush = false;
                }
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
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

    /// A client session and the server side's incoming streams, over an in-memory link.
    fn session_pair() -> (crate::mux::Session, crate::mux::Incoming) {
        use crate::mux::{self, ByteLink, MuxSettings, Role};
        let (link_a, link_b) = tokio::io::duplex(64 * 1024);
        let settings = MuxSettings::default();
        let (client, _client_in, client_driver) = mux::start(ByteLink::new(link_a), Role::Client, &settings);
        let (_server, server_in, server_driver) = mux::start(ByteLink::new(link_b), Role::Server, &settings);
        tokio::spawn(client_driver);
        tokio::spawn(server_driver);
        (client, server_in)
    }

    /// Both ends of a tunnelled connection spliced onto multiplexer streams: everything arrives
    /// both ways, in order, half-close included, and the counts match.
    #[tokio::test]
    async fn splices_onto_multiplexer_streams_both_ways_with_half_close() {
        let (client, mut server_in) = session_pair();

        let (mut app, mut entry) = tokio::io::duplex(8 * 1024);
        let (mut exit, mut target) = tokio::io::duplex(8 * 1024);
        let mut opened = client.open().await.unwrap();
        let entry_side = tokio::spawn(async move { splice_mux(&mut entry, &mut opened, |_, _| {}).await.unwrap() });
        // Uneven sizes, so reads, frames and chunks never line up.
        let request: Vec<u8> = (0..1_234_567u32).map(|i| (i % 251) as u8).collect();
        let response: Vec<u8> = (0..3_000_001u32).map(|i| (i % 241) as u8).collect();
        let writer = {
            let request = request.clone();
            tokio::spawn(async move {
                app.write_all(&request).await.unwrap();
                app.shutdown().await.unwrap();
                let mut got = Vec::new();
                app.read_to_end(&mut got).await.unwrap();
                got
            })
        };
        let mut accepted = server_in.accept().await.unwrap();
        let exit_side = tokio::spawn(async move { splice_mux(&mut exit, &mut accepted, |_, _| {}).await.unwrap() });
        let mut got = Vec::new();
        target.read_to_end(&mut got).await.unwrap();
        assert!(got == request, "the request arrives whole and in order");
        target.write_all(&response).await.unwrap();
        target.shutdown().await.unwrap();
        assert!(writer.await.unwrap() == response, "the response arrives after the client shut down writing");
        let entry_stats = entry_side.await.unwrap();
        let exit_stats = exit_side.await.unwrap();
        assert_eq!(entry_stats, SpliceStats { a_to_b: request.len() as u64, b_to_a: response.len() as u64 });
        assert_eq!(exit_stats, SpliceStats { a_to_b: response.len() as u64, b_to_a: request.len() as u64 });
    }

    /// Small reads go through the thread's scratch buffer; once the stream's credit runs out, what
    /// the session cannot take moves into a buffer of the stream's own and is sent first later.
    #[tokio::test]
    async fn small_reads_that_outrun_the_window_arrive_whole_and_in_order() {
        let (client, mut server_in) = session_pair();

        // A 300-byte pipe: every read on the entry side is small.
        let (mut app, mut entry) = tokio::io::duplex(300);
        let mut opened = client.open().await.unwrap();
        let entry_side = tokio::spawn(async move { splice_mux(&mut entry, &mut opened, |_, _| {}).await.unwrap() });
        // More than the stream's 256 KiB window, which fills while nobody reads the far end.
        let request: Vec<u8> = (0..700_001u32).map(|i| (i % 251) as u8).collect();
        let writer = {
            let request = request.clone();
            tokio::spawn(async move {
                app.write_all(&request).await.unwrap();
                app.shutdown().await.unwrap();
            })
        };
        let mut accepted = server_in.accept().await.unwrap();
        let mut got = Vec::new();
        let mut window = vec![0u8; 256 * 1024];
        // Wait until the window is full: the entry side then holds bytes it read but cannot send.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(!writer.is_finished(), "the writer is held back by the window");
        loop {
            let n = accepted.read(&mut window).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&window[..n]);
        }
        assert!(got == request, "all {} bytes arrive in order (got {})", request.len(), got.len());
        writer.await.unwrap();
        accepted.shutdown().await.unwrap();
        let stats = entry_side.await.unwrap();
        assert_eq!(stats.a_to_b, request.len() as u64);
    }
}
