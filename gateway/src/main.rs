//! `tether-gateway`: see the crate documentation and README.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use tether_gateway::{Gateway, GatewayConfig};
use tether_tunnel::telemetry::{self, LogFormat};
use tokio::signal::unix::{SignalKind, signal};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Tether gateway: agents connect here over WSS; each tenant's kube-apiserver connects to its
/// CONNECT frontend to reach its nodes.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// YAML configuration file. Every key can be overridden as TETHER__SECTION__KEY.
    #[arg(long, short, env = "TETHER_CONFIG")]
    config: Option<PathBuf>,
    /// Validate the configuration (files included) and exit.
    #[arg(long)]
    check_config: bool,
    /// With --check-config: do not require referenced files to exist (for configurations
    /// rendered for another machine, such as a Helm chart's).
    #[arg(long, requires = "check_config")]
    offline: bool,
    /// Log format (overrides log.format).
    #[arg(long, value_enum)]
    log_format: Option<LogFormat>,
    /// Log filter, e.g. info or tether_gateway=debug (overrides log.level).
    #[arg(long)]
    log_level: Option<String>,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let config = match GatewayConfig::load_checked(cli.config.as_deref(), !cli.offline) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("tether-gateway: {e:#}");
            return std::process::ExitCode::from(2);
        }
    };
    if cli.check_config {
        println!("configuration OK: {} tenant(s)", config.tenants.len());
        return std::process::ExitCode::SUCCESS;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("tether-gateway: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli, config)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tether-gateway: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli, config: GatewayConfig) -> anyhow::Result<()> {
    let format = cli.log_format.unwrap_or(config.log.format);
    let level = cli.log_level.clone().unwrap_or_else(|| config.log.level.clone());
    telemetry::init_logging(format, &level).map_err(anyhow::Error::msg)?;
    tether_tunnel::tls::install_default_provider();
    let metrics = telemetry::install_metrics().map_err(anyhow::Error::msg)?;
    if config.tenants.is_empty() {
        tracing::warn!("no tenants configured yet; agents are refused until a reload adds one");
    }
    let gateway = Gateway::bind_with_path(config, cli.config.clone(), Some(metrics)).await?;
    tracing::info!(agents = %gateway.agent_addr(), admin = %gateway.admin_addr(), "listeners bound");
    let handle = gateway.handle();
    let mut terminate = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut hangup = signal(SignalKind::hangup()).context("cannot watch SIGHUP")?;
    let reload = handle.clone();
    tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            tracing::info!("SIGHUP: reloading the configuration and certificates");
            // Errors are logged and counted by reload(); the old configuration stays in force.
            let _ = reload.reload().await;
        }
    });
    let shutdown = async move {
        tokio::select! {
            _ = terminate.recv() => tracing::info!("SIGTERM received"),
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupt received"),
        }
    };
    gateway.run(shutdown).await
}
