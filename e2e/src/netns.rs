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

    /// A command that runs `program` inside the namespace.
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name, program]);
        command
    }

    /// Runs `sh -c script` inside the namespace.
    pub fn sh(&self, script: &str) -> Output {
        self.command("sh").args(["-c", script]).output().expect("run sh in namespace")
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
