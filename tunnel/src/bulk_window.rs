//! A local TCP connection whose receive buffer grows once it carries bulk data.
//!
//! Linux sizes a socket's receive buffer by how much the application copies out per round trip
//! (receive autotuning). Tether reads a connection in pieces of at most 256 KiB, and under a bulk
//! sender on the same host autotuning settles at about 2 MB (wstunnel, reading about 1.25 MB a
//! call, gets 14-22 MB): the window is nearly closed after each read, so each window update lets
//! the sender's queued bytes go, and on a same-host path the kernel transmits them, and does the
//! receive work for them, inside the reading process's system call. With the larger buffer a
//! single bulk stream cost 3-7 % less CPU per byte in the tunnel's two processes and `-R` carried
//! 9 % more (docs/benchmarks.md, "A larger receive buffer for bulk connections").
//!
//! [`BulkWindow`] watches the reads: once [`BULK_READS`] of them have each found at least
//! [`BULK_READ`] bytes waiting (a sender that outruns us), it sets the socket's receive buffer to
//! [`RECEIVE_BUFFER`], once. A connection that never moves bulk data keeps autotuning's small
//! buffer, so a stalled request/response connection cannot pin megabytes of kernel memory; a bulk
//! one that stalls later holds at most twice [`RECEIVE_BUFFER`]. Setting the size turns autotuning
//! off for that socket, so it is done only where `net.core.rmem_max` allows the whole
//! [`RECEIVE_BUFFER`] (the kernel's default allows 208 KiB: there nothing changes, and an operator
//! who raised it has budgeted for buffers that large) and the socket has not grown that large on
//! its own.
//!
//! Used for the connections on the local side of a tunnel (node processes at the agent, targets
//! behind the gateway), not for the link between agent and gateway: that one may cross a long,
//! fast path where autotuning's larger maximum matters more.

use std::io;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Receive buffer a bulk connection gets (the kernel doubles it for its bookkeeping).
pub const RECEIVE_BUFFER: usize = 4 * 1024 * 1024;
/// A read that returns at least this much found a backlog: the sender outruns the reader.
pub const BULK_READ: usize = 128 * 1024;
/// Backlogged reads after which a connection counts as bulk.
pub const BULK_READS: u32 = 4;

/// A TCP connection that raises its receive buffer once it carries bulk data (see the module).
#[derive(Debug)]
pub struct BulkWindow {
    stream: TcpStream,
    /// Backlogged reads so far, counted up to [`BULK_READS`].
    bulk_reads: u32,
    raised: bool,
}

impl BulkWindow {
    /// Wraps a connected stream.
    pub fn new(stream: TcpStream) -> Self {
        Self { stream, bulk_reads: 0, raised: false }
    }

    /// Whether the receive buffer was raised.
    pub fn raised(&self) -> bool {
        self.raised
    }

    /// The socket's receive buffer as the kernel reports it (0 if it cannot be read).
    pub fn receive_buffer(&self) -> usize {
        socket2::SockRef::from(&self.stream).recv_buffer_size().unwrap_or(0)
    }

    fn count_read(&mut self, n: usize) {
        if self.bulk_reads >= BULK_READS || n < BULK_READ {
            return;
        }
        self.bulk_reads += 1;
        if self.bulk_reads < BULK_READS {
            return;
        }
        if may_raise() && self.receive_buffer() < 2 * RECEIVE_BUFFER {
            match socket2::SockRef::from(&self.stream).set_recv_buffer_size(RECEIVE_BUFFER) {
                Ok(()) => self.raised = true,
                Err(e) => tracing::debug!(error = %e, "cannot raise a bulk connection's receive buffer"),
            }
        }
    }
}

/// Whether `net.core.rmem_max` (the largest receive buffer an unprivileged process may set) allows
/// the whole [`RECEIVE_BUFFER`]; read once.
fn may_raise() -> bool {
    static MAX: OnceLock<Option<usize>> = OnceLock::new();
    MAX.get_or_init(|| std::fs::read_to_string("/proc/sys/net/core/rmem_max").ok()?.trim().parse().ok())
        .is_some_and(|max| max >= RECEIVE_BUFFER)
}

impl AsyncRead for BulkWindow {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let result = Pin::new(&mut this.stream).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = result {
            this.count_read(buf.filled().len() - before);
        }
        result
    }
}

impl AsyncWrite for BulkWindow {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    async fn pair() -> (BulkWindow, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (connected, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (BulkWindow::new(accepted.unwrap().0), connected.unwrap())
    }

    #[tokio::test]
    async fn a_bulk_connection_gets_the_larger_buffer_once_its_reads_find_a_backlog() {
        let (mut ours, mut sender) = pair().await;
        let before = ours.receive_buffer();
        // A sender faster than the reader: it keeps a backlog queued for every read.
        let sending = tokio::spawn(async move {
            let chunk = vec![7u8; 256 * 1024];
            while sender.write_all(&chunk).await.is_ok() {}
        });
        let mut buf = vec![0u8; 256 * 1024];
        let mut read = 0usize;
        while !ours.raised() && read < 64 << 20 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            read += ours.read(&mut buf).await.unwrap();
        }
        if may_raise() {
            assert!(ours.raised(), "not raised after {read} bytes (buffer {}, was {before})", ours.receive_buffer());
            assert!(ours.receive_buffer() >= 2 * RECEIVE_BUFFER, "{}", ours.receive_buffer());
        } else {
            assert!(!ours.raised(), "rmem_max is below {RECEIVE_BUFFER}: autotuning keeps the socket");
        }
        // The data still flows: the next read takes more of the sender's bytes.
        assert!(ours.read(&mut buf).await.unwrap() > 0);
        drop(ours);
        sending.await.unwrap();
    }

    #[tokio::test]
    async fn request_response_traffic_keeps_the_autotuned_buffer() {
        let (mut ours, mut sender) = pair().await;
        let before = ours.receive_buffer();
        let mut buf = vec![0u8; 256 * 1024];
        for _ in 0..200 {
            sender.write_all(&[1u8; 300]).await.unwrap();
            let mut got = 0;
            while got < 300 {
                got += ours.read(&mut buf).await.unwrap();
            }
        }
        assert!(!ours.raised());
        assert!(ours.receive_buffer() < 2 * RECEIVE_BUFFER, "{} (was {before})", ours.receive_buffer());
    }
}
