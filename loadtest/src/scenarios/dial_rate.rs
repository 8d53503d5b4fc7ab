//! `dial-rate`: new connections one after another: through the tunnel each is a CONNECT, a
//! 16-byte request, the answer and a close; the baseline is the same exchange over a new direct
//! TCP connection to the same echo server.

use std::time::{Duration, Instant};

use crate::progress::Progress;
use crate::report::{Report, Series, Table, num, pct};
use crate::scenarios::Outcome;
use crate::scenarios::measure::{self, DialResult};
use crate::stats::{distribution, median, median_index, percentiles, ratio};
use crate::svg::{self, Labels, Line};
use crate::target::{DataPath, DataTarget, Route};

/// Label of the plain relay baseline.
const RELAY: &str = "relay (1 hop, no tunnel)";
/// Label of the CONNECT relay baseline.
const CONNECT_RELAY: &str = "CONNECT relay (no tunnel)";

/// Options of `dial-rate`.
#[derive(Debug, Clone, clap::Args)]
pub struct DialRateArgs {
    /// Dials in flight at once (1 = strictly sequential).
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Also measure dials through one plain TCP relay (the two TCP connections a tunnelled dial
    /// sets up, client -> frontend and agent -> server, without the tunnel session in between)
    /// and through a bare CONNECT relay (the same plus Tether's CONNECT exchange): floors for
    /// what the new connections, and a Konnectivity-compatible frontend, cost on the same machine.
    #[arg(long)]
    pub relay_baseline: bool,
    /// Where to send traffic.
    #[command(flatten)]
    pub target: DataTarget,
}

/// Runs the scenario.
pub async fn run(args: &DialRateArgs, progress: &Progress) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let mut path = DataPath::start(&args.target).await?;
    let mut routes = vec![("direct".to_owned(), path.direct(path.echo))];
    for (label, frontend) in &path.frontends {
        routes.push((label.clone(), Route::Connect { frontend: frontend.clone(), target: path.echo }));
    }
    if args.relay_baseline {
        routes.push((RELAY.to_owned(), path.relay_route(path.echo, 1).await?));
        routes.push((CONNECT_RELAY.to_owned(), path.connect_relay_route(path.echo).await?));
    }
    let duration = Duration::from_secs_f64(args.duration.max(0.2));
    let mut runs: Vec<Vec<DialResult>> = routes.iter().map(|_| Vec::new()).collect();
    for rep in 0..args.repeat.max(1) {
        for (i, (via, route)) in routes.iter().enumerate() {
            let label = format!("{via} dials #{}", rep + 1);
            runs[i].push(measure::dials(route, duration, args.concurrency, progress, &label).await?);
        }
    }
    let mut report = Report::new(
        "dial-rate",
        path.kind,
        serde_json::json!({
            "concurrency": args.concurrency, "duration_s": args.duration, "repeat": args.repeat,
            "request_bytes": 16, "frontends": path.frontends.iter().map(|f| f.1.to_string()).collect::<Vec<_>>(),
            "link_delay_ms": args.target.link_delay_ms,
        }),
    );
    path.shutdown().await;
    let rates: Vec<Vec<f64>> = runs.iter().map(|r| r.iter().map(|x| x.per_second).collect()).collect();
    let direct_rate = median(&rates[0]);
    let tunnel_rate = rates.get(1).map_or(0.0, |r| median(r));
    let mut table =
        Table::new(&["path", "dials/s", "vs direct", "p50 us", "p90 us", "p99 us", "errors", "CPU us/dial"]);
    let mut lines = Vec::new();
    for (i, (via, _)) in routes.iter().enumerate() {
        let representative = &runs[i][median_index(&rates[i])];
        let p = percentiles(&representative.histogram);
        let key_prefix = if i == 0 {
            String::new()
        } else {
            via.replace("tunnel", "").replace(['(', ')'], "").trim().replace(' ', "_")
        };
        let rate = median(&rates[i]);
        let errors: u64 = runs[i].iter().map(|r| r.errors).sum();
        let cpu = crate::stats::median_of(runs[i].iter().filter_map(|r| r.cpu_us_per_dial));
        let name = via
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
            .collect::<Vec<_>>()
            .join("_")
            .to_lowercase();
        if let Some(cpu) = cpu {
            report.figures.insert(format!("{name}_cpu_us_per_dial"), cpu);
        }
        if let Some(key) = match via.as_str() {
            RELAY => Some("relay"),
            CONNECT_RELAY => Some("connect_relay"),
            _ => None,
        } {
            report.figures.insert(format!("{key}_dials_per_s"), rate);
            report.figures.insert(format!("{key}_over_direct"), ratio(rate, direct_rate));
            report.figures.insert(format!("tunnel_over_{key}"), ratio(tunnel_rate, rate));
            report.figures.insert(format!("{key}_p50_us"), p[0].1);
        } else if i == 0 {
            report.baseline.insert("dials_per_s".into(), rate);
            for (name, v) in &p {
                report.baseline.insert(format!("{name}_us"), *v);
            }
        } else if key_prefix.is_empty() {
            report.compared("dials_per_s", direct_rate, rate);
            for (name, v) in &p {
                let direct = report.baseline.get(&format!("{name}_us")).copied().unwrap_or(0.0);
                report.latency(&format!("{name}_us"), direct, *v);
            }
        } else {
            report.tunnel.insert(format!("{key_prefix}_dials_per_s"), rate);
            report.ratios.insert(format!("{key_prefix}_dials_per_s"), ratio(rate, direct_rate));
            for (name, v) in &p {
                report.tunnel.insert(format!("{key_prefix}_{name}_us"), *v);
            }
        }
        report.figures.insert(format!("{name}_errors"), errors as f64);
        report.series.push(Series::per_second(format!("{via} dials"), "dials/s", &representative.samples));
        let points = distribution(&representative.histogram);
        report.series.push(crate::report::Series {
            name: format!("{via} dial latency distribution"),
            x_unit: "percentile".into(),
            y_unit: "us".into(),
            points: points.clone(),
        });
        lines.push(Line { name: via.clone(), points: points.iter().map(|p| (p[0], p[1])).collect(), dashed: i == 0 });
        table.row(vec![
            via.clone(),
            num(rate),
            pct(ratio(rate, direct_rate)),
            num(p[0].1),
            num(p[1].1),
            num(p[2].1),
            errors.to_string(),
            cpu.map_or_else(|| "-".into(), |v| format!("{v:.1}")),
        ]);
    }
    report.machine.load_average_end = crate::report::load_average();
    report.elapsed_s = started.elapsed().as_secs_f64();
    let chart = svg::percentile_chart(
        &Labels {
            title: &format!(
                "New-connection latency (open, 16 B request, answer, close), concurrency {}",
                args.concurrency
            ),
            x: "percentile",
            y: "latency (us, log scale)",
        },
        &lines,
    );
    Ok(Outcome { report, table: table.render(), charts: vec![("dial-rate.svg".into(), chart)] })
}
