//! `peer`: Tether next to another tunnel in the same run. Today that is rathole in its
//! WebSocket-over-TLS transport: its server forwards a port to its client, which connects to the
//! same bulk and echo servers Tether's agent reaches. Single-stream throughput and the dial rate
//! are measured direct, through Tether (in-process deployment) and through rathole (two
//! processes), interleaved.
//!
//! rathole opens a new data channel (a new TLS + WebSocket connection from its client) for every
//! visitor connection, where Tether opens a stream on an existing session; the dial rate shows it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::devpki::DevCa;
use crate::local::ScratchDir;
use crate::procs::{ChildProcess, free_loopback};
use crate::progress::Progress;
use crate::report::{Report, Table, num, pct};
use crate::scenarios::Outcome;
use crate::scenarios::measure::{self, Direction};
use crate::stats::{median, percentiles, ratio};
use crate::svg::{self, Labels, Line};
use crate::target::{DataPath, DataTarget, Route};

/// Options of `peer`.
#[derive(Debug, Clone, clap::Args)]
pub struct PeerArgs {
    /// The rathole binary (default: `rathole` on PATH, then ~/.cargo/bin/rathole).
    #[arg(long)]
    pub rathole_bin: Option<PathBuf>,
    /// Seconds per throughput measurement.
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Seconds per dial-rate measurement.
    #[arg(long, default_value_t = 3.0)]
    pub dial_duration: f64,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
}

fn find_rathole(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(path) = explicit {
        return Ok(path.to_owned());
    }
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    let mut candidates: Vec<PathBuf> = std::env::split_paths(&path_var).map(|d| d.join("rathole")).collect();
    if let Some(home) = std::env::var_os("HOME") {
        candidates.push(Path::new(&home).join(".cargo/bin/rathole"));
    }
    candidates
        .into_iter()
        .find(|p| p.exists())
        .context("rathole not found: cargo install rathole, or pass --rathole-bin")
}

struct Rathole {
    _dir: ScratchDir,
    _server: ChildProcess,
    _client: ChildProcess,
    bulk: SocketAddr,
    echo: SocketAddr,
}

async fn start_rathole(binary: &Path, bulk: SocketAddr, echo: SocketAddr) -> anyhow::Result<Rathole> {
    let dir = ScratchDir::new("tether-rathole")?;
    let ca = DevCa::create(dir.path(), "rathole")?;
    let cert = ca.server("server", &["localhost"])?;
    let identity = dir.path().join("identity.pfx");
    let status = std::process::Command::new("openssl")
        .args(["pkcs12", "-export", "-passout", "pass:tether", "-out"])
        .arg(&identity)
        .arg("-inkey")
        .arg(&cert.key)
        .arg("-in")
        .arg(&cert.cert)
        .arg("-certfile")
        .arg(&ca.ca_cert)
        .status()
        .context("openssl is needed to make rathole's PKCS#12 identity")?;
    anyhow::ensure!(status.success(), "openssl pkcs12 failed");
    let control = free_loopback()?;
    let bulk_forward = free_loopback()?;
    let echo_forward = free_loopback()?;
    let server = format!(
        r#"[server]
bind_addr = "{control}"
[server.transport]
type = "websocket"
[server.transport.tls]
pkcs12 = "{identity}"
pkcs12_password = "tether"
[server.transport.websocket]
tls = true
[server.services.bulk]
token = "loadtest"
bind_addr = "{bulk_forward}"
[server.services.echo]
token = "loadtest"
bind_addr = "{echo_forward}"
"#,
        identity = identity.display()
    );
    let client = format!(
        r#"[client]
remote_addr = "localhost:{port}"
[client.transport]
type = "websocket"
[client.transport.tls]
trusted_root = "{ca}"
hostname = "localhost"
[client.transport.websocket]
tls = true
[client.services.bulk]
token = "loadtest"
local_addr = "{bulk}"
[client.services.echo]
token = "loadtest"
local_addr = "{echo}"
"#,
        port = control.port(),
        ca = ca.ca_cert.display()
    );
    let server_file = dir.path().join("server.toml");
    let client_file = dir.path().join("client.toml");
    std::fs::write(&server_file, server)?;
    std::fs::write(&client_file, client)?;
    let server = spawn_rathole(binary, "--server", &server_file, &dir.path().join("server.log"))?;
    let client = spawn_rathole(binary, "--client", &client_file, &dir.path().join("client.log"))?;
    // Ready when a request makes it through the echo service.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let attempt = async {
            let mut conn = Route::Direct(echo_forward).open().await?;
            conn.write_all(b"ready?").await?;
            let mut answer = [0u8; 6];
            tokio::time::timeout(Duration::from_secs(2), conn.read_exact(&mut answer)).await??;
            anyhow::Ok(())
        };
        if attempt.await.is_ok() {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "rathole did not forward within 20 s:\n{}", server.log_tail());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(Rathole { _dir: dir, _server: server, _client: client, bulk: bulk_forward, echo: echo_forward })
}

fn spawn_rathole(binary: &Path, mode: &str, config: &Path, log: &Path) -> anyhow::Result<ChildProcess> {
    // rathole takes `--server FILE` / `--client FILE`; ChildProcess passes `--config FILE`, so
    // spawn through a tiny shell wrapper instead of teaching ChildProcess other flags.
    let wrapper = config.with_extension("sh");
    std::fs::write(&wrapper, format!("#!/bin/sh\nshift\nexec '{}' {mode} \"$1\"\n", binary.display()))?;
    let status = std::process::Command::new("chmod").arg("+x").arg(&wrapper).status()?;
    anyhow::ensure!(status.success(), "chmod failed");
    ChildProcess::spawn(&wrapper, config, log)
}

/// Runs the scenario.
pub async fn run(args: &PeerArgs, progress: &Progress) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let binary = find_rathole(args.rathole_bin.as_deref())?;
    let path = DataPath::start(&DataTarget {
        frontend: None,
        backend_ip: std::net::IpAddr::from([127, 0, 0, 1]),
        bulk_port: 0,
        echo_port: 0,
        link_delay_ms: 0,
        grpc: false,
    })
    .await?;
    let rathole = start_rathole(&binary, path.bulk, path.echo).await?;
    let bulk_routes = [
        ("direct", Route::Direct(path.bulk)),
        ("tether", path.tunnel(path.bulk)),
        ("rathole", Route::Direct(rathole.bulk)),
    ];
    let echo_routes = [
        ("direct", Route::Direct(path.echo)),
        ("tether", path.tunnel(path.echo)),
        ("rathole", Route::Direct(rathole.echo)),
    ];
    let duration = Duration::from_secs_f64(args.duration.max(0.2));
    let dial_duration = Duration::from_secs_f64(args.dial_duration.max(0.2));
    let mut throughput: Vec<[Vec<f64>; 2]> = vec![[Vec::new(), Vec::new()]; 3];
    let mut dials: Vec<Vec<f64>> = vec![Vec::new(); 3];
    let mut dial_p50: Vec<Vec<f64>> = vec![Vec::new(); 3];
    let mut unconfirmed = [false; 3];
    for rep in 0..args.repeat.max(1) {
        for (d, direction) in [Direction::Download, Direction::Upload].into_iter().enumerate() {
            for (i, (via, route)) in bulk_routes.iter().enumerate() {
                let label = format!("{via} {} #{}", direction.name(), rep + 1);
                let result = measure::bulk(route, direction, 1, duration, progress, &label).await?;
                unconfirmed[i] |= !result.confirmed;
                throughput[i][d].push(result.mib_s);
            }
        }
        for (i, (via, route)) in echo_routes.iter().enumerate() {
            let result =
                measure::dials(route, dial_duration, 1, progress, &format!("{via} dials #{}", rep + 1)).await?;
            dials[i].push(result.per_second);
            dial_p50[i].push(percentiles(&result.histogram)[0].1);
        }
    }
    let version = std::process::Command::new(&binary)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let mut report = Report::new(
        "peer",
        "local",
        serde_json::json!({
            "peer": "rathole", "peer_version": version, "peer_transport": "websocket + TLS (native-tls)",
            "duration_s": args.duration, "dial_duration_s": args.dial_duration, "repeat": args.repeat, "streams": 1,
        }),
    );
    path.shutdown().await;
    drop(rathole);
    let mut table = Table::new(&[
        "path",
        "download MiB/s",
        "upload MiB/s",
        "dials/s",
        "dial p50 us",
        "vs direct (down / up / dials)",
    ]);
    let names = ["direct", "tether", "rathole"];
    let direct = [median(&throughput[0][0]), median(&throughput[0][1]), median(&dials[0])];
    let mut bars: Vec<Line> = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let figures = [median(&throughput[i][0]), median(&throughput[i][1]), median(&dials[i])];
        let keys = ["download_mib_s", "upload_mib_s", "dials_per_s"];
        for (k, key) in keys.iter().enumerate() {
            if i == 0 {
                report.baseline.insert((*key).into(), figures[k]);
            } else {
                report.tunnel.insert(format!("{name}_{key}"), figures[k]);
                report.ratios.insert(format!("{name}_{key}"), ratio(figures[k], direct[k]));
            }
        }
        report.figures.insert(format!("{name}_dial_p50_us"), median(&dial_p50[i]));
        table.row(vec![
            (*name).into(),
            num(figures[0]),
            num(figures[1]),
            num(figures[2]),
            num(median(&dial_p50[i])),
            if i == 0 {
                String::new()
            } else {
                format!(
                    "{} / {} / {}",
                    pct(ratio(figures[0], direct[0])),
                    pct(ratio(figures[1], direct[1])),
                    pct(ratio(figures[2], direct[2]))
                )
            },
        ]);
        if i > 0 {
            bars.push(Line {
                name: (*name).into(),
                points: (0..3).map(|k| (k as f64, 100.0 * ratio(figures[k], direct[k]))).collect(),
                dashed: false,
            });
        }
    }
    report.machine.load_average_end = crate::report::load_average();
    report.elapsed_s = started.elapsed().as_secs_f64();
    let chart = svg::bar_chart(
        &Labels {
            title: "Tether vs rathole (WebSocket + TLS), same run, % of direct loopback TCP",
            x: "",
            y: "% of direct",
        },
        &["download, 1 stream".into(), "upload, 1 stream".into(), "new connections/s".into()],
        &bars,
    );
    Ok(Outcome { report, table: table.render(), charts: vec![("peer.svg".into(), chart)] })
}
