//! `tether-demo`: a complete Tether deployment on loopback, with traffic pushed through it.
//!
//! Generates a CA, certificates and a dev token signing key, starts a gateway (TLS agent
//! endpoint, CONNECT frontends on TCP and a Unix socket) and two agents, each in front of a sample
//! node-side HTTP server, plus a TLS server standing in for the tenant's kube-apiserver that the
//! nodes reach through their agents (node -> control plane). Pushes traffic both ways, prints a
//! report and commands to try, and runs until Ctrl-C.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use hdrhistogram::Histogram;
use tether_agent::config::ListenerConfig;
use tether_gateway::config::{ForwardTarget, NodeToControlPlane};
use tether_loadtest::backends;
use tether_loadtest::connect_client::connect_tcp;
use tether_loadtest::devpki::{DevCa, PemPair};
use tether_loadtest::local::{AgentSpec, LocalDeployment, LocalOptions, allow};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How long one request of a check may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the bulk transfer may take (both ways, at the largest `--bulk-mib` anyone would try).
const BULK_TIMEOUT: Duration = Duration::from_secs(300);

/// Runs a complete local Tether deployment with generated credentials and shows it working.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// First port to use: gateway agent endpoint = base, CONNECT frontend = base+1, gateway admin
    /// = base+2, node servers = base+10 and base+11, kube-apiserver stand-in = base+12, agent
    /// node -> control-plane listener = base+13.
    #[arg(long, default_value_t = 18440)]
    base_port: u16,
    /// Exit after the report instead of waiting for Ctrl-C.
    #[arg(long)]
    once: bool,
    /// Dials to push through each frontend.
    #[arg(long, default_value_t = 200)]
    dials: usize,
    /// Size of each bulk transfer, MiB.
    #[arg(long, default_value_t = 64)]
    bulk_mib: u64,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let _ = tether_tunnel::telemetry::init_logging(tether_tunnel::telemetry::LogFormat::Text, "warn");
    match run(cli).await {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("tether-demo: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

struct Node {
    id: &'static str,
    addr: SocketAddr,
}

async fn run(cli: Cli) -> anyhow::Result<bool> {
    let base = cli.base_port;
    anyhow::ensure!(base < 65000, "--base-port must leave room for 20 ports below 65535");
    println!(
        "Tether demo: one gateway, two agents, node-side servers and a kube-apiserver stand-in, all on loopback.\n"
    );
    let mut nodes = Vec::new();
    for (i, id) in ["node-1", "node-2"].into_iter().enumerate() {
        let ip = IpAddr::from([127, 0, 1, i as u8 + 1]);
        let addr = SocketAddr::new(ip, base + 10);
        let listener =
            TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr} (try --base-port)"))?;
        backends::spawn_http(listener, id.into());
        nodes.push(Node { id, addr });
    }
    let bulk_addr = SocketAddr::new(IpAddr::from([127, 0, 1, 1]), base + 11);
    backends::spawn_bulk(TcpListener::bind(bulk_addr).await.with_context(|| format!("cannot listen on {bulk_addr}"))?);

    let agents = nodes
        .iter()
        .map(|node| {
            let mut ports = vec![node.addr.port()];
            if node.addr.ip() == bulk_addr.ip() {
                ports.push(bulk_addr.port());
            }
            AgentSpec {
                id: node.id.into(),
                addresses: vec![node.addr.ip()],
                allow: vec![allow(node.addr.ip(), &ports)],
                default_route: false,
            }
        })
        .collect();
    // A stand-in for the tenant's kube-apiserver in the "control plane": TLS with its own CA.
    let kas_dir = tether_loadtest::local::ScratchDir::new("tether-demo-kas")?;
    let kas_ca = DevCa::create(kas_dir.path(), "kube-apiserver")?;
    let kas_addr = SocketAddr::new(IpAddr::from([127, 0, 2, 1]), base + 12);
    let kas_cert = kas_ca.server("kube-apiserver", &["kubernetes.default.svc", "127.0.3.1"])?;
    spawn_kas(&kas_cert, kas_addr).await?;
    let listener_addr = SocketAddr::new(IpAddr::from([127, 0, 3, 1]), base + 13);

    let (agents_port, frontend_port, admin_port) = (base, base + 1, base + 2);
    let deployment = LocalDeployment::start(LocalOptions {
        agents,
        tweak_gateway: Some(Box::new(move |config| {
            config.listen.agents = loopback(agents_port);
            config.listen.admin = loopback(admin_port);
            for tenant in &mut config.tenants {
                if let Some(tcp) = tenant.frontend.tcp.as_mut() {
                    tcp.listen = loopback(frontend_port);
                }
                tenant.node_to_controlplane = Some(NodeToControlPlane {
                    targets: vec![ForwardTarget {
                        name: "kube-apiserver".into(),
                        address: kas_addr.to_string(),
                        allowed_networks: vec![],
                    }],
                });
            }
        })),
        // The Unix socket speaks Konnectivity's gRPC protocol, as in Kubernetes' documented
        // konnectivity set-up; the TCP frontend speaks CONNECT.
        uds_protocol: tether_gateway::config::FrontendProtocol::Grpc,
        tweak_agent: Some(std::sync::Arc::new(move |id, config| {
            if id == "node-1" {
                config.listeners = vec![ListenerConfig::new(listener_addr, "kube-apiserver")];
            }
        })),
        ..LocalOptions::default()
    })
    .await
    .context("starting the gateway (ports in use? try --base-port)")?;
    deployment.wait_connected(Duration::from_secs(15)).await?;
    println!("  credentials   {} (CA, certificates, dev signing key, agent tokens)", deployment.dir.path().display());
    println!("  gateway       wss://{} (TLS, tenant host demo.tether.local)", deployment.agent_addr);
    println!(
        "  frontends     TCP {} (HTTP CONNECT)  |  Unix socket {} (gRPC)",
        deployment.frontend_addr,
        deployment.frontend_uds.display()
    );
    println!("  admin         http://{}/metrics", deployment.admin_addr);
    println!("  control plane kube-apiserver stand-in at {kas_addr} (TLS, its own CA)");
    println!("  node -> CP    agent node-1 listens on {listener_addr} -> target kube-apiserver");
    for (node, agent) in nodes.iter().zip(&deployment.agents) {
        println!(
            "  agent {}    serves {} (admin http://{})",
            node.id,
            node.addr,
            agent.admin.map(|a| a.to_string()).unwrap_or_default()
        );
    }
    println!("\nPushing traffic through the tunnel...\n");

    let mut all_ok = true;
    let tcp = dial_round(&cli, &nodes, Frontend::Tcp(deployment.frontend_addr)).await;
    let uds = dial_round(&cli, &nodes, Frontend::GrpcUnix(&deployment.frontend_uds)).await;
    let bulk = within(BULK_TIMEOUT, bulk_round(deployment.frontend_addr, bulk_addr, cli.bulk_mib << 20)).await;
    let refused = within(REQUEST_TIMEOUT, check_refusal(deployment.frontend_addr)).await;
    let upstream = node_to_controlplane(listener_addr, &kas_ca.ca_cert, cli.dials.min(50)).await;

    println!("  {:<38} {:>8} {:>10} {:>10} {:>10}", "check", "result", "p50", "p99", "rate");
    for (name, round) in [("CONNECT dials via TCP frontend", &tcp), ("gRPC dials via Unix socket", &uds)] {
        all_ok &= round.failures == 0;
        println!(
            "  {:<38} {:>8} {:>10} {:>10} {:>10}",
            name,
            format!("{}/{}", round.ok, round.ok + round.failures),
            micros(round.latency.value_at_quantile(0.5)),
            micros(round.latency.value_at_quantile(0.99)),
            format!("{:.0}/s", round.per_second),
        );
    }
    match &bulk {
        Ok((down, up)) => println!(
            "  {:<38} {:>8} {:>21} {:>10}",
            format!("{} MiB down + up, checksummed", cli.bulk_mib),
            "ok",
            format!("{down:.0} / {up:.0} MiB/s"),
            ""
        ),
        Err(e) => {
            all_ok = false;
            println!("  bulk transfer FAILED: {e}");
        }
    }
    match &upstream {
        Ok(round) => {
            all_ok &= round.failures == 0;
            println!(
                "  {:<38} {:>8} {:>10} {:>10} {:>10}",
                "node -> control plane, TLS end to end",
                format!("{}/{}", round.ok, round.ok + round.failures),
                micros(round.latency.value_at_quantile(0.5)),
                micros(round.latency.value_at_quantile(0.99)),
                format!("{:.0}/s", round.per_second),
            );
        }
        Err(e) => {
            all_ok = false;
            println!("  node -> control plane FAILED: {e}");
        }
    }
    match &refused {
        Ok(reason) => println!("  {:<38} {:>8}   {}", "target off the allow list", "refused", reason),
        Err(e) => {
            all_ok = false;
            println!("  allow-list check FAILED: {e}");
        }
    }
    println!();
    if all_ok {
        println!("All checks passed.");
    } else {
        println!("Some checks FAILED; see above.");
    }

    let node = &nodes[1];
    println!("\nTry it yourself (the deployment keeps running):\n");
    println!("  curl -p -x http://{} http://{}/hello", deployment.frontend_addr, node.addr);
    println!("  curl -p -x http://{} http://{}/logs", deployment.frontend_addr, nodes[0].addr);
    println!(
        "  cargo run --release -p tether-loadtest -- dial-rate --grpc   # CONNECT vs gRPC frontend: new connections/s"
    );
    println!(
        "  curl --cacert {} --resolve kubernetes.default.svc:{}:{} https://kubernetes.default.svc:{}/version",
        kas_ca.ca_cert.display(),
        listener_addr.port(),
        listener_addr.ip(),
        listener_addr.port()
    );
    println!("  curl -s http://{}/metrics | grep ^tether_gateway", deployment.admin_addr);
    println!("  curl -s http://{}/readyz", deployment.admin_addr);
    if cli.once {
        deployment.shutdown().await;
        return Ok(all_ok);
    }
    // Ctrl-C, or SIGTERM (`kill`, `timeout`, a service manager): either stops the deployment and
    // removes its temporary credentials. The handlers are in place before the demo says it is
    // ready, so a signal sent the moment it does is not the default action (no clean-up).
    let stop = tether_tunnel::cli::stop_signal();
    println!("\nPress Ctrl-C to stop.");
    match stop {
        Ok(stop) => stop.await,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    println!("\nStopping: agents, then the gateway drains.");
    deployment.shutdown().await;
    Ok(all_ok)
}

enum Frontend<'a> {
    Tcp(SocketAddr),
    GrpcUnix(&'a Path),
}

struct Round {
    ok: usize,
    failures: usize,
    latency: Histogram<u64>,
    per_second: f64,
}

/// Sequential CONNECT + request + response, alternating between the nodes.
async fn dial_round(cli: &Cli, nodes: &[Node], frontend: Frontend<'_>) -> Round {
    let mut latency = tether_loadtest::latency_histogram();
    let (mut ok, mut failures) = (0, 0);
    let started = Instant::now();
    for i in 0..cli.dials {
        let node = &nodes[i % nodes.len()];
        let begin = Instant::now();
        let answer = async {
            match &frontend {
                Frontend::Tcp(addr) => match connect_tcp(*addr, &node.addr.to_string()).await {
                    Ok(Ok(stream)) => request(stream).await,
                    Ok(Err(refused)) => Err(refused.to_string()),
                    Err(e) => Err(e.to_string()),
                },
                Frontend::GrpcUnix(path) => match tokio::net::UnixStream::connect(path).await {
                    Ok(stream) => match tether_loadtest::grpc_client::dial(stream, &node.addr.to_string()).await {
                        Ok(Ok(conn)) => request(conn).await,
                        Ok(Err(refused)) => Err(refused),
                        Err(e) => Err(e.to_string()),
                    },
                    Err(e) => Err(e.to_string()),
                },
            }
        };
        match within(REQUEST_TIMEOUT, answer).await {
            Ok(body) if body.contains(node.id) => {
                ok += 1;
                let _ = latency.record(u64::try_from(begin.elapsed().as_micros()).unwrap_or(u64::MAX).max(1));
            }
            Ok(body) => {
                failures += 1;
                eprintln!("unexpected answer: {body}");
            }
            Err(e) => {
                failures += 1;
                eprintln!("dial failed: {e}");
            }
        }
    }
    let per_second = ok as f64 / started.elapsed().as_secs_f64().max(1e-9);
    Round { ok, failures, latency, per_second }
}

async fn request<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(mut stream: S) -> Result<String, String> {
    tether_tunnel::transport::send_all(&mut stream, b"GET /demo HTTP/1.1\r\nHost: node\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.map_err(|e| e.to_string())?;
    Ok(response)
}

/// Download then upload `bytes` through the tunnel, verifying content and count; MiB/s each way.
async fn bulk_round(frontend: SocketAddr, bulk: SocketAddr, bytes: u64) -> Result<(f64, f64), String> {
    let mut tunnel =
        connect_tcp(frontend, &bulk.to_string()).await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    let started = Instant::now();
    tunnel.write_all(b"D").await.map_err(|e| e.to_string())?;
    tunnel.write_all(&bytes.to_be_bytes()).await.map_err(|e| e.to_string())?;
    let pattern = backends::pattern(256 * 1024);
    let mut buf = vec![0u8; 256 * 1024];
    let mut received: u64 = 0;
    loop {
        let n = tunnel.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        // Compare against the pattern in at most a few slice comparisons per read.
        let mut checked = 0;
        while checked < n {
            let at = ((received + checked as u64) % pattern.len() as u64) as usize;
            let len = (n - checked).min(pattern.len() - at);
            if buf[checked..checked + len] != pattern[at..at + len] {
                return Err(format!("bytes near offset {} differ", received + checked as u64));
            }
            checked += len;
        }
        received += n as u64;
    }
    if received != bytes {
        return Err(format!("downloaded {received} of {bytes} bytes"));
    }
    let down = mib_per_s(bytes, started.elapsed());

    let mut tunnel =
        connect_tcp(frontend, &bulk.to_string()).await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    let started = Instant::now();
    tunnel.write_all(b"U").await.map_err(|e| e.to_string())?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(pattern.len() as u64) as usize;
        tunnel.write_all(&pattern[..n]).await.map_err(|e| e.to_string())?;
        left -= n as u64;
    }
    tunnel.shutdown().await.map_err(|e| e.to_string())?;
    let mut count = [0u8; 8];
    tunnel.read_exact(&mut count).await.map_err(|e| e.to_string())?;
    if u64::from_be_bytes(count) != bytes {
        return Err(format!("the node received {} of {bytes} bytes", u64::from_be_bytes(count)));
    }
    Ok((down, mib_per_s(bytes, started.elapsed())))
}

/// A dial to a port no agent allows must be refused with a reason.
async fn check_refusal(frontend: SocketAddr) -> Result<String, String> {
    match connect_tcp(frontend, "127.0.1.1:22").await {
        Ok(Err(refused)) if refused.status == 403 => Ok(format!("403: {}", truncate(&refused.reason, 60))),
        Ok(Err(refused)) => Err(format!("expected 403, got {}: {}", refused.status, refused.reason)),
        Ok(Ok(_)) => Err("the dial was allowed".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Serves `GET /version` over TLS with the kube-apiserver stand-in's own certificate.
async fn spawn_kas(cert: &PemPair, addr: SocketAddr) -> anyhow::Result<()> {
    let resolver = tether_tunnel::tls::ReloadableCert::load(&cert.cert, &cert.key)?;
    let config = tether_tunnel::tls::server_config(resolver, None, &[b"http/1.1"])?;
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(stream).await else { return };
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                    match tls.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let sni = tls.get_ref().1.server_name().unwrap_or("-").to_owned();
                let body = format!(
                    "{{\"major\":\"1\",\"minor\":\"31\",\"gitVersion\":\"v1.31.0-tether-demo\",\"sni\":\"{sni}\"}}\n"
                );
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = tls.write_all(response.as_bytes()).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    Ok(())
}

/// Node-side clients reach the kube-apiserver through the agent's listener, verifying its own
/// certificate (the tunnel never terminates TLS).
async fn node_to_controlplane(listener: SocketAddr, kas_ca: &Path, requests: usize) -> Result<Round, String> {
    let roots = tether_tunnel::tls::ClientRoots { ca_file: Some(kas_ca.to_owned()), system_roots: false };
    let config = tether_tunnel::tls::client_config(&roots, None, &[b"http/1.1"]).map_err(|e| e.to_string())?;
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let mut latency = tether_loadtest::latency_histogram();
    let (mut ok, mut failures) = (0, 0);
    let started = Instant::now();
    for _ in 0..requests {
        let begin = Instant::now();
        let attempt = async {
            let tcp = tokio::net::TcpStream::connect(listener).await.map_err(|e| e.to_string())?;
            let name = rustls_pki_types::ServerName::try_from("kubernetes.default.svc").map_err(|e| e.to_string())?;
            let mut tls = connector.connect(name, tcp).await.map_err(|e| format!("TLS: {e}"))?;
            tether_tunnel::transport::send_all(
                &mut tls,
                b"GET /version HTTP/1.1\r\nHost: kubernetes.default.svc\r\n\r\n",
            )
            .await
            .map_err(|e| e.to_string())?;
            let mut response = String::new();
            tls.read_to_string(&mut response).await.map_err(|e| e.to_string())?;
            if response.contains("v1.31.0-tether-demo") && response.contains("\"sni\":\"kubernetes.default.svc\"") {
                Ok(())
            } else {
                Err(format!("unexpected answer: {response}"))
            }
        };
        match within(REQUEST_TIMEOUT, attempt).await {
            Ok(()) => {
                ok += 1;
                let _ = latency.record(u64::try_from(begin.elapsed().as_micros()).unwrap_or(u64::MAX).max(1));
            }
            Err(e) => {
                failures += 1;
                eprintln!("node -> control plane request failed: {e}");
            }
        }
    }
    if ok == 0 {
        return Err(format!("all {failures} requests failed"));
    }
    Ok(Round { ok, failures, latency, per_second: ok as f64 / started.elapsed().as_secs_f64().max(1e-9) })
}

/// A check that stalls is a failure to report, not a demo that hangs.
async fn within<T>(limit: Duration, check: impl Future<Output = Result<T, String>>) -> Result<T, String> {
    tokio::time::timeout(limit, check).await.unwrap_or_else(|_| Err(format!("no answer within {} s", limit.as_secs())))
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n { s.to_owned() } else { format!("{}...", s.chars().take(n).collect::<String>()) }
}

fn mib_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / (1024.0 * 1024.0) / elapsed.as_secs_f64().max(1e-9)
}

fn micros(us: u64) -> String {
    if us >= 10_000 { format!("{:.1} ms", us as f64 / 1000.0) } else { format!("{us} us") }
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}
