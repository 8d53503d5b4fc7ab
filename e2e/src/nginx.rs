//! Running a real nginx in the foreground with a generated configuration.

use std::path::Path;
use std::time::Duration;

use crate::daemons::Daemon;

/// An nginx process, stopped (SIGTERM, then SIGKILL) when dropped.
pub struct Nginx {
    daemon: Daemon,
}

impl Nginx {
    /// Starts `nginx` with `body` placed inside a configuration that keeps every file (pid, logs,
    /// temp paths) under `dir`. `body` holds `http { ... }` and/or `stream { ... }` blocks. With
    /// `netns`, nginx runs inside that network namespace.
    pub fn start(dir: &Path, body: &str, netns: Option<&str>) -> Self {
        std::fs::create_dir_all(dir).expect("nginx dir");
        let d = dir.display();
        let modules = if Path::new("/usr/lib/nginx/modules/ngx_stream_module.so").exists() && body.contains("stream {")
        {
            "load_module /usr/lib/nginx/modules/ngx_stream_module.so;\n"
        } else {
            ""
        };
        let conf = format!(
            "{modules}daemon off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log info;\nevents {{ worker_connections 1024; }}\n{}\n",
            body.replace("$DIR", &d.to_string())
        );
        let file = dir.join("nginx.conf");
        std::fs::write(&file, conf).expect("write nginx.conf");
        let stderr = format!("{d}/stderr.log");
        let daemon = Daemon::spawn("nginx", "nginx", &["-c", &file.display().to_string(), "-e", &stderr], dir, netns);
        Self { daemon }
    }

    /// The http block's common settings: temp paths and an access log under `$DIR`.
    pub fn http_preamble() -> &'static str {
        "access_log $DIR/access.log;\nclient_body_temp_path $DIR/body; proxy_temp_path $DIR/proxy; fastcgi_temp_path $DIR/fcgi;\nuwsgi_temp_path $DIR/uwsgi; scgi_temp_path $DIR/scgi;\n"
    }

    /// Stops nginx and waits for it.
    pub fn stop(&mut self) {
        self.daemon.stop();
    }
}

/// Waits until something accepts TCP connections on `addr`.
pub async fn wait_listening(addr: std::net::SocketAddr, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    false
}
