//! The gRPC frontend (Konnectivity's `proxyProtocol: GRPC`) end to end: the real binaries, driven
//! by a Python grpcio client generated from the .proto that follows kube-apiserver's sequence.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tether_e2e::bins::{Process, eventually, free_port, http_get, metric_sum, wait_ready};
use tether_e2e::konnectivity::{GrpcClient, next_report};
use tether_loadtest::backends;
use tether_loadtest::devpki::{DevCa, DevIssuer, IssuerKey, PemPair, write_private};
use tether_loadtest::local::{AUDIENCE, ScratchDir};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::support::{echo_server, firehose, node_listener, sockets_on_port};

struct Deployment {
    _dir: ScratchDir,
    ca: DevCa,
    kas: PemPair,
    gateway: Process,
    _agent: Process,
    uds: PathBuf,
    empty_uds: PathBuf,
    tcp: SocketAddr,
    shared: SocketAddr,
    admin: SocketAddr,
    agent_admin: SocketAddr,
    node: SocketAddr,
    echo: SocketAddr,
    firehose: SocketAddr,
    firehose_open: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    tarpit: SocketAddr,
    _tarpit_held: (TcpListener, Vec<TcpStream>),
}

impl Deployment {
    fn uds_client(&self) -> GrpcClient {
        GrpcClient::uds(&self.uds)
    }

    fn mtls_client(&self, addr: SocketAddr) -> GrpcClient {
        GrpcClient::mtls(addr, &self.ca.ca_cert, &self.kas.cert, &self.kas.key, "e2e.tether.local")
    }

    async fn gateway_metrics(&self) -> String {
        http_get(self.admin, "/metrics").await.unwrap().1
    }

    async fn agent_metrics(&self) -> String {
        http_get(self.agent_admin, "/metrics").await.unwrap().1
    }
}

/// A listener whose accept queue is full: connection attempts to it hang (SYNs are dropped), so a
/// dial to it stays pending.
async fn tarpit() -> (SocketAddr, (TcpListener, Vec<TcpStream>)) {
    let (probe, addr) = node_listener().await;
    drop(probe);
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(addr).unwrap();
    let listener = socket.listen(1).unwrap();
    let mut held = Vec::new();
    while let Ok(Ok(stream)) = tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(addr)).await {
        held.push(stream);
        assert!(held.len() < 64, "the tarpit's accept queue never filled");
    }
    (addr, (listener, held))
}

/// Gateway (tenant `e2e` in gRPC mode on a Unix socket, TCP + mutual TLS and the shared frontend;
/// tenant `empty`, also gRPC, with no agent) and one agent, with the tenant limits `limits`.
async fn start(limits: serde_json::Value) -> Deployment {
    let dir = ScratchDir::new("tether-grpc").unwrap();
    let ca = DevCa::create(dir.path(), "e2e").unwrap();
    let issuer = DevIssuer::create(dir.path(), "e2e", "https://issuer.e2e.local", IssuerKey::Rs256).unwrap();
    let other_issuer = DevIssuer::create(dir.path(), "empty", "https://issuer.empty.local", IssuerKey::Rs256).unwrap();
    let gateway_cert = ca.server("gateway", &["e2e.tether.local", "127.0.0.1"]).unwrap();
    let kas = ca.client("kas", "kube-apiserver").unwrap();
    let (listener, node) = node_listener().await;
    backends::spawn_http(listener, "node-1".into());
    let echo = echo_server().await;
    let (firehose, firehose_open) = firehose().await;
    let (tarpit, tarpit_held) = tarpit().await;

    let port = || SocketAddr::from(([127, 0, 0, 1], free_port()));
    let (tcp, shared, admin, agents_addr, agent_admin) = (port(), port(), port(), port(), port());
    let uds = dir.path().join("kas.sock");
    let empty_uds = dir.path().join("empty.sock");
    let gateway_config = serde_json::json!({
        "server_id": "gw-grpc",
        "listen": { "agents": agents_addr.to_string(), "admin": admin.to_string() },
        "tls": { "cert_file": gateway_cert.cert, "key_file": gateway_cert.key },
        "drain_grace_period": "30s",
        "shared_frontend": {
            "listen": shared.to_string(),
            "tls": { "cert_file": gateway_cert.cert, "key_file": gateway_cert.key },
            "client_ca_file": ca.ca_cert,
        },
        "tenants": [{
            "name": "e2e",
            "hosts": ["e2e.tether.local"],
            "auth": { "issuer": issuer.issuer, "audiences": [AUDIENCE], "jwks_file": issuer.jwks_file },
            "frontend": {
                "protocol": "grpc",
                "uds": uds,
                "tcp": {
                    "listen": tcp.to_string(),
                    "tls": { "cert_file": gateway_cert.cert, "key_file": gateway_cert.key },
                    "client_ca_file": ca.ca_cert,
                },
                "client_names": ["kube-apiserver"],
            },
            "limits": limits,
        }, {
            "name": "empty",
            "hosts": ["empty.tether.local"],
            "auth": { "issuer": other_issuer.issuer, "audiences": [AUDIENCE], "jwks_file": other_issuer.jwks_file },
            "frontend": { "protocol": "grpc", "uds": empty_uds },
        }],
    });
    let gateway_file = dir.path().join("gateway.yaml");
    std::fs::write(&gateway_file, serde_json::to_string_pretty(&gateway_config).unwrap()).unwrap();

    let token = issuer
        .service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(3600), Some("node-1"))
        .unwrap();
    let token_file = dir.path().join("agent.token");
    write_private(&token_file, token.as_bytes()).unwrap();
    let allow = |a: SocketAddr| serde_json::json!({ "cidr": format!("{}/32", a.ip()), "ports": [a.port()] });
    let agent_config = serde_json::json!({
        "gateway": {
            "url": format!("wss://127.0.0.1:{}/v1/tunnel", agents_addr.port()),
            "server_name": "e2e.tether.local",
            "token_file": token_file,
            "ca_file": ca.ca_cert,
            "reconnect_initial": "100ms",
            "reconnect_max": "1s",
        },
        "admin_listen": agent_admin.to_string(),
        "identifiers": { "addresses": [node.ip(), echo.ip(), firehose.ip(), tarpit.ip()] },
        "allow": [allow(node), allow(echo), allow(firehose), allow(tarpit)],
    });
    let agent_file = dir.path().join("agent.yaml");
    std::fs::write(&agent_file, serde_json::to_string_pretty(&agent_config).unwrap()).unwrap();

    let gateway = Process::spawn(
        "tether-gateway",
        &["--config", gateway_file.to_str().unwrap()],
        &[("TETHER__LOG__FORMAT", "json")],
        dir.path(),
        "gateway",
    )
    .unwrap();
    assert!(wait_ready(admin, "/readyz", Duration::from_secs(20)).await, "gateway:\n{}", gateway.log_text());
    let agent =
        Process::spawn("tether-agent", &["--config", agent_file.to_str().unwrap()], &[], dir.path(), "agent").unwrap();
    assert!(wait_ready(agent_admin, "/readyz", Duration::from_secs(20)).await, "agent:\n{}", agent.log_text());
    Deployment {
        _dir: dir,
        ca,
        kas,
        gateway,
        _agent: agent,
        uds,
        empty_uds,
        tcp,
        shared,
        admin,
        agent_admin,
        node,
        echo,
        firehose,
        firehose_open,
        tarpit,
        _tarpit_held: tarpit_held,
    }
}

fn audit_lines(gateway: &Process) -> Vec<serde_json::Value> {
    gateway
        .log_text()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "audit")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_dials_carry_http_and_20_mib_both_ways_on_every_transport() {
    let d = start(serde_json::json!({})).await;
    let transports =
        [("unix", d.uds_client()), ("tcp+mtls", d.mtls_client(d.tcp)), ("shared", d.mtls_client(d.shared))];
    for (name, client) in &transports {
        let report = client.run(&["http", &d.node.to_string(), "/containerLogs/x"]).await;
        assert_eq!(report["dial_error"], "", "{name}: {report}");
        let response = report["response"].as_str().unwrap();
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{name}: {report}");
        assert!(response.ends_with("hello from node-1: you asked for /containerLogs/x\n"), "{name}: {report}");
        assert_eq!(report["close_error"], "", "{name}: the node's close is a clean CLOSE_RSP: {report}");
    }
    for (name, client) in &transports[..2] {
        let size = (20 << 20).to_string();
        let report = client.run(&["echo", &d.echo.to_string(), &size]).await;
        assert_eq!(report["received"], 20 << 20, "{name}: {report}");
        assert_eq!(report["received_sha256"], report["sent_sha256"], "{name}: bytes differ: {report}");
        assert_eq!(report["close_error"], "", "{name}: CLOSE_REQ is answered with CLOSE_RSP: {report}");
    }

    // A target outside the agent's allow list: the reason the CONNECT frontend gives, as the error.
    let refused = d.uds_client().run(&["dial", "127.0.0.1:9"]).await;
    let error = refused["dial_error"].as_str().unwrap();
    assert!(error == "agent node-1: port 9 is not on this agent's allow list", "{refused}");
    // A malformed address.
    let bad = d.uds_client().run(&["dial", "no-port"]).await;
    assert!(!bad["dial_error"].as_str().unwrap().is_empty(), "{bad}");

    let metrics = d.gateway_metrics().await;
    let ok = metric_sum(&metrics, "tether_gateway_dials_total", "protocol=\"grpc\",result=\"ok\"")
        + metric_sum(&metrics, "tether_gateway_dials_total", "result=\"ok\",protocol=\"grpc\"");
    assert_eq!(ok, 5.0, "{metrics}");
    assert_eq!(metric_sum(&metrics, "tether_gateway_dials_total", "result=\"not_allowed\""), 1.0, "{metrics}");
    assert!(metric_sum(&metrics, "tether_gateway_bytes_total", "direction=\"to_agent\"") >= (40 << 20) as f64);
    assert!(metric_sum(&metrics, "tether_gateway_bytes_total", "direction=\"from_agent\"") >= (40 << 20) as f64);
    assert!(
        eventually(Duration::from_secs(5), async || {
            metric_sum(&d.gateway_metrics().await, "tether_gateway_streams_open", "tenant=\"e2e\"") == 0.0
        })
        .await
    );

    let lines = audit_lines(&d.gateway);
    let grpc_ok: Vec<_> = lines.iter().filter(|l| l["protocol"] == "grpc" && l["result"] == "ok").collect();
    assert_eq!(grpc_ok.len(), 5, "{lines:#?}");
    let frontends: Vec<_> = grpc_ok.iter().map(|l| l["frontend"].as_str().unwrap()).collect();
    for frontend in ["unix", "tcp+mtls", "shared"] {
        assert!(frontends.contains(&frontend), "{frontends:?}");
    }
    let bulk = grpc_ok.iter().find(|l| l["bytes_to_node"] == 20 << 20).expect("the 20 MiB echo's audit line");
    assert_eq!(bulk["bytes_from_node"], 20 << 20, "{bulk}");
    assert_eq!(bulk["agent"], "node-1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_without_agents_answers_the_dial_with_the_reason() {
    let d = start(serde_json::json!({})).await;
    let report = GrpcClient::uds(&d.empty_uds).run(&["dial", &d.node.to_string()]).await;
    assert_eq!(report["dial_error"], format!("no agent available for {}", d.node), "{report}");
    let metrics = d.gateway_metrics().await;
    assert_eq!(metric_sum(&metrics, "tether_gateway_dials_total", "result=\"no_agent\""), 1.0, "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dial_cls_frees_the_pending_dial_at_once_on_both_sides() {
    // One pending dial at a time: a cancelled dial that kept its slot would refuse the next.
    let d = start(serde_json::json!({ "max_pending_dials": 1, "dial_timeout": "60s" })).await;
    for round in 0..3 {
        let report = d.uds_client().run(&["cancel", &d.tarpit.to_string(), "500"]).await;
        assert_eq!(report["packets_after_cancel"], serde_json::json!([]), "round {round}: {report}");
        assert_eq!(report["status"], "StatusCode.OK", "round {round}: {report}");
    }
    let metrics = d.gateway_metrics().await;
    assert_eq!(metric_sum(&metrics, "tether_gateway_dials_total", "result=\"cancelled\""), 3.0, "{metrics}");
    assert_eq!(metric_sum(&metrics, "tether_gateway_dials_total", "result=\"too_many_pending\""), 0.0);
    // The agent stops connecting too: no connection attempt to the target is left.
    assert!(
        eventually(Duration::from_secs(5), async || {
            metric_sum(&d.agent_metrics().await, "tether_agent_dials_total", "result=\"abandoned\"") == 3.0
        })
        .await,
        "{}",
        d.agent_metrics().await
    );
    let syn_sent: Vec<_> = std::process::Command::new("ss")
        .args(["-Htan", "state", "syn-sent", &format!("( dport = :{} )", d.tarpit.port())])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().map(str::to_owned).collect())
        .unwrap();
    assert!(syn_sent.is_empty(), "connection attempts left behind: {syn_sent:?}");
    let lines = audit_lines(&d.gateway);
    assert_eq!(lines.iter().filter(|l| l["result"] == "cancelled" && l["status"] == 499).count(), 3, "{lines:#?}");
    // And the slot is free for a real dial.
    let report = d.uds_client().run(&["http", &d.node.to_string(), "/after"]).await;
    assert_eq!(report["dial_error"], "", "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kube_apiserver_that_disconnects_mid_stream_frees_the_node_side() {
    let d = start(serde_json::json!({})).await;
    for client in [d.uds_client(), d.mtls_client(d.tcp)] {
        let report = client.run(&["abandon", &d.firehose.to_string(), "262144"]).await;
        assert!(report["read"].as_u64().unwrap() >= 262_144, "{report}");
        assert!(
            eventually(Duration::from_secs(10), async || {
                d.firehose_open.load(std::sync::atomic::Ordering::SeqCst) == 0
            })
            .await,
            "the node-side connection stayed open"
        );
    }
    assert!(
        eventually(Duration::from_secs(5), async || {
            let (g, a) = (d.gateway_metrics().await, d.agent_metrics().await);
            metric_sum(&g, "tether_gateway_streams_open", "") == 0.0
                && metric_sum(&a, "tether_agent_streams_open", "") == 0.0
        })
        .await
    );
    assert!(
        eventually(Duration::from_secs(5), async || sockets_on_port(d.firehose.port()).is_empty()).await,
        "{:?}",
        sockets_on_port(d.firehose.port())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_grpc_dials_are_all_served() {
    let d = start(serde_json::json!({ "max_pending_dials": 2000 })).await;
    // Each dial and exchange has 60 s: one never answered shows up in the report with its stage.
    let report = d.uds_client().run(&["many", &d.node.to_string(), "1000", "--deadline", "60"]).await;
    if report["dialed"] != 1000 || report["answered"] != 1000 {
        // Which side holds what the client waits for.
        let keep = |text: String| {
            text.lines()
                .filter(|l| !l.starts_with('#') && (l.contains("stream") || l.contains("dial")))
                .collect::<Vec<_>>()
                .join("\n")
        };
        let (g, a) = (keep(d.gateway_metrics().await), keep(d.agent_metrics().await));
        panic!("{report}\ngateway:\n{g}\nagent:\n{a}");
    }
    assert_eq!(report["distinct_connect_ids"], 1000, "{report}");
    assert!(
        eventually(Duration::from_secs(10), async || {
            metric_sum(&d.gateway_metrics().await, "tether_gateway_streams_open", "") == 0.0
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_stalls_only_its_own_dial() {
    let d = start(serde_json::json!({})).await;
    let size = (4 << 20).to_string();
    let (mut child, mut stdout) = d.uds_client().spawn(&["hol", &d.firehose.to_string(), &d.echo.to_string(), &size]);
    let report = tokio::time::timeout(Duration::from_secs(60), next_report(&mut stdout)).await.expect("hol report");
    assert_eq!(report["fast_identical"], true, "{report}");
    assert!(report["slow_read"].as_u64().unwrap() >= 65_536, "{report}");
    // The stalled dial's node keeps writing, but nothing moves: flow control reaches the node.
    let from_target =
        async || metric_sum(&d.agent_metrics().await, "tether_agent_bytes_total", "direction=\"from_target\"");
    // Once the windows between them are full (on a loaded machine that takes a while), a second
    // passes with less than 64 KiB moved; without flow control that never happens.
    let mut after = from_target().await;
    let mut moved = Vec::new();
    for _ in 0..15 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let before = std::mem::replace(&mut after, from_target().await);
        moved.push(after - before);
        if after - before < 65_536.0 {
            break;
        }
    }
    assert!(moved.last().is_some_and(|m| *m < 65_536.0), "the stalled dial still moves, bytes per second: {moved:?}");
    let buffered = after - (4 << 20) as f64 - report["slow_read"].as_f64().unwrap();
    assert!(buffered < (16 << 20) as f64, "{buffered} bytes held for a reader that does not read");
    drop(child.stdin.take().unwrap().shutdown().await);
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
}

/// SIGTERM while a gRPC dial is open: the socket stops taking connections, the connection in
/// flight gets GOAWAY but its dial keeps working and closes cleanly, and the gateway exits as soon
/// as it is done (its grace period is 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_gateway_lets_grpc_dials_in_flight_finish() {
    let mut d = start(serde_json::json!({})).await;
    let (mut child, mut stdout) = d.uds_client().spawn(&["hold", &d.echo.to_string(), "65536"]);
    let report = tokio::time::timeout(Duration::from_secs(30), next_report(&mut stdout)).await.expect("dial report");
    assert_eq!(report["dial_error"], "", "{report}");
    d.gateway.terminate();
    let admin = d.admin;
    let draining = eventually(
        Duration::from_secs(5),
        async || matches!(http_get(admin, "/readyz").await, Ok((503, body)) if body.contains("draining")),
    )
    .await;
    assert!(draining, "readyz must report draining");
    let uds = d.uds.clone();
    let refused =
        eventually(Duration::from_secs(5), async || std::os::unix::net::UnixStream::connect(&uds).is_err()).await;
    assert!(refused, "the Unix socket must stop accepting");
    // The dial in flight still carries data both ways and ends with CLOSE_RSP.
    drop(child.stdin.take().unwrap().shutdown().await);
    let report = tokio::time::timeout(Duration::from_secs(30), next_report(&mut stdout)).await.expect("echo report");
    assert_eq!(report["identical"], true, "{report}");
    assert_eq!(report["close_error"], "", "{report}");
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    let status = d.gateway.wait(Duration::from_secs(20)).await.expect("the gateway did not exit after its last dial");
    assert!(status.success(), "{status:?}\n{}", d.gateway.log_text());
}
