//! Keeping a session to the gateway: connect (token re-read every time), handshake, serve dial
//! streams, refresh the token when the file rotates, move on Drain, and reconnect with
//! exponential backoff and full jitter when anything breaks.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use std::sync::Mutex;
use tether_tunnel::backoff::Backoff;
use tether_tunnel::client::{self, ClientSettings, ConnectError};
use tether_tunnel::framed::{FrameError, forward_frames, read_frame, write_frame};
use tether_tunnel::mux::{self, Incoming, MuxSettings, MuxStream, Role, Session};
use tether_tunnel::protocol::{
    ControlMessage, ControlOpen, ErrorCode, Hello, Identifiers, Leaving, MAX_CONTROL_FRAME, MAX_STREAM_FRAME,
    PROTOCOL_VERSION, StreamOpen, StreamResult, TokenRefresh, Welcome,
};
use tether_tunnel::session_threads::SessionThreads;
use tokio::io::WriteHalf;

use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::dialer::{DialPolicy, serve_stream};
use crate::metrics::{BUSY, CONNECTS, DRAINS, SESSIONS, TOKEN_EXPIRY, TOKEN_REFRESHES, TOKEN_USABLE};

/// Everything a connection needs, fixed for the agent's life.
pub struct ConnectionContext {
    /// How to reach the gateway.
    pub client: ClientSettings,
    /// Token file, re-read on every connect.
    pub token_file: std::path::PathBuf,
    /// How often the token file is checked for rotation.
    pub token_check_interval: Duration,
    /// What the Hello says.
    pub agent_id: String,
    /// Identifiers declared in the Hello.
    pub identifiers: Identifiers,
    /// Reconnect backoff bounds.
    pub reconnect: (Duration, Duration),
    /// Multiplexer tuning.
    pub mux: MuxSettings,
    /// Dial policy.
    pub policy: Arc<DialPolicy>,
    /// Live state for readiness and diagnostics.
    pub state: Arc<AgentState>,
    /// Streams being served (waited for at shutdown).
    pub tasks: TaskTracker,
    /// Longest pause before dialing again after landing on a replica already held.
    pub duplicate_retry_max: Duration,
    /// Longest random pause before dialing again after a drain message.
    pub drain_reconnect_window: Duration,
    /// How long the agent holds its busy sessions after its traffic was last at the busy rate.
    pub busy_linger: Duration,
    /// On stop: how long open streams may take to finish.
    pub shutdown_grace_period: Duration,
    /// Threads the sessions run on, one session per thread as far as they go, when the agent
    /// holds several sessions per replica (always or while busy); without them every session
    /// shares the runtime.
    pub threads: LazySessionThreads,
}

/// Session threads, started when the first session that belongs on one is dialed: an agent that
/// never becomes busy never starts them.
pub struct LazySessionThreads {
    count: usize,
    started: std::sync::OnceLock<Option<Arc<SessionThreads>>>,
}

impl LazySessionThreads {
    /// `count` threads when there are several sessions per replica (held or busy); none for one.
    pub fn new(sessions_per_replica: usize) -> Self {
        Self { count: if sessions_per_replica < 2 { 0 } else { sessions_per_replica }, started: Default::default() }
    }

    /// Whether sessions may run on threads of their own.
    fn enabled(&self) -> bool {
        self.count > 0
    }

    /// The threads, started on first use; `None` when the agent has none, or they could not be
    /// started (logged; sessions then share the runtime).
    fn get(&self) -> Option<&Arc<SessionThreads>> {
        if !self.enabled() {
            return None;
        }
        self.started.get_or_init(|| SessionThreads::start_shared(self.count)).as_ref()
    }
}

/// Live state of the agent: its sessions (for readiness and for forwarding), the last error.
#[derive(Default)]
pub struct AgentState {
    live: Mutex<Vec<LiveEntry>>,
    next_id: AtomicU64,
    last_error: Mutex<Option<String>>,
    /// Why the token file's content is not worth presenting, while it is not.
    token_problem: Mutex<Option<String>>,
    session_added: Notify,
    /// Woken when sessions come or go or the replica count changes.
    changed: Notify,
    /// The latest replica count the gateway reported (0: none yet).
    server_count: AtomicU32,
    /// Set when a session was lost, so the supervisor backs off before redialing.
    lost: AtomicBool,
    /// No dial before this instant (set after a drain message, spread by jitter).
    redial_at: Mutex<Option<tokio::time::Instant>>,
    /// Dials to the gateway started.
    dials: AtomicU64,
    mode: PoolMode,
    /// Sessions kept to each replica (at least one).
    per_replica: usize,
    /// Sessions kept to each replica while busy (at least `per_replica`).
    busy_per_replica: usize,
    /// Bytes per second over all sessions at which the agent counts as busy.
    busy_rate: u64,
    /// Set when the sessions' traffic reaches `busy_rate`; cleared after `busy_linger` below it.
    busy: AtomicBool,
    /// The traffic sampler's last reading.
    traffic: Mutex<TrafficSample>,
}

/// What the traffic sampler saw last.
#[derive(Default)]
struct TrafficSample {
    /// When, and the sessions' link bytes then.
    at: Option<(tokio::time::Instant, u64)>,
    /// The last time the traffic was at the busy rate.
    hot_at: Option<tokio::time::Instant>,
}

/// How often the traffic of the sessions is sampled (while busy sessions are configured).
const TRAFFIC_SAMPLE_INTERVAL: Duration = Duration::from_millis(500);

/// How many gateway replicas the agent keeps sessions to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolMode {
    /// One session to every replica (dials to any replica find this agent locally).
    #[default]
    All,
    /// A single session (replicas reach the agent through peer forwarding).
    One,
}

struct LiveEntry {
    id: u64,
    server_id: String,
    session: Session,
    /// Cancelled when the session is no longer wanted (the agent is quiet again).
    retire: CancellationToken,
    /// The session runs on a session thread, not on the agent's runtime.
    on_thread: bool,
}

/// A live session picked to carry a stream.
pub struct Picked {
    /// The session.
    pub session: Session,
    /// It runs on a session thread of its own: a node-side socket moves there.
    pub on_thread: bool,
}

impl AgentState {
    /// State for an agent keeping sessions per `mode`: `per_replica` to each replica, and
    /// `busy_per_replica` while its sessions move `busy_rate` bytes per second or more.
    pub fn new(mode: PoolMode, per_replica: usize, busy_per_replica: usize, busy_rate: u64) -> Self {
        let per_replica = per_replica.max(1);
        Self {
            mode,
            per_replica,
            busy_per_replica: busy_per_replica.max(per_replica),
            busy_rate: busy_rate.max(1),
            ..Self::default()
        }
    }

    /// Whether the agent ever holds more sessions when busy than when quiet.
    fn has_busy_sessions(&self) -> bool {
        self.busy_per_replica > self.per_replica
    }

    /// Reads the sessions' traffic since the last sample. At the busy rate the agent becomes busy
    /// (and the supervisor is woken to dial the busy sessions); after `linger` below it, quiet
    /// again, and the sessions beyond `per_replica` are told to retire. Returns how many were.
    fn sample_traffic(&self, linger: Duration) -> usize {
        let now = tokio::time::Instant::now();
        let bytes: u64 = self.live.lock().map(|l| l.iter().map(|e| e.session.link_bytes()).sum()).unwrap_or(0);
        let Ok(mut sample) = self.traffic.lock() else { return 0 };
        let previous = sample.at.replace((now, bytes));
        if let Some((then, before)) = previous {
            // A session that ended takes its bytes with it: that interval reads as quiet.
            let moved = bytes.saturating_sub(before) as f64;
            let seconds = now.duration_since(then).as_secs_f64();
            if seconds > 0.0 && moved / seconds >= self.busy_rate as f64 {
                sample.hot_at = Some(now);
                if !self.busy.swap(true, Ordering::Relaxed) {
                    metrics::gauge!(BUSY).set(1.0);
                    tracing::debug!(mib_per_second = moved / seconds / 1048576.0, "busy: dialing the busy sessions");
                    self.changed.notify_waiters();
                }
                return 0;
            }
        }
        let quiet_long_enough = sample.hot_at.is_none_or(|hot| now.duration_since(hot) >= linger);
        if !self.is_busy() || !quiet_long_enough {
            return 0;
        }
        drop(sample);
        self.busy.store(false, Ordering::Relaxed);
        metrics::gauge!(BUSY).set(0.0);
        self.retire_surplus()
    }

    /// Whether the agent counts as busy (holding `busy_per_replica` sessions to each replica).
    pub fn is_busy(&self) -> bool {
        self.busy.load(Ordering::Relaxed)
    }

    /// Sessions wanted to each replica now.
    fn target_per_replica(&self) -> usize {
        if self.is_busy() { self.busy_per_replica } else { self.per_replica }
    }

    /// Tells the sessions beyond `per_replica` (to each replica, or in all in mode `one`) to
    /// retire, keeping the oldest. Returns how many were.
    fn retire_surplus(&self) -> usize {
        let Ok(live) = self.live.lock() else { return 0 };
        let mut entries: Vec<&LiveEntry> = live.iter().filter(|e| !e.retire.is_cancelled()).collect();
        entries.sort_by_key(|e| e.id);
        let mut kept: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        let mut retired = 0;
        for entry in entries {
            let group = match self.mode {
                PoolMode::All => entry.server_id.as_str(),
                PoolMode::One => "",
            };
            let held = kept.entry(group).or_default();
            if *held < self.per_replica {
                *held += 1;
            } else {
                entry.retire.cancel();
                retired += 1;
            }
        }
        retired
    }

    /// Ready: a session to every known replica (pool mode `all`) or to one (mode `one`).
    pub fn is_ready(&self) -> bool {
        let replicas = self.replicas_held();
        replicas > 0 && replicas >= self.wanted_replicas()
    }

    /// Distinct replicas with a live session.
    pub fn replicas_held(&self) -> usize {
        let ids = self.server_ids();
        ids.iter().collect::<std::collections::HashSet<_>>().len()
    }

    /// Live sessions to `server_id` (not retiring).
    fn sessions_to(&self, server_id: &str) -> usize {
        self.live
            .lock()
            .map(|l| l.iter().filter(|e| e.server_id == server_id && !e.retire.is_cancelled()).count())
            .unwrap_or_default()
    }

    /// Sessions that are up and not draining or retiring.
    pub fn live_sessions(&self) -> usize {
        self.live.lock().map(|l| l.iter().filter(|e| !e.retire.is_cancelled()).count()).unwrap_or_default()
    }

    /// The last connection error, for `/readyz`.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().map(|e| e.clone()).unwrap_or_default()
    }

    fn set_last_error(&self, error: Option<String>) {
        if let Ok(mut last) = self.last_error.lock() {
            *last = error;
        }
    }

    /// Why the agent is not dialing: its token file holds no usable token (`/readyz` says so).
    pub fn token_problem(&self) -> Option<String> {
        self.token_problem.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// Records the token problem; returns whether it differs from the one recorded before (so
    /// each change is logged once).
    fn set_token_problem(&self, problem: Option<String>) -> bool {
        let Ok(mut current) = self.token_problem.lock() else { return false };
        let changed = *current != problem;
        *current = problem;
        changed
    }

    /// Replicas the agent wants sessions to: the reported replica count (at least one), or one.
    pub fn wanted_replicas(&self) -> usize {
        match self.mode {
            PoolMode::One => 1,
            PoolMode::All => (self.server_count.load(Ordering::Relaxed) as usize).max(1),
        }
    }

    /// Sessions the agent wants in all: `per_replica` to each wanted replica, or
    /// `busy_per_replica` while busy.
    pub fn wanted_sessions(&self) -> usize {
        self.wanted_replicas() * self.target_per_replica()
    }

    /// Whether a new session to `server_id` would be one too many: that replica already has its
    /// share (pool mode `all`), or the agent already holds all it wants (mode `one`, whose
    /// sessions may land on any replicas).
    fn is_surplus(&self, server_id: &str) -> bool {
        match self.mode {
            PoolMode::All => self.sessions_to(server_id) >= self.target_per_replica(),
            PoolMode::One => self.live_sessions() >= self.target_per_replica(),
        }
    }

    /// The latest replica count reported by any gateway.
    pub fn server_count(&self) -> u32 {
        self.server_count.load(Ordering::Relaxed)
    }

    fn note_server_count(&self, count: u32) {
        if self.server_count.swap(count, Ordering::Relaxed) != count {
            self.changed.notify_waiters();
        }
    }

    fn take_lost(&self) -> bool {
        self.lost.swap(false, Ordering::Relaxed)
    }

    /// Holds the next dial until `at` (the latest such instant wins).
    fn redial_not_before(&self, at: tokio::time::Instant) {
        if let Ok(mut slot) = self.redial_at.lock() {
            *slot = Some(slot.map_or(at, |held| held.max(at)));
        }
    }

    /// Dials to the gateway started so far.
    pub fn dials(&self) -> u64 {
        self.dials.load(Ordering::Relaxed)
    }

    /// Gateway replicas with a live session.
    pub fn server_ids(&self) -> Vec<String> {
        self.live.lock().map(|l| l.iter().map(|e| e.server_id.clone()).collect()).unwrap_or_default()
    }

    /// Open streams on each live session (its control stream included).
    pub fn session_streams(&self) -> Vec<usize> {
        self.live.lock().map(|l| l.iter().map(|e| e.session.open_streams()).collect()).unwrap_or_default()
    }

    /// The live session with the fewest open streams (any replica will do for a forward).
    pub fn pick_session(&self) -> Option<Picked> {
        let live = self.live.lock().ok()?;
        live.iter()
            .filter(|e| !e.session.is_closed() && !e.retire.is_cancelled())
            .min_by_key(|e| e.session.open_streams())
            .map(|e| Picked { session: e.session.clone(), on_thread: e.on_thread })
    }

    /// Whether the agent holds the sessions it keeps when quiet (`per_replica` to each wanted
    /// replica): any more are busy sessions.
    fn holds_its_quota(&self) -> bool {
        self.live_sessions() >= self.wanted_replicas() * self.per_replica
    }

    /// Whether the next session belongs on a session thread: with several sessions held to each
    /// replica, all do; otherwise the held ones run on the agent's runtime (where a quiet agent's
    /// work stays on one thread) and only the busy ones beyond them on threads.
    fn next_on_thread(&self) -> bool {
        self.per_replica > 1 || self.holds_its_quota()
    }

    /// A live session, waiting up to `timeout` for one to come up.
    pub async fn wait_for_session(&self, timeout: Duration) -> Option<Picked> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let added = self.session_added.notified();
            tokio::pin!(added);
            added.as_mut().enable();
            if let Some(session) = self.pick_session() {
                return Some(session);
            }
            if tokio::time::timeout_at(deadline, added).await.is_err() {
                return None;
            }
        }
    }
}

/// Why a connection attempt failed.
#[derive(Debug, thiserror::Error)]
pub enum EstablishError {
    /// The gateway could not be reached or refused the upgrade.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The handshake on the control stream failed.
    #[error("handshake with the gateway failed: {0}")]
    Handshake(String),
    /// The gateway refused the Hello because a limit is full (the tenant's agents).
    #[error("the gateway refused the session: {0}")]
    AtLimit(String),
}

/// How long an agent refused at its Hello for a full limit waits before it dials again, at least:
/// what the gateway's `Retry-After` says when it refuses before the upgrade.
const AT_LIMIT_RETRY: Duration = Duration::from_secs(5);

impl EstablishError {
    /// How long the gateway asked the agent to wait before it dials again: its `Retry-After`, or
    /// [`AT_LIMIT_RETRY`] when it refused the Hello for a full limit.
    fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Connect(c) => c.retry_after(),
            Self::AtLimit(_) => Some(AT_LIMIT_RETRY),
            Self::Handshake(_) => None,
        }
    }

    fn label(&self) -> &'static str {
        match self {
            Self::Connect(e) if e.is_unauthorized() => "unauthorized",
            Self::Connect(ConnectError::Proxy(tether_tunnel::proxy::ProxyError::Authentication { .. })) => "proxy_auth",
            Self::Connect(ConnectError::Proxy(_)) => "proxy",
            Self::Connect(ConnectError::Rejected { .. }) => "rejected",
            Self::Connect(ConnectError::Tls { .. }) => "tls",
            Self::Connect(ConnectError::Timeout { .. }) => "timeout",
            Self::Connect(ConnectError::Tcp { .. }) => "tcp",
            Self::Connect(_) => "connect_error",
            Self::Handshake(_) => "handshake",
            Self::AtLimit(_) => "rejected",
        }
    }
}

/// A freshly established session.
struct Established {
    session: Session,
    incoming: Incoming,
    control: MuxStream,
    welcome: Welcome,
    token: String,
}

enum SessionEnd {
    /// The gateway asked to move; the drain deadline it gave.
    Drained(Duration),
    Lost(String),
    Stopped,
    /// A busy session no longer needed: the gateway was told, and the streams it still carried
    /// have ended (or its grace did).
    Retired,
}

/// Keeps sessions to the gateway until `stop` is cancelled: one to every replica the gateway
/// reports (`server_count`), or just one. Dialing goes through the load balancer, so the replica a
/// new connection lands on is chance: a second session to a replica already held is closed and the
/// agent dials again after a short jittered pause, until it holds one session per replica.
pub async fn maintain(ctx: Arc<ConnectionContext>, stop: CancellationToken) {
    let (initial, max) = ctx.reconnect;
    let mut backoff = Backoff::new(initial, max);
    // Duplicates are expected behind a balancer; retry them quickly, but never in a tight loop.
    let mut duplicates = Backoff::new(Duration::from_millis(50), ctx.duplicate_retry_max);
    // Re-reading a token file that holds no usable token: never dial with it.
    let mut token_wait = Backoff::new(initial, max);
    let tasks = TaskTracker::new();
    if ctx.state.has_busy_sessions() {
        tasks.spawn(sample_traffic(ctx.clone(), stop.clone()));
    }
    loop {
        if stop.is_cancelled() {
            break;
        }
        let changed = ctx.state.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if ctx.state.live_sessions() >= ctx.state.wanted_sessions() {
            tokio::select! {
                () = &mut changed => {}
                () = tokio::time::sleep(Duration::from_secs(5)) => {}
                () = stop.cancelled() => break,
            }
            continue;
        }
        let token = match read_usable_token(&ctx.token_file).await {
            Ok(token) => {
                token_wait.reset();
                metrics::gauge!(TOKEN_USABLE).set(1.0);
                if ctx.state.set_token_problem(None) {
                    tracing::info!(path = %ctx.token_file.display(), "the token file holds a usable token again; connecting");
                }
                token
            }
            Err(problem) => {
                metrics::gauge!(TOKEN_USABLE).set(0.0);
                if ctx.state.set_token_problem(Some(problem.clone())) {
                    tracing::warn!("{problem}");
                }
                // A rotated file is noticed within one token check interval at most.
                let wait = token_wait.next_delay().min(ctx.token_check_interval);
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = stop.cancelled() => break,
                }
                continue;
            }
        };
        let wait = ctx.state.redial_at.lock().ok().and_then(|mut at| at.take());
        if let Some(at) = wait {
            tokio::select! {
                () = tokio::time::sleep_until(at) => {}
                () = stop.cancelled() => break,
            }
        }
        ctx.state.dials.fetch_add(1, Ordering::Relaxed);
        let on_thread = ctx.threads.enabled() && ctx.state.next_on_thread();
        // A busy session beyond the held ones: the held ones carry the agent meanwhile.
        let busy_extra = ctx.state.holds_its_quota();
        // Not the agent's first session: where it lands next to another, the two share one slot
        // under the tenant's agent limit.
        let additional = ctx.state.live_sessions() > 0;
        let delay = match establish_session(&ctx, token, on_thread, additional).await {
            Ok(established) if ctx.state.is_surplus(&established.welcome.server_id) => {
                metrics::counter!(CONNECTS, "result" => "duplicate").increment(1);
                tracing::debug!(server = %established.welcome.server_id, "landed on a replica already held; dialing again");
                established.session.close();
                duplicates.next_delay()
            }
            Ok(established) => {
                backoff.reset();
                duplicates.reset();
                ctx.state.set_last_error(None);
                ctx.state.note_server_count(established.welcome.server_count);
                let live = LiveSession::new(
                    ctx.state.clone(),
                    established.welcome.server_id.clone(),
                    established.session.clone(),
                    on_thread,
                );
                let retire = live.retire.clone();
                let (ctx, stop) = (ctx.clone(), stop.clone());
                tasks.spawn(async move {
                    match run_session(&ctx, established, &stop, &retire).await {
                        SessionEnd::Stopped | SessionEnd::Retired => {}
                        SessionEnd::Drained(deadline) if ctx.state.live_sessions() > 1 => {
                            // Spread the drained replica's agents over a window (at most half
                            // the drain deadline, so they have moved before it ends). Only while
                            // another session still carries this agent's dials: without one, a
                            // pause would be an outage, so it redials at once.
                            let window = ctx.drain_reconnect_window.min(deadline / 2);
                            let pause = window.mul_f64(fastrand::f64());
                            tracing::debug!(pause_ms = pause.as_millis() as u64, "redialing after the drain pause");
                            ctx.state.redial_not_before(tokio::time::Instant::now() + pause);
                        }
                        SessionEnd::Drained(_) => {}
                        SessionEnd::Lost(reason) => {
                            tracing::warn!(%reason, "session to the gateway lost; reconnecting");
                            ctx.state.set_last_error(Some(reason));
                        }
                    }
                    drop(live);
                });
                Duration::ZERO
            }
            Err(e) => {
                metrics::counter!(CONNECTS, "result" => e.label()).increment(1);
                let mut delay = backoff.next_delay();
                let mut busy_dial_failed = false;
                if let Some(asked) = e.retry_after() {
                    // The gateway said when (a limit, a drain, a TokenReview outage): not sooner,
                    // plus up to a fifth more so its refused agents do not come back together.
                    delay = delay.max(asked + asked.mul_f64(fastrand::f64() / 5.0));
                }
                if matches!(
                    &e,
                    EstablishError::Connect(ConnectError::Proxy(
                        tether_tunnel::proxy::ProxyError::Authentication { .. }
                    ))
                ) {
                    tracing::error!(error = %e, retry_in_ms = delay.as_millis() as u64, "proxy authentication failed; check gateway.proxy (user, password file) or HTTPS_PROXY");
                } else if matches!(&e, EstablishError::Connect(c) if c.is_unauthorized()) {
                    tracing::error!(error = %e, retry_in_ms = delay.as_millis() as u64, "the gateway refused this agent's token; check the token file, audience and issuer");
                } else if busy_extra {
                    // A gateway at its session limit refuses these first; not an outage.
                    tracing::info!(error = %e, retry_in_ms = delay.as_millis() as u64, "cannot open a busy session; the held sessions carry the traffic meanwhile");
                    busy_dial_failed = true;
                } else {
                    tracing::warn!(error = %e, attempt = backoff.attempts(), retry_in_ms = delay.as_millis() as u64, "cannot connect to the gateway");
                }
                if !busy_dial_failed {
                    ctx.state.set_last_error(Some(e.to_string()));
                }
                delay
            }
        };
        // A session that just ended (lost) waits out the backoff before the next dial.
        if ctx.state.take_lost() {
            let lost_delay = backoff.next_delay();
            tokio::select! {
                () = tokio::time::sleep(lost_delay) => {}
                () = stop.cancelled() => break,
            }
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = stop.cancelled() => break,
        }
    }
    tasks.close();
    tasks.wait().await;
}

/// Samples the sessions' traffic until `stop`: it decides when the agent is busy and holds its
/// busy sessions, and when it is quiet again.
async fn sample_traffic(ctx: Arc<ConnectionContext>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(TRAFFIC_SAMPLE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
        let retired = ctx.state.sample_traffic(ctx.busy_linger);
        if retired > 0 {
            tracing::debug!(retired, "quiet for the busy linger; closing the busy sessions");
        }
    }
}

/// Dials a session: `on_thread`, on a session thread of its own, there from its TCP connection to
/// its end (with the streams it serves), otherwise on the runtime.
async fn establish_session(
    ctx: &Arc<ConnectionContext>,
    token: String,
    on_thread: bool,
    additional: bool,
) -> Result<Established, EstablishError> {
    let Some(threads) = ctx.threads.get().filter(|_| on_thread) else {
        return establish(ctx, token, additional).await.map(|(established, _driver)| established);
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let on_thread = ctx.clone();
    threads.spawn(async move {
        match establish(&on_thread, token, additional).await {
            Ok((established, driver)) => {
                if tx.send(Ok(established)).is_ok() {
                    // The thread counts the session while its driver runs.
                    let _ = driver.await;
                }
            }
            Err(e) => {
                let _ = tx.send(Err(e));
            }
        }
    });
    rx.await.unwrap_or_else(|_| Err(EstablishError::Handshake("the session thread stopped".into())))
}

/// Dials a session on the current runtime; its driver runs as a task there (the handle is for
/// waiting on it).
async fn establish(
    ctx: &ConnectionContext,
    token: String,
    additional: bool,
) -> Result<(Established, tokio::task::JoinHandle<()>), EstablishError> {
    let ws = client::connect_session(&ctx.client, Some(&token), additional).await?;
    let (session, incoming, driver) = mux::start(ws, Role::Client, &ctx.mux);
    let driver = tokio::spawn(async move {
        if let Err(e) = driver.await {
            tracing::warn!(error = %e, "tunnel session to the gateway ended");
        }
    });
    let handshake = async {
        let failed = |e: &dyn std::fmt::Display| EstablishError::Handshake(e.to_string());
        let mut control = session.open().await.map_err(|e| failed(&e))?;
        let open = StreamOpen::Control(ControlOpen { version: PROTOCOL_VERSION });
        write_frame(&mut control, &open, MAX_STREAM_FRAME).await.map_err(|e| failed(&e))?;
        let hello = ControlMessage::Hello(Hello {
            agent_id: ctx.agent_id.clone(),
            version: env!("CARGO_PKG_VERSION").into(),
            identifiers: ctx.identifiers.clone(),
            capabilities: vec![],
        });
        write_frame(&mut control, &hello, MAX_CONTROL_FRAME).await.map_err(|e| failed(&e))?;
        let result: StreamResult = read_frame(&mut control, MAX_STREAM_FRAME).await.map_err(|e| failed(&e))?;
        if !result.ok {
            let message = result.message.unwrap_or_default();
            if result.code == Some(ErrorCode::LimitExceeded) {
                return Err(EstablishError::AtLimit(message));
            }
            return Err(EstablishError::Handshake(format!("gateway refused the Hello: {message}")));
        }
        match read_frame::<ControlMessage, _>(&mut control, MAX_CONTROL_FRAME).await {
            Ok(ControlMessage::Welcome(welcome)) => Ok((control, welcome)),
            Ok(other) => Err(EstablishError::Handshake(format!("expected Welcome, got {other:?}"))),
            Err(e) => Err(EstablishError::Handshake(e.to_string())),
        }
    };
    match tokio::time::timeout(ctx.client.handshake_timeout, handshake).await {
        Ok(Ok((control, welcome))) => Ok((Established { session, incoming, control, welcome, token }, driver)),
        Ok(Err(e)) => {
            session.close();
            Err(e)
        }
        Err(_) => {
            session.close();
            Err(EstablishError::Handshake("no Welcome in time".into()))
        }
    }
}

async fn run_session(
    ctx: &Arc<ConnectionContext>,
    established: Established,
    stop: &CancellationToken,
    retire: &CancellationToken,
) -> SessionEnd {
    let Established { session, mut incoming, control, welcome, mut token } = established;
    metrics::counter!(CONNECTS, "result" => "ok").increment(1);
    tracing::info!(server = %welcome.server_id, agent_id = %welcome.agent_id, servers = welcome.server_count, "connected to the gateway");

    let (control_read, mut control_write) = tokio::io::split(control);
    let (message_tx, mut messages) = mpsc::channel(16);
    let reader = tokio::spawn(forward_frames(control_read, MAX_CONTROL_FRAME, message_tx));
    let mut token_check = tokio::time::interval(ctx.token_check_interval);
    token_check.tick().await;
    // Each token problem seen on this session is logged once.
    let mut warned: Option<String> = None;
    // Retiring (a busy session no longer wanted): nothing new comes here; the session runs on,
    // its token refreshed, until the streams still on it are done or RETIRE_GRACE is over.
    let retire_deadline = tokio::time::sleep(Duration::MAX / 4);
    tokio::pin!(retire_deadline);
    let mut retiring = false;
    let mut idle_check = tokio::time::interval(Duration::from_millis(200));

    let end = loop {
        tokio::select! {
            stream = incoming.accept() => match stream {
                Some(stream) => {
                    session.spawn_local(ctx.tasks.track_future(serve_stream(stream, ctx.policy.clone())));
                }
                None => break SessionEnd::Lost("the session closed".into()),
            },
            message = messages.recv() => match message.map(|m| *m) {
                Some(Ok(ControlMessage::Drain(drain))) => {
                    metrics::counter!(DRAINS).increment(1);
                    tracing::info!(server = %welcome.server_id, reason = %drain.reason, deadline_ms = drain.deadline_ms, "gateway asked to move; reconnecting while in-flight streams finish");
                    let deadline = Duration::from_millis(drain.deadline_ms);
                    // The control stream stays open too: closing it would end the session at the
                    // gateway, and with it the streams still in flight.
                    let control = (control_write, reader, messages);
                    tokio::spawn(finish_draining(session.clone(), incoming, control, ctx.clone(), deadline));
                    return SessionEnd::Drained(deadline);
                }
                Some(Ok(ControlMessage::ServerCount(count))) => {
                    tracing::info!(servers = count.server_count, "the gateway's replica count changed");
                    ctx.state.note_server_count(count.server_count);
                }
                Some(Ok(ControlMessage::TokenRefreshResult(result))) => {
                    let label = if result.ok { "ok" } else { "refused" };
                    metrics::counter!(TOKEN_REFRESHES, "result" => label).increment(1);
                    if result.ok {
                        tracing::info!(expires_at = result.expires_at, "gateway accepted the refreshed token");
                    } else {
                        tracing::error!(reason = result.message.as_deref().unwrap_or_default(), "gateway refused the refreshed token");
                    }
                }
                Some(Ok(other)) => tracing::debug!(?other, "control message ignored"),
                Some(Err(e)) => break SessionEnd::Lost(format!("control stream failed: {e}")),
                None => break SessionEnd::Lost("the gateway closed the control stream".into()),
            },
            _ = token_check.tick() => {
                match read_token(&ctx.token_file).await {
                    Ok(fresh) if fresh != token => {
                        if let Some(problem) = expiry_problem(&fresh, &ctx.token_file) {
                            if warned.as_ref() != Some(&problem) {
                                tracing::warn!("{problem}; not sent to the gateway");
                                warned = Some(problem);
                            }
                            continue;
                        }
                        let refresh = ControlMessage::TokenRefresh(TokenRefresh { token: fresh.clone() });
                        if let Err(e) = send(&mut control_write, &refresh).await {
                            break SessionEnd::Lost(format!("cannot send token refresh: {e}"));
                        }
                        tracing::info!("token file changed; sent the new token to the gateway");
                        note_token_expiry(&fresh);
                        token = fresh;
                    }
                    Ok(_) => {
                        // Not rotated: say so once before the gateway ends the session for it.
                        let soon = ctx.token_check_interval * 2 + TOKEN_MIN_REMAINING;
                        if let Some(exp) = tether_tunnel::jwt::unverified_expiry(&token)
                            && exp <= tether_tunnel::jwt::now_unix() + soon.as_secs()
                        {
                            let problem = format!(
                                "the token expires at {} and {} has not been rotated; the gateway will close the session then",
                                tether_tunnel::jwt::rfc3339(exp),
                                ctx.token_file.display()
                            );
                            if warned.as_ref() != Some(&problem) {
                                tracing::warn!("{problem}");
                                warned = Some(problem);
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot re-read the token file; keeping the current token"),
                }
            }
            () = retire.cancelled(), if !retiring => {
                // The gateway routes nothing new here once it has read this (a dial it sent
                // before is still served), and the agent opens nothing new here.
                let leaving = leaving(RETIRE_GRACE, "the agent is quiet again; closing a busy session");
                if send(&mut control_write, &leaving).await.is_err() {
                    break SessionEnd::Retired;
                }
                tracing::debug!(server = %welcome.server_id, open_streams = tunnelled_streams(&session), "closing a busy session: quiet for the busy linger");
                retiring = true;
                retire_deadline.as_mut().reset(tokio::time::Instant::now() + RETIRE_GRACE);
            }
            _ = idle_check.tick(), if retiring => {
                if tunnelled_streams(&session) == 0 {
                    break SessionEnd::Retired;
                }
            }
            () = &mut retire_deadline, if retiring => break SessionEnd::Retired,
            () = stop.cancelled() => {
                let grace = ctx.shutdown_grace_period;
                let leaving = leaving(grace, "agent shutting down");
                if grace.is_zero() || send(&mut control_write, &leaving).await.is_err() {
                    break SessionEnd::Stopped;
                }
                tracing::info!(server = %welcome.server_id, open_streams = tunnelled_streams(&session), grace_ms = grace.as_millis() as u64, "stopping: told the gateway; open streams may finish");
                finish_draining(session, incoming, (control_write, reader, messages), ctx.clone(), grace).await;
                return SessionEnd::Stopped;
            }
        }
    };
    reader.abort();
    session.close();
    if matches!(end, SessionEnd::Lost(_)) {
        ctx.state.lost.store(true, Ordering::Relaxed);
    }
    end
}

/// Serves a drained session's last streams until they are done (or the deadline), then closes
/// it: the gateway can finish its drain as soon as its agents have moved.
async fn finish_draining(
    session: Session,
    mut incoming: Incoming,
    control: DrainingControl,
    ctx: Arc<ConnectionContext>,
    deadline: Duration,
) {
    let (_control_write, reader, mut messages) = control;
    let until = tokio::time::sleep(deadline);
    tokio::pin!(until);
    let mut idle_check = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = idle_check.tick() => {
                if tunnelled_streams(&session) == 0 {
                    tracing::debug!("drained session has no streams left; closing it");
                    break;
                }
            }
            stream = incoming.accept() => match stream {
                Some(stream) => {
                    session.spawn_local(ctx.tasks.track_future(serve_stream(stream, ctx.policy.clone())));
                }
                None => break,
            },
            message = messages.recv() => if message.is_none() { break },
            () = &mut until => break,
        }
    }
    reader.abort();
    session.close();
}

/// Streams a session carries besides its control stream: 0 when nothing is in flight.
fn tunnelled_streams(session: &Session) -> usize {
    session.open_streams().saturating_sub(1)
}

/// The control stream of a draining session, kept open until the session ends.
type DrainingControl =
    (WriteHalf<MuxStream>, tokio::task::JoinHandle<()>, mpsc::Receiver<Box<Result<ControlMessage, FrameError>>>);

/// The `leaving` message: nothing new for this session; it closes when its streams are done, at
/// the latest after `deadline`.
fn leaving(deadline: Duration, reason: &str) -> ControlMessage {
    ControlMessage::Leaving(Leaving {
        deadline_ms: u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX),
        reason: reason.into(),
    })
}

async fn send(writer: &mut WriteHalf<MuxStream>, message: &ControlMessage) -> Result<(), FrameError> {
    write_frame(writer, message, MAX_CONTROL_FRAME).await
}

/// Longest a retiring busy session stays for the streams it still carries (its token is refreshed
/// meanwhile, as on any session).
const RETIRE_GRACE: Duration = Duration::from_secs(3600);

/// A token with less than this left is not presented (the session would end almost at once).
const TOKEN_MIN_REMAINING: Duration = Duration::from_secs(2);

/// Reads the bearer token; surrounding whitespace is ignored, an empty file is an error.
pub async fn read_token(path: &Path) -> Result<String, String> {
    let error = |reason: String| format!("token file {}: {reason}", path.display());
    let text = tokio::fs::read_to_string(path).await.map_err(|e| error(e.to_string()))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(error("the file is empty".into()));
    }
    if token.len() > 16 * 1024 {
        return Err(error("the token is larger than 16 KiB".into()));
    }
    Ok(token.to_owned())
}

/// Reads the token and checks that it is worth presenting: a token that has expired, or is about
/// to, would only get a 401 or a session the gateway closes at once.
pub async fn read_usable_token(path: &Path) -> Result<String, String> {
    let token = read_token(path).await.map_err(|e| format!("{e}; waiting for a usable token"))?;
    note_token_expiry(&token);
    match expiry_problem(&token, path) {
        Some(problem) => Err(problem),
        None => Ok(token),
    }
}

/// What is wrong with `token`'s expiry, if anything (a token without `exp` is for the gateway to
/// judge).
fn expiry_problem(token: &str, path: &Path) -> Option<String> {
    let exp = tether_tunnel::jwt::unverified_expiry(token)?;
    let now = tether_tunnel::jwt::now_unix();
    let at = tether_tunnel::jwt::rfc3339(exp);
    if exp <= now {
        Some(format!("token expired at {at}, waiting for a new token in {}", path.display()))
    } else if exp < now + TOKEN_MIN_REMAINING.as_secs() {
        Some(format!("token expires at {at} (in {} s), waiting for a new token in {}", exp - now, path.display()))
    } else {
        None
    }
}

/// Publishes the expiry of the token just read.
fn note_token_expiry(token: &str) {
    if let Some(exp) = tether_tunnel::jwt::unverified_expiry(token) {
        metrics::gauge!(TOKEN_EXPIRY).set(exp as f64);
    }
}

/// Lists a live session in the agent state and the sessions gauge until dropped.
pub(crate) struct LiveSession {
    state: Arc<AgentState>,
    id: u64,
    /// Cancelled when the agent no longer wants this session (a busy spell ended).
    pub(crate) retire: CancellationToken,
}

impl LiveSession {
    pub(crate) fn new(state: Arc<AgentState>, server_id: String, session: Session, on_thread: bool) -> Self {
        let id = state.next_id.fetch_add(1, Ordering::Relaxed);
        let retire = CancellationToken::new();
        if let Ok(mut live) = state.live.lock() {
            live.push(LiveEntry { id, server_id, session, retire: retire.clone(), on_thread });
        }
        state.session_added.notify_waiters();
        state.changed.notify_waiters();
        metrics::gauge!(SESSIONS).increment(1.0);
        Self { state, id, retire }
    }
}

impl Drop for LiveSession {
    fn drop(&mut self) {
        if let Ok(mut live) = self.state.live.lock() {
            live.retain(|e| e.id != self.id);
        }
        self.state.changed.notify_waiters();
        metrics::gauge!(SESSIONS).decrement(1.0);
    }
}
