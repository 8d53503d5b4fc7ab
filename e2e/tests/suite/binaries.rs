//! End to end with the real binaries, curl, and the exact bytes kube-apiserver sends.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tether_e2e::bins::{Process, free_port, http_get, metric_sum, wait_ready};
use tether_loadtest::backends;
use tether_loadtest::devpki::{DevCa, DevIssuer, IssuerKey, PemPair, write_private};
use tether_loadtest::local::{AUDIENCE, ScratchDir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::node_listener;

struct Bins {
    dir: ScratchDir,
    ca: DevCa,
    client_cert: PemPair,
    gateway: Process,
    agent: Process,
    frontend: SocketAddr,
    uds: PathBuf,
    gateway_admin: SocketAddr,
    agent_admin: SocketAddr,
    node: SocketAddr,
    /// A node-side server that writes forever, and the connections it holds.
    firehose: SocketAddr,
    firehose_open: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

/// Gateway and agent binaries with dev credentials; the frontend uses mutual TLS if `mtls`.
async fn start(mtls: bool, grace: &str) -> Bins {
    start_with_env(mtls, grace, &[]).await
}

/// Like [`start`], with extra environment for the gateway.
async fn start_with_env(mtls: bool, grace: &str, gateway_env: &[(&str, &str)]) -> Bins {
    let dir = ScratchDir::new("tether-bins").unwrap();
    let ca = DevCa::create(dir.path(), "e2e").unwrap();
    let issuer = DevIssuer::create(dir.path(), "e2e", "https://issuer.e2e.local", IssuerKey::Rs256).unwrap();
    let gateway_cert = ca.server("gateway", &["e2e.tether.local", "127.0.0.1"]).unwrap();
    let client_cert = ca.client("kas", "kube-apiserver").unwrap();
    let (listener, node) = node_listener().await;
    backends::spawn_http(listener, "node-1".into());
    let (firehose, firehose_open) = crate::support::firehose().await;

    let frontend = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let gateway_admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let agents_addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let agent_admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let uds = dir.path().join("e2e.sock");
    let tcp_frontend = if mtls {
        serde_json::json!({
            "listen": frontend.to_string(),
            "tls": { "cert_file": gateway_cert.cert, "key_file": gateway_cert.key },
            "client_ca_file": ca.ca_cert,
        })
    } else {
        serde_json::json!({ "listen": frontend.to_string() })
    };
    let gateway_config = serde_json::json!({
        "server_id": "gw-e2e",
        "listen": { "agents": agents_addr.to_string(), "admin": gateway_admin.to_string() },
        "tls": { "cert_file": gateway_cert.cert, "key_file": gateway_cert.key },
        "drain_grace_period": grace,
        "reload_check_interval": "300ms",
        // Neither default (one per CPU on the gateway): the metrics below show it is honoured.
        "runtime": { "worker_threads": 5 },
        "tenants": [{
            "name": "e2e",
            "hosts": ["e2e.tether.local"],
            "auth": { "issuer": issuer.issuer, "audiences": [AUDIENCE], "jwks_file": issuer.jwks_file },
            "frontend": { "uds": uds, "tcp": tcp_frontend },
        }],
    });
    // YAML is a superset of JSON, so the JSON text is a valid YAML configuration file.
    let gateway_file = dir.path().join("gateway.yaml");
    std::fs::write(&gateway_file, serde_json::to_string_pretty(&gateway_config).unwrap()).unwrap();

    let token = issuer
        .service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(3600), Some("node-1"))
        .unwrap();
    let token_file = dir.path().join("agent.token");
    write_private(&token_file, token.as_bytes()).unwrap();
    let agent_config = serde_json::json!({
        "gateway": {
            "url": format!("wss://e2e.tether.local:{}/v1/tunnel", agents_addr.port()),
            "token_file": token_file,
            "ca_file": ca.ca_cert,
            "reconnect_initial": "100ms",
            "reconnect_max": "1s",
        },
        "admin_listen": agent_admin.to_string(),
        "runtime": { "worker_threads": 3 },
        "identifiers": { "addresses": [node.ip().to_string(), firehose.ip().to_string()] },
        "allow": [
            { "cidr": format!("{}/32", node.ip()), "ports": [node.port()] },
            { "cidr": format!("{}/32", firehose.ip()), "ports": [firehose.port()] },
        ],
    });
    let agent_file = dir.path().join("agent.yaml");
    std::fs::write(&agent_file, serde_json::to_string_pretty(&agent_config).unwrap()).unwrap();

    let gateway = Process::spawn(
        "tether-gateway",
        &["--config", gateway_file.to_str().unwrap()],
        gateway_env,
        dir.path(),
        "gateway",
    )
    .unwrap();
    assert!(
        wait_ready(gateway_admin, "/readyz", Duration::from_secs(20)).await,
        "gateway not ready:\n{}",
        gateway.log_text()
    );
    // The agent resolves e2e.tether.local through the URL; point it at loopback via server_name.
    let agent = Process::spawn(
        "tether-agent",
        &["--config", agent_file.to_str().unwrap()],
        &[
            ("TETHER__GATEWAY__URL", &format!("wss://127.0.0.1:{}/v1/tunnel", agents_addr.port())),
            ("TETHER__GATEWAY__SERVER_NAME", "e2e.tether.local"),
        ],
        dir.path(),
        "agent",
    )
    .unwrap();
    assert!(
        wait_ready(agent_admin, "/readyz", Duration::from_secs(20)).await,
        "agent not ready:\n{}",
        agent.log_text()
    );
    Bins {
        dir,
        ca,
        client_cert,
        gateway,
        agent,
        frontend,
        uds,
        gateway_admin,
        agent_admin,
        node,
        firehose,
        firehose_open,
    }
}

fn curl(args: &[&str]) -> (bool, String, String) {
    let output =
        std::process::Command::new("curl").args(["-sS", "--max-time", "20"]).args(args).output().expect("curl");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into(),
        String::from_utf8_lossy(&output.stderr).into(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_reaches_a_node_through_the_tcp_frontend() {
    let bins = start(false, "5s").await;
    let proxy = format!("http://{}", bins.frontend);
    let url = format!("http://{}/logs/kubelet.log", bins.node);
    let (ok, body, err) = tokio::task::spawn_blocking(move || curl(&["-p", "-x", &proxy, &url])).await.unwrap();
    assert!(ok, "curl failed: {err}\n{}", bins.gateway.log_text());
    assert_eq!(body, "hello from node-1: you asked for /logs/kubelet.log\n");

    // A target outside the agent's allow list: a clear refusal, not a hang.
    let proxy = format!("http://{}", bins.frontend);
    let (ok, _, err) =
        tokio::task::spawn_blocking(move || curl(&["-p", "-x", &proxy, "http://127.0.0.1:9/"])).await.unwrap();
    assert!(!ok);
    assert!(err.contains("403"), "{err}");

    let (status, metrics) = http_get(bins.gateway_admin, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(metric_sum(&metrics, "tether_gateway_dials_total", "result=\"ok\""), 1.0, "{metrics}");
    assert_eq!(metric_sum(&metrics, "tether_gateway_dials_total", "result=\"not_allowed\""), 1.0);
    assert_eq!(metric_sum(&metrics, "tether_gateway_agent_sessions", "tenant=\"e2e\""), 1.0);
    assert!(metric_sum(&metrics, "tether_gateway_bytes_total", "direction=\"from_agent\"") > 0.0);
    assert_eq!(metric_sum(&metrics, "tether_gateway_runtime_workers", ""), 5.0, "runtime.worker_threads");
    assert!(metric_sum(&metrics, "tether_gateway_runtime_tasks", "") > 0.0);
    let (_, agent_metrics) = http_get(bins.agent_admin, "/metrics").await.unwrap();
    assert_eq!(metric_sum(&agent_metrics, "tether_agent_dials_total", "result=\"ok\""), 1.0, "{agent_metrics}");
    assert_eq!(metric_sum(&agent_metrics, "tether_agent_sessions", ""), 1.0);
    assert_eq!(metric_sum(&agent_metrics, "tether_agent_runtime_workers", ""), 3.0, "runtime.worker_threads");
    drop(bins.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unix_socket_answers_kube_apiservers_exact_request() {
    let bins = start(false, "5s").await;
    let mut socket = tokio::net::UnixStream::connect(&bins.uds).await.unwrap();
    // Byte for byte what kube-apiserver's egress selector writes in HTTPConnect mode.
    let request = format!("CONNECT {} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", bins.node);
    socket.write_all(request.as_bytes()).await.unwrap();
    let expected = b"HTTP/1.1 200 Connection Established\r\n\r\n";
    let mut head = vec![0u8; expected.len()];
    socket.read_exact(&mut head).await.unwrap();
    assert_eq!(head, expected);
    // Nothing may follow the head before the tunnelled server speaks (it waits for a request).
    let mut extra = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(300), socket.read(&mut extra)).await;
    assert!(early.is_err(), "bytes after the response head: {early:?}");
    socket.write_all(b"GET /containerLogs/x HTTP/1.1\r\nHost: node\r\n\r\n").await.unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(response.ends_with("hello from node-1: you asked for /containerLogs/x\n"));

    // Anything but CONNECT is refused with 405 and a reason.
    let mut socket = tokio::net::UnixStream::connect(&bins.uds).await.unwrap();
    socket.write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").await.unwrap();
    let mut answer = String::new();
    socket.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mtls_frontend_refuses_clients_without_a_valid_certificate() {
    let bins = start(true, "5s").await;
    let proxy = format!("https://127.0.0.1:{}", bins.frontend.port());
    let url = format!("http://{}/mtls", bins.node);
    let ca = bins.ca.ca_cert.display().to_string();
    let cert = bins.client_cert.cert.display().to_string();
    let key = bins.client_cert.key.display().to_string();

    let (p, u, c, ce, k) = (proxy.clone(), url.clone(), ca.clone(), cert.clone(), key.clone());
    let (ok, body, err) = tokio::task::spawn_blocking(move || {
        curl(&["-p", "-x", &p, "--proxy-cacert", &c, "--proxy-cert", &ce, "--proxy-key", &k, &u])
    })
    .await
    .unwrap();
    assert!(ok, "with a client certificate: {err}");
    assert!(body.contains("hello from node-1"), "{body}");

    let (p, u, c) = (proxy.clone(), url.clone(), ca.clone());
    let (ok, _, err) =
        tokio::task::spawn_blocking(move || curl(&["-p", "-x", &p, "--proxy-cacert", &c, &u])).await.unwrap();
    assert!(!ok, "without a client certificate the handshake must fail: {err}");

    // A certificate from another CA is refused too.
    let other = DevCa::create(&bins.dir.path().join("other"), "other").unwrap();
    let stranger = other.client("stranger", "kube-apiserver").unwrap();
    let (sc, sk) = (stranger.cert.display().to_string(), stranger.key.display().to_string());
    let (ok, _, err) = tokio::task::spawn_blocking(move || {
        curl(&["-p", "-x", &proxy, "--proxy-cacert", &ca, "--proxy-cert", &sc, "--proxy-key", &sk, &url])
    })
    .await
    .unwrap();
    assert!(!ok, "a certificate from another CA must be refused: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_streams_then_exits() {
    let mut bins = start(false, "20s").await;
    // A tunnel that is open when SIGTERM arrives.
    let mut open =
        tether_loadtest::connect_client::connect_tcp(bins.frontend, &bins.node.to_string()).await.unwrap().unwrap();
    bins.gateway.terminate();
    // Readiness drops at once so LBs stop sending new work.
    let mut drained = false;
    for _ in 0..100 {
        match http_get(bins.gateway_admin, "/readyz").await {
            Ok((503, body)) if body.contains("draining") => {
                drained = true;
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert!(drained, "readyz must report draining");
    // New connections are no longer accepted (readiness turns first, the listeners close right
    // after it).
    let frontend = bins.frontend;
    let refused = tether_e2e::bins::eventually(Duration::from_secs(2), async || {
        tokio::net::TcpStream::connect(frontend).await.is_err()
    })
    .await;
    assert!(refused, "the frontend must stop accepting");
    // The open tunnel keeps working within the grace period.
    open.write_all(b"GET /during-drain HTTP/1.1\r\nHost: n\r\n\r\n").await.unwrap();
    let mut response = String::new();
    open.read_to_string(&mut response).await.unwrap();
    assert!(response.contains("/during-drain"), "{response}");
    drop(open);
    // With the last stream done the gateway exits well before the 20 s grace period.
    let status = bins.gateway.wait(Duration::from_secs(15)).await.expect("gateway did not exit after draining");
    assert!(status.success(), "{status:?}\n{}", bins.gateway.log_text());
    // The agent was told to move and counted it.
    let (_, metrics) = http_get(bins.agent_admin, "/metrics").await.unwrap();
    assert_eq!(metric_sum(&metrics, "tether_agent_drains_total", ""), 1.0, "{metrics}");
    assert!(bins.agent.log_text().contains("gateway asked to move"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configuration_is_reported_with_the_key_and_the_fix() {
    let dir = ScratchDir::new("tether-badconfig").unwrap();
    let file = dir.path().join("gateway.yaml");
    std::fs::write(&file, "tenants:\n  - name: Bad Name\n    hosts: []\n    auth:\n      issuer: x\n      audiences: [a]\n      jwks_file: /missing.json\nruntime:\n  worker_threads: 0\n").unwrap();
    let output = std::process::Command::new(tether_e2e::bins::bin_path("tether-gateway"))
        .args(["--check-config", "--config", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let err = String::from_utf8_lossy(&output.stderr);
    for key in [
        "tenants[0].name",
        "tenants[0].hosts",
        "tenants[0].auth.jwks_file",
        "tenants[0].frontend",
        "runtime.worker_threads",
    ] {
        assert!(err.contains(key), "{key} missing from:\n{err}");
    }
    // An environment override with a bad value names its key.
    let output = std::process::Command::new(tether_e2e::bins::bin_path("tether-agent"))
        .args(["--check-config"])
        .env("TETHER__GATEWAY__URL", "wss://gw.example.com/v1/tunnel")
        .env("TETHER__GATEWAY__TOKEN_FILE", "/nonexistent/token")
        .env("TETHER__GATEWAY__PING_INTERVAL", "often")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(err.contains("ping_interval") || err.contains("often"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quick_start_demo_runs_and_passes_its_checks() {
    // The demo uses fixed ports from --base-port; pick a base below the ephemeral range and try
    // another if something else holds one of them.
    let mut attempt = 0;
    let output = loop {
        attempt += 1;
        let base = 20_000 + fastrand::u16(0..12_000);
        let output = tokio::process::Command::new(tether_e2e::bins::bin_path("tether-demo"))
            .args(["--once", "--dials", "20", "--bulk-mib", "4", "--base-port", &base.to_string()])
            .output()
            .await
            .unwrap();
        if attempt < 5 && String::from_utf8_lossy(&output.stderr).contains("Address already in use") {
            continue;
        }
        break output;
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("All checks passed."), "{stdout}");
    assert!(stdout.contains("20/20"), "{stdout}");
    assert!(stdout.contains("node -> control plane, TLS end to end"), "{stdout}");
    assert!(stdout.contains("gRPC dials via Unix socket"), "{stdout}");
    assert!(stdout.contains("curl -p -x http://127.0.0.1:"), "{stdout}");
}

/// Stopped by SIGTERM (`timeout`, `kill`, a service manager) rather than Ctrl-C, the demo still
/// shuts down and removes its temporary credentials (CA, dev signing key, agent tokens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_stopped_by_sigterm_leaves_no_credentials_behind() {
    use tokio::io::AsyncBufReadExt;
    let mut attempt = 0;
    let (mut demo, mut stdout, lines) = loop {
        attempt += 1;
        let base = 20_000 + fastrand::u16(0..12_000);
        let mut demo = tokio::process::Command::new(tether_e2e::bins::bin_path("tether-demo"))
            .args(["--dials", "5", "--bulk-mib", "1", "--base-port", &base.to_string()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut stdout = tokio::io::BufReader::new(demo.stdout.take().unwrap()).lines();
        let mut lines = Vec::new();
        let ready = tokio::time::timeout(Duration::from_secs(60), async {
            while let Ok(Some(line)) = stdout.next_line().await {
                let done = line.contains("Press Ctrl-C to stop.");
                lines.push(line);
                if done {
                    return true;
                }
            }
            false
        })
        .await
        .unwrap_or(false);
        if ready {
            break (demo, stdout, lines);
        }
        let stderr = demo.wait_with_output().await.unwrap().stderr;
        let stderr = String::from_utf8_lossy(&stderr);
        assert!(attempt < 5 && stderr.contains("Address already in use"), "{}\n{stderr}", lines.join("\n"));
    };
    let text = lines.join("\n");
    // The dirs the demo names: its credentials and the control-plane stand-in's CA.
    let dirs: Vec<std::path::PathBuf> = text
        .split_whitespace()
        .filter(|w| w.starts_with("/tmp/tether-local-") || w.starts_with("/tmp/tether-demo-kas-"))
        .map(|w| {
            let w = w.trim_start_matches("--cacert=");
            let path = std::path::Path::new(w);
            // A file inside the dir (the CA certificate) names the dir too.
            if path.extension().is_some() { path.parent().unwrap().to_owned() } else { path.to_owned() }
        })
        .collect();
    assert!(dirs.len() >= 2, "the demo names its temporary dirs:\n{text}");
    for dir in &dirs {
        assert!(dir.exists(), "{} exists while the demo runs", dir.display());
    }
    let pid = demo.id().unwrap().to_string();
    let killed = std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    // Keep reading: the demo reports its shutdown on stdout.
    let rest = async {
        let mut rest = Vec::new();
        while let Ok(Some(line)) = stdout.next_line().await {
            rest.push(line);
        }
        rest
    };
    let rest = tokio::time::timeout(Duration::from_secs(30), rest).await.unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), demo.wait()).await.unwrap().unwrap();
    assert!(rest.join("\n").contains("Stopping"), "{}", rest.join("\n"));
    assert!(status.success(), "the demo stops cleanly on SIGTERM: {status}");
    for dir in &dirs {
        assert!(!dir.exists(), "{} is left behind after SIGTERM", dir.display());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_is_picked_up_without_a_restart() {
    let bins = start(false, "5s").await;
    let agents = {
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(bins.dir.path().join("gateway.yaml")).unwrap()).unwrap();
        config["listen"]["agents"].as_str().unwrap().parse::<SocketAddr>().unwrap()
    };
    let roots = tether_tunnel::tls::ClientRoots { ca_file: Some(bins.ca.ca_cert.clone()), system_roots: false };
    let tls = tether_tunnel::tls::client_config(&roots, None, &[tether_tunnel::tls::ALPN_HTTP11]).unwrap();
    let settings = tether_tunnel::client::ClientSettings {
        url: format!("wss://{agents}/v1/tunnel").parse().unwrap(),
        tls: Some(std::sync::Arc::new(tls)),
        tls_server_name: Some("renewed.tether.local".into()),
        connect_timeout: Duration::from_secs(5),
        handshake_timeout: Duration::from_secs(5),
        user_agent: "tether-test".into(),
        ..Default::default()
    };
    let attempt = async || tether_tunnel::client::connect(&settings, None).await;
    // The current certificate does not cover the new name: the TLS handshake fails.
    assert!(matches!(attempt().await, Err(tether_tunnel::client::ConnectError::Tls { .. })));
    // cert-manager renews the Secret: same files, new content.
    bins.ca.server("gateway", &["e2e.tether.local", "renewed.tether.local", "127.0.0.1"]).unwrap();
    let renewed = tether_e2e::bins::eventually(Duration::from_secs(10), async || {
        // TLS now succeeds; the name belongs to no tenant, so the answer is a plain 404.
        matches!(attempt().await, Err(tether_tunnel::client::ConnectError::Rejected { status: 404, .. }))
    })
    .await;
    assert!(renewed, "the renewed certificate was not picked up:\n{}", bins.gateway.log_text());
    assert!(bins.gateway.log_text().contains("certificate files changed; reloading"));
    // The agent's session and tunnels were untouched.
    let (status, _) = http_get(bins.agent_admin, "/readyz").await.unwrap();
    assert_eq!(status, 200);
}

/// An interrupted `kubectl logs -f` or `exec` (the kube-apiserver's connection goes away with data
/// unread) frees the stream on both sides and closes the node-side connection completely, over
/// the Unix-socket and the mutual-TLS frontends, however the race between the two directions goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_downloads_free_the_stream_and_the_node_side_connection() {
    use std::sync::atomic::Ordering;
    let bins = start(true, "5s").await;
    let target = bins.firehose.to_string();
    let roots = tether_tunnel::tls::ClientRoots { ca_file: Some(bins.ca.ca_cert.clone()), system_roots: false };
    let client_tls =
        tether_tunnel::tls::client_config(&roots, Some((&bins.client_cert.cert, &bins.client_cert.key)), &[]).unwrap();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(client_tls));
    for round in 0..3 {
        let mut clients = Vec::new();
        for i in 0..20 {
            let (target, uds, frontend, connector) =
                (target.clone(), bins.uds.clone(), bins.frontend, connector.clone());
            clients.push(tokio::spawn(async move {
                if i % 2 == 0 {
                    let tunnel = tether_loadtest::connect_client::connect_uds(&uds, &target).await.unwrap().unwrap();
                    crate::support::read_a_little_then_abort(tunnel).await;
                } else {
                    let tcp = tokio::net::TcpStream::connect(frontend).await.unwrap();
                    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
                    let tls = connector.connect(name, tcp).await.unwrap();
                    let tunnel = tether_loadtest::connect_client::connect_via(tls, &target).await.unwrap().unwrap();
                    crate::support::read_a_little_then_abort(tunnel).await;
                }
            }));
        }
        for client in clients {
            client.await.unwrap();
        }
        let (gateway_admin, agent_admin, port) = (bins.gateway_admin, bins.agent_admin, bins.firehose.port());
        let open = bins.firehose_open.clone();
        let all_freed = tether_e2e::bins::eventually(Duration::from_secs(5), async || {
            let gateway = http_get(gateway_admin, "/metrics").await.map(|(_, m)| m).unwrap_or_default();
            let agent = http_get(agent_admin, "/metrics").await.map(|(_, m)| m).unwrap_or_default();
            metric_sum(&gateway, "tether_gateway_streams_open", "") == 0.0
                && metric_sum(&agent, "tether_agent_streams_open", "") == 0.0
                && open.load(Ordering::SeqCst) == 0
                && crate::support::sockets_on_port(port).is_empty()
        })
        .await;
        let gateway = http_get(gateway_admin, "/metrics").await.unwrap().1;
        let agent = http_get(agent_admin, "/metrics").await.unwrap().1;
        assert!(
            all_freed,
            "round {round}: gateway streams open {}, agent streams open {}, node-side server connections {}, sockets {:?}",
            metric_sum(&gateway, "tether_gateway_streams_open", ""),
            metric_sum(&agent, "tether_agent_streams_open", ""),
            open.load(Ordering::SeqCst),
            crate::support::sockets_on_port(port)
        );
    }
}

/// SIGTERM to the agent: a long stream open through it (`logs -f`-like) keeps flowing; the agent
/// tells the gateway it is leaving, so new dials get no agent at once (instead of a dead one), and
/// the agent exits as soon as the stream is done, well within `shutdown_grace_period` (20 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_to_the_agent_lets_open_streams_finish_then_exits() {
    let mut bins = start(false, "20s").await;
    let mut stream =
        tether_loadtest::connect_client::connect_tcp(bins.frontend, &bins.firehose.to_string()).await.unwrap().unwrap();
    stream.write_all(b"follow").await.unwrap();
    let mut chunk = vec![0u8; 64 * 1024];
    stream.read_exact(&mut chunk).await.unwrap();
    bins.agent.terminate();
    let gateway_log = || bins.gateway.log_text();
    assert!(
        tether_e2e::bins::eventually(Duration::from_secs(5), async || gateway_log().contains("agent is leaving")).await,
        "the gateway was not told:\n{}\n{}",
        bins.gateway.log_text(),
        bins.agent.log_text()
    );
    // The open stream still carries data after SIGTERM...
    let mut after = 0usize;
    while after < 4 << 20 {
        match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => after += n,
            other => panic!("the open stream broke after SIGTERM ({other:?}) after {after} bytes"),
        }
    }
    // ...while a new dial is not given to the leaving agent: the gateway waits for the node's agent
    // to come back (a restarted agent would take it) and answers 503 at the dial timeout.
    let frontend = bins.frontend;
    let target = bins.node.to_string();
    let dial = tokio::spawn(async move { tether_loadtest::connect_client::connect_tcp(frontend, &target).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(stream);
    let status = bins.agent.wait(Duration::from_secs(8)).await.expect("the agent did not exit after its streams");
    assert!(status.success(), "{status:?}\n{}", bins.agent.log_text());
    let refused = dial.await.unwrap().unwrap().unwrap_err();
    assert_eq!(refused.status, 503, "{}", refused.reason);
    assert!(bins.agent.log_text().contains("open streams may finish"), "{}", bins.agent.log_text());
}

/// The audit log: one JSON line per dial with the stable fields (docs/operations.md), here for a
/// dial through the mutual-TLS frontend (with the kube-apiserver's certificate name) and a
/// refused one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dial_leaves_one_audit_line_with_its_outcome() {
    let bins = start_with_env(true, "5s", &[("TETHER__LOG__FORMAT", "json")]).await;
    let proxy = format!("https://127.0.0.1:{}", bins.frontend.port());
    let ca = bins.ca.ca_cert.display().to_string();
    let cert = bins.client_cert.cert.display().to_string();
    let key = bins.client_cert.key.display().to_string();
    for url in [format!("http://{}/audited", bins.node), "http://127.0.0.1:1/refused".to_owned()] {
        let (p, c, ce, k) = (proxy.clone(), ca.clone(), cert.clone(), key.clone());
        tokio::task::spawn_blocking(move || {
            curl(&["-p", "-x", &p, "--proxy-cacert", &c, "--proxy-cert", &ce, "--proxy-key", &k, &url])
        })
        .await
        .unwrap();
    }
    let audit_lines = || -> Vec<serde_json::Value> {
        bins.gateway
            .log_text()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["target"] == "audit")
            .collect()
    };
    assert!(
        tether_e2e::bins::eventually(Duration::from_secs(5), async || audit_lines().len() >= 2).await,
        "{}",
        bins.gateway.log_text()
    );
    let lines = audit_lines();
    assert_eq!(lines.len(), 2, "{lines:#?}");
    let ok = lines.iter().find(|l| l["result"] == "ok").expect("the served dial");
    for (field, value) in [
        ("event", "dial"),
        ("tenant", "e2e"),
        ("frontend", "tcp+mtls"),
        ("client_name", "kube-apiserver"),
        ("destination", &bins.node.to_string()),
        ("replica", "gw-e2e"),
        ("agent", "node-1"),
        ("via_replica", ""),
    ] {
        assert_eq!(ok[field], value, "{field} in {ok}");
    }
    assert_eq!(ok["status"], 200);
    assert!(ok["bytes_to_node"].as_u64().unwrap() > 0 && ok["bytes_from_node"].as_u64().unwrap() > 0, "{ok}");
    assert!(ok["duration_ms"].is_u64(), "{ok}");
    let refused = lines.iter().find(|l| l["result"] != "ok").expect("the refused dial");
    assert_eq!(refused["destination"], "127.0.0.1:1");
    assert!(refused["status"].as_u64().unwrap() >= 400, "{refused}");
    assert_eq!(refused["bytes_to_node"], 0);
}
