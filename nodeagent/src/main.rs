//! `tether-agent`: see the crate documentation and README.

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;
use tether_agent::{Agent, AgentConfig};
use tether_tunnel::cli::{self, CommonArgs};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Tether node agent: dials out to the gateway over WSS and serves its dials to node-side targets.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match AgentConfig::load_checked(cli.common.config.as_deref(), !cli.common.offline) {
        Ok(config) => config,
        Err(e) => return cli::config_error("tether-agent", &e),
    };
    if cli.common.check_config {
        println!("configuration OK: agent {} -> {}", config.agent_id(), config.gateway.url);
        return ExitCode::SUCCESS;
    }
    let runtime = config.runtime();
    cli::run("tether-agent", &runtime, run(cli, config))
}

async fn run(cli: Cli, config: AgentConfig) -> anyhow::Result<()> {
    let metrics = cli::start_telemetry(&cli.common, &config.log).map_err(anyhow::Error::msg)?;
    let agent = Agent::bind(config, Some(metrics)).await?;
    let shutdown = cli::stop_signal().context("cannot watch SIGTERM")?;
    agent.run(shutdown).await
}
