//! The real `tether-gateway` and `tether-agent` binaries as child processes, with generated dev
//! credentials and configuration, and what the memory scenarios read about them (VmRSS, metrics).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

use crate::devpki::{DevCa, DevIssuer, IssuerKey, PemPair, write_private};
use crate::local::{AUDIENCE, ScratchDir};

/// The tenant host name the generated gateways serve.
pub const TENANT_HOST: &str = "load.tether.local";

/// Finds a workspace binary: the explicit path, else next to this executable.
pub fn find_binary(name: &str, explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(path) = explicit {
        anyhow::ensure!(path.exists(), "{} does not exist", path.display());
        return Ok(path.to_owned());
    }
    let exe = std::env::current_exe().context("cannot find the path of this executable")?;
    let candidate = exe.parent().map(|dir| dir.join(name)).context("executable has no directory")?;
    anyhow::ensure!(
        candidate.exists(),
        "{} not found next to tether-loadtest; build it (cargo build --release -p tether-gateway -p tether-agent) or pass --{}-bin",
        candidate.display(),
        name.trim_start_matches("tether-")
    );
    Ok(candidate)
}

/// Dev CA, issuer and gateway certificate in a scratch directory.
pub struct Credentials {
    /// Where everything is written (removed on drop).
    pub dir: ScratchDir,
    /// Signs the gateway certificate.
    pub ca: DevCa,
    /// Signs agent tokens; its JWKS is the tenant's.
    pub issuer: DevIssuer,
    /// The gateway's server certificate.
    pub cert: PemPair,
}

impl Credentials {
    /// Generates everything.
    pub fn create(prefix: &str) -> anyhow::Result<Self> {
        let dir = ScratchDir::new(prefix)?;
        let ca = DevCa::create(dir.path(), "loadtest")?;
        let issuer = DevIssuer::create(dir.path(), "load", "https://issuer.load.local", IssuerKey::Es256)?;
        let cert = ca.server("gateway", &[TENANT_HOST, "localhost", "127.0.0.1"])?;
        Ok(Self { dir, ca, issuer, cert })
    }

    /// A ServiceAccount token bound to `node`, valid for a day.
    pub fn token(&self, node: &str) -> anyhow::Result<String> {
        self.issuer.service_account_token(
            "kube-system",
            "tether-agent",
            AUDIENCE,
            Duration::from_secs(24 * 3600),
            Some(node),
        )
    }
}

/// Addresses of a generated gateway.
#[derive(Debug, Clone, Copy)]
pub struct GatewayPorts {
    /// Agent endpoint (TLS).
    pub agents: SocketAddr,
    /// Admin endpoint.
    pub admin: SocketAddr,
    /// The tenant's TCP CONNECT frontend.
    pub frontend: SocketAddr,
}

impl GatewayPorts {
    /// Free loopback ports.
    pub fn pick() -> anyhow::Result<Self> {
        Ok(Self { agents: free_loopback()?, admin: free_loopback()?, frontend: free_loopback()? })
    }
}

/// Lowest port [`free_loopback`] hands out.
const FIXED_PORTS_FROM: u16 = 10_000;

/// A free loopback address for a child process to listen on: bound once to check, then released.
///
/// The port is taken below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`): a port
/// from that range (what binding port 0 returns) may be handed to any outgoing connection between
/// the check and the child's own bind - and load tests open thousands per second - which made
/// children fail with "address already in use". A port is handed out at most once per process,
/// and reserved across processes (test runners run several at once) by a file named after it in
/// `$TMPDIR/tether-test-ports` holding the owner's pid, reclaimed once that process is gone.
/// Falls back to an ephemeral port when the range below is too small or full.
pub fn free_loopback() -> anyhow::Result<SocketAddr> {
    static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next().and_then(|low| low.parse::<u16>().ok()))
        .unwrap_or(32_768);
    if ephemeral_from > FIXED_PORTS_FROM + 1_000 {
        for _ in 0..256 {
            let port = fastrand::u16(FIXED_PORTS_FROM..ephemeral_from);
            let mut handed_out = HANDED_OUT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if handed_out.contains(&port) || !reserve_across_processes(port) {
                continue;
            }
            if let Ok(listener) = std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, port)) {
                handed_out.insert(port);
                return Ok(listener.local_addr()?);
            }
        }
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("cannot bind a loopback port")?;
    Ok(listener.local_addr()?)
}

/// Claims `port` for this process unless a live process holds it (see [`free_loopback`]).
fn reserve_across_processes(port: u16) -> bool {
    use std::io::Write as _;
    let dir = std::env::temp_dir().join("tether-test-ports");
    if std::fs::create_dir_all(&dir).is_err() {
        return true;
    }
    let file = dir.join(port.to_string());
    for _ in 0..2 {
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&file) {
            Ok(mut claim) => {
                let _ = write!(claim, "{}", std::process::id());
                return true;
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let owner = std::fs::read_to_string(&file).ok().and_then(|pid| pid.trim().parse::<u32>().ok());
                let alive = owner.is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
                if alive {
                    return false;
                }
                // Its owner is gone: reclaim it.
                let _ = std::fs::remove_file(&file);
            }
            Err(_) => return true,
        }
    }
    false
}

/// Limits for a generated gateway.
#[derive(Debug, Clone, Copy)]
pub struct GatewaySizing {
    /// Agent sessions (global and tenant limit).
    pub agents: usize,
    /// Streams per agent session and per tenant.
    pub streams: usize,
}

/// Writes a gateway configuration (JSON text, which is valid YAML) and returns its path.
pub fn write_gateway_config(
    creds: &Credentials,
    ports: &GatewayPorts,
    sizing: GatewaySizing,
) -> anyhow::Result<PathBuf> {
    let config = serde_json::json!({
        "server_id": "gw-loadtest",
        "listen": { "agents": ports.agents.to_string(), "admin": ports.admin.to_string() },
        "tls": { "cert_file": creds.cert.cert, "key_file": creds.cert.key },
        "drain_grace_period": "2s",
        "limits": {
            "max_agent_sessions": sizing.agents + 100,
            "max_streams_per_agent": sizing.streams.max(1024) + 100,
            "handshake_timeout": "30s",
        },
        "log": { "format": "text", "level": "warn" },
        "tenants": [{
            "name": "load",
            "hosts": [TENANT_HOST],
            "auth": {
                "issuer": creds.issuer.issuer,
                "audiences": [AUDIENCE],
                "algorithms": ["ES256"],
                "jwks_file": creds.issuer.jwks_file,
            },
            "frontend": { "tcp": { "listen": ports.frontend.to_string() } },
            "limits": {
                "max_agents": sizing.agents + 100,
                "max_streams": sizing.streams.max(1024) * 2 + 100,
                "max_pending_dials": 1000,
                // The harness measures the gateway, not its per-tenant dial rate limit.
                "dials_per_second": 0,
            },
        }],
    });
    let path = creds.dir.path().join("gateway.yaml");
    std::fs::write(&path, serde_json::to_string_pretty(&config)?)?;
    Ok(path)
}

/// Writes an agent configuration allowing `allowed` and returns its path.
pub fn write_agent_config(
    creds: &Credentials,
    ports: &GatewayPorts,
    admin: SocketAddr,
    allowed: SocketAddr,
) -> anyhow::Result<PathBuf> {
    let spec = AgentProcessSpec { name: "node-1", admin, allowed: vec![allowed], listeners: vec![] };
    Ok(write_named_agent_config(creds, ports, &spec)?.config)
}

/// What a generated agent is: its node name, admin address, the node-side targets it may dial
/// (their IP addresses are the ones it declares) and its node -> control-plane listeners.
#[derive(Debug, Clone)]
pub struct AgentProcessSpec<'a> {
    /// Node name (`agent_id` and the token's node claim).
    pub name: &'a str,
    /// Admin endpoint (`/readyz`, `/metrics`).
    pub admin: SocketAddr,
    /// Targets the gateway may dial through it.
    pub allowed: Vec<SocketAddr>,
    /// (listen address, target name) pairs.
    pub listeners: Vec<(SocketAddr, &'a str)>,
}

/// The files of a generated agent.
#[derive(Debug, Clone)]
pub struct AgentFiles {
    /// Its configuration.
    pub config: PathBuf,
    /// Its token file (rewrite it to rotate the token).
    pub token: PathBuf,
    /// Its log.
    pub log: PathBuf,
}

/// Writes the configuration and token of the agent `spec` describes (files named after it).
pub fn write_named_agent_config(
    creds: &Credentials,
    ports: &GatewayPorts,
    spec: &AgentProcessSpec<'_>,
) -> anyhow::Result<AgentFiles> {
    let file = |extension: &str| creds.dir.path().join(format!("{}.{extension}", spec.name));
    let files = AgentFiles { config: file("yaml"), token: file("token"), log: file("log") };
    write_private(&files.token, creds.token(spec.name)?.as_bytes())?;
    let mut addresses: Vec<String> = spec.allowed.iter().map(|a| a.ip().to_string()).collect();
    addresses.sort();
    addresses.dedup();
    let allow: Vec<serde_json::Value> = spec
        .allowed
        .iter()
        .map(|a| serde_json::json!({ "cidr": format!("{}/32", a.ip()), "ports": [a.port()] }))
        .collect();
    let listeners: Vec<serde_json::Value> =
        spec.listeners.iter().map(|(bind, target)| serde_json::json!({ "bind": bind, "target": target })).collect();
    let config = serde_json::json!({
        "agent_id": spec.name,
        "gateway": {
            "url": format!("wss://{}/v1/tunnel", ports.agents),
            "server_name": TENANT_HOST,
            "token_file": files.token,
            "ca_file": creds.ca.ca_cert,
            "reconnect_initial": "100ms",
            "reconnect_max": "1s",
            "token_check_interval": "2s",
            // A busy session retires 5 s after the bulk traffic that brought it, so after a
            // soak's load the agent is back at one session well inside the settle wait.
            "pool": { "busy_linger": "5s" },
        },
        "admin_listen": spec.admin.to_string(),
        "identifiers": { "addresses": addresses },
        "allow": allow,
        "listeners": listeners,
        "shutdown_grace_period": "2s",
        "log": { "format": "text", "level": "warn" },
    });
    std::fs::write(&files.config, serde_json::to_string_pretty(&config)?)?;
    Ok(files)
}

/// A child process, killed when dropped; stderr goes to a log file.
pub struct ChildProcess {
    child: Child,
    /// Its process id.
    pub pid: u32,
    /// Its stderr.
    pub log: PathBuf,
}

impl ChildProcess {
    /// Starts `binary --config config`.
    pub fn spawn(binary: &Path, config: &Path, log: &Path) -> anyhow::Result<Self> {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        let child = Command::new(binary)
            .arg("--config")
            .arg(config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start {}", binary.display()))?;
        let pid = child.id().context("child exited at once")?;
        Ok(Self { child, pid, log: log.to_owned() })
    }

    /// Kills it (SIGKILL: a crash, no drain) and reaps it.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }

    /// Stops it the way Kubernetes does: SIGTERM, then SIGKILL if it has not exited after
    /// `grace`. Returns whether it exited on its own.
    pub async fn terminate(&mut self, grace: Duration) -> bool {
        let sent = Command::new("kill").arg("-TERM").arg(self.pid.to_string()).status().await;
        if sent.is_ok_and(|s| s.success()) && tokio::time::timeout(grace, self.child.wait()).await.is_ok() {
            return true;
        }
        self.kill().await;
        false
    }

    /// The last lines of its log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

/// Waits until `GET path` on `addr` answers 200.
pub async fn wait_ready(
    process: &mut ChildProcess,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Ok((200, _)) = http_get(addr, path).await {
            return Ok(());
        }
        if !process.running() {
            anyhow::bail!("process {} exited:\n{}", process.pid, process.log_tail());
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("{addr}{path} not ready after {timeout:?}:\n{}", process.log_tail());
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A plain HTTP/1.1 GET; returns the status and body.
pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut response))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "slow HTTP answer"))??;
    let status = response.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    Ok((status, body))
}

/// The sum of a Prometheus metric's samples on `addr`'s `/metrics`.
pub async fn metric(addr: SocketAddr, name: &str) -> Option<f64> {
    metric_in(&scrape(addr).await?, name, None)
}

/// The text of `addr`'s `/metrics`, if it answers 200.
pub async fn scrape(addr: SocketAddr) -> Option<String> {
    match http_get(addr, "/metrics").await {
        Ok((200, text)) => Some(text),
        _ => None,
    }
}

/// The sum of a metric's samples in a scraped exposition, only those carrying `label` (e.g.
/// `result="ok"`) if given; `None` when there is no such sample.
pub fn metric_in(text: &str, name: &str, label: Option<&str>) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| label.is_none_or(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .collect();
    if values.is_empty() { None } else { Some(values.iter().sum()) }
}

/// Resident memory of a process in KiB (VmRSS from /proc/<pid>/status).
pub fn rss_kib(pid: u32) -> Option<u64> {
    status_field(pid, "VmRSS:")
}

/// Open file descriptors of a process.
pub fn open_fds(pid: u32) -> Option<usize> {
    std::fs::read_dir(format!("/proc/{pid}/fd")).ok().map(|d| d.count())
}

fn status_field(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok())
}

/// Resident memory of this process in KiB.
pub fn own_rss_kib() -> u64 {
    rss_kib(std::process::id()).unwrap_or(0)
}

/// Raises the soft open-file limit to the hard limit; returns the new soft limit.
pub fn raise_fd_limit() -> u64 {
    match rlimit::getrlimit(rlimit::Resource::NOFILE) {
        Ok((_, hard)) => {
            let _ = rlimit::setrlimit(rlimit::Resource::NOFILE, hard, hard);
            rlimit::getrlimit(rlimit::Resource::NOFILE).map(|l| l.0).unwrap_or(0)
        }
        Err(_) => 0,
    }
}
