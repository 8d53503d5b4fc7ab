//! Third-party daemons for end-to-end tests: squid, tinyproxy and haproxy in the foreground with
//! generated configuration, stopped when dropped.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A child process stopped with SIGTERM (then SIGKILL) when dropped.
pub struct Daemon {
    child: Child,
    name: &'static str,
}

impl Daemon {
    /// Spawns `program args...`, optionally inside network namespace `netns`, logging to
    /// `<dir>/<name>.out`.
    pub fn spawn(name: &'static str, program: &str, args: &[&str], dir: &Path, netns: Option<&str>) -> Self {
        let out = std::fs::File::create(dir.join(format!("{name}.out"))).expect("daemon log");
        let err = out.try_clone().expect("daemon log");
        let mut command = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, program]);
                c
            }
            None => Command::new(program),
        };
        let child = command
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {program}: {e} (scripts/install-test-deps.sh installs it)"));
        Self { child, name }
    }

    /// Stops the daemon and waits for it.
    // Called from Drop, which cannot await; the waits are a few 50 ms naps at most.
    #[allow(clippy::disallowed_methods)]
    pub fn stop(&mut self) {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        for _ in 0..60 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The daemon's name.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A world-writable directory (daemons that drop privileges write logs and pid files there).
pub fn shared_dir(dir: &Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).expect("daemon dir");
    let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777));
    dir.to_owned()
}

/// squid as a corporate proxy requiring Basic auth for `user`/`password`.
pub fn squid(dir: &Path, listen: std::net::SocketAddr, user: &str, password: &str) -> Daemon {
    let dir = shared_dir(dir);
    let htpasswd = dir.join("htpasswd");
    let status = Command::new("htpasswd").args(["-bc", htpasswd.to_str().unwrap_or_default(), user, password]).output();
    assert!(status.is_ok_and(|o| o.status.success()), "htpasswd (apache2-utils) failed");
    let _ = std::fs::set_permissions(&htpasswd, std::os::unix::fs::PermissionsExt::from_mode(0o644));
    let d = dir.display();
    let conf = format!(
        "http_port {listen}\n\
         auth_param basic program /usr/lib/squid/basic_ncsa_auth {d}/htpasswd\n\
         auth_param basic realm tether-test\n\
         acl authenticated proxy_auth REQUIRED\n\
         http_access allow authenticated\n\
         http_access deny all\n\
         pid_filename {d}/squid.pid\n\
         access_log stdio:{d}/access.log\n\
         cache_log {d}/cache.log\n\
         cache deny all\n\
         cache_mem 8 MB\n\
         coredump_dir {d}\n\
         shutdown_lifetime 0 seconds\n"
    );
    let file = dir.join("squid.conf");
    std::fs::write(&file, conf).expect("squid.conf");
    Daemon::spawn("squid", "squid", &["-N", "-f", file.to_str().unwrap_or_default()], &dir, None)
}

/// tinyproxy requiring Basic auth (it answers bad credentials with 401, not 407).
pub fn tinyproxy(dir: &Path, listen: std::net::SocketAddr, user: &str, password: &str) -> Daemon {
    let dir = shared_dir(dir);
    let d = dir.display();
    let conf = format!(
        "User nobody\nGroup nogroup\nPort {}\nListen {}\nTimeout 600\nMaxClients 100\nBasicAuth {user} {password}\n\
         PidFile \"{d}/tinyproxy.pid\"\nLogFile \"{d}/tinyproxy.log\"\nLogLevel Info\n",
        listen.port(),
        listen.ip()
    );
    let file = dir.join("tinyproxy.conf");
    std::fs::write(&file, conf).expect("tinyproxy.conf");
    Daemon::spawn("tinyproxy", "tinyproxy", &["-d", "-c", file.to_str().unwrap_or_default()], &dir, None)
}

/// haproxy with the given configuration body (after a fixed `global`/`defaults` preamble).
pub fn haproxy(dir: &Path, body: &str) -> Daemon {
    let dir = shared_dir(dir);
    let conf = format!(
        "global\n  maxconn 2000\n\ndefaults\n  mode tcp\n  timeout connect 5s\n  timeout client 1h\n  timeout server 1h\n  timeout check 2s\n\n{body}\n"
    );
    let file = dir.join("haproxy.cfg");
    std::fs::write(&file, conf).expect("haproxy.cfg");
    Daemon::spawn("haproxy", "haproxy", &["-f", file.to_str().unwrap_or_default(), "-db"], &dir, None)
}
