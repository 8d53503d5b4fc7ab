//! The gateway's life: serving, draining, stopped. Every task that must end with the gateway is
//! spawned through here, so a drain can wait for them (the shutdown pattern of tokio's
//! mini-redis: a broadcast to stop, and a tracker to wait on).
//!
//! A drain goes: unready (load balancers move away) -> `drain_started` (listeners close, agents
//! are told to move) -> wait until the open connections and agent sessions have ended, at most the
//! grace period -> `hard_stop` (whatever is left is closed).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Lifecycle of one gateway process; shared by every part that serves.
#[derive(Debug, Default)]
pub struct Lifecycle {
    drain_started: CancellationToken,
    hard_stop: CancellationToken,
    connections: TaskTracker,
    sessions: TaskTracker,
    serving: AtomicBool,
    unready: AtomicBool,
}

impl Lifecycle {
    /// A gateway that is not serving yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancelled when draining starts: listeners stop accepting, agents are told to move.
    pub fn drain_started(&self) -> &CancellationToken {
        &self.drain_started
    }

    /// Whether draining has started.
    pub fn is_draining(&self) -> bool {
        self.drain_started.is_cancelled()
    }

    /// Cancelled when the grace period is over: everything still open is closed.
    pub fn hard_stop(&self) -> &CancellationToken {
        &self.hard_stop
    }

    /// Runs a tunnelled connection (a CONNECT, a forwarded dial) the drain waits for.
    pub fn spawn_connection<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.connections.spawn(task);
    }

    /// A tunnelled connection the drain waits for, to run on an agent session's own task
    /// ([`tether_tunnel::mux::Session::spawn_local`]).
    pub fn track_connection<F>(&self, task: F) -> impl Future<Output = ()> + Send + 'static
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.connections.track_future(task)
    }

    /// Runs an agent session the drain waits for.
    pub fn spawn_session<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.sessions.spawn(task);
    }

    /// Tunnelled connections open now.
    pub fn open_connections(&self) -> usize {
        self.connections.len()
    }

    /// Agent sessions open now.
    pub fn open_sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Marks every listener as serving (readiness may turn green).
    pub fn set_serving(&self) {
        self.serving.store(true, Ordering::Relaxed);
    }

    /// Why the gateway is not ready, if it is not: `/readyz` answers 503 with it.
    pub fn not_ready_reason(&self) -> Option<&'static str> {
        if self.unready.load(Ordering::Relaxed) {
            Some("draining")
        } else if !self.serving.load(Ordering::Relaxed) {
            Some("listeners not up yet")
        } else {
            None
        }
    }

    /// Turns unready (from SIGTERM on, through the whole drain) so balancers move away.
    pub fn set_unready(&self) {
        self.unready.store(true, Ordering::Relaxed);
    }

    /// Starts the drain and waits for open connections and sessions to end, at most `grace`;
    /// then stops everything and waits (briefly) for the tasks to finish. Returns how many
    /// connections and sessions were still open when the grace period ended.
    pub async fn drain(&self, grace: Duration) -> (usize, usize) {
        self.begin_drain();
        self.finish_drain(grace).await
    }

    /// Turns unready and starts the drain: listeners stop, agents are told to move.
    pub fn begin_drain(&self) {
        self.set_unready();
        self.drain_started.cancel();
        self.connections.close();
        self.sessions.close();
    }

    /// Waits for open connections and sessions to end, at most `grace`, then stops everything
    /// (see [`drain`](Self::drain)).
    pub async fn finish_drain(&self, grace: Duration) -> (usize, usize) {
        let finished = async {
            self.connections.wait().await;
            self.sessions.wait().await;
        };
        let left = match tokio::time::timeout(grace, finished).await {
            Ok(()) => (0, 0),
            Err(_) => (self.connections.len(), self.sessions.len()),
        };
        self.hard_stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.connections.wait()).await;
        let _ = tokio::time::timeout(Duration::from_secs(5), self.sessions.wait()).await;
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_drain_waits_for_open_work_within_the_grace_period_then_stops_the_rest() {
        let lifecycle = std::sync::Arc::new(Lifecycle::new());
        assert_eq!(lifecycle.not_ready_reason(), Some("listeners not up yet"));
        lifecycle.set_serving();
        assert_eq!(lifecycle.not_ready_reason(), None);
        // A connection that finishes on its own 3 s into the drain, and a session that only ends
        // when told to stop.
        let stop = lifecycle.hard_stop().clone();
        lifecycle.spawn_connection(tokio::time::sleep(Duration::from_secs(3)));
        lifecycle.spawn_session(async move { stop.cancelled().await });
        let started = tokio::time::Instant::now();
        let left = lifecycle.drain(Duration::from_secs(10)).await;
        assert_eq!(left, (0, 1), "the session was still open when the grace period ended");
        assert_eq!(started.elapsed(), Duration::from_secs(10));
        assert_eq!(lifecycle.not_ready_reason(), Some("draining"));
        assert!(lifecycle.is_draining() && lifecycle.hard_stop().is_cancelled());
        assert_eq!(lifecycle.open_sessions(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn with_nothing_open_a_drain_ends_at_once() {
        let lifecycle = Lifecycle::new();
        let started = tokio::time::Instant::now();
        assert_eq!(lifecycle.drain(Duration::from_secs(30)).await, (0, 0));
        assert!(started.elapsed() < Duration::from_millis(1));
    }
}
