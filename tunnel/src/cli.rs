//! What both binaries do the same way at their edge: common flags, the runtime, exit codes.

use std::fmt::Display;
use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;

use metrics_exporter_prometheus::PrometheusHandle;

use crate::telemetry::{self, LogConfig, LogFormat};

/// Flags both binaries take.
#[derive(Debug, clap::Args)]
pub struct CommonArgs {
    /// YAML configuration file. Every key can be overridden as TETHER__SECTION__KEY.
    #[arg(long, short, env = "TETHER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Validate the configuration (files included) and exit.
    #[arg(long)]
    pub check_config: bool,
    /// With --check-config: do not require referenced files to exist (for configurations
    /// rendered for another machine, such as a Helm chart's).
    #[arg(long, requires = "check_config")]
    pub offline: bool,
    /// Log format (overrides log.format).
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// Log filter, e.g. info or tether_gateway=debug (overrides log.level).
    #[arg(long)]
    pub log_level: Option<String>,
}

/// Exit code for a configuration that cannot be used.
pub const EXIT_CONFIG: u8 = 2;

/// Starts logging (flags over the `log` section), the aws-lc-rs TLS provider and the metrics
/// recorder.
pub fn start_telemetry(args: &CommonArgs, log: &LogConfig) -> Result<PrometheusHandle, String> {
    let format = args.log_format.unwrap_or(log.format);
    let level = args.log_level.clone().unwrap_or_else(|| log.level.clone());
    telemetry::init_logging(format, &level)?;
    crate::tls::install_default_provider();
    telemetry::install_metrics()
}

/// The `runtime` section both binaries share.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Worker threads of the async runtime. Unset: the binary's default (the gateway: one per CPU
    /// the process may use, a cgroup CPU quota included, or `TOKIO_WORKER_THREADS`; the agent: 1).
    #[serde(default)]
    pub worker_threads: Option<usize>,
}

/// Most worker threads `runtime.worker_threads` accepts.
pub const MAX_WORKER_THREADS: usize = 1024;

impl RuntimeConfig {
    /// What is wrong with `worker_threads`, if anything.
    pub fn worker_threads_problem(&self) -> Option<String> {
        match self.worker_threads {
            Some(0) => Some("must be at least 1".into()),
            Some(n) if n > MAX_WORKER_THREADS => Some(format!("{n} is more than {MAX_WORKER_THREADS}")),
            _ => None,
        }
    }
}

/// Runs `main` on a runtime sized by `runtime`; an error is printed as `<name>: <error>` and exits
/// with 1.
///
/// With one worker thread this is tokio's current-thread scheduler: the same single thread as a
/// multi-threaded runtime with one worker, without the bookkeeping for work stealing it would never
/// do (after every batch of task polls it times them to tune a queue interval).
pub fn run<F, E>(name: &str, runtime: &RuntimeConfig, main: F) -> ExitCode
where
    F: Future<Output = Result<(), E>>,
    E: Display,
{
    let mut builder = match runtime.worker_threads {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(threads) => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(threads.clamp(1, MAX_WORKER_THREADS));
            builder
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    builder.enable_all();
    let runtime = match builder.build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("{name}: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(main) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Prints a configuration error as `<name>: <error>` and returns the exit code for it.
pub fn config_error(name: &str, error: &dyn Display) -> ExitCode {
    eprintln!("{name}: {error:#}");
    ExitCode::from(EXIT_CONFIG)
}

/// Watches SIGTERM (kill, a service manager, Kubernetes) and Ctrl-C: the future it returns ends
/// when either comes and logs which. Fails only if a handler cannot be installed.
pub fn stop_signal() -> std::io::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    // Both handlers are installed here, not when the future is first polled: a signal that
    // arrives in between is caught rather than ending the process by its default action.
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = terminate.recv() => tracing::info!("SIGTERM received"),
            _ = interrupt.recv() => tracing::info!("interrupt received"),
        }
    })
}
