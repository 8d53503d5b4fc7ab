//! `tether-gateway`: see the crate documentation and README.

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;
use tether_gateway::{Gateway, GatewayConfig};
use tether_tunnel::cli::{self, CommonArgs};
use tokio::signal::unix::{SignalKind, signal};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Tether gateway: agents connect here over WSS; each tenant's kube-apiserver connects to its
/// CONNECT frontend to reach its nodes.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match GatewayConfig::load_checked(cli.common.config.as_deref(), !cli.common.offline) {
        Ok(config) => config,
        Err(e) => return cli::config_error("tether-gateway", &e),
    };
    if cli.common.check_config {
        println!("configuration OK: {} tenant(s)", config.tenants.len());
        return ExitCode::SUCCESS;
    }
    let runtime = config.runtime.clone();
    cli::run("tether-gateway", &runtime, run(cli, config))
}

async fn run(cli: Cli, config: GatewayConfig) -> anyhow::Result<()> {
    let metrics = cli::start_telemetry(&cli.common, &config.log).map_err(anyhow::Error::msg)?;
    if config.tenants.is_empty() {
        tracing::warn!("no tenants configured yet; agents are refused until a reload adds one");
    }
    let gateway = Gateway::bind_with_path(config, cli.common.config.clone(), Some(metrics)).await?;
    tracing::info!(agents = %gateway.agent_addr(), admin = %gateway.admin_addr(), "listeners bound");
    let handle = gateway.handle();
    let shutdown = cli::stop_signal().context("cannot watch SIGTERM")?;
    let mut hangup = signal(SignalKind::hangup()).context("cannot watch SIGHUP")?;
    let reload = handle.clone();
    tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            tracing::info!("SIGHUP: reloading the configuration and certificates");
            // Errors are logged and counted by reload(); the old configuration stays in force.
            let _ = reload.reload().await;
        }
    });
    Ok(gateway.run(shutdown).await?)
}
