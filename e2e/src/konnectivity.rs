//! A kube-apiserver stand-in for the gRPC egress mode: `e2e/tests/fixtures/konnectivity_client.py`,
//! Python grpcio with stubs generated from `gateway/proto/konnectivity.proto` by grpcio-tools
//! (both installed by `scripts/install-test-deps.sh` into Tether's tools directory).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};

use crate::helm::{repo_root, tools_dir};

/// The Python that has grpcio: the tools venv's, else the system's.
pub fn python() -> PathBuf {
    let venv = tools_dir().join("venv/bin/python");
    if venv.exists() { venv } else { PathBuf::from("python3") }
}

/// How the client reaches the gateway.
#[derive(Debug, Clone)]
pub struct GrpcClient {
    transport: Vec<String>,
}

impl GrpcClient {
    /// Over a Unix socket (cleartext HTTP/2, as kube-apiserver's `transport.uds`).
    pub fn uds(path: &Path) -> Self {
        Self { transport: vec!["--uds".into(), path.display().to_string()] }
    }

    /// Over TCP with mutual TLS (as kube-apiserver's `transport.tcp` with `tlsConfig`).
    pub fn mtls(addr: std::net::SocketAddr, ca: &Path, cert: &Path, key: &Path, server_name: &str) -> Self {
        let transport = [
            "--tcp".to_owned(),
            addr.to_string(),
            "--ca".into(),
            ca.display().to_string(),
            "--cert".into(),
            cert.display().to_string(),
            "--key".into(),
            key.display().to_string(),
            "--server-name".into(),
            server_name.into(),
        ];
        Self { transport: transport.to_vec() }
    }

    fn command(&self, scenario: &[&str]) -> Command {
        let root = repo_root();
        let mut command = Command::new(python());
        command
            .arg(root.join("e2e/tests/fixtures/konnectivity_client.py"))
            .arg("--proto")
            .arg(root.join("gateway/proto/konnectivity.proto"))
            .args(&self.transport)
            .args(scenario)
            .kill_on_drop(true);
        command
    }

    /// Runs a scenario to its end; its JSON report.
    pub async fn run(&self, scenario: &[&str]) -> Value {
        let output = self.command(scenario).output().await.expect("python for the gRPC client");
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "gRPC client {scenario:?} failed ({}):\n{stdout}\n{stderr}", output.status);
        let last = stdout.lines().last().unwrap_or_default();
        serde_json::from_str(last).unwrap_or_else(|e| panic!("gRPC client report {last:?}: {e}\n{stderr}"))
    }

    /// Starts a scenario that reports, then waits until its stdin is closed.
    pub fn spawn(&self, scenario: &[&str]) -> (Child, BufReader<ChildStdout>) {
        let mut child = self
            .command(scenario)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python for the gRPC client");
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        (child, stdout)
    }
}

/// The next report line of a spawned scenario.
pub async fn next_report(stdout: &mut BufReader<ChildStdout>) -> Value {
    let mut line = String::new();
    stdout.read_line(&mut line).await.expect("reading the gRPC client");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("gRPC client report {line:?}: {e}"))
}
