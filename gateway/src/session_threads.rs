//! Threads that each run a single-threaded runtime for agent connections: from its TLS handshake
//! to the end of its session, an agent connection lives on one thread, with its socket registered
//! on that thread's own I/O driver.
//!
//! On the shared multi-threaded runtime a busy session's task is woken by whichever worker's I/O
//! driver saw its event and moves between workers, its state following it from cache to cache.
//! Measured on the peer benchmark (docs/benchmarks.md), keeping each connection on one thread
//! costs less CPU per byte and per request; the connections of many agents still spread over all
//! of them (each new one goes to the thread with the fewest).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::TcpStream;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// Single-threaded runtimes for agent connections; the threads end when this is dropped.
pub struct SessionThreads {
    threads: Vec<SessionThread>,
    stop: CancellationToken,
}

struct SessionThread {
    handle: Handle,
    /// Connections running on this thread now.
    load: Arc<AtomicUsize>,
}

impl SessionThreads {
    /// Starts `count` threads named `tether-session-<i>`. Fails only when a thread or its runtime
    /// cannot be created.
    pub fn start(count: usize) -> std::io::Result<Self> {
        let stop = CancellationToken::new();
        let mut threads = Vec::with_capacity(count);
        for i in 0..count {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let handle = runtime.handle().clone();
            let stopped = stop.clone();
            std::thread::Builder::new().name(format!("tether-session-{i}")).spawn(move || {
                runtime.block_on(stopped.cancelled());
                // The gateway drained its sessions before it let go of these threads; whatever is
                // left (a connection still in its handshake) is dropped without waiting.
                runtime.shutdown_background();
            })?;
            threads.push(SessionThread { handle, load: Arc::new(AtomicUsize::new(0)) });
        }
        Ok(Self { threads, stop })
    }

    /// Serves an accepted connection with `serve` on the thread with the fewest connections, its
    /// socket moved to that thread's I/O driver. A socket that cannot be moved is closed (logged).
    pub fn serve<F, Fut>(&self, stream: TcpStream, peer: SocketAddr, serve: F)
    where
        F: FnOnce(TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "connection closed: cannot hand it to a session thread");
                return;
            }
        };
        self.spawn(async move {
            match TcpStream::from_std(stream) {
                Ok(stream) => serve(stream).await,
                Err(e) => tracing::warn!(%peer, error = %e, "connection closed: cannot register its socket"),
            }
        });
    }

    /// Runs `task` on the thread with the fewest connections (sockets it creates register with
    /// that thread's I/O driver).
    fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let Some(thread) = self.threads.iter().min_by_key(|t| t.load.load(Ordering::Relaxed)) else {
            tokio::spawn(task);
            return;
        };
        let load = LoadGuard::new(thread.load.clone());
        thread.handle.spawn(async move {
            let _load = load;
            task.await;
        });
    }
}

impl Drop for SessionThreads {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Counts a connection on its thread while it lives.
struct LoadGuard(Arc<AtomicUsize>);

impl LoadGuard {
    fn new(load: Arc<AtomicUsize>) -> Self {
        load.fetch_add(1, Ordering::Relaxed);
        Self(load)
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn thread_name() -> String {
        std::thread::current().name().unwrap_or_default().to_owned()
    }

    #[tokio::test]
    async fn connections_go_to_the_least_loaded_thread_and_stay_there_and_the_threads_end_on_drop() {
        let threads = SessionThreads::start(2).unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut releases = Vec::new();
        for _ in 0..4 {
            let (release, released) = tokio::sync::oneshot::channel::<()>();
            releases.push(release);
            let tx = tx.clone();
            threads.spawn(async move {
                let before = thread_name();
                // A socket registered here and a timer on this thread's runtime.
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
                let _ = released.await;
                drop(listener);
                tx.send((before, thread_name())).unwrap();
            });
        }
        // Four long-lived connections over two threads: two each.
        let loads: Vec<usize> = threads.threads.iter().map(|t| t.load.load(Ordering::Relaxed)).collect();
        assert_eq!(loads, vec![2, 2]);
        drop(releases);
        let mut seen = Vec::new();
        for _ in 0..4 {
            let (before, after) = rx.recv().await.unwrap();
            assert!(before.starts_with("tether-session-"), "ran on {before}");
            assert_eq!(before, after, "a connection stays on its thread");
            seen.push(before);
        }
        seen.sort();
        assert_eq!(seen, ["tether-session-0", "tether-session-0", "tether-session-1", "tether-session-1"]);
        let handle = threads.threads[0].handle.clone();
        drop(threads);
        // The runtime shuts down once its thread has seen the stop.
        tokio::time::timeout(Duration::from_secs(5), async {
            while handle.spawn(async {}).await.is_ok() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the session threads end when dropped");
    }
}
