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
    /// Where to send traffic.
    #[command(flatten)]
    pub target: DataTarget,
}

struct RpsRun {
    per_second: f64,
    samples: Vec<f64>,
    histogram: Histogram<u64>,
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
    let samples = sampler.finish().await;
    phase.done().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(RpsRun { per_second: histogram.len() as f64 / secs, samples, histogram })
}

/// Runs the scenario.
pub async fn run(args: &RpsArgs, progress: &Progress) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let path = DataPath::start(&args.target).await?;
    let routes = [("direct", path.direct(path.echo)), ("tunnel", path.tunnel(path.echo))];
    let mut runs: [Vec<RpsRun>; 2] = [Vec::new(), Vec::new()];
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
    let mut table = Table::new(&["path", "req/s", "p50 us", "p99 us", "runs"]);
    let mut lines = Vec::new();
    for (i, via) in ["direct", "tunnel"].iter().enumerate() {
        let representative = &runs[i][median_index(&rates[i])];
        for (name, value) in percentiles(&representative.histogram) {
            let key = format!("{name}_us");
            if i == 0 {
                report.baseline.insert(key, value);
            } else {
                report.tunnel.insert(key, value);
            }
        }
        for (r, v) in rates[i].iter().enumerate() {
            report.figures.insert(format!("{via}_run{}_requests_per_s", r + 1), *v);
        }
        report.series.push(Series::per_second(format!("{via} requests"), "req/s", &representative.samples));
        lines.push(Line {
            name: format!("{via} ({} connections)", args.connections),
            points: representative.samples.iter().enumerate().map(|(s, v)| ((s + 1) as f64, *v)).collect(),
            dashed: i == 0,
        });
        let p = percentiles(&representative.histogram);
        table.row(vec![
            (*via).into(),
            num(median(&rates[i])),
            num(p[0].1),
            num(p[2].1),
            rates[i].iter().map(|v| format!("{v:.0}")).collect::<Vec<_>>().join(" / "),
        ]);
    }
    table.row(vec![
        "tunnel/direct".into(),
        pct(report.ratios.get("requests_per_s").copied().unwrap_or(0.0)),
        String::new(),
        String::new(),
        String::new(),
    ]);
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
