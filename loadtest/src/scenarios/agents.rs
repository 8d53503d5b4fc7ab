//! `agents`: N simulated agents, each with its own WSS connection and token, held idle against a
//! gateway in a separate process (the real binary, started here, or an external one). Reports the
//! gateway's resident memory per agent and the connect-time distribution.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt as _;

use crate::procs::{self, ChildProcess, Credentials, GatewayPorts, GatewaySizing};
use crate::progress::Progress;
use crate::report::{Report, Table, num};
use crate::scenarios::Outcome;
use crate::sim_agent::{self, GatewayArgs, GatewayTarget, SimAgent, TokenSource};
use crate::stats::{distribution, percentiles};
use crate::svg::{self, Labels, Line};

/// Options of `agents`.
#[derive(Debug, Clone, clap::Args)]
pub struct AgentsArgs {
    /// Simulated agents.
    #[arg(long, default_value_t = 1000)]
    pub agents: usize,
    /// Connection attempts in flight at once.
    #[arg(long, default_value_t = 200)]
    pub concurrency: usize,
    /// Source addresses to spread connections over (127.0.1.1 ...).
    #[arg(long, default_value_t = 8)]
    pub source_ips: usize,
    /// Seconds to hold the agents idle before the final memory reading.
    #[arg(long, default_value_t = 5.0)]
    pub hold: f64,
    /// The gateway.
    #[command(flatten)]
    pub gateway: GatewayArgs,
}

/// A gateway to measure: one we started, or an external one.
pub(crate) struct GatewayUnderTest {
    pub target: Arc<GatewayTarget>,
    pub tokens: TokenSource,
    pub pid: Option<u32>,
    pub admin: Option<std::net::SocketAddr>,
    pub frontend: Option<std::net::SocketAddr>,
    pub process: Option<ChildProcess>,
    pub config: Option<std::path::PathBuf>,
    pub binary: Option<std::path::PathBuf>,
    pub creds: Option<Credentials>,
    pub kind: &'static str,
}

impl GatewayUnderTest {
    pub(crate) async fn start(args: &GatewayArgs, sizing: GatewaySizing) -> anyhow::Result<Self> {
        if let Some(target) = GatewayTarget::external(args)? {
            let tokens = TokenSource::external(args)?
                .context("an external gateway needs --signing-key (one token per agent) or --token-file")?;
            return Ok(Self {
                target: Arc::new(target),
                tokens,
                pid: args.gateway_pid,
                admin: None,
                frontend: None,
                process: None,
                config: None,
                binary: None,
                creds: None,
                kind: "external",
            });
        }
        let binary = procs::find_binary("tether-gateway", args.gateway_bin.as_deref())?;
        let creds = Credentials::create("tether-loadtest")?;
        let ports = GatewayPorts::pick()?;
        let config = procs::write_gateway_config(&creds, &ports, sizing)?;
        let mut process = ChildProcess::spawn(&binary, &config, &creds.dir.path().join("gateway.log"))?;
        procs::wait_ready(&mut process, ports.admin, "/readyz", Duration::from_secs(20)).await?;
        let target = GatewayTarget::new(ports.agents, procs::TENANT_HOST, creds.ca.ca_cert.clone())?;
        // Tokens are signed with the key of the issuer the generated gateway trusts.
        let tokens = TokenSource::Key {
            key: jsonwebtoken::EncodingKey::from_ec_pem(creds.issuer.private_pem.as_bytes())?,
            algorithm: creds.issuer.algorithm,
            kid: Some(creds.issuer.kid.clone()),
            issuer: creds.issuer.issuer.clone(),
            audience: crate::local::AUDIENCE.into(),
        };
        Ok(Self {
            target: Arc::new(target),
            tokens,
            pid: Some(process.pid),
            admin: Some(ports.admin),
            frontend: Some(ports.frontend),
            process: Some(process),
            config: Some(config),
            binary: Some(binary),
            creds: Some(creds),
            kind: "processes",
        })
    }

    pub(crate) fn rss_kib(&self) -> Option<u64> {
        self.pid.and_then(procs::rss_kib)
    }
}

/// Mints one token per agent (sim-0, sim-1, ...).
pub(crate) fn mint_tokens(tokens: &TokenSource, count: usize) -> anyhow::Result<Vec<String>> {
    (0..count).map(|i| tokens.token_for(&format!("sim-{i}"))).collect()
}

/// Runs the scenario.
pub async fn run(args: &AgentsArgs, progress: &Progress) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let gateway = GatewayUnderTest::start(&args.gateway, GatewaySizing { agents: args.agents, streams: 1024 }).await?;
    progress.note(&format!("minting {} tokens", args.agents));
    let tokens = mint_tokens(&gateway.tokens, args.agents)?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let gateway_before = gateway.rss_kib();
    let own_before = procs::own_rss_kib();
    let sources = sim_agent::source_addresses(args.source_ips);

    let connected = Arc::new(AtomicUsize::new(0));
    let live = connected.clone();
    let total = args.agents;
    let phase = progress.phase(
        &format!("connecting {total} agents"),
        Duration::from_secs((total / 500).max(1) as u64),
        move || format!("{}/{total}", live.load(Ordering::Relaxed)),
    );
    // Memory while connecting: (agents connected, gateway RSS MiB).
    let memory_points = Arc::new(std::sync::Mutex::new(Vec::<(f64, f64)>::new()));
    let sampler = {
        let connected = connected.clone();
        let points = memory_points.clone();
        let pid = gateway.pid;
        tokio::spawn(async move {
            loop {
                if let Some(rss) = pid.and_then(procs::rss_kib)
                    && let Ok(mut points) = points.lock()
                {
                    points.push((connected.load(Ordering::Relaxed) as f64, rss as f64 / 1024.0));
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    let connect_started = Instant::now();
    let target = gateway.target.clone();
    let mut attempts = futures::stream::iter(tokens.into_iter().enumerate().map(|(i, token)| {
        let target = target.clone();
        let source = sources[i % sources.len()];
        let connected = connected.clone();
        async move {
            let t0 = Instant::now();
            let result = sim_agent::connect(&target, Some(source), &token, &format!("sim-{i}")).await;
            if result.is_ok() {
                connected.fetch_add(1, Ordering::Relaxed);
            }
            (result, t0.elapsed())
        }
    }))
    .buffer_unordered(args.concurrency.max(1));
    let mut agents: Vec<SimAgent> = Vec::with_capacity(args.agents);
    let mut histogram = crate::latency_histogram();
    let mut errors: Vec<String> = Vec::new();
    while let Some((result, took)) = attempts.next().await {
        match result {
            Ok(agent) => {
                let _ = histogram.record(took.as_micros().max(1) as u64);
                agents.push(agent);
            }
            Err(e) => errors.push(format!("{e:#}")),
        }
    }
    let connect_secs = connect_started.elapsed().as_secs_f64();
    phase.done().await;
    anyhow::ensure!(!agents.is_empty(), "no agent connected: {:?}", errors.first());

    let hold = progress.phase("holding idle", Duration::from_secs_f64(args.hold), String::new);
    tokio::time::sleep(Duration::from_secs_f64(args.hold.max(0.5))).await;
    hold.done().await;
    sampler.abort();
    let gateway_after = gateway.rss_kib();
    let own_after = procs::own_rss_kib();
    let registered = match gateway.admin {
        Some(admin) => procs::metric(admin, "tether_gateway_agent_sessions").await,
        None => None,
    };
    let alive = agents.iter().filter(|a| !a.session.is_closed()).count();
    let gateway_fds = gateway.pid.and_then(procs::open_fds);

    let n = agents.len() as f64;
    let mut report = Report::new(
        "agents",
        gateway.kind,
        serde_json::json!({
            "agents": args.agents, "concurrency": args.concurrency, "source_ips": args.source_ips,
            "hold_s": args.hold, "ws_read_buffer_size": gateway.target.ws.read_buffer_size,
        }),
    );
    for (name, v) in percentiles(&histogram) {
        report.tunnel.insert(format!("connect_{name}_ms"), v / 1000.0);
    }
    report.tunnel.insert("connect_max_ms".into(), histogram.max() as f64 / 1000.0);
    report.tunnel.insert("connects_per_s".into(), n / connect_secs.max(1e-6));
    report.figures.insert("agents_connected".into(), n);
    report.figures.insert("agents_alive_after_hold".into(), alive as f64);
    report.figures.insert("connect_errors".into(), errors.len() as f64);
    report.figures.insert("connect_wall_s".into(), connect_secs);
    if let Some(r) = registered {
        report.figures.insert("gateway_registered_sessions".into(), r);
    }
    if let Some(fds) = gateway_fds {
        report.figures.insert("gateway_open_fds".into(), fds as f64);
    }
    let mut table = Table::new(&["figure", "value"]);
    table.row(vec!["agents connected / asked".into(), format!("{} / {}", agents.len(), args.agents)]);
    table.row(vec!["connect errors".into(), errors.len().to_string()]);
    if let (Some(before), Some(after)) = (gateway_before, gateway_after) {
        let per_agent = (after as f64 - before as f64) / n;
        report.figures.insert("gateway_rss_before_mib".into(), before as f64 / 1024.0);
        report.figures.insert("gateway_rss_after_mib".into(), after as f64 / 1024.0);
        report.figures.insert("gateway_rss_per_agent_kib".into(), per_agent);
        table.row(vec![
            "gateway RSS before -> after".into(),
            format!("{:.1} -> {:.1} MiB", before as f64 / 1024.0, after as f64 / 1024.0),
        ]);
        table.row(vec!["gateway RSS per idle agent".into(), format!("{per_agent:.1} KiB")]);
    }
    let own_per_agent = (own_after as f64 - own_before as f64) / n;
    report.figures.insert("loadtest_rss_per_simulated_agent_kib".into(), own_per_agent);
    table.row(vec!["load generator RSS per simulated agent".into(), format!("{own_per_agent:.1} KiB")]);
    let p = percentiles(&histogram);
    table.row(vec!["connect p50 / p99".into(), format!("{} / {} ms", num(p[0].1 / 1000.0), num(p[2].1 / 1000.0))]);
    table.row(vec!["connects per second".into(), num(n / connect_secs.max(1e-6))]);
    if let Some(r) = registered {
        table.row(vec!["sessions registered at the gateway".into(), format!("{r:.0}")]);
    }
    if let Some(first) = errors.first() {
        report.notes.push(format!("first connect error: {first}"));
    }
    let points: Vec<(f64, f64)> = memory_points.lock().map(|p| p.clone()).unwrap_or_default();
    report.series.push(crate::report::Series {
        name: "gateway RSS while connecting".into(),
        x_unit: "agents".into(),
        y_unit: "MiB".into(),
        points: points.iter().map(|p| [p.0, p.1]).collect(),
    });
    let dist = distribution(&histogram);
    report.series.push(crate::report::Series {
        name: "connect time distribution".into(),
        x_unit: "percentile".into(),
        y_unit: "us".into(),
        points: dist.clone(),
    });
    drop(agents);
    if let Some(mut process) = gateway.process {
        process.kill().await;
    }
    report.machine.load_average_end = crate::report::load_average();
    report.elapsed_s = started.elapsed().as_secs_f64();
    let memory_chart = svg::line_chart(
        &Labels {
            title: "Gateway resident memory vs connected idle agents",
            x: "agents connected",
            y: "gateway RSS (MiB)",
        },
        &[Line { name: "gateway VmRSS".into(), points, dashed: false }],
    );
    let connect_chart = svg::percentile_chart(
        &Labels {
            title: &format!("Agent connect time (TCP + TLS + upgrade + Hello/Welcome), {} in flight", args.concurrency),
            x: "percentile",
            y: "connect time (us, log scale)",
        },
        &[Line { name: "connect".into(), points: dist.iter().map(|p| (p[0], p[1])).collect(), dashed: false }],
    );
    Ok(Outcome {
        report,
        table: table.render(),
        charts: vec![("agents-memory.svg".into(), memory_chart), ("agents-connect.svg".into(), connect_chart)],
    })
}
