//! Logging and metrics set-up shared by the binaries.

use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde::{Deserialize, Serialize};
use tracing_subscriber::EnvFilter;

/// Log output format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log pipelines.
    Json,
}

/// The `log` section both binaries share.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// `text` or `json`.
    #[serde(default)]
    pub format: LogFormat,
    /// Filter in `RUST_LOG` syntax.
    #[serde(default = "default_level")]
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { format: LogFormat::Text, level: default_level() }
    }
}

fn default_level() -> String {
    "info".into()
}

/// Starts logging to stderr. `filter` uses `RUST_LOG` syntax (`info`, `tether_gateway=debug`);
/// the `RUST_LOG` environment variable wins when set.
pub fn init_logging(format: LogFormat, filter: &str) -> Result<(), String> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(from_env) if !from_env.is_empty() => EnvFilter::try_new(from_env),
        _ => EnvFilter::try_new(filter),
    }
    .map_err(|e| format!("bad log filter: {e}"))?;
    use std::io::IsTerminal;
    // Colours only for a person at a terminal; files and log collectors get plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let result = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).try_init(),
    };
    result.map_err(|e| format!("cannot start logging: {e}"))
}

/// The answer to `GET /metrics`: the exposition, after setting the gauges `tasks` and `workers`
/// to the current runtime's live tasks and worker threads; 404 when metrics are off.
pub fn metrics_response(
    handle: Option<&PrometheusHandle>,
    tasks: &'static str,
    workers: &'static str,
) -> (http::StatusCode, [(&'static str, &'static str); 1], String) {
    let content_type = [("content-type", "text/plain; version=0.0.4; charset=utf-8")];
    let Some(handle) = handle else {
        return (http::StatusCode::NOT_FOUND, content_type, "metrics are not enabled in this process\n".into());
    };
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        let figures = runtime.metrics();
        metrics::gauge!(tasks).set(figures.num_alive_tasks() as f64);
        metrics::gauge!(workers).set(figures.num_workers() as f64);
    }
    (http::StatusCode::OK, content_type, handle.render())
}

/// Latency buckets in seconds, from 100 us to 30 s.
pub const LATENCY_BUCKETS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// Installs the process-wide Prometheus recorder (once) and returns its handle; metrics whose
/// name ends in `_seconds` become histograms with [`LATENCY_BUCKETS`].
pub fn install_metrics() -> Result<PrometheusHandle, String> {
    static HANDLE: std::sync::Mutex<Option<PrometheusHandle>> = std::sync::Mutex::new(None);
    let mut installed = HANDLE.lock().map_err(|_| "metrics set-up panicked earlier".to_owned())?;
    if let Some(handle) = installed.as_ref() {
        return Ok(handle.clone());
    }
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    *installed = Some(handle.clone());
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}
