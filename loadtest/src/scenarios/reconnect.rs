//! `reconnect`: N simulated agents (reconnecting like the real agent: exponential backoff with
//! full jitter, serving dials) on a gateway process; the gateway is killed (SIGKILL, a crash) and
//! started again on the same ports. Reports how long until every agent is back and a dial through
//! the frontend succeeds again.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::procs::{self, ChildProcess, GatewaySizing};
use crate::progress::Progress;
use crate::report::{Report, Table, num};
use crate::scenarios::Outcome;
use crate::scenarios::agents::{GatewayUnderTest, mint_tokens};
use crate::sim_agent::{self, AgentEvent, GatewayArgs, ReconnectingAgent};
use crate::stats::percentiles;
use crate::svg::{self, Labels, Line};
use crate::target::{Frontend, Route};

/// Options of `reconnect`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReconnectArgs {
    /// Simulated agents.
    #[arg(long, default_value_t = 1000)]
    pub agents: usize,
    /// Source addresses to spread connections over.
    #[arg(long, default_value_t = 8)]
    pub source_ips: usize,
    /// First reconnect delay ceiling, seconds (the real agent's default is 1).
    #[arg(long, default_value_t = 1.0)]
    pub reconnect_initial: f64,
    /// Largest reconnect delay ceiling, seconds (the real agent's default is 60).
    #[arg(long, default_value_t = 60.0)]
    pub reconnect_max: f64,
    /// Give up waiting for the agents after this many seconds.
    #[arg(long, default_value_t = 120.0)]
    pub timeout: f64,
    /// The tether-gateway binary (default: next to this executable).
    #[arg(long)]
    pub gateway_bin: Option<std::path::PathBuf>,
}

async fn dial_once(route: &Route) -> anyhow::Result<()> {
    let mut conn = tokio::time::timeout(Duration::from_secs(5), route.open()).await??;
    conn.write_all(b"are you there?!!").await?;
    let mut answer = [0u8; 16];
    tokio::time::timeout(Duration::from_secs(5), conn.read_exact(&mut answer)).await??;
    Ok(())
}

async fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + timeout;
    loop {
        if done() {
            return Ok(Instant::now());
        }
        anyhow::ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Runs the scenario.
pub async fn run(args: &ReconnectArgs, progress: &Progress) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let gateway_args = GatewayArgs {
        gateway_url: None,
        ca_file: None,
        server_name: None,
        token_file: None,
        signing_key: None,
        signing_alg: "ES256".into(),
        kid: None,
        issuer: None,
        audience: crate::local::AUDIENCE.into(),
        gateway_pid: None,
        gateway_bin: args.gateway_bin.clone(),
    };
    let mut gateway =
        GatewayUnderTest::start(&gateway_args, GatewaySizing { agents: args.agents, streams: 1024 }).await?;
    let (Some(admin), Some(frontend), Some(binary), Some(config)) =
        (gateway.admin, gateway.frontend, gateway.binary.clone(), gateway.config.clone())
    else {
        anyhow::bail!("reconnect needs a gateway process started here");
    };
    let log = gateway.creds.as_ref().map(|c| c.dir.path().join("gateway.log")).context("no scratch directory")?;
    let echo_listener = TcpListener::bind("127.0.0.1:0").await?;
    let echo = echo_listener.local_addr()?;
    let echo_server = crate::backends::spawn_echo(echo_listener);
    let route = Route::Connect { frontend: Frontend::Tcp(frontend), target: echo };

    progress.note(&format!("minting {} tokens", args.agents));
    let tokens = mint_tokens(&gateway.tokens, args.agents)?;
    let sources = sim_agent::source_addresses(args.source_ips);
    let live = Arc::new(AtomicUsize::new(0));
    let stop = CancellationToken::new();
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let backoff = (Duration::from_secs_f64(args.reconnect_initial), Duration::from_secs_f64(args.reconnect_max));
    let mut tasks = Vec::new();
    for (index, token) in tokens.into_iter().enumerate() {
        let agent =
            ReconnectingAgent { index, source: Some(sources[index % sources.len()]), token, backoff, allowed: echo };
        tasks.push(tokio::spawn(agent.run(gateway.target.clone(), live.clone(), events_tx.clone(), stop.clone())));
    }
    let n = args.agents;
    let timeout = Duration::from_secs_f64(args.timeout);
    let counter = live.clone();
    let phase = progress.phase(&format!("connecting {n} agents"), Duration::from_secs(3), move || {
        format!("{}/{n}", counter.load(Ordering::Relaxed))
    });
    wait_for("the first connections", timeout, || live.load(Ordering::Relaxed) >= n).await?;
    phase.done().await;
    dial_once(&route).await.context("dial before the restart")?;
    while events.try_recv().is_ok() {}

    // Connected agents over time, from the kill on.
    let killed_at = Instant::now();
    let timeline = {
        let live = live.clone();
        tokio::spawn(async move {
            let mut points = Vec::new();
            let t0 = Instant::now();
            loop {
                points.push((t0.elapsed().as_secs_f64(), live.load(Ordering::Relaxed) as f64));
                if points.len() > 20 && live.load(Ordering::Relaxed) >= n && t0.elapsed() > Duration::from_millis(500) {
                    return points;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let phase = progress.phase("killing and restarting the gateway", Duration::from_secs(3), {
        let live = live.clone();
        move || format!("{}/{n} agents back", live.load(Ordering::Relaxed))
    });
    if let Some(process) = gateway.process.as_mut() {
        process.kill().await;
    }
    let all_down = wait_for("agents to notice", timeout, || live.load(Ordering::Relaxed) == 0).await?;
    let spawned_at = Instant::now();
    let mut process = ChildProcess::spawn(&binary, &config, &log)?;
    procs::wait_ready(&mut process, admin, "/readyz", timeout).await?;
    let ready_at = Instant::now();
    let dial_route = route.clone();
    let dialer = tokio::spawn(async move {
        loop {
            if dial_once(&dial_route).await.is_ok() {
                return Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    let all_back = wait_for("agents to come back", timeout, || live.load(Ordering::Relaxed) >= n).await?;
    let dial_ok = tokio::time::timeout(timeout, dialer).await.context("no dial succeeded after the restart")??;
    phase.done().await;
    let points = timeline.await.unwrap_or_default();
    gateway.process = Some(process);

    let mut per_agent = crate::latency_histogram();
    while let Ok(event) = events.try_recv() {
        if let AgentEvent::Connected(_, at) = event {
            let _ = per_agent.record(at.saturating_duration_since(killed_at).as_micros().max(1) as u64);
        }
    }
    let ms = |a: Instant, b: Instant| a.saturating_duration_since(b).as_secs_f64() * 1000.0;
    let mut report = Report::new(
        "reconnect",
        "processes",
        serde_json::json!({
            "agents": args.agents, "source_ips": args.source_ips,
            "reconnect_initial_s": args.reconnect_initial, "reconnect_max_s": args.reconnect_max,
            "kill": "SIGKILL", "restart": "immediately after every agent noticed",
        }),
    );
    let figures = [
        ("kill_to_all_agents_noticed_ms", ms(all_down, killed_at)),
        ("restart_to_gateway_ready_ms", ms(ready_at, spawned_at)),
        ("restart_to_all_agents_back_ms", ms(all_back, spawned_at)),
        ("restart_to_first_dial_ok_ms", ms(dial_ok, spawned_at)),
        ("kill_to_all_agents_back_ms", ms(all_back, killed_at)),
        ("kill_to_first_dial_ok_ms", ms(dial_ok, killed_at)),
    ];
    let mut table = Table::new(&["figure", "ms"]);
    for (key, value) in figures {
        report.tunnel.insert(key.into(), value);
        table.row(vec![key.replace('_', " ").trim_end_matches(" ms").to_owned(), num(value)]);
    }
    for (name, v) in percentiles(&per_agent) {
        report.tunnel.insert(format!("agent_back_after_kill_{name}_ms"), v / 1000.0);
    }
    report.figures.insert("agents".into(), n as f64);
    report.series.push(crate::report::Series {
        name: "agents connected after the kill".into(),
        x_unit: "s".into(),
        y_unit: "agents".into(),
        points: points.iter().map(|p| [p.0, p.1]).collect(),
    });
    stop.cancel();
    for task in tasks {
        let _ = task.await;
    }
    if let Some(mut process) = gateway.process.take() {
        process.kill().await;
    }
    echo_server.abort();
    report.machine.load_average_end = crate::report::load_average();
    report.elapsed_s = started.elapsed().as_secs_f64();
    let chart = svg::line_chart(
        &Labels {
            title: &format!("{n} agents after the gateway is killed (t=0) and restarted"),
            x: "time since kill (s)",
            y: "agents with a session",
        },
        &[Line { name: "connected agents".into(), points, dashed: false }],
    );
    Ok(Outcome { report, table: table.render(), charts: vec![("reconnect.svg".into(), chart)] })
}
