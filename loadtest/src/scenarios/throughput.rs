//! `throughput`: bulk data over N streams, download and upload, direct TCP vs through the tunnel,
//! interleaved in the same run.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::progress::Progress;
use crate::report::{Report, Series, Table, num, pct};
use crate::scenarios::Outcome;
use crate::scenarios::measure::{self, BulkResult, Direction};
use crate::stats::{median, median_index};
use crate::svg::{self, Labels, Line};
use crate::target::{DataPath, DataTarget};

/// Options of `throughput`.
#[derive(Debug, Clone, clap::Args)]
pub struct ThroughputArgs {
    /// Concurrent bulk streams.
    #[arg(long, default_value_t = 1)]
    pub streams: usize,
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

/// Runs the scenario.
pub async fn run(args: &ThroughputArgs, progress: &Progress) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let path = DataPath::start(&args.target).await?;
    let duration = Duration::from_secs_f64(args.duration.max(0.2));
    let routes = [("direct", path.direct(path.bulk)), ("tunnel", path.tunnel(path.bulk))];
    let mut runs: BTreeMap<(&str, &str), Vec<BulkResult>> = BTreeMap::new();
    for rep in 0..args.repeat.max(1) {
        for direction in [Direction::Download, Direction::Upload] {
            for (via, route) in &routes {
                let label = format!("{via} {} x{} #{}", direction.name(), args.streams, rep + 1);
                let result = measure::bulk(route, direction, args.streams, duration, progress, &label).await?;
                runs.entry((via, direction.name())).or_default().push(result);
            }
        }
    }
    let mut report = Report::new(
        "throughput",
        path.kind,
        serde_json::json!({
            "streams": args.streams, "duration_s": args.duration, "repeat": args.repeat,
            "frontend": path.frontends.first().map(|f| f.1.to_string()), "link_delay_ms": args.target.link_delay_ms,
        }),
    );
    path.shutdown().await;
    let mut table = Table::new(&["direction", "direct MiB/s", "tunnel MiB/s", "tunnel/direct", "runs (tunnel)"]);
    let mut lines = Vec::new();
    for direction in ["download", "upload"] {
        let figures = |via: &str| runs.get(&(via, direction)).map(|r| r.iter().map(|x| x.mib_s).collect::<Vec<_>>());
        let direct = figures("direct").unwrap_or_default();
        let tunnel = figures("tunnel").unwrap_or_default();
        let key = format!("{direction}_mib_s");
        report.compared(&key, median(&direct), median(&tunnel));
        for (via, values) in [("direct", &direct), ("tunnel", &tunnel)] {
            for (i, v) in values.iter().enumerate() {
                report.figures.insert(format!("{direction}_{via}_run{}_mib_s", i + 1), *v);
            }
            if let Some(results) = runs.get(&(via, direction)) {
                let representative = &results[median_index(values)];
                let name = format!("{via} {direction}");
                report.series.push(Series::per_second(&name, "MiB/s", &representative.samples));
                lines.push(Line {
                    name,
                    points: representative.samples.iter().enumerate().map(|(i, v)| ((i + 1) as f64, *v)).collect(),
                    dashed: via == "direct",
                });
            }
        }
        table.row(vec![
            direction.into(),
            num(median(&direct)),
            num(median(&tunnel)),
            pct(report.ratios.get(&key).copied().unwrap_or(0.0)),
            tunnel.iter().map(|v| format!("{v:.0}")).collect::<Vec<_>>().join(" / "),
        ]);
    }
    report.machine.load_average_end = crate::report::load_average();
    report.elapsed_s = started.elapsed().as_secs_f64();
    let chart = svg::line_chart(
        &Labels {
            title: &format!("Bulk throughput, {} stream(s): tunnel vs direct loopback TCP", args.streams),
            x: "time (s)",
            y: "MiB/s",
        },
        &lines,
    );
    Ok(Outcome { report, table: table.render(), charts: vec![("throughput.svg".into(), chart)] })
}
