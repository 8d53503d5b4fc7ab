//! `streams`: many concurrent, mostly idle tunnelled connections. The real gateway and agent run
//! as separate processes; this process holds the client sockets and runs the echo server the
//! agent dials. Memory per stream on each side is the slope of resident memory over the number of
//! open streams, measured in steps.
//!
//! Every stream costs a socket in three processes (client + echo server here, the frontend
//! connection in the gateway, the target connection in the agent), and the hard open-file limit
//! here is about 20,000 per process, so the default stops at 8,000 streams.
//!
//! With `--cycles N` the streams are opened and closed N times: resident memory and open file
//! descriptors after each close, and the stream gauges on both sides, show whether anything
//! stays behind (a leak grows with every cycle; memory the allocator keeps for reuse does not).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::procs::{self, ChildProcess, Credentials, GatewayPorts, GatewaySizing};
use crate::progress::Progress;
use crate::report::{Report, Table};
use crate::scenarios::Outcome;
use crate::stats::slope;
use crate::svg::{self, Labels, Line};
use crate::target::{Conn, Frontend, Route};

/// Options of `streams`.
#[derive(Debug, Clone, clap::Args)]
pub struct StreamsArgs {
    /// Streams to hold open at the end.
    #[arg(long, default_value_t = 8000)]
    pub streams: usize,
    /// Memory readings on the way (evenly spaced).
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    /// Streams opened at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Seconds to let memory settle before each reading.
    #[arg(long, default_value_t = 1.0)]
    pub settle: f64,
    /// Times to open all streams and close them again (a leak check: what remains after each
    /// close must not grow from cycle to cycle).
    #[arg(long, default_value_t = 1)]
    pub cycles: usize,
    /// The tether-gateway binary (default: next to this executable).
    #[arg(long)]
    pub gateway_bin: Option<std::path::PathBuf>,
    /// The tether-agent binary (default: next to this executable).
    #[arg(long)]
    pub agent_bin: Option<std::path::PathBuf>,
}

async fn open_streams(route: &Route, count: usize, concurrency: usize) -> anyhow::Result<Vec<Conn>> {
    let mut opened = futures::stream::iter((0..count).map(|_| async {
        let mut conn = route.open().await?;
        // One round trip proves the stream is through and touches every buffer once.
        conn.write_all(b"ping1234").await?;
        let mut answer = [0u8; 8];
        conn.read_exact(&mut answer).await?;
        anyhow::Ok(conn)
    }))
    .buffer_unordered(concurrency.max(1));
    let mut conns = Vec::with_capacity(count);
    while let Some(conn) = opened.next().await {
        conns.push(conn?);
    }
    Ok(conns)
}

struct Sides {
    gateway: u32,
    agent: u32,
}

impl Sides {
    fn rss(&self) -> (f64, f64) {
        (procs::rss_kib(self.gateway).unwrap_or(0) as f64, procs::rss_kib(self.agent).unwrap_or(0) as f64)
    }

    fn fds(&self) -> (usize, usize) {
        (procs::open_fds(self.gateway).unwrap_or(0), procs::open_fds(self.agent).unwrap_or(0))
    }

    /// Open descriptors once closed streams have been torn down: connections close
    /// asynchronously, so this waits (up to `patience`) until both sides are back at `base`.
    async fn fds_after_close(&self, base: (usize, usize), patience: Duration) -> (usize, usize) {
        let deadline = Instant::now() + patience;
        loop {
            let now = self.fds();
            if (now.0 <= base.0 && now.1 <= base.1) || Instant::now() >= deadline {
                return now;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// What remained after one cycle's streams were closed.
struct AfterClose {
    gateway_rss_kib: f64,
    agent_rss_kib: f64,
    gateway_fds: usize,
    agent_fds: usize,
    gateway_open: Option<f64>,
    agent_open: Option<f64>,
}

/// Runs the scenario.
pub async fn run(args: &StreamsArgs, progress: &Progress) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let gateway_bin = procs::find_binary("tether-gateway", args.gateway_bin.as_deref())?;
    let agent_bin = procs::find_binary("tether-agent", args.agent_bin.as_deref())?;
    let echo_listener = TcpListener::bind("127.0.0.1:0").await?;
    let echo: SocketAddr = echo_listener.local_addr()?;
    let echo_server = crate::backends::spawn_echo(echo_listener);

    let creds = Credentials::create("tether-loadtest")?;
    let ports = GatewayPorts::pick()?;
    let gateway_config =
        procs::write_gateway_config(&creds, &ports, GatewaySizing { agents: 10, streams: args.streams + 1000 })?;
    let mut gateway = ChildProcess::spawn(&gateway_bin, &gateway_config, &creds.dir.path().join("gateway.log"))?;
    procs::wait_ready(&mut gateway, ports.admin, "/readyz", Duration::from_secs(20)).await?;
    let agent_admin = procs::free_loopback()?;
    let agent_config = procs::write_agent_config(&creds, &ports, agent_admin, echo)?;
    let mut agent = ChildProcess::spawn(&agent_bin, &agent_config, &creds.dir.path().join("agent.log"))?;
    procs::wait_ready(&mut agent, agent_admin, "/readyz", Duration::from_secs(20)).await?;
    let sides = Sides { gateway: gateway.pid, agent: agent.pid };
    let route = Route::Connect { frontend: Frontend::Tcp(ports.frontend), target: echo };

    // Warm-up: the first streams allocate per-thread buffers and grow tables; leave those out.
    let warm = open_streams(&route, 200.min(args.streams.max(1)), args.concurrency).await?;
    drop(warm);
    let settle = Duration::from_secs_f64(args.settle.max(0.1));
    tokio::time::sleep(settle * 2).await;

    let (g0, a0) = sides.rss();
    let fds_base = sides.fds();
    // The slope comes from the first fill; later cycles only check what stays behind.
    let mut points: Vec<(f64, f64, f64)> = vec![(0.0, g0, a0)];
    let mut open_at_gateway = None;
    let mut fds_full = None;
    let mut n = 0.0;
    let mut after_close: Vec<AfterClose> = Vec::new();
    let steps = args.steps.max(1);
    let cycles = args.cycles.max(1);
    for cycle in 1..=cycles {
        let mut held: Vec<Conn> = Vec::with_capacity(args.streams);
        for step in 1..=steps {
            let goal = args.streams * step / steps;
            let label = if cycles > 1 {
                format!("cycle {cycle}/{cycles}: opening streams to {goal}")
            } else {
                format!("opening streams to {goal}")
            };
            let phase = progress.phase(&label, Duration::from_secs(2), String::new);
            let more = open_streams(&route, goal - held.len(), args.concurrency).await;
            phase.done().await;
            held.extend(more?);
            if cycle == 1 {
                tokio::time::sleep(settle).await;
                let (g, a) = sides.rss();
                points.push((held.len() as f64, g, a));
            }
        }
        if cycle == 1 {
            open_at_gateway = procs::metric(ports.admin, "tether_gateway_streams_open").await;
            fds_full = Some((sides.fds(), procs::open_fds(std::process::id()).unwrap_or(0)));
            n = held.len() as f64;
        }
        drop(held);
        tokio::time::sleep(settle * 3).await;
        let (gateway_fds, agent_fds) = sides.fds_after_close(fds_base, settle * 10).await;
        let (g, a) = sides.rss();
        after_close.push(AfterClose {
            gateway_rss_kib: g,
            agent_rss_kib: a,
            gateway_fds,
            agent_fds,
            gateway_open: procs::metric(ports.admin, "tether_gateway_streams_open").await,
            agent_open: procs::metric(agent_admin, "tether_agent_streams_open").await,
        });
    }
    let last_close = after_close.last();
    let (g_closed, a_closed) = last_close.map_or((g0, a0), |c| (c.gateway_rss_kib, c.agent_rss_kib));
    let open_after_close = last_close.and_then(|c| c.gateway_open);
    let agent_open_after_close = last_close.and_then(|c| c.agent_open);

    let gateway_slope = slope(&points.iter().map(|p| (p.0, p.1)).collect::<Vec<_>>());
    let agent_slope = slope(&points.iter().map(|p| (p.0, p.2)).collect::<Vec<_>>());
    let last = points.last().copied().unwrap_or((0.0, g0, a0));
    let mut report = Report::new(
        "streams",
        "processes",
        serde_json::json!({
            "streams": args.streams, "steps": args.steps, "concurrency": args.concurrency,
            "settle_s": args.settle, "cycles": cycles,
        }),
    );
    report.tunnel.insert("gateway_kib_per_stream".into(), gateway_slope);
    report.tunnel.insert("agent_kib_per_stream".into(), agent_slope);
    report.figures.insert("streams_open".into(), n);
    report.figures.insert("gateway_rss_base_mib".into(), g0 / 1024.0);
    report.figures.insert("gateway_rss_full_mib".into(), last.1 / 1024.0);
    report.figures.insert("gateway_rss_after_close_mib".into(), g_closed / 1024.0);
    report.figures.insert("agent_rss_base_mib".into(), a0 / 1024.0);
    report.figures.insert("agent_rss_full_mib".into(), last.2 / 1024.0);
    report.figures.insert("agent_rss_after_close_mib".into(), a_closed / 1024.0);
    report.figures.insert("gateway_kib_per_stream_endpoints".into(), (last.1 - g0) / n.max(1.0));
    report.figures.insert("agent_kib_per_stream_endpoints".into(), (last.2 - a0) / n.max(1.0));
    if let Some(open) = open_at_gateway {
        report.figures.insert("gateway_streams_open_metric".into(), open);
    }
    if let Some(open) = open_after_close {
        report.figures.insert("gateway_streams_open_after_close".into(), open);
    }
    if let Some(open) = agent_open_after_close {
        report.figures.insert("agent_streams_open_after_close".into(), open);
    }
    if let Some(((g, a), own)) = fds_full {
        report.figures.insert("gateway_open_fds".into(), g as f64);
        report.figures.insert("agent_open_fds".into(), a as f64);
        report.figures.insert("loadtest_open_fds".into(), own as f64);
    }
    report.figures.insert("cycles".into(), after_close.len() as f64);
    report.figures.insert("gateway_open_fds_base".into(), fds_base.0 as f64);
    report.figures.insert("agent_open_fds_base".into(), fds_base.1 as f64);
    if let Some(close) = last_close {
        report.figures.insert("gateway_open_fds_after_close".into(), close.gateway_fds as f64);
        report.figures.insert("agent_open_fds_after_close".into(), close.agent_fds as f64);
    }
    let cycle_points = |rss: fn(&AfterClose) -> f64| -> Vec<(f64, f64)> {
        after_close.iter().enumerate().map(|(i, c)| ((i + 1) as f64, rss(c))).collect()
    };
    let growth = (after_close.len() >= 2)
        .then(|| (slope(&cycle_points(|c| c.gateway_rss_kib)), slope(&cycle_points(|c| c.agent_rss_kib))));
    if let Some((g, a)) = growth {
        report.figures.insert("gateway_rss_growth_kib_per_cycle".into(), g);
        report.figures.insert("agent_rss_growth_kib_per_cycle".into(), a);
        for (name, rss) in
            [("gateway", cycle_points(|c| c.gateway_rss_kib)), ("agent", cycle_points(|c| c.agent_rss_kib))]
        {
            report.series.push(crate::report::Series {
                name: format!("{name} RSS after close"),
                x_unit: "cycle".into(),
                y_unit: "KiB".into(),
                points: rss.iter().map(|p| [p.0, p.1]).collect(),
            });
        }
    }
    for (i, p) in points.iter().enumerate() {
        report.figures.insert(format!("step{i}_streams"), p.0);
    }
    report.series.push(crate::report::Series {
        name: "gateway RSS".into(),
        x_unit: "streams".into(),
        y_unit: "KiB".into(),
        points: points.iter().map(|p| [p.0, p.1]).collect(),
    });
    report.series.push(crate::report::Series {
        name: "agent RSS".into(),
        x_unit: "streams".into(),
        y_unit: "KiB".into(),
        points: points.iter().map(|p| [p.0, p.2]).collect(),
    });
    report.notes.push(
        "100,000 streams cannot be opened on a machine whose hard open-file limit is ~20,000 per process with one socket per stream per process; the per-stream cost is the slope measured up to --streams".into(),
    );
    let mut table = Table::new(&["side", "RSS base MiB", "RSS full MiB", "after close MiB", "KiB per stream (slope)"]);
    table.row(vec![
        "gateway".into(),
        format!("{:.1}", g0 / 1024.0),
        format!("{:.1}", last.1 / 1024.0),
        format!("{:.1}", g_closed / 1024.0),
        format!("{gateway_slope:.2}"),
    ]);
    table.row(vec![
        "agent".into(),
        format!("{:.1}", a0 / 1024.0),
        format!("{:.1}", last.2 / 1024.0),
        format!("{:.1}", a_closed / 1024.0),
        format!("{agent_slope:.2}"),
    ]);
    agent.kill().await;
    gateway.kill().await;
    echo_server.abort();
    report.machine.load_average_end = crate::report::load_average();
    report.elapsed_s = started.elapsed().as_secs_f64();
    let chart = svg::line_chart(
        &Labels { title: "Resident memory vs open idle streams (real binaries)", x: "streams open", y: "RSS (MiB)" },
        &[
            Line {
                name: "gateway".into(),
                points: points.iter().map(|p| (p.0, p.1 / 1024.0)).collect(),
                dashed: false,
            },
            Line { name: "agent".into(), points: points.iter().map(|p| (p.0, p.2 / 1024.0)).collect(), dashed: false },
        ],
    );
    let mut summary = format!("{}  {} streams held open\n", table.render(), n);
    if let (Some((g, a)), Some(close)) = (growth, last_close) {
        summary.push_str(&format!(
            "  {} cycles of open + close: RSS after close grows {g:.1} KiB per cycle (gateway), {a:.1} (agent); \
             open files after close {} / {} (before: {} / {}); streams still open {} / {}\n",
            after_close.len(),
            close.gateway_fds,
            close.agent_fds,
            fds_base.0,
            fds_base.1,
            close.gateway_open.map_or_else(|| "-".into(), |v| v.to_string()),
            close.agent_open.map_or_else(|| "-".into(), |v| v.to_string()),
        ));
    }
    Ok(Outcome { report, table: summary, charts: vec![("streams-memory.svg".into(), chart)] })
}
