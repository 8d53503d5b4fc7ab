//! `rps`: closed-loop request/response (wrk-style): C long-lived connections, each sending a
//! 100-byte request and waiting for the 100-byte answer, as fast as possible; direct vs tunnel.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::progress::Progress;
use crate::report::{Report, Series, Table, num, pct};
use crate::scenarios::Outcome;
use crate::stats::{self, Sampler, median, median_index, percentiles};
use crate::svg::{self, Labels, Line};
use crate::target::{DataPath, DataTarget, Route};

/// Options of `rps`.
#[derive(Debug, Clone, clap::Args)]
pub struct RpsArgs {
    /// Concurrent connections.
    #[arg(long, default_value_t = 50)]
    pub connections: usize,
    /// Request and response size, bytes.
    #[arg(long, default_value_t = 100)]
    pub size: usize,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Also measure a chain of two plain TCP relays (the tunnel's three TCP connections without
    /// TLS, WebSocket or multiplexer): how much of the gap to direct TCP the hops alone explain.
    #[arg(long)]
    pub relay_baseline: bool,
    /// Where to send traffic.
    #[command(flatten)]
    pub target: DataTarget,
}

struct RpsRun {
    per_second: f64,
    samples: Vec<f64>,
    histogram: Histogram<u64>,
    /// CPU this process used per request, microseconds (see [`stats::process_cpu_seconds`]).
    cpu_us_per_request: Option<f64>,
}

async fn measure(route: &Route, args: &RpsArgs, progress: &Progress, label: &str) -> anyhow::Result<RpsRun> {
    let mut conns = Vec::with_capacity(args.connections);
    for _ in 0..args.connections.max(1) {
        conns.push(route.open().await?);
    }
    let counter = stats::counter();
    let live = counter.clone();
    let t0 = Instant::now();
    let duration = Duration::from_secs_f64(args.duration.max(0.2));
    let phase = progress.phase(label, duration, move || {
        format!("{:.0} req/s", live.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64().max(1e-3))
    });
    let sampler = Sampler::start(counter.clone(), Duration::from_secs(1));
    let cpu = stats::CpuMeter::start();
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + duration;
    let size = args.size.max(1);
    let mut tasks = Vec::new();
    for mut conn in conns {
        let counter = counter.clone();
        tasks.push(tokio::spawn(async move {
            let request = vec![b'r'; size];
            let mut answer = vec![0u8; size];
            let mut histogram = crate::latency_histogram();
            let work = async {
                loop {
                    let sent = Instant::now();
                    conn.write_all(&request).await?;
                    conn.read_exact(&mut answer).await?;
                    let _ = histogram.record(sent.elapsed().as_micros().max(1) as u64);
                    counter.fetch_add(1, Ordering::Relaxed);
                }
                #[allow(unreachable_code)]
                std::io::Result::Ok(())
            };
            match tokio::time::timeout_at(deadline, work).await {
                Ok(Err(e)) => Err(anyhow::anyhow!("request failed: {e}")),
                Ok(Ok(())) | Err(_) => Ok(histogram),
            }
        }));
    }
    let mut histogram = crate::latency_histogram();
    for task in tasks {
        histogram.add(&task.await??).map_err(|e| anyhow::anyhow!("histogram: {e}"))?;
    }
    let secs = started.elapsed().as_secs_f64();
    let requests = histogram.len();
    let cpu_us_per_request = cpu.seconds().filter(|_| requests > 0).map(|s| s * 1e6 / requests as f64);
    let samples = sampler.finish().await;
    phase.done().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(RpsRun { per_second: requests as f64 / secs, samples, histogram, cpu_us_per_request })
}

/// Runs the scenario.
pub async fn run(args: &RpsArgs, progress: &Progress) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let mut path = DataPath::start(&args.target).await?;
    let mut routes = vec![("direct", path.direct(path.echo)), ("tunnel", path.tunnel(path.echo))];
    if args.relay_baseline {
        routes.push(("relay", path.relay_route(path.echo, 2).await?));
    }
    let mut runs: Vec<Vec<RpsRun>> = routes.iter().map(|_| Vec::new()).collect();
    for rep in 0..args.repeat.max(1) {
        for (i, (via, route)) in routes.iter().enumerate() {
            let label = format!("{via} {} conns #{}", args.connections, rep + 1);
            runs[i].push(measure(route, args, progress, &label).await?);
        }
    }
    let mut report = Report::new(
        "rps",
        path.kind,
        serde_json::json!({
            "connections": args.connections, "size": args.size, "duration_s": args.duration,
            "repeat": args.repeat, "frontend": path.frontends.first().map(|f| f.1.to_string()), "link_delay_ms": args.target.link_delay_ms,
        }),
    );
    path.shutdown().await;
    let rates: Vec<Vec<f64>> = runs.iter().map(|r| r.iter().map(|x| x.per_second).collect()).collect();
    report.compared("requests_per_s", median(&rates[0]), median(&rates[1]));
    let mut table = Table::new(&["path", "req/s", "p50 us", "p99 us", "runs", "CPU us/req"]);
    let mut lines = Vec::new();
    for (i, (via, _)) in routes.iter().enumerate() {
        let representative = &runs[i][median_index(&rates[i])];
        for (name, value) in percentiles(&representative.histogram) {
            let key = format!("{name}_us");
            match i {
                0 => report.baseline.insert(key, value),
                1 => report.tunnel.insert(key, value),
                _ => report.figures.insert(format!("{via}_{key}"), value),
            };
        }
        let cpu = stats::median_of(runs[i].iter().filter_map(|r| r.cpu_us_per_request));
        if let Some(cpu) = cpu {
            report.figures.insert(format!("{via}_cpu_us_per_request"), cpu);
        }
        for (r, v) in rates[i].iter().enumerate() {
            report.figures.insert(format!("{via}_run{}_requests_per_s", r + 1), *v);
        }
        report.series.push(Series::per_second(format!("{via} requests"), "req/s", &representative.samples));
        lines.push(Line {
            name: format!("{via} ({} connections)", args.connections),
            points: representative.samples.iter().enumerate().map(|(s, v)| ((s + 1) as f64, *v)).collect(),
            dashed: i != 1,
        });
        let p = percentiles(&representative.histogram);
        table.row(vec![
            (*via).into(),
            num(median(&rates[i])),
            num(p[0].1),
            num(p[2].1),
            rates[i].iter().map(|v| format!("{v:.0}")).collect::<Vec<_>>().join(" / "),
            cpu.map_or_else(|| "-".into(), |v| format!("{v:.1}")),
        ]);
    }
    table.row(vec!["tunnel/direct".into(), pct(report.ratios.get("requests_per_s").copied().unwrap_or(0.0))]);
    if let Some(relay) = rates.get(2) {
        let ratio = crate::stats::ratio;
        report.figures.insert("relay_requests_per_s".into(), median(relay));
        report.figures.insert("relay_over_direct".into(), ratio(median(relay), median(&rates[0])));
        report.figures.insert("tunnel_over_relay".into(), ratio(median(&rates[1]), median(relay)));
        table.row(vec!["relay/direct".into(), pct(ratio(median(relay), median(&rates[0])))]);
        table.row(vec!["tunnel/relay".into(), pct(ratio(median(&rates[1]), median(relay)))]);
    }
    report.machine.load_average_end = crate::report::load_average();
    report.elapsed_s = started.elapsed().as_secs_f64();
    let chart = svg::line_chart(
        &Labels {
            title: &format!("Closed-loop requests, {} connections, {} B each way", args.connections, args.size),
            x: "time (s)",
            y: "requests/s",
        },
        &lines,
    );
    Ok(Outcome { report, table: table.render(), charts: vec![("rps.svg".into(), chart)] })
}
