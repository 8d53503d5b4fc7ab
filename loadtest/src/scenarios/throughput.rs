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
    /// Also measure a chain of two TCP relays (the tunnel's three TCP connections without
    /// WebSocket or multiplexer), plain and with TLS between the two relays: how much of the gap
    /// to direct TCP the hops alone, and the hops with the tunnel's encryption, explain.
    #[arg(long)]
    pub relay_baseline: bool,
    /// Where to send traffic.
    #[command(flatten)]
    pub target: DataTarget,
}

/// The relay baselines of `--relay-baseline`: route key and label.
const BASELINES: [(&str, &str); 2] = [("relay", "two plain relays"), ("tls_relay", "two relays, TLS between")];

/// Runs the scenario.
pub async fn run(args: &ThroughputArgs, progress: &Progress) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let mut path = DataPath::start(&args.target).await?;
    let duration = Duration::from_secs_f64(args.duration.max(0.2));
    let mut routes = vec![("direct", path.direct(path.bulk)), ("tunnel", path.tunnel(path.bulk))];
    if args.relay_baseline {
        routes.push(("relay", path.relay_route(path.bulk, 2).await?));
        routes.push(("tls_relay", path.tls_relay_route(path.bulk).await?));
    }
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
    let mut table = Table::new(&[
        "direction",
        "direct MiB/s",
        "tunnel MiB/s",
        "tunnel/direct",
        "runs (tunnel)",
        "CPU s/GiB direct",
        "tunnel",
    ]);
    let mut relay_table = Table::new(&["direction", "path", "MiB/s", "vs direct", "tunnel vs it", "CPU s/GiB"]);
    let mut lines = Vec::new();
    for direction in ["download", "upload"] {
        let figures = |via: &str| runs.get(&(via, direction)).map(|r| r.iter().map(|x| x.mib_s).collect::<Vec<_>>());
        let direct = figures("direct").unwrap_or_default();
        let tunnel = figures("tunnel").unwrap_or_default();
        let key = format!("{direction}_mib_s");
        report.compared(&key, median(&direct), median(&tunnel));
        // CPU per byte: the whole process (client, servers and, in-process, gateway and agent).
        let cpu = |via: &str| {
            crate::stats::median_of(runs.get(&(via, direction)).into_iter().flatten().filter_map(|r| r.cpu_s_per_gib))
        };
        let (cpu_direct, cpu_tunnel) = (cpu("direct"), cpu("tunnel"));
        if let (Some(d), Some(t)) = (cpu_direct, cpu_tunnel) {
            report.figures.insert(format!("{direction}_direct_cpu_s_per_gib"), d);
            report.figures.insert(format!("{direction}_tunnel_cpu_s_per_gib"), t);
            report.figures.insert(format!("{direction}_cpu_cost_tunnel_over_direct"), crate::stats::ratio(t, d));
        }
        let mut baselines = Vec::new();
        for (via, label) in BASELINES {
            let values = figures(via).unwrap_or_default();
            if values.is_empty() {
                continue;
            }
            let (mib_s, cpu_via) = (median(&values), cpu(via));
            let ratio = crate::stats::ratio;
            report.figures.insert(format!("{direction}_{via}_mib_s"), mib_s);
            report.figures.insert(format!("{direction}_{via}_over_direct"), ratio(mib_s, median(&direct)));
            report.figures.insert(format!("{direction}_tunnel_over_{via}"), ratio(median(&tunnel), mib_s));
            if let Some(c) = cpu_via {
                report.figures.insert(format!("{direction}_{via}_cpu_s_per_gib"), c);
            }
            relay_table.row(vec![
                direction.into(),
                label.into(),
                num(mib_s),
                pct(ratio(mib_s, median(&direct))),
                pct(ratio(median(&tunnel), mib_s)),
                cpu_via.map_or_else(|| "-".into(), |v| format!("{v:.2}")),
            ]);
            baselines.push((via, values));
        }
        let measured =
            [("direct", &direct), ("tunnel", &tunnel)].into_iter().chain(baselines.iter().map(|(v, x)| (*v, x)));
        for (via, values) in measured {
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
                    dashed: via != "tunnel",
                });
            }
        }
        table.row(vec![
            direction.into(),
            num(median(&direct)),
            num(median(&tunnel)),
            pct(report.ratios.get(&key).copied().unwrap_or(0.0)),
            tunnel.iter().map(|v| format!("{v:.0}")).collect::<Vec<_>>().join(" / "),
            cpu_direct.map_or_else(|| "-".into(), |v| format!("{v:.2}")),
            cpu_tunnel.map_or_else(|| "-".into(), |v| format!("{v:.2}")),
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
    let mut rendered = table.render();
    if args.relay_baseline {
        rendered.push_str(
            "\n  two relays in a chain (the tunnel's three TCP connections without WebSocket or multiplexer;\n  \
             plain, and with TLS between the relays as between gateway and agent):\n\n",
        );
        rendered.push_str(&relay_table.render());
    }
    Ok(Outcome { report, table: rendered, charts: vec![("throughput.svg".into(), chart)] })
}
