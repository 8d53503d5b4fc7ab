//! `tether-loadtest`: Tether's load-test harness. Every scenario measures the tunnel against a
//! baseline in the same run (direct loopback TCP) where one exists, prints a table, and can write
//! a JSON result (`--json`) and SVG charts (`--svg-dir`). See docs/benchmarks.md.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tether_loadtest::progress::Progress;
use tether_loadtest::scenarios::{
    self, Outcome, agents::AgentsArgs, dial_rate::DialRateArgs, latency::LatencyArgs, mux_compare::MuxCompareArgs,
    peer::PeerArgs, reconnect::ReconnectArgs, rps::RpsArgs, soak::SoakArgs, streams::StreamsArgs,
    throughput::ThroughputArgs,
};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Tether's load-test harness: throughput, request rate, latency, dial rate, memory per agent and
/// per stream, reconnect time, and the multiplexer comparison.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// Write the result as JSON to this file.
    #[arg(long, global = true)]
    json: Option<PathBuf>,
    /// Write SVG charts into this directory.
    #[arg(long, global = true)]
    svg_dir: Option<PathBuf>,
    /// No progress output on stderr.
    #[arg(long, global = true)]
    quiet: bool,
    /// Runtime worker threads (default: one per CPU).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Subcommand)]
enum Scenario {
    /// Bulk throughput over N streams, download and upload, tunnel vs direct TCP.
    Throughput(ThroughputArgs),
    /// Closed-loop 100-byte requests over C connections, tunnel vs direct.
    Rps(RpsArgs),
    /// Open-loop latency at a fixed rate (no coordinated omission), tunnel vs direct.
    Latency(LatencyArgs),
    /// New connections per second (CONNECT + request + answer + close) vs new direct connections.
    DialRate(DialRateArgs),
    /// N idle simulated agents against a gateway process: memory per agent, connect times.
    Agents(AgentsArgs),
    /// Many idle streams through gateway and agent processes: memory per stream on each side.
    Streams(StreamsArgs),
    /// Kill and restart the gateway under N agents: time until all are back and a dial works.
    Reconnect(ReconnectArgs),
    /// yamux vs tokio-yamux over the same WSS stack, vs direct TCP.
    MuxCompare(MuxCompareArgs),
    /// Tether next to rathole (WebSocket + TLS) in the same run: throughput and dial rate.
    Peer(PeerArgs),
    /// Mixed load for a long time against the real binaries (dials, forwards, bulk and idle
    /// streams, agents coming and going, a gateway restart, a token rotation): memory, open files,
    /// tasks and gauges over time, and whether they return to their baseline.
    Soak(SoakArgs),
    /// Ratios between two result files (before / after).
    Compare {
        /// The "before" result.
        a: PathBuf,
        /// The "after" result.
        b: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Thousands of agents or streams need thousands of sockets; child processes inherit this.
    let _ = tether_loadtest::procs::raise_fd_limit();
    let _ = tether_tunnel::telemetry::init_logging(tether_tunnel::telemetry::LogFormat::Text, "error");
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if let Some(threads) = cli.threads {
        builder.worker_threads(threads.max(1));
    }
    let runtime = match builder.build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("tether-loadtest: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tether-loadtest: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    tether_tunnel::tls::install_default_provider();
    let name = match &cli.scenario {
        Scenario::Throughput(_) => "throughput",
        Scenario::Rps(_) => "rps",
        Scenario::Latency(_) => "latency",
        Scenario::DialRate(_) => "dial-rate",
        Scenario::Agents(_) => "agents",
        Scenario::Streams(_) => "streams",
        Scenario::Reconnect(_) => "reconnect",
        Scenario::MuxCompare(_) => "mux-compare",
        Scenario::Peer(_) => "peer",
        Scenario::Soak(_) => "soak",
        Scenario::Compare { .. } => "compare",
    };
    let progress = Progress::new(name, cli.quiet);
    let load_at_start = tether_loadtest::report::load_average();
    let mut outcome: Outcome = match &cli.scenario {
        Scenario::Throughput(args) => scenarios::throughput::run(args, &progress).await?,
        Scenario::Rps(args) => scenarios::rps::run(args, &progress).await?,
        Scenario::Latency(args) => scenarios::latency::run(args, &progress).await?,
        Scenario::DialRate(args) => scenarios::dial_rate::run(args, &progress).await?,
        Scenario::Agents(args) => scenarios::agents::run(args, &progress).await?,
        Scenario::Streams(args) => scenarios::streams::run(args, &progress).await?,
        Scenario::Reconnect(args) => scenarios::reconnect::run(args, &progress).await?,
        Scenario::MuxCompare(args) => scenarios::mux_compare::run(args, &progress).await?,
        Scenario::Peer(args) => scenarios::peer::run(args, &progress).await?,
        Scenario::Soak(args) => scenarios::soak::run(args, &progress).await?,
        Scenario::Compare { a, b } => {
            print!("{}", scenarios::compare::compare(a, b)?);
            return Ok(());
        }
    };
    // Scenarios build their report after measuring; the load figures span the whole run.
    outcome.report.machine.load_average_start = load_at_start;
    outcome.report.machine.load_average_end = tether_loadtest::report::load_average();
    let machine = &outcome.report.machine;
    println!(
        "\n{} ({}; {} CPUs, {}; load {:.2} -> {:.2})\n",
        outcome.report.scenario,
        outcome.report.target,
        machine.nproc,
        machine.cpu_model,
        machine.load_average_start[0],
        machine.load_average_end[0]
    );
    print!("{}", outcome.table);
    for note in &outcome.report.notes {
        println!("  note: {note}");
    }
    if let Some(path) = &cli.json {
        outcome.report.write_json(path)?;
        println!("\n  result: {}", path.display());
    }
    if let Some(dir) = &cli.svg_dir {
        for (file, svg) in &outcome.charts {
            let path = tether_loadtest::svg::write(dir, file, svg)?;
            println!("  chart:  {}", path.display());
        }
    }
    Ok(())
}
