//! An emulated long link: a TCP relay that holds every byte for a fixed one-way delay before
//! passing it on, in both directions, so a loopback measurement sees a node's round-trip time to
//! the gateway (`--link-delay`).
//!
//! The relay is a fat pipe of fixed latency and bounded depth, not a model of a WAN: it neither
//! drops nor limits bandwidth, and it accepts up to [`MAX_IN_FLIGHT`] bytes per direction ahead of
//! the far end, like a router with a deep queue. What it does model faithfully is what flow
//! control sees: every window update, acknowledgement and answer arrives one delay after it was
//! sent. (Kernel `netem` would be the usual tool; it needs the `sch_netem` module, which CI
//! machines and containers often lack.)

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Bytes one direction of one connection may hold in the relay. Bounds the relay's memory and
/// caps any flow through it at `MAX_IN_FLIGHT / delay` (1.6 GiB/s at 10 ms).
pub const MAX_IN_FLIGHT: usize = 16 * 1024 * 1024;

const CHUNK: usize = 64 * 1024;

/// A running relay: connections to [`addr`](Self::addr) reach the upstream with the delay added
/// in each direction. Stops when dropped.
pub struct DelayedLink {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl DelayedLink {
    /// Relays connections accepted on `listener` to `upstream`, delaying each direction by `delay`.
    pub fn spawn(listener: TcpListener, upstream: SocketAddr, delay: Duration) -> io::Result<Self> {
        let addr = listener.local_addr()?;
        let task = spawn_relay(listener, upstream, move |client, server| async move {
            let (client_read, client_write) = client.into_split();
            let (server_read, server_write) = server.into_split();
            tokio::join!(pipe(client_read, server_write, delay), pipe(server_read, client_write, delay));
        });
        Ok(Self { addr, task })
    }

    /// Where to connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for DelayedLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Accepts connections on `listener`; for each, connects to `upstream` (both without Nagle's
/// delay) and hands the pair to `relay`. A connection whose upstream cannot be reached is closed.
/// The accept loop runs until the returned task is aborted.
pub fn spawn_relay<F, Fut>(listener: TcpListener, upstream: SocketAddr, relay: F) -> JoinHandle<()>
where
    F: Fn(TcpStream, TcpStream) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let relay = relay.clone();
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(upstream).await else { return };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                relay(client, server).await;
            });
        }
    })
}

/// Copies `reader` to `writer`, delivering each chunk `delay` after it was read; end-of-stream
/// is passed on (as a write shutdown) after the same delay. Returns when either side fails or
/// the stream has ended.
pub async fn pipe<R, W>(mut reader: R, mut writer: W, delay: Duration)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let budget = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    // The semaphore bounds the bytes; the channel only needs room for the chunks they fill.
    let (tx, mut rx) = mpsc::channel::<(Instant, Bytes)>(MAX_IN_FLIGHT / 1024);
    let read = async {
        let mut buf = BytesMut::with_capacity(CHUNK);
        loop {
            buf.reserve(CHUNK);
            let n = reader.read_buf(&mut buf).await.unwrap_or(0);
            let chunk = buf.split().freeze();
            // n <= CHUNK, far below u32::MAX.
            let permits = u32::try_from(n).unwrap_or(u32::MAX);
            let Ok(permit) = budget.clone().acquire_many_owned(permits).await else { return };
            permit.forget();
            if tx.send((Instant::now() + delay, chunk)).await.is_err() || n == 0 {
                return;
            }
        }
    };
    let write = async {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if chunk.is_empty() {
                let _ = writer.shutdown().await;
                return;
            }
            if writer.write_all(&chunk).await.is_err() {
                return;
            }
            budget.add_permits(chunk.len());
        }
    };
    // The writer decides the end: it delivers end-of-stream last, or fails first; a reader still
    // waiting then has nowhere to send to.
    let read = async {
        read.await;
        std::future::pending::<()>().await;
    };
    tokio::select! {
        () = read => {}
        () = write => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bytes_and_end_of_stream_arrive_late_and_intact() {
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream_addr = upstream.local_addr().unwrap();
        let echo = tokio::spawn(async move {
            let (mut stream, _) = upstream.accept().await.unwrap();
            let (mut r, mut w) = stream.split();
            tokio::io::copy(&mut r, &mut w).await.unwrap();
            w.shutdown().await.unwrap();
        });
        let link = DelayedLink::spawn(
            TcpListener::bind("127.0.0.1:0").await.unwrap(),
            upstream_addr,
            Duration::from_millis(30),
        )
        .unwrap();
        let mut client = TcpStream::connect(link.addr()).await.unwrap();
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let started = std::time::Instant::now();
        let (mut r, mut w) = client.split();
        let send = async {
            w.write_all(&data).await.unwrap();
            w.shutdown().await.unwrap();
        };
        let mut back = Vec::new();
        let receive = r.read_to_end(&mut back);
        let (_, got) = tokio::join!(send, receive);
        got.unwrap();
        assert_eq!(back, data);
        // Two one-way delays each way: client -> relay -> echo -> relay -> client. A lower
        // bound only: it holds however slow the machine is.
        assert!(started.elapsed() >= Duration::from_millis(60));
        echo.await.unwrap();
    }
}
