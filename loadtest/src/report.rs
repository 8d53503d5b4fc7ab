//! The result of a scenario: a JSON document with a stable schema, and a table for the terminal.
//!
//! Schema `tether-loadtest/1`: `scenario`, `target`, `parameters` (the scenario's options),
//! `machine` (nproc, kernel, CPU model, memory, load average before and after), `baseline` (direct
//! loopback figures), `tunnel` (the same figures through Tether), `ratios` (tunnel / baseline, or
//! tunnel - baseline for latency overheads, named `*_overhead_us`), `figures` (everything else a
//! scenario measures, e.g. memory per agent), `series` (time series and distributions), `notes`.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

/// Version tag of the JSON schema.
pub const SCHEMA: &str = "tether-loadtest/1";

/// Where the measurement ran.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    /// Logical CPUs available to this process.
    pub nproc: usize,
    /// `uname -r`.
    pub kernel: String,
    /// CPU model from /proc/cpuinfo.
    pub cpu_model: String,
    /// Total memory, MiB.
    pub mem_total_mib: u64,
    /// 1, 5 and 15 minute load averages when the scenario started.
    pub load_average_start: [f64; 3],
    /// The same when it ended (a high value means other work distorted the figures).
    pub load_average_end: [f64; 3],
}

impl Machine {
    /// Describes this machine now.
    pub fn probe() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_else(|| "unknown".into());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let mem_total_kib = meminfo
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        Self {
            nproc: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_owned(),
            cpu_model,
            mem_total_mib: mem_total_kib / 1024,
            load_average_start: load_average(),
            load_average_end: [0.0; 3],
        }
    }
}

/// The 1, 5 and 15 minute load averages.
pub fn load_average() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut out = [0.0; 3];
    for (slot, value) in out.iter_mut().zip(text.split_whitespace()) {
        *slot = value.parse().unwrap_or(0.0);
    }
    out
}

/// A named sequence of (x, y) points: a time series or a distribution.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Series {
    /// What it shows, e.g. `tunnel download`.
    pub name: String,
    /// Unit of x, e.g. `s`, `percentile`, `streams`.
    pub x_unit: String,
    /// Unit of y, e.g. `MiB/s`, `us`.
    pub y_unit: String,
    /// The points.
    pub points: Vec<[f64; 2]>,
}

impl Series {
    /// A series of per-second samples starting at second 1.
    pub fn per_second(name: impl Into<String>, y_unit: &str, samples: &[f64]) -> Self {
        Self {
            name: name.into(),
            x_unit: "s".into(),
            y_unit: y_unit.into(),
            points: samples.iter().enumerate().map(|(i, v)| [(i + 1) as f64, *v]).collect(),
        }
    }
}

/// One scenario's result.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// [`SCHEMA`].
    pub schema: String,
    /// Scenario name (the subcommand).
    pub scenario: String,
    /// `local` (in-process deployment), `processes` (real binaries spawned here) or `external`.
    pub target: String,
    /// Unix time the scenario started.
    pub started_at_unix: u64,
    /// Wall time of the whole scenario, seconds.
    pub elapsed_s: f64,
    /// The scenario's options.
    pub parameters: serde_json::Value,
    /// Where it ran.
    pub machine: Machine,
    /// Direct loopback figures.
    pub baseline: BTreeMap<String, f64>,
    /// The same figures through the tunnel.
    pub tunnel: BTreeMap<String, f64>,
    /// Tunnel relative to baseline.
    pub ratios: BTreeMap<String, f64>,
    /// Other measured figures.
    pub figures: BTreeMap<String, f64>,
    /// Time series and distributions.
    pub series: Vec<Series>,
    /// Remarks worth keeping with the figures.
    pub notes: Vec<String>,
}

impl Report {
    /// An empty report for `scenario`.
    pub fn new(scenario: &str, target: &str, parameters: serde_json::Value) -> Self {
        Self {
            schema: SCHEMA.into(),
            scenario: scenario.into(),
            target: target.into(),
            started_at_unix: crate::devpki::now(),
            elapsed_s: 0.0,
            parameters,
            machine: Machine::probe(),
            baseline: BTreeMap::new(),
            tunnel: BTreeMap::new(),
            ratios: BTreeMap::new(),
            figures: BTreeMap::new(),
            series: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// Records a figure measured both directly and through the tunnel, and their ratio.
    pub fn compared(&mut self, key: &str, direct: f64, tunnel: f64) {
        self.baseline.insert(key.into(), direct);
        self.tunnel.insert(key.into(), tunnel);
        self.ratios.insert(key.into(), crate::stats::ratio(tunnel, direct));
    }

    /// Records a latency measured both ways and the tunnel's overhead in microseconds.
    pub fn latency(&mut self, key: &str, direct_us: f64, tunnel_us: f64) {
        self.baseline.insert(key.into(), direct_us);
        self.tunnel.insert(key.into(), tunnel_us);
        self.ratios.insert(format!("{key}_overhead_us"), tunnel_us - direct_us);
    }

    /// Writes the report as pretty JSON.
    pub fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        }
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
    }

    /// Reads a report written by [`Report::write_json`].
    pub fn read_json(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not a tether-loadtest result", path.display()))
    }

    /// Every figure under one flat name: `baseline.x`, `tunnel.x`, `ratios.x`, `figures.x`.
    pub fn flat(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for (section, map) in [
            ("baseline", &self.baseline),
            ("tunnel", &self.tunnel),
            ("ratios", &self.ratios),
            ("figures", &self.figures),
        ] {
            for (key, value) in map {
                out.insert(format!("{section}.{key}"), *value);
            }
        }
        out
    }
}

/// A plain text table with right-aligned numeric columns.
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new(headers: &[&str]) -> Self {
        Self { headers: headers.iter().map(|h| (*h).to_owned()).collect(), rows: Vec::new() }
    }

    /// Adds a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Renders the table.
    pub fn render(&self) -> String {
        let columns = self.headers.len();
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate().take(columns) {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let mut out = String::new();
            for (i, width) in widths.iter().enumerate() {
                let cell = cells.get(i).map(String::as_str).unwrap_or("");
                if i == 0 {
                    out.push_str(&format!("  {cell:<width$}"));
                } else {
                    out.push_str(&format!("  {cell:>width$}"));
                }
            }
            out.push('\n');
            out
        };
        let mut out = line(&self.headers);
        let total: usize = widths.iter().map(|w| w + 2).sum();
        out.push_str(&format!("  {}\n", "-".repeat(total.saturating_sub(2))));
        for row in &self.rows {
            out.push_str(&line(row));
        }
        out
    }
}

/// `12.3` style with a precision that suits the magnitude.
pub fn num(value: f64) -> String {
    if value.abs() >= 1000.0 {
        format!("{value:.0}")
    } else if value.abs() >= 100.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

/// A ratio as a percentage, `41.2 %`.
pub fn pct(ratio: f64) -> String {
    format!("{:.1} %", ratio * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_round_trips_and_flattens() {
        let mut report = Report::new("throughput", "local", serde_json::json!({"streams": 1}));
        report.compared("download_mib_s", 1000.0, 400.0);
        report.latency("p50_us", 30.0, 55.0);
        let json = serde_json::to_string(&report).unwrap();
        let back: Report = serde_json::from_str(&json).unwrap();
        let flat = back.flat();
        assert_eq!(flat["ratios.download_mib_s"], 0.4);
        assert_eq!(flat["ratios.p50_us_overhead_us"], 25.0);
        assert_eq!(back.schema, SCHEMA);
    }

    #[test]
    fn table_aligns_columns() {
        let mut table = Table::new(&["what", "value"]);
        table.row(vec!["a".into(), "1".into()]);
        table.row(vec!["longer".into(), "1234".into()]);
        let text = table.render();
        assert!(text.contains("  a           1\n"), "{text}");
    }
}
