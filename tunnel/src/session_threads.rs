//! Threads that each run a single-threaded runtime for tunnel sessions: from its TLS handshake to
//! its end, a session lives on one thread, with its socket registered on that thread's own I/O
//! driver, and so do the streams it serves (their tasks run on the session's own task).
//!
//! On a shared multi-threaded runtime a busy session's task is woken by whichever worker's I/O
//! driver saw its event and moves between workers, its state following it from cache to cache.
//! Measured on the peer benchmark (docs/benchmarks.md), keeping each session on one thread costs
//! less CPU per byte and per request, and sessions on different threads use different cores. The
//! gateway puts every agent connection on one of these; an agent with several sessions per gateway
//! replica puts each of its sessions on one (each new one goes to the thread with the fewest).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::TcpStream;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// Single-threaded runtimes for tunnel sessions; the threads end when this is dropped.
pub struct SessionThreads {
    threads: Vec<SessionThread>,
    stop: CancellationToken,
}

struct SessionThread {
    handle: Handle,
    /// Tasks (connections, sessions) running on this thread now.
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
                // The owner drained its sessions before it let go of these threads; whatever is
                // left (a connection still in its handshake) is dropped without waiting.
                runtime.shutdown_background();
            })?;
            threads.push(SessionThread { handle, load: Arc::new(AtomicUsize::new(0)) });
        }
        Ok(Self { threads, stop })
    }

    /// Starts `count` threads to share, or none when they cannot be created (logged): the
    /// caller's sessions then share its runtime.
    pub fn start_shared(count: usize) -> Option<Arc<Self>> {
        match Self::start(count) {
            Ok(threads) => Some(Arc::new(threads)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start session threads; sessions share the runtime");
                None
            }
        }
    }

    /// Serves an accepted connection with `serve` on the thread with the fewest tasks, its socket
    /// moved to that thread's I/O driver. A socket that cannot be moved is closed (logged).
    ///
    /// The connection is counted on its thread while `serve` runs and while any clone of the
    /// [`ThreadLoad`] it is given lives: a connection that hands its session to another task on
    /// the thread (an HTTP upgrade) gives that task a clone, so the session goes on counting.
    pub fn serve<F, Fut>(&self, stream: TcpStream, peer: SocketAddr, serve: F)
    where
        F: FnOnce(TcpStream, ThreadLoad) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "connection closed: cannot hand it to a session thread");
                return;
            }
        };
        self.spawn_counted(move |load| async move {
            match TcpStream::from_std(stream) {
                Ok(stream) => serve(stream, load).await,
                Err(e) => tracing::warn!(%peer, error = %e, "connection closed: cannot register its socket"),
            }
        });
    }

    /// Runs `task` on the thread with the fewest tasks, counted there until it ends (sockets it
    /// creates register with that thread's I/O driver).
    pub fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.spawn_counted(move |load| async move {
            let _load = load;
            task.await;
        });
    }

    /// Runs the task `make` returns on the thread with the fewest tasks; it is counted there while
    /// the [`ThreadLoad`] it is given, or a clone, lives.
    fn spawn_counted<F, Fut>(&self, make: F)
    where
        F: FnOnce(ThreadLoad) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let Some(thread) = self.threads.iter().min_by_key(|t| t.load.load(Ordering::Relaxed)) else {
            tokio::spawn(make(ThreadLoad::new(Arc::new(AtomicUsize::new(0)))));
            return;
        };
        let load = ThreadLoad::new(thread.load.clone());
        thread.handle.spawn(make(load));
    }
}

impl Drop for SessionThreads {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// One task's place in its thread's count: the count falls when the last clone is dropped.
#[derive(Clone)]
pub struct ThreadLoad {
    _guard: Arc<LoadGuard>,
}

impl ThreadLoad {
    fn new(load: Arc<AtomicUsize>) -> Self {
        load.fetch_add(1, Ordering::Relaxed);
        Self { _guard: Arc::new(LoadGuard(load)) }
    }
}

impl std::fmt::Debug for ThreadLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ThreadLoad")
    }
}

/// Takes a task off its thread's count when dropped.
struct LoadGuard(Arc<AtomicUsize>);

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

    /// A connection whose serving ends after it handed its session to another task on the thread
    /// (as an HTTP upgrade does) goes on counting there while that task lives: sessions that
    /// arrive one after another spread over the threads instead of piling onto the first.
    #[tokio::test]
    async fn a_connection_handed_over_to_another_task_still_counts_on_its_thread() {
        let threads = SessionThreads::start(2).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut clients = Vec::new();
        for _ in 0..4 {
            clients.push(TcpStream::connect(addr).await.unwrap());
            let (stream, peer) = listener.accept().await.unwrap();
            let (served, done) = tokio::sync::oneshot::channel();
            let tx = tx.clone();
            threads.serve(stream, peer, move |mut stream, load| async move {
                // The "session": a task of its own, holding the connection's load.
                tokio::spawn(async move {
                    let _load = load;
                    let _ = tx.send(thread_name());
                    let mut byte = [0u8; 1];
                    let _ = tokio::io::AsyncReadExt::read(&mut stream, &mut byte).await;
                });
                let _ = served.send(());
            });
            // Serving ended (as after an upgrade) before the next connection arrives.
            done.await.unwrap();
        }
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(rx.recv().await.unwrap());
        }
        seen.sort();
        assert_eq!(seen, ["tether-session-0", "tether-session-0", "tether-session-1", "tether-session-1"]);
        let loads: Vec<usize> = threads.threads.iter().map(|t| t.load.load(Ordering::Relaxed)).collect();
        assert_eq!(loads, vec![2, 2]);
        // The sessions end with their connections, and so does their count.
        drop(clients);
        tokio::time::timeout(Duration::from_secs(5), async {
            while threads.threads.iter().any(|t| t.load.load(Ordering::Relaxed) > 0) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("a session's count ends with it");
    }
}
