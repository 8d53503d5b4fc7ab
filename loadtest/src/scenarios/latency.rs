//! `latency`: open-loop request/response at a fixed rate. Requests leave on a fixed schedule
//! whether or not earlier answers came back, and each latency is measured from the request's
//! *scheduled* send time, so a stall is charged to every request it delays (no coordinated
//! omission). Sender and receiver are dedicated OS threads with blocking sockets, so the
//! measuring side adds no async scheduling noise; direct and tunnel use the same code.

use std::io::{Read as _, Write as _};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::progress::Progress;
use crate::report::{Report, Series, Table, num};
use crate::scenarios::Outcome;
use crate::stats::{PERCENTILES, distribution, median, median_index};
use crate::svg::{self, Labels, Line};
use crate::target::{DataPath, DataTarget, Route, StdConn};

/// Options of `latency`.
#[derive(Debug, Clone, clap::Args)]
pub struct LatencyArgs {
    /// Requests per second, over all connections.
    #[arg(long, default_value_t = 1000.0)]
    pub rate: f64,
    /// Connections the rate is spread over.
    #[arg(long, default_value_t = 1)]
    pub connections: usize,
    /// Request and response size, bytes (at least 8).
    #[arg(long, default_value_t = 100)]
    pub size: usize,
    /// Seconds per measurement (after a 0.5 s warm-up that is not recorded).
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Repetitions (the median of each percentile is reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Where to send traffic.
    #[command(flatten)]
    pub target: DataTarget,
}

const WARMUP: Duration = Duration::from_millis(500);

struct LatencyRun {
    /// From the scheduled send time (what a caller waiting on this schedule sees).
    histogram: Histogram<u64>,
    /// From the actual send time (service time only; hides sender lateness).
    service: Histogram<u64>,
    p99_per_second: Vec<f64>,
}

/// Sleeping this close to a deadline risks waking late (timer slack, VM wake-up); spin instead.
const SPIN: Duration = Duration::from_micros(150);

/// Sends on schedule and notes when each request really left (nanoseconds after `start`). A
/// dedicated thread, so sleeping does not block a runtime worker.
#[allow(clippy::disallowed_methods)]
fn send_on_schedule(
    mut conn: StdConn,
    start: Instant,
    interval: Duration,
    sent_at: &[AtomicU64],
    size: usize,
) -> std::io::Result<()> {
    let mut request = vec![b'q'; size];
    for (i, slot) in sent_at.iter().enumerate() {
        let at = start + interval.mul_f64(i as f64);
        let now = Instant::now();
        if at > now + SPIN {
            std::thread::sleep(at - now - SPIN);
        }
        while Instant::now() < at {
            std::hint::spin_loop();
        }
        request[..8].copy_from_slice(&(i as u64).to_be_bytes());
        slot.store(start.elapsed().as_nanos() as u64, Ordering::Release);
        conn.write_all(&request)?;
    }
    Ok(())
}

type Received = (Histogram<u64>, Histogram<u64>, Vec<Histogram<u64>>);

fn receive(
    mut conn: StdConn,
    start: Instant,
    interval: Duration,
    sent_at: &[AtomicU64],
    size: usize,
) -> std::io::Result<Received> {
    let mut answer = vec![0u8; size];
    let mut histogram = crate::latency_histogram();
    let mut service = crate::latency_histogram();
    let mut per_second: Vec<Histogram<u64>> = Vec::new();
    for (i, slot) in sent_at.iter().enumerate() {
        let i = i as u64;
        conn.read_exact(&mut answer)?;
        let received = Instant::now();
        let mut id = [0u8; 8];
        id.copy_from_slice(&answer[..8]);
        if u64::from_be_bytes(id) != i {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "answers out of order"));
        }
        let scheduled = start + interval.mul_f64(i as f64);
        if scheduled < start + WARMUP {
            continue;
        }
        let micros = received.saturating_duration_since(scheduled).as_micros().max(1) as u64;
        let _ = histogram.record(micros);
        let sent = start + Duration::from_nanos(slot.load(Ordering::Acquire));
        let _ = service.record(received.saturating_duration_since(sent).as_micros().max(1) as u64);
        let second = (scheduled - start - WARMUP).as_secs() as usize;
        while per_second.len() <= second {
            per_second.push(crate::latency_histogram());
        }
        let _ = per_second[second].record(micros);
    }
    Ok((histogram, service, per_second))
}

async fn measure(route: &Route, args: &LatencyArgs, progress: &Progress, label: &str) -> anyhow::Result<LatencyRun> {
    let connections = args.connections.max(1);
    let size = args.size.max(8);
    let per_connection = (args.rate / connections as f64).max(1.0);
    let interval = Duration::from_secs_f64(1.0 / per_connection);
    let count = ((args.duration + WARMUP.as_secs_f64()) * per_connection).ceil() as u64;
    let mut conns = Vec::new();
    for _ in 0..connections {
        let conn = route.open().await?.into_std()?;
        conn.set_read_timeout(Some(Duration::from_secs(10)))?;
        conns.push(conn);
    }
    let phase = progress.phase(label, Duration::from_secs_f64(args.duration) + WARMUP, String::new);
    let start = Instant::now() + Duration::from_millis(20);
    let mut receivers = Vec::new();
    let mut senders = Vec::new();
    for conn in conns {
        let writer = conn.try_clone()?;
        let sent_at: Arc<Vec<AtomicU64>> = Arc::new((0..count).map(|_| AtomicU64::new(0)).collect());
        let sent = sent_at.clone();
        senders.push(tokio::task::spawn_blocking(move || send_on_schedule(writer, start, interval, &sent, size)));
        receivers.push(tokio::task::spawn_blocking(move || receive(conn, start, interval, &sent_at, size)));
    }
    let mut histogram = crate::latency_histogram();
    let mut service = crate::latency_histogram();
    let mut per_second: Vec<Histogram<u64>> = Vec::new();
    for receiver in receivers {
        let (h, s, seconds) = receiver.await??;
        histogram.add(&h).map_err(|e| anyhow::anyhow!("histogram: {e}"))?;
        service.add(&s).map_err(|e| anyhow::anyhow!("histogram: {e}"))?;
        for (i, s) in seconds.iter().enumerate() {
            while per_second.len() <= i {
                per_second.push(crate::latency_histogram());
            }
            per_second[i].add(s).map_err(|e| anyhow::anyhow!("histogram: {e}"))?;
        }
    }
    for sender in senders {
        sender.await??;
    }
    phase.done().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let p99_per_second = per_second.iter().map(|h| h.value_at_quantile(0.99) as f64).collect();
    Ok(LatencyRun { histogram, service, p99_per_second })
}

/// Runs the scenario.
pub async fn run(args: &LatencyArgs, progress: &Progress) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let path = DataPath::start(&args.target).await?;
    let routes = [("direct", path.direct(path.echo)), ("tunnel", path.tunnel(path.echo))];
    let mut runs: [Vec<LatencyRun>; 2] = [Vec::new(), Vec::new()];
    for rep in 0..args.repeat.max(1) {
        for (i, (via, route)) in routes.iter().enumerate() {
            let label = format!("{via} {:.0} req/s over {} conn #{}", args.rate, args.connections, rep + 1);
            runs[i].push(measure(route, args, progress, &label).await?);
        }
    }
    let mut report = Report::new(
        "latency",
        path.kind,
        serde_json::json!({
            "rate_per_s": args.rate, "connections": args.connections, "size": args.size,
            "duration_s": args.duration, "warmup_s": WARMUP.as_secs_f64(), "repeat": args.repeat,
            "frontend": path.frontends.first().map(|f| f.1.to_string()), "link_delay_ms": args.target.link_delay_ms,
        }),
    );
    path.shutdown().await;
    let mut table = Table::new(&[
        "percentile",
        "direct us",
        "tunnel us",
        "overhead us",
        "direct (from send)",
        "tunnel (from send)",
        "overhead",
    ]);
    for (name, q) in PERCENTILES {
        let values =
            |i: usize| runs[i].iter().map(|r| r.histogram.value_at_quantile(q / 100.0) as f64).collect::<Vec<_>>();
        let (direct, tunnel) = (median(&values(0)), median(&values(1)));
        report.latency(&format!("{name}_us"), direct, tunnel);
        let service =
            |i: usize| runs[i].iter().map(|r| r.service.value_at_quantile(q / 100.0) as f64).collect::<Vec<_>>();
        let (direct_service, tunnel_service) = (median(&service(0)), median(&service(1)));
        report.latency(&format!("service_{name}_us"), direct_service, tunnel_service);
        table.row(vec![
            name.into(),
            num(direct),
            num(tunnel),
            num(tunnel - direct),
            num(direct_service),
            num(tunnel_service),
            num(tunnel_service - direct_service),
        ]);
    }
    let mut lines = Vec::new();
    for (i, via) in ["direct", "tunnel"].iter().enumerate() {
        let p50s: Vec<f64> = runs[i].iter().map(|r| r.histogram.value_at_quantile(0.5) as f64).collect();
        let representative = &runs[i][median_index(&p50s)];
        let points = distribution(&representative.histogram);
        report.series.push(crate::report::Series {
            name: format!("{via} latency distribution"),
            x_unit: "percentile".into(),
            y_unit: "us".into(),
            points: points.clone(),
        });
        report.series.push(Series::per_second(format!("{via} p99 per second"), "us", &representative.p99_per_second));
        report.figures.insert(format!("{via}_requests"), representative.histogram.len() as f64);
        report.figures.insert(format!("{via}_max_us"), representative.histogram.max() as f64);
        lines.push(Line { name: (*via).into(), points: points.iter().map(|p| (p[0], p[1])).collect(), dashed: i == 0 });
    }
    report.machine.load_average_end = crate::report::load_average();
    report.elapsed_s = started.elapsed().as_secs_f64();
    let chart = svg::percentile_chart(
        &Labels {
            title: &format!(
                "Open-loop latency at {:.0} req/s over {} connection(s), {} B request/response",
                args.rate, args.connections, args.size
            ),
            x: "percentile",
            y: "latency from scheduled send (us, log scale)",
        },
        &lines,
    );
    Ok(Outcome { report, table: table.render(), charts: vec![("latency.svg".into(), chart)] })
}
