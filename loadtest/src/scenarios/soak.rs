//! `soak`: a long run of mixed load against the real `tether-gateway` and `tether-agent`
//! binaries, looking for anything that grows with time rather than with load.
//!
//! The load, all at once: CONNECT dials at a steady rate (open, echo round trip, close),
//! node -> control-plane connections through the agent's listener at a steady rate, bulk streams
//! (download, upload, close, pause), a pool of idle streams of which some are closed and replaced
//! every second, and extra agents that connect and leave over and over (stopped with SIGTERM or
//! SIGKILL in turn). Half-way the gateway is restarted (SIGTERM: it drains, then starts again on
//! the same ports); at three quarters the main agent's token file is rotated, as the kubelet does.
//!
//! Every few seconds it samples, for the gateway and the main agent: resident memory, open files,
//! runtime tasks, and the stream, forward and session gauges. When the load ends it waits until
//! the gauges are back at zero and the open files at their baseline, and reports how long that
//! took, the slopes of memory, files and tasks over the loaded time, and charts of all of it.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::procs::{self, AgentFiles, AgentProcessSpec, ChildProcess, Credentials, GatewayPorts, GatewaySizing};
use crate::progress::Progress;
use crate::report::{Report, Series, Table};
use crate::scenarios::Outcome;
use crate::stats::slope;
use crate::svg::{self, Labels, Line};
use crate::target::{Conn, Frontend, Route};

/// Options of `soak`.
#[derive(Debug, Clone, clap::Args)]
pub struct SoakArgs {
    /// How long the load runs, e.g. `2m` or `1h`.
    #[arg(long, value_parser = tether_tunnel::duration::parse, default_value = "10m")]
    pub duration: Duration,
    /// Time between samples.
    #[arg(long, value_parser = tether_tunnel::duration::parse, default_value = "5s")]
    pub sample_interval: Duration,
    /// CONNECT dials per second to the main agent's node (each: open, echo round trip, close).
    #[arg(long, default_value_t = 50.0)]
    pub dial_rate: f64,
    /// Node -> control-plane connections per second through the main agent's listener.
    #[arg(long, default_value_t = 20.0)]
    pub forward_rate: f64,
    /// Bulk streams at once; each downloads and uploads --bulk-mib, closes, pauses, again.
    #[arg(long, default_value_t = 2)]
    pub bulk_streams: usize,
    /// MiB each bulk transfer moves in each direction.
    #[arg(long, default_value_t = 16)]
    pub bulk_mib: u64,
    /// Pause between bulk transfers.
    #[arg(long, value_parser = tether_tunnel::duration::parse, default_value = "2s")]
    pub bulk_pause: Duration,
    /// Idle streams held open.
    #[arg(long, default_value_t = 500)]
    pub idle_streams: usize,
    /// Idle node -> control-plane connections held open through the agent's listener (the
    /// kubelet's watches), turned over like the idle streams.
    #[arg(long, default_value_t = 100)]
    pub idle_forwards: usize,
    /// Idle streams (and idle forwards) closed and replaced by new ones every second.
    #[arg(long, default_value_t = 10)]
    pub idle_turnover: usize,
    /// Extra agents that connect and leave over and over.
    #[arg(long, default_value_t = 3)]
    pub churn_agents: usize,
    /// About how long an extra agent stays connected (then it is away for about half that).
    #[arg(long, value_parser = tether_tunnel::duration::parse, default_value = "30s")]
    pub churn_period: Duration,
    /// Longest wait, after the load, for gauges and open files to return to their baseline.
    #[arg(long, value_parser = tether_tunnel::duration::parse, default_value = "60s")]
    pub settle_timeout: Duration,
    /// The tether-gateway binary (default: next to this executable).
    #[arg(long)]
    pub gateway_bin: Option<PathBuf>,
    /// The tether-agent binary (default: next to this executable).
    #[arg(long)]
    pub agent_bin: Option<PathBuf>,
}

/// The node -> control-plane target name the gateway is configured with.
const FORWARD_TARGET: &str = "soak-controlplane";
/// In-flight dials per load loop; a tick finding this many still running is counted as skipped.
const MAX_IN_FLIGHT: usize = 256;
/// Time allowed for one round trip of any load connection.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long after the restarted gateway's first good dial failures still count as the restart's.
const RESTART_TAIL: Duration = Duration::from_secs(10);

/// Successes and failures of one kind of load.
#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
    /// Failures while the gateway restarts (expected: its connections go with it).
    failed_in_restart: AtomicU64,
}

/// Everything the load loops count, and the first unexpected errors.
#[derive(Default)]
struct Load {
    dials: Tally,
    forwards: Tally,
    bulk: Tally,
    bulk_bytes: AtomicU64,
    idle_opened: Tally,
    idle_closed: AtomicU64,
    idle_lost: Tally,
    idle_open: AtomicUsize,
    idle_forwards_open: AtomicUsize,
    churn_dials: Tally,
    churn_starts: AtomicU64,
    churn_stops: AtomicU64,
    skipped: AtomicU64,
    restarting: AtomicBool,
    /// When the gateway restart began: an idle stream opened before it died with that gateway,
    /// however late a ping finds out.
    restart_began: Mutex<Option<Instant>>,
    errors: Mutex<Vec<String>>,
}

impl Load {
    /// An idle stream opened at `opened` stopped answering.
    fn idle_stream_lost(&self, opened: Instant, error: anyhow::Error) {
        let restart = *self.restart_began.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if restart.is_some_and(|began| opened <= began) {
            self.idle_lost.failed_in_restart.fetch_add(1, Ordering::Relaxed);
        } else {
            self.record(&self.idle_lost, Err(error), "idle stream lost");
        }
    }

    fn record(&self, tally: &Tally, result: anyhow::Result<()>, what: &str) {
        match result {
            Ok(()) => {
                tally.ok.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) if self.restarting.load(Ordering::Relaxed) => {
                tally.failed_in_restart.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tally.failed.fetch_add(1, Ordering::Relaxed);
                let mut errors = self.errors.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if errors.len() < 10 {
                    errors.push(format!("{what}: {e:#}"));
                }
            }
        }
    }
}

/// One sample of one process.
#[derive(Debug, Clone, Copy, Default)]
struct Side {
    rss_kib: Option<f64>,
    fds: Option<f64>,
    tasks: Option<f64>,
    streams: Option<f64>,
    forwards: Option<f64>,
    sessions: Option<f64>,
}

/// One sample: seconds since the load started, both processes, the load counters.
#[derive(Debug, Clone, Copy)]
struct Sample {
    t: f64,
    gateway: Side,
    agent: Side,
    dials: u64,
    forwards: u64,
    bulk_bytes: u64,
    idle_open: usize,
    idle_forwards_open: usize,
}

/// Where to read a process's figures.
#[derive(Clone)]
struct Watched {
    pid: Arc<AtomicU32>,
    admin: SocketAddr,
    prefix: &'static str,
    sessions: &'static str,
}

impl Watched {
    async fn sample(&self) -> Side {
        let pid = self.pid.load(Ordering::Relaxed);
        // Files first: the scrape below holds a connection open on the process.
        let fds = procs::open_fds(pid).map(|n| n as f64);
        let rss_kib = procs::rss_kib(pid).map(|k| k as f64);
        let text = procs::scrape(self.admin).await.unwrap_or_default();
        let gauge = |name: &str| procs::metric_in(&text, &format!("{}_{name}", self.prefix), None);
        // A gauge never touched is absent from an exposition: nothing of it was ever open.
        let open = |name: &str| (!text.is_empty()).then(|| gauge(name).unwrap_or(0.0));
        Side {
            rss_kib,
            fds,
            tasks: gauge("runtime_tasks"),
            streams: open("streams_open"),
            forwards: open("forwards_open"),
            sessions: open(self.sessions),
        }
    }
}

async fn round_trip(conn: &mut Conn, payload: &[u8]) -> anyhow::Result<()> {
    conn.write_all(payload).await?;
    let mut answer = vec![0u8; payload.len()];
    tokio::time::timeout(IO_TIMEOUT, conn.read_exact(&mut answer)).await.context("no echo in time")??;
    anyhow::ensure!(answer == payload, "the echo differs from what was sent");
    Ok(())
}

/// Opens `route`, checks one echo round trip and closes it.
async fn dial_echo(route: &Route) -> anyhow::Result<()> {
    let mut conn = tokio::time::timeout(IO_TIMEOUT, route.open()).await.context("dial timed out")??;
    round_trip(&mut conn, b"soak dial: are you there?").await?;
    let _ = conn.shutdown().await;
    Ok(())
}

/// Opens `route` at `rate` per second until `stop`, counting into `tally`.
fn steady_dials(
    route: Route,
    rate: f64,
    load: Arc<Load>,
    pick: fn(&Load) -> &Tally,
    what: &'static str,
    stop: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        if rate <= 0.0 {
            return;
        }
        let in_flight = Arc::new(AtomicUsize::new(0));
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            if in_flight.load(Ordering::Relaxed) >= MAX_IN_FLIGHT {
                load.skipped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            in_flight.fetch_add(1, Ordering::Relaxed);
            let (route, load, in_flight) = (route.clone(), load.clone(), in_flight.clone());
            tokio::spawn(async move {
                let result = dial_echo(&route).await;
                load.record(pick(&load), result, what);
                in_flight.fetch_sub(1, Ordering::Relaxed);
            });
        }
        // Let the dials in flight finish, so nothing of this loop is open when the load ends.
        let deadline = Instant::now() + IO_TIMEOUT * 2;
        while in_flight.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

/// One bulk transfer: download `bytes`, then upload as many; returns the bytes moved.
async fn bulk_once(route: &Route, bytes: u64) -> anyhow::Result<u64> {
    let mut down = tokio::time::timeout(IO_TIMEOUT, route.open()).await.context("dial timed out")??;
    let mut command = [0u8; 9];
    command[0] = b'D';
    command[1..].copy_from_slice(&bytes.to_be_bytes());
    down.write_all(&command).await?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut got = 0u64;
    loop {
        let n = tokio::time::timeout(IO_TIMEOUT, down.read(&mut buf)).await.context("download stalled")??;
        if n == 0 {
            break;
        }
        got += n as u64;
    }
    anyhow::ensure!(got == bytes, "downloaded {got} of {bytes} bytes");
    drop(down);
    let mut up = tokio::time::timeout(IO_TIMEOUT, route.open()).await.context("dial timed out")??;
    up.write_all(b"U").await?;
    let chunk = crate::backends::pattern(256 * 1024);
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        tokio::time::timeout(IO_TIMEOUT, up.write_all(&chunk[..n])).await.context("upload stalled")??;
        left -= n as u64;
    }
    up.shutdown().await?;
    let mut count = [0u8; 8];
    tokio::time::timeout(IO_TIMEOUT, up.read_exact(&mut count)).await.context("no upload count")??;
    let counted = u64::from_be_bytes(count);
    anyhow::ensure!(counted == bytes, "the server counted {counted} of {bytes} uploaded bytes");
    Ok(got + counted)
}

fn bulk_loop(route: Route, bytes: u64, pause: Duration, load: Arc<Load>, stop: CancellationToken) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let result = tokio::select! {
                () = stop.cancelled() => return,
                result = bulk_once(&route, bytes) => result,
            };
            let result = result.map(|moved| {
                load.bulk_bytes.fetch_add(moved, Ordering::Relaxed);
            });
            load.record(&load.bulk, result, "bulk");
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(pause) => {}
            }
        }
    })
}

/// Holds `target` idle streams; every second closes `turnover` at random, checks a few of the
/// others still answer, and opens new ones up to `target`.
fn idle_pool(
    route: Route,
    target: usize,
    turnover: usize,
    held: fn(&Load) -> &AtomicUsize,
    load: Arc<Load>,
    stop: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut pool: Vec<(Conn, Instant)> = Vec::with_capacity(target);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let per_tick = (turnover * 2).max(100);
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            for _ in 0..turnover.min(pool.len()) {
                drop(pool.swap_remove(fastrand::usize(..pool.len())));
                load.idle_closed.fetch_add(1, Ordering::Relaxed);
            }
            // A stream the gateway or agent dropped answers no more.
            let mut checked = 0;
            while checked < 10.min(pool.len()) {
                let index = fastrand::usize(..pool.len());
                checked += 1;
                if let Err(e) = round_trip(&mut pool[index].0, b"idle ping").await {
                    let (conn, opened) = pool.swap_remove(index);
                    drop(conn);
                    load.idle_stream_lost(opened, e);
                }
            }
            let wanted = target.saturating_sub(pool.len()).min(per_tick);
            let opened: Vec<anyhow::Result<Conn>> = futures::stream::iter((0..wanted).map(|_| async {
                let mut conn = tokio::time::timeout(IO_TIMEOUT, route.open()).await.context("dial timed out")??;
                round_trip(&mut conn, b"idle open").await?;
                anyhow::Ok(conn)
            }))
            .buffer_unordered(16)
            .collect()
            .await;
            for conn in opened {
                match conn {
                    Ok(conn) => {
                        pool.push((conn, Instant::now()));
                        load.idle_opened.ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => load.record(&load.idle_opened, Err(e), "idle stream open"),
                }
            }
            held(&load).store(pool.len(), Ordering::Relaxed);
        }
        load.idle_closed.fetch_add(pool.len() as u64, Ordering::Relaxed);
        drop(pool);
        held(&load).store(0, Ordering::Relaxed);
    })
}

/// What the extra agents share.
struct Churn {
    binary: PathBuf,
    creds: Arc<Credentials>,
    ports: GatewayPorts,
    period: Duration,
    load: Arc<Load>,
    stop: CancellationToken,
}

/// Extra agent `index`: connects, stays a while (its node is dialled twice a second), leaves
/// (SIGTERM and SIGKILL in turn), stays away a while, again, until `stop`.
async fn churn_agent(index: usize, churn: Arc<Churn>) -> anyhow::Result<()> {
    let octet = u8::try_from(index + 2).context("too many extra agents")?;
    let echo_listener = TcpListener::bind((Ipv4Addr::new(127, 0, 0, octet), 0)).await?;
    let echo = echo_listener.local_addr()?;
    let echo_server = crate::backends::spawn_echo(echo_listener);
    let name = format!("node-{}", index + 2);
    let admin = procs::free_loopback()?;
    let spec = AgentProcessSpec { name: &name, admin, allowed: vec![echo], listeners: vec![] };
    let files = procs::write_named_agent_config(&churn.creds, &churn.ports, &spec)?;
    let route = Route::Connect { frontend: Frontend::Tcp(churn.ports.frontend), target: echo };
    let jitter = |base: Duration| base.mul_f64(0.5 + fastrand::f64());
    let mut round = 0u64;
    while !churn.stop.is_cancelled() {
        round += 1;
        let mut process = ChildProcess::spawn(&churn.binary, &files.config, &files.log)?;
        churn.load.churn_starts.fetch_add(1, Ordering::Relaxed);
        let ready = procs::wait_ready(&mut process, admin, "/readyz", Duration::from_secs(30)).await;
        if let Err(e) = ready {
            churn.load.record(&churn.load.churn_dials, Err(e), "extra agent start");
        } else {
            let up_until = tokio::time::Instant::now() + jitter(churn.period);
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tokio::select! {
                    () = churn.stop.cancelled() => break,
                    () = tokio::time::sleep_until(up_until) => break,
                    _ = tick.tick() => {}
                }
                let result = dial_echo(&route).await;
                churn.load.record(&churn.load.churn_dials, result, "dial to an extra agent");
            }
        }
        // Leave gracefully and by crashing in turn; at the end always gracefully.
        if round.is_multiple_of(2) && !churn.stop.is_cancelled() {
            process.kill().await;
        } else {
            process.terminate(Duration::from_secs(10)).await;
        }
        churn.load.churn_stops.fetch_add(1, Ordering::Relaxed);
        tokio::select! {
            () = churn.stop.cancelled() => {}
            () = tokio::time::sleep(jitter(churn.period / 2)) => {}
        }
    }
    echo_server.abort();
    Ok(())
}

/// Samples both processes every `interval` until `stop`.
fn sampler(
    gateway: Watched,
    agent: Watched,
    load: Arc<Load>,
    started: Instant,
    interval: Duration,
    stop: CancellationToken,
) -> JoinHandle<Vec<Sample>> {
    tokio::spawn(async move {
        let mut samples = Vec::new();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return samples,
                _ = tick.tick() => {}
            }
            let (g, a) = tokio::join!(gateway.sample(), agent.sample());
            samples.push(Sample {
                t: started.elapsed().as_secs_f64(),
                gateway: g,
                agent: a,
                dials: load.dials.ok.load(Ordering::Relaxed),
                forwards: load.forwards.ok.load(Ordering::Relaxed),
                bulk_bytes: load.bulk_bytes.load(Ordering::Relaxed),
                idle_open: load.idle_open.load(Ordering::Relaxed),
                idle_forwards_open: load.idle_forwards_open.load(Ordering::Relaxed),
            });
        }
    })
}

/// Writes a token file the way the kubelet does: a new file renamed over the old one.
fn rotate_token(files: &AgentFiles, token: &str) -> anyhow::Result<()> {
    let fresh = files.token.with_extension("rotating");
    crate::devpki::write_private(&fresh, token.as_bytes())?;
    std::fs::rename(&fresh, &files.token).with_context(|| format!("cannot replace {}", files.token.display()))?;
    Ok(())
}

async fn wait_until<F, Fut>(timeout: Duration, mut done: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    loop {
        if done().await {
            return Some(started.elapsed());
        }
        if started.elapsed() >= timeout {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn gateway_config(creds: &Credentials, ports: &GatewayPorts, forward_target: SocketAddr) -> anyhow::Result<PathBuf> {
    let path = procs::write_gateway_config(creds, ports, GatewaySizing { agents: 16, streams: 8192 })?;
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    config["tenants"][0]["node_to_controlplane"] =
        serde_json::json!({ "targets": [{ "name": FORWARD_TARGET, "address": forward_target.to_string() }] });
    std::fs::write(&path, serde_json::to_string_pretty(&config)?)?;
    Ok(path)
}

/// The figures at rest (before and after the load) that must match.
#[derive(Debug, Clone, Copy)]
struct Rest {
    gateway: Side,
    agent: Side,
}

async fn at_rest(gateway: &Watched, agent: &Watched) -> Rest {
    let (gateway, agent) = tokio::join!(gateway.sample(), agent.sample());
    Rest { gateway, agent }
}

/// Whether everything is back where it was at `base`.
fn settled(base: &Rest, now: &Rest) -> bool {
    let zero = |v: Option<f64>| v == Some(0.0);
    let at_most = |v: Option<f64>, b: Option<f64>| matches!((v, b), (Some(v), Some(b)) if v <= b);
    zero(now.gateway.streams)
        && zero(now.agent.streams)
        && zero(now.gateway.forwards)
        && zero(now.agent.forwards)
        && now.gateway.sessions == Some(1.0)
        && now.agent.sessions == Some(1.0)
        && at_most(now.gateway.fds, base.gateway.fds)
        && at_most(now.agent.fds, base.agent.fds)
}

/// Runs the scenario.
pub async fn run(args: &SoakArgs, progress: &Progress) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let gateway_bin = procs::find_binary("tether-gateway", args.gateway_bin.as_deref())?;
    let agent_bin = procs::find_binary("tether-agent", args.agent_bin.as_deref())?;
    anyhow::ensure!(args.churn_agents <= 200, "--churn-agents: at most 200 (one loopback address each)");

    let echo_listener = TcpListener::bind("127.0.0.1:0").await?;
    let echo = echo_listener.local_addr()?;
    let echo_server = crate::backends::spawn_echo(echo_listener);
    let bulk_listener = TcpListener::bind("127.0.0.1:0").await?;
    let bulk = bulk_listener.local_addr()?;
    let bulk_server = crate::backends::spawn_bulk(bulk_listener);
    let controlplane_listener = TcpListener::bind("127.0.0.1:0").await?;
    let controlplane = controlplane_listener.local_addr()?;
    let controlplane_server = crate::backends::spawn_echo(controlplane_listener);

    let creds = Arc::new(Credentials::create("tether-soak")?);
    let ports = GatewayPorts::pick()?;
    let gateway_config = gateway_config(&creds, &ports, controlplane)?;
    let gateway_log = creds.dir.path().join("gateway.log");
    let mut gateway = ChildProcess::spawn(&gateway_bin, &gateway_config, &gateway_log)?;
    procs::wait_ready(&mut gateway, ports.admin, "/readyz", Duration::from_secs(30)).await?;
    let agent_admin = procs::free_loopback()?;
    let forward_listen = procs::free_loopback()?;
    let spec = AgentProcessSpec {
        name: "node-1",
        admin: agent_admin,
        allowed: vec![echo, bulk],
        listeners: vec![(forward_listen, FORWARD_TARGET)],
    };
    let agent_files = procs::write_named_agent_config(&creds, &ports, &spec)?;
    let mut agent = ChildProcess::spawn(&agent_bin, &agent_files.config, &agent_files.log)?;
    procs::wait_ready(&mut agent, agent_admin, "/readyz", Duration::from_secs(30)).await?;

    let dial_route = Route::Connect { frontend: Frontend::Tcp(ports.frontend), target: echo };
    let bulk_route = Route::Connect { frontend: Frontend::Tcp(ports.frontend), target: bulk };
    let forward_route = Route::Direct(forward_listen);

    // Warm-up: every path once, so what is created on first use is in the baseline.
    for route in [&dial_route, &forward_route] {
        for _ in 0..20 {
            dial_echo(route).await.context("warm-up dial")?;
        }
    }
    bulk_once(&bulk_route, 1 << 20).await.context("warm-up bulk transfer")?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let gateway_pid = Arc::new(AtomicU32::new(gateway.pid));
    let watched_gateway =
        Watched { pid: gateway_pid.clone(), admin: ports.admin, prefix: "tether_gateway", sessions: "agent_sessions" };
    let watched_agent = Watched {
        pid: Arc::new(AtomicU32::new(agent.pid)),
        admin: agent_admin,
        prefix: "tether_agent",
        sessions: "sessions",
    };
    let base = at_rest(&watched_gateway, &watched_agent).await;
    anyhow::ensure!(settled(&base, &base), "not at rest before the load: {base:?}");

    // The load.
    let load = Arc::new(Load::default());
    let stop_load = CancellationToken::new();
    let stop_sampling = CancellationToken::new();
    let load_started = Instant::now();
    let samples = sampler(
        watched_gateway.clone(),
        watched_agent.clone(),
        load.clone(),
        load_started,
        args.sample_interval,
        stop_sampling.clone(),
    );
    let mut tasks = vec![
        steady_dials(dial_route.clone(), args.dial_rate, load.clone(), |l| &l.dials, "dial", stop_load.clone()),
        steady_dials(
            forward_route.clone(),
            args.forward_rate,
            load.clone(),
            |l| &l.forwards,
            "forward",
            stop_load.clone(),
        ),
        idle_pool(
            dial_route.clone(),
            args.idle_streams,
            args.idle_turnover,
            |l| &l.idle_open,
            load.clone(),
            stop_load.clone(),
        ),
        idle_pool(
            forward_route,
            args.idle_forwards,
            args.idle_turnover.min(args.idle_forwards / 10).max(1),
            |l| &l.idle_forwards_open,
            load.clone(),
            stop_load.clone(),
        ),
    ];
    for _ in 0..args.bulk_streams {
        tasks.push(bulk_loop(
            bulk_route.clone(),
            args.bulk_mib << 20,
            args.bulk_pause,
            load.clone(),
            stop_load.clone(),
        ));
    }
    let churn = Arc::new(Churn {
        binary: agent_bin.clone(),
        creds: creds.clone(),
        ports,
        period: args.churn_period,
        load: load.clone(),
        stop: stop_load.clone(),
    });
    let churners: Vec<JoinHandle<anyhow::Result<()>>> =
        (0..args.churn_agents).map(|i| tokio::spawn(churn_agent(i, churn.clone()))).collect();

    let live = {
        let load = load.clone();
        move || {
            format!(
                "dials {} forwards {} idle {} bulk {:.1} GiB",
                load.dials.ok.load(Ordering::Relaxed),
                load.forwards.ok.load(Ordering::Relaxed),
                load.idle_open.load(Ordering::Relaxed),
                load.bulk_bytes.load(Ordering::Relaxed) as f64 / f64::from(1u32 << 30)
            )
        }
    };
    let phase = progress.phase(&format!("mixed load for {:?}", args.duration), args.duration, live);

    // Half-way: restart the gateway (SIGTERM, drain, start again on the same ports).
    tokio::time::sleep(args.duration / 2).await;
    let restart_at = load_started.elapsed().as_secs_f64();
    load.restarting.store(true, Ordering::Relaxed);
    let restart_began = Instant::now();
    *load.restart_began.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(restart_began);
    let drained = gateway.terminate(Duration::from_secs(30)).await;
    gateway = ChildProcess::spawn(&gateway_bin, &gateway_config, &gateway_log)?;
    gateway_pid.store(gateway.pid, Ordering::Relaxed);
    procs::wait_ready(&mut gateway, ports.admin, "/readyz", Duration::from_secs(30)).await?;
    wait_until(Duration::from_secs(60), || async { dial_echo(&dial_route).await.is_ok() })
        .await
        .context("no dial went through within 60 s of the gateway's restart")?;
    let restart_s = restart_began.elapsed().as_secs_f64();
    let restart_done_at = load_started.elapsed().as_secs_f64();
    tokio::time::sleep(RESTART_TAIL).await;
    load.restarting.store(false, Ordering::Relaxed);

    // Three quarters: rotate the main agent's token.
    let rotate_wait = (args.duration * 3 / 4).saturating_sub(load_started.elapsed());
    tokio::time::sleep(rotate_wait).await;
    let rotate_at = load_started.elapsed().as_secs_f64();
    let fresh = creds.issuer.service_account_token(
        "kube-system",
        "tether-agent",
        crate::local::AUDIENCE,
        Duration::from_secs(20 * 3600),
        Some("node-1"),
    )?;
    rotate_token(&agent_files, &fresh)?;
    let accepted = |addr: SocketAddr, name: &'static str| async move {
        procs::scrape(addr).await.and_then(|t| procs::metric_in(&t, name, Some("result=\"ok\""))).unwrap_or(0.0) >= 1.0
    };
    let rotated = wait_until(Duration::from_secs(30), || async {
        accepted(agent_admin, "tether_agent_token_refreshes_total").await
            && accepted(ports.admin, "tether_gateway_token_refreshes_total").await
    })
    .await;

    let rest_of_load = args.duration.saturating_sub(load_started.elapsed());
    tokio::time::sleep(rest_of_load).await;
    phase.done().await;
    let load_ended_at = load_started.elapsed().as_secs_f64();

    // Stop the load and wait for everything to return to its baseline.
    stop_load.cancel();
    for task in tasks {
        let _ = task.await;
    }
    let mut churn_errors = Vec::new();
    for churner in churners {
        match churner.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => churn_errors.push(format!("{e:#}")),
            Err(e) => churn_errors.push(e.to_string()),
        }
    }
    let phase =
        progress.phase("waiting for gauges and open files to return to the baseline", args.settle_timeout, String::new);
    let settling = Instant::now();
    let (end, settle) = loop {
        let now = at_rest(&watched_gateway, &watched_agent).await;
        if settled(&base, &now) {
            break (now, Some(settling.elapsed()));
        }
        if settling.elapsed() >= args.settle_timeout {
            break (now, None);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    phase.done().await;
    // A few samples at rest close the charts.
    tokio::time::sleep(args.sample_interval * 3).await;
    stop_sampling.cancel();
    let samples = samples.await.unwrap_or_default();

    agent.terminate(Duration::from_secs(10)).await;
    gateway.terminate(Duration::from_secs(10)).await;
    echo_server.abort();
    bulk_server.abort();
    controlplane_server.abort();

    let events = Events { restart_at, restart_done_at, rotate_at, load_ended_at };
    let mut outcome = summarise(args, &load, &samples, &base, &end, &events);
    let report = &mut outcome.report;
    report.figures.insert("gateway_restart_s".into(), restart_s);
    report.figures.insert("gateway_drained_on_sigterm".into(), f64::from(u8::from(drained)));
    report.figures.insert("token_rotation_accepted".into(), f64::from(u8::from(rotated.is_some())));
    if let Some(rotated) = rotated {
        report.figures.insert("token_rotation_s".into(), rotated.as_secs_f64());
    }
    report.figures.insert("settled".into(), f64::from(u8::from(settle.is_some())));
    if let Some(settle) = settle {
        report.figures.insert("settle_s".into(), settle.as_secs_f64());
    }
    for error in load.errors.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter() {
        report.notes.push(format!("failure outside the restart: {error}"));
    }
    for error in churn_errors {
        report.notes.push(format!("extra agent: {error}"));
    }
    report.elapsed_s = started.elapsed().as_secs_f64();
    outcome.table.push_str(&format!(
        "  gateway restart at {} (SIGTERM, {}): first dial through after {restart_s:.1} s; token rotated at {}: {}\n  \
         after the load: {}\n",
        minutes(restart_at),
        if drained { "drained and exited" } else { "killed after 30 s" },
        minutes(rotate_at),
        rotated.map_or_else(
            || "NOT accepted within 30 s".into(),
            |d| format!("accepted by agent and gateway within {:.1} s", d.as_secs_f64())
        ),
        settle.map_or_else(
            || format!("NOT back at the baseline within {:?}: {end:?}", args.settle_timeout),
            |d| format!("gauges at zero and open files at the baseline after {:.1} s", d.as_secs_f64())
        ),
    ));
    Ok(outcome)
}

fn minutes(seconds: f64) -> String {
    format!("{}:{:02}", (seconds / 60.0) as u64, (seconds % 60.0) as u64)
}

struct Events {
    restart_at: f64,
    restart_done_at: f64,
    rotate_at: f64,
    load_ended_at: f64,
}

/// A series of one field of one side over time (minutes), leaving out samples without it.
fn series(samples: &[Sample], pick: impl Fn(&Sample) -> Option<f64>) -> Vec<(f64, f64)> {
    samples.iter().filter_map(|s| pick(s).map(|v| (s.t / 60.0, v))).collect()
}

/// The slope per hour of `points` (x in minutes) between `from` and `to` seconds, leaving out the
/// first fifth of that window (allocator and table warm-up after a start).
fn slope_per_hour(points: &[(f64, f64)], from: f64, to: f64) -> Option<f64> {
    let skip = from + (to - from) / 5.0;
    let window: Vec<(f64, f64)> = points.iter().copied().filter(|p| p.0 * 60.0 >= skip && p.0 * 60.0 <= to).collect();
    (window.len() >= 3).then(|| slope(&window) * 60.0)
}

/// Per-interval rate of a counter.
fn rate(samples: &[Sample], pick: impl Fn(&Sample) -> f64) -> Vec<(f64, f64)> {
    samples
        .windows(2)
        .map(|w| {
            let dt = (w[1].t - w[0].t).max(1e-3);
            (w[1].t / 60.0, (pick(&w[1]) - pick(&w[0])).max(0.0) / dt)
        })
        .collect()
}

fn summarise(args: &SoakArgs, load: &Load, samples: &[Sample], base: &Rest, end: &Rest, events: &Events) -> Outcome {
    let mut report = Report::new(
        "soak",
        "processes",
        serde_json::json!({
            "duration_s": args.duration.as_secs_f64(),
            "sample_interval_s": args.sample_interval.as_secs_f64(),
            "dial_rate": args.dial_rate,
            "forward_rate": args.forward_rate,
            "bulk_streams": args.bulk_streams,
            "bulk_mib": args.bulk_mib,
            "bulk_pause_s": args.bulk_pause.as_secs_f64(),
            "idle_streams": args.idle_streams,
            "idle_forwards": args.idle_forwards,
            "idle_turnover": args.idle_turnover,
            "churn_agents": args.churn_agents,
            "churn_period_s": args.churn_period.as_secs_f64(),
        }),
    );
    let figures = &mut report.figures;
    let count = |v: &AtomicU64| v.load(Ordering::Relaxed) as f64;
    for (name, tally) in [
        ("dials", &load.dials),
        ("forwards", &load.forwards),
        ("bulk_transfers", &load.bulk),
        ("idle_opens", &load.idle_opened),
        ("idle_lost", &load.idle_lost),
        ("extra_agent_dials", &load.churn_dials),
    ] {
        figures.insert(format!("{name}_ok"), count(&tally.ok));
        figures.insert(format!("{name}_failed"), count(&tally.failed));
        figures.insert(format!("{name}_failed_in_restart"), count(&tally.failed_in_restart));
    }
    // `idle_lost_ok` would read oddly: a lost stream is only ever a failure.
    figures.remove("idle_lost_ok");
    figures.insert("idle_closed".into(), count(&load.idle_closed));
    figures.insert("bulk_gib".into(), count(&load.bulk_bytes) / f64::from(1u32 << 30));
    figures.insert("extra_agent_starts".into(), count(&load.churn_starts));
    figures.insert("extra_agent_stops".into(), count(&load.churn_stops));
    figures.insert("skipped_ticks".into(), count(&load.skipped));
    figures.insert("gateway_restarts".into(), 1.0);
    figures.insert("samples".into(), samples.len() as f64);
    figures.insert("load_s".into(), events.load_ended_at);
    figures.insert("restart_at_s".into(), events.restart_at);
    figures.insert("token_rotation_at_s".into(), events.rotate_at);

    type Pick = fn(&Side) -> Option<f64>;
    let fields: [(&str, &str, Pick); 6] = [
        ("rss_kib", "KiB", |s| s.rss_kib),
        ("open_fds", "files", |s| s.fds),
        ("tasks", "tasks", |s| s.tasks),
        ("streams_open", "streams", |s| s.streams),
        ("forwards_open", "connections", |s| s.forwards),
        ("sessions", "sessions", |s| s.sessions),
    ];
    let mut table =
        Table::new(&["figure", "baseline", "peak", "after load", "slope/h (1st half)", "slope/h (2nd half)"]);
    for (side_name, side_of, rest_of) in [
        ("gateway", (|s: &Sample| s.gateway) as fn(&Sample) -> Side, (|r: &Rest| r.gateway) as fn(&Rest) -> Side),
        ("agent", |s: &Sample| s.agent, |r: &Rest| r.agent),
    ] {
        for (field, unit, pick) in fields {
            let points = series(samples, |s| pick(&side_of(s)));
            let peak = points.iter().map(|p| p.1).fold(f64::NAN, f64::max);
            let at_base = pick(&rest_of(base));
            let at_end = pick(&rest_of(end));
            if let Some(v) = at_base {
                figures.insert(format!("{side_name}_{field}_base"), v);
            }
            if let Some(v) = at_end {
                figures.insert(format!("{side_name}_{field}_end"), v);
            }
            if peak.is_finite() {
                figures.insert(format!("{side_name}_{field}_peak"), peak);
            }
            // The gateway's two halves are two processes; the agent runs throughout, but the
            // restart tears down its streams, so it is cut the same way.
            let first = slope_per_hour(&points, 0.0, events.restart_at);
            let second = slope_per_hour(&points, events.restart_done_at, events.load_ended_at);
            if let Some(v) = first {
                figures.insert(format!("{side_name}_{field}_slope_per_h_first_half"), v);
            }
            if let Some(v) = second {
                figures.insert(format!("{side_name}_{field}_slope_per_h_second_half"), v);
            }
            let shown = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.0}"));
            let shown_slope = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:+.1}"));
            if matches!(field, "rss_kib" | "open_fds" | "tasks") || at_base.is_some() {
                table.row(vec![
                    format!("{side_name} {field}"),
                    shown(at_base),
                    if peak.is_finite() { format!("{peak:.0}") } else { "-".into() },
                    shown(at_end),
                    shown_slope(first),
                    shown_slope(second),
                ]);
            }
            report.series.push(Series {
                name: format!("{side_name} {field}"),
                x_unit: "min".into(),
                y_unit: unit.into(),
                points: points.iter().map(|p| [p.0, p.1]).collect(),
            });
        }
    }
    let load_lines = [
        Line { name: "CONNECT dials/s".into(), points: rate(samples, |s| s.dials as f64), dashed: false },
        Line { name: "forwards/s".into(), points: rate(samples, |s| s.forwards as f64), dashed: false },
        Line {
            name: "bulk MiB/s".into(),
            points: rate(samples, |s| s.bulk_bytes as f64 / f64::from(1u32 << 20)),
            dashed: false,
        },
        Line { name: "idle streams held".into(), points: series(samples, |s| Some(s.idle_open as f64)), dashed: true },
        Line {
            name: "idle forwards held".into(),
            points: series(samples, |s| Some(s.idle_forwards_open as f64)),
            dashed: true,
        },
    ];
    for line in &load_lines {
        report.series.push(Series {
            name: format!("load {}", line.name),
            x_unit: "min".into(),
            y_unit: "per s".into(),
            points: line.points.iter().map(|p| [p.0, p.1]).collect(),
        });
    }
    let two = |title: &str, y: &str, field: Pick, scale: f64| {
        svg::line_chart(
            &Labels { title, x: "minutes (gateway restart half-way, token rotation at 3/4)", y },
            &[
                Line {
                    name: "gateway".into(),
                    points: series(samples, |s| field(&s.gateway).map(|v| v / scale)),
                    dashed: false,
                },
                Line {
                    name: "agent".into(),
                    points: series(samples, |s| field(&s.agent).map(|v| v / scale)),
                    dashed: false,
                },
            ],
        )
    };
    let gauges = svg::line_chart(
        &Labels { title: "Open streams, forwards and sessions", x: "minutes", y: "open" },
        &[
            Line { name: "gateway streams".into(), points: series(samples, |s| s.gateway.streams), dashed: false },
            Line { name: "agent streams".into(), points: series(samples, |s| s.agent.streams), dashed: true },
            Line { name: "gateway forwards".into(), points: series(samples, |s| s.gateway.forwards), dashed: false },
            Line { name: "agent forwards".into(), points: series(samples, |s| s.agent.forwards), dashed: true },
            Line { name: "agent sessions".into(), points: series(samples, |s| s.agent.sessions), dashed: false },
            Line { name: "gateway sessions".into(), points: series(samples, |s| s.gateway.sessions), dashed: false },
        ],
    );
    let charts = vec![
        ("soak-memory.svg".into(), two("Resident memory under mixed load", "RSS (MiB)", |s| s.rss_kib, 1024.0)),
        ("soak-files.svg".into(), two("Open files under mixed load", "open file descriptors", |s| s.fds, 1.0)),
        ("soak-tasks.svg".into(), two("Runtime tasks under mixed load", "tasks alive", |s| s.tasks, 1.0)),
        ("soak-gauges.svg".into(), gauges),
        (
            "soak-load.svg".into(),
            svg::line_chart(&Labels { title: "The load", x: "minutes", y: "per second / held" }, &load_lines),
        ),
    ];
    let tally = |t: &Tally| {
        format!(
            "{} ok, {} failed, {} failed during the restart",
            t.ok.load(Ordering::Relaxed),
            t.failed.load(Ordering::Relaxed),
            t.failed_in_restart.load(Ordering::Relaxed)
        )
    };
    let text = format!(
        "{}  CONNECT dials: {}\n  forwards: {}\n  bulk transfers: {} ({:.2} GiB)\n  idle streams and forwards: {} opened, {} closed, {} lost ({} open when the gateway restarted)\n  \
         extra agents: {} starts, {} stops; their dials: {}\n",
        table.render(),
        tally(&load.dials),
        tally(&load.forwards),
        tally(&load.bulk),
        load.bulk_bytes.load(Ordering::Relaxed) as f64 / f64::from(1u32 << 30),
        load.idle_opened.ok.load(Ordering::Relaxed),
        load.idle_closed.load(Ordering::Relaxed),
        load.idle_lost.failed.load(Ordering::Relaxed),
        load.idle_lost.failed_in_restart.load(Ordering::Relaxed),
        load.churn_starts.load(Ordering::Relaxed),
        load.churn_stops.load(Ordering::Relaxed),
        tally(&load.churn_dials),
    );
    Outcome { report, table: text, charts }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slope_is_per_hour_and_skips_the_warm_up() {
        // x in minutes; y grows 2 per minute after a jump in the first fifth of the window.
        let points: Vec<(f64, f64)> =
            (0..=60).map(|m| (f64::from(m), if m < 10 { 1000.0 } else { 2.0 * f64::from(m) })).collect();
        let slope = slope_per_hour(&points, 0.0, 3600.0).unwrap_or(f64::NAN);
        assert!((slope - 120.0).abs() < 1e-9, "{slope}");
        assert_eq!(slope_per_hour(&points[..2], 0.0, 60.0), None);
    }

    #[test]
    fn at_rest_means_nothing_open_one_session_and_no_more_files() {
        let side = |fds: f64| Side {
            rss_kib: Some(1.0),
            fds: Some(fds),
            tasks: Some(9.0),
            streams: Some(0.0),
            forwards: Some(0.0),
            sessions: Some(1.0),
        };
        let base = Rest { gateway: side(15.0), agent: side(14.0) };
        assert!(settled(&base, &base));
        assert!(!settled(&base, &Rest { gateway: side(16.0), ..base }));
        let mut open = base;
        open.agent.forwards = Some(1.0);
        assert!(!settled(&base, &open));
        let mut unknown = base;
        unknown.gateway.streams = None;
        assert!(!settled(&base, &unknown));
    }
}
