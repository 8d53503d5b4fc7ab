//! Running the real `tether-gateway` and `tether-agent` binaries with generated configuration.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Path of a workspace binary next to the test executable (`target/<profile>/<name>`).
pub fn bin_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile> directory");
    let path = profile_dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first (cargo build --workspace --bins, as scripts/test.sh does)",
        path.display()
    );
    path
}

/// A child process that is killed when dropped; its stderr goes to a log file.
pub struct Process {
    child: Child,
    /// Where its stderr goes.
    pub log: PathBuf,
    name: String,
}

impl Process {
    /// Starts `binary` with `args`, logging to `<dir>/<name>.log`.
    pub fn spawn(binary: &str, args: &[&str], env: &[(&str, &str)], dir: &Path, name: &str) -> std::io::Result<Self> {
        let log = dir.join(format!("{name}.log"));
        let stderr = std::fs::File::create(&log)?;
        let mut command = Command::new(bin_path(binary));
        command.args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(stderr);
        command.env("RUST_LOG", "info");
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command.spawn()?;
        Ok(Self { child, log, name: name.to_owned() })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let _ = Command::new("kill").arg("-TERM").arg(self.pid().to_string()).status();
    }

    /// Waits up to `timeout` for the process to exit.
    pub async fn wait(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if tokio::time::Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The process's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!("---- {} log ----\n{}", self.name, self.log_text());
        }
    }
}

/// A plain HTTP/1.1 GET; returns the status and body.
pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    Ok((status, body))
}

/// Polls `GET path` until it answers 200 or `timeout` passes.
pub async fn wait_ready(addr: SocketAddr, path: &str, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if let Ok((200, _)) = http_get(addr, path).await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// A free loopback TCP port for a child process, below the ephemeral range so that no outgoing
/// connection takes it before the child binds it (see `tether_loadtest::procs::free_loopback`).
pub fn free_port() -> u16 {
    tether_loadtest::procs::free_loopback().map(|a| a.port()).unwrap_or(0)
}

/// The value of an unlabelled or labelled sample in Prometheus text, summed over series.
pub fn metric_sum(text: &str, name: &str, label_filter: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| l.contains(label_filter))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// Writes `config` (JSON, which is valid YAML) to `<dir>/<name>.yaml` and starts the gateway
/// binary on it; waits for `/readyz` on `admin`.
pub async fn start_gateway(dir: &Path, name: &str, config: &serde_json::Value, admin: SocketAddr) -> Process {
    let file = dir.join(format!("{name}.yaml"));
    std::fs::write(&file, config.to_string()).expect("gateway config");
    let gateway = Process::spawn("tether-gateway", &["-c", file.to_str().unwrap_or_default()], &[], dir, name)
        .expect("start tether-gateway");
    assert!(wait_ready(admin, "/readyz", Duration::from_secs(20)).await, "{name} not ready:\n{}", gateway.log_text());
    gateway
}

/// Writes `config` to `<dir>/<name>.yaml` and starts the agent binary on it with `env`.
pub fn start_agent(dir: &Path, name: &str, config: &serde_json::Value, env: &[(&str, &str)]) -> Process {
    let file = dir.join(format!("{name}.yaml"));
    std::fs::write(&file, config.to_string()).expect("agent config");
    Process::spawn("tether-agent", &["-c", file.to_str().unwrap_or_default()], env, dir, name)
        .expect("start tether-agent")
}

/// Polls `check` every 50 ms until it holds or `timeout` passes.
pub async fn eventually(timeout: Duration, mut check: impl AsyncFnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    check().await
}
