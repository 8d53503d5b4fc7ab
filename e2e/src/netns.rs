//! Network namespaces and veth links for tests that need an isolated topology (root only).

use std::process::{Command, Output};

/// Whether this process may create network namespaces (root).
pub fn available() -> bool {
    Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false)
        && Command::new("ip").arg("-V").output().is_ok()
}

/// Runs `ip` with arguments, panicking with its output on failure.
pub fn ip(args: &[&str]) {
    let output = Command::new("ip").args(args).output().expect("run ip");
    assert!(output.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&output.stderr));
}

/// A child process killed when dropped.
pub struct ChildGuard {
    child: std::process::Child,
    /// Its log file.
    pub log: std::path::PathBuf,
}

impl ChildGuard {
    /// The log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A network namespace, deleted (with its interfaces) when dropped.
pub struct Netns {
    /// Its name.
    pub name: String,
}

impl Netns {
    /// Creates `<prefix>-<random>` with loopback up.
    pub fn new(prefix: &str) -> Self {
        let name = format!("{prefix}-{:06x}", fastrand::u32(..0xff_ffff));
        ip(&["netns", "add", &name]);
        let ns = Self { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// Runs `ip` inside the namespace.
    pub fn ip(&self, args: &[&str]) {
        let mut full = vec!["netns", "exec", &self.name, "ip"];
        full.extend_from_slice(args);
        ip(&full);
    }

    /// A command that runs `program` inside the namespace (stdin and stdout closed).
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.name, program])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null());
        command
    }

    /// Starts the agent binary inside the namespace with `config`, logging to `log`; the process
    /// is killed when the guard drops.
    pub fn spawn_agent(&self, config: &serde_json::Value, dir: &std::path::Path, name: &str) -> ChildGuard {
        let file = dir.join(format!("{name}.yaml"));
        std::fs::write(&file, config.to_string()).expect("agent config");
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).expect("agent log");
        let child = self
            .command(crate::bins::bin_path("tether-agent").to_str().unwrap_or_default())
            .args(["-c", file.to_str().unwrap_or_default()])
            .stderr(log)
            .spawn()
            .expect("start tether-agent in the namespace");
        ChildGuard { child, log: dir.join(format!("{name}.log")) }
    }

    /// Runs `sh -c script` inside the namespace.
    pub fn sh(&self, script: &str) -> Output {
        self.command("sh")
            .args(["-c", script])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .output()
            .expect("run sh in namespace")
    }

    /// Links this namespace to the root namespace with a veth pair: `inner` here with
    /// `inner_addr` (CIDR), `outer` in the root namespace with `outer_addr` (CIDR).
    pub fn link_to_root(&self, outer: &str, outer_addr: &str, inner: &str, inner_addr: &str) {
        ip(&["link", "add", outer, "type", "veth", "peer", "name", inner]);
        ip(&["link", "set", inner, "netns", &self.name]);
        ip(&["addr", "add", outer_addr, "dev", outer]);
        ip(&["link", "set", outer, "up"]);
        self.ip(&["addr", "add", inner_addr, "dev", inner]);
        self.ip(&["link", "set", inner, "up"]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}
