//! Node -> control plane in an isolated topology built with network namespaces: the "node"
//! namespace reaches only the gateway's address, the "control-plane" namespace runs nginx standing
//! in for kube-apiserver, and nothing routes between them except Tether.

use std::net::SocketAddr;
use std::time::Duration;

use tether_e2e::bins::{Process, free_port, http_get, metric_sum, wait_ready};
use tether_e2e::netns::{self, Netns};
use tether_e2e::nginx::Nginx;
use tether_loadtest::devpki::{DevCa, DevIssuer, IssuerKey, write_private};
use tether_loadtest::local::{AUDIENCE, ScratchDir};

fn sh_ok(output: &std::process::Output) -> String {
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_reaches_the_control_plane_only_through_tether_with_tls_untouched() {
    if !netns::available() {
        eprintln!("SKIPPED: needs root for network namespaces (CI runs as root)");
        return;
    }
    let dir = ScratchDir::new("tether-topology").unwrap();
    let net = fastrand::u8(1..250);
    let (gw_ip, node_ip) = (format!("10.213.{net}.1"), format!("10.213.{net}.2"));
    let (cp_outer, cp_ip) = (format!("10.214.{net}.1"), format!("10.214.{net}.2"));
    let tag = format!("{:04x}", fastrand::u16(..));

    let node = Netns::new("tnode");
    node.link_to_root(&format!("tn{tag}h"), &format!("{gw_ip}/30"), &format!("tn{tag}n"), &format!("{node_ip}/30"));
    // The host-scoped address the kubernetes Service points at, as on a real node.
    // The same script the agent ships (dummy interface, or loopback where dummy is unavailable).
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../nodeagent/scripts/setup-host-address.sh");
    let setup = node.command("sh").arg(&script).arg("100.64.0.1").output().unwrap();
    assert!(setup.status.success(), "{}", String::from_utf8_lossy(&setup.stderr));
    let cp = Netns::new("tcp");
    cp.link_to_root(&format!("tc{tag}h"), &format!("{cp_outer}/30"), &format!("tc{tag}c"), &format!("{cp_ip}/30"));

    // kube-apiserver stand-in: nginx with its own certificate, serving /version.
    let ca = DevCa::create(dir.path(), "kas").unwrap();
    let kas_cert = ca.server("kas", &["kubernetes.default.svc", "100.64.0.1", &cp_ip]).unwrap();
    let _nginx = Nginx::start(
        &dir.path().join("nginx"),
        &format!(
            r#"http {{
  {preamble}
  log_format sni '$ssl_server_name $request';
  server {{
    listen {cp_ip}:6443 ssl;
    ssl_certificate {cert};
    ssl_certificate_key {key};
    access_log $DIR/sni.log sni;
    location = /version {{ default_type application/json; return 200 '{{"major":"1","minor":"31","gitVersion":"v1.31.0"}}'; }}
  }}
}}"#,
            preamble = Nginx::http_preamble(),
            cert = kas_cert.cert.display(),
            key = kas_cert.key.display(),
        ),
        Some(&cp.name),
    );

    // Gateway in the root namespace; its agent endpoint is the only address the node can reach.
    let gw_ca = DevCa::create(&dir.path().join("gw"), "gw").unwrap();
    let gw_cert = gw_ca.server("gateway", &["topo.tether.local"]).unwrap();
    let issuer = DevIssuer::create(dir.path(), "topo", "https://issuer.topo.local", IssuerKey::Es256).unwrap();
    let agents_addr: SocketAddr = format!("{gw_ip}:{}", free_port()).parse().unwrap();
    let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let gateway_config = serde_json::json!({
        "listen": { "agents": agents_addr.to_string(), "admin": admin.to_string() },
        "tls": { "cert_file": gw_cert.cert, "key_file": gw_cert.key },
        "tenants": [{
            "name": "topo",
            "hosts": ["topo.tether.local"],
            "auth": { "issuer": issuer.issuer, "audiences": [AUDIENCE], "jwks_file": issuer.jwks_file },
            "frontend": { "uds": dir.path().join("topo.sock") },
            "node_to_controlplane": { "targets": [{ "name": "kube-apiserver", "address": format!("{cp_ip}:6443") }] },
        }],
    });
    let gateway_file = dir.path().join("gateway.yaml");
    std::fs::write(&gateway_file, gateway_config.to_string()).unwrap();
    let gateway =
        Process::spawn("tether-gateway", &["-c", gateway_file.to_str().unwrap()], &[], dir.path(), "gateway").unwrap();
    assert!(wait_ready(admin, "/readyz", Duration::from_secs(20)).await, "{}", gateway.log_text());

    // Agent in the node namespace.
    let token = issuer
        .service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(3600), Some("node-1"))
        .unwrap();
    let token_file = dir.path().join("agent.token");
    write_private(&token_file, token.as_bytes()).unwrap();
    let agent_admin_port = free_port();
    let agent_config = serde_json::json!({
        "gateway": {
            "url": format!("wss://{agents_addr}/v1/tunnel"),
            "server_name": "topo.tether.local",
            "token_file": token_file,
            "ca_file": gw_ca.ca_cert,
            "reconnect_initial": "100ms",
        },
        "admin_listen": format!("127.0.0.1:{agent_admin_port}"),
        "listeners": [{ "bind": "100.64.0.1:6443", "target": "kube-apiserver" }],
    });
    let agent_file = dir.path().join("agent.yaml");
    std::fs::write(&agent_file, agent_config.to_string()).unwrap();
    let agent_bin = tether_e2e::bins::bin_path("tether-agent");
    let agent_log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
    let agent = node
        .command(agent_bin.to_str().unwrap())
        .args(["-c", agent_file.to_str().unwrap()])
        .stderr(agent_log)
        .spawn()
        .unwrap();
    let _agent = KillOnDrop(agent);
    let mut ready = false;
    for _ in 0..200 {
        let probe = node.sh(&format!("curl -sf http://127.0.0.1:{agent_admin_port}/readyz"));
        if probe.status.success() {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let agent_log_text = || std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default();
    assert!(ready, "agent not ready:\n{}\n{}", agent_log_text(), gateway.log_text());

    // Isolation: the node cannot reach the control plane directly.
    let direct = node.sh(&format!("curl -sS --max-time 3 -k https://{cp_ip}:6443/version"));
    assert!(!direct.status.success(), "the node must not reach the control plane directly");

    // Through the agent's host-scoped listener: the KAS's own certificate, with our SNI.
    let ca_file = ca.ca_cert.display().to_string();
    let body = sh_ok(&node.sh(&format!(
        "curl -sS --max-time 10 --cacert {ca_file} --resolve kubernetes.default.svc:6443:100.64.0.1 https://kubernetes.default.svc:6443/version"
    )));
    assert_eq!(body, r#"{"major":"1","minor":"31","gitVersion":"v1.31.0"}"#);
    let seen = sh_ok(&node.sh(
        "openssl s_client -connect 100.64.0.1:6443 -servername kubernetes.default.svc </dev/null 2>/dev/null | openssl x509 -noout -fingerprint -sha256",
    ));
    let expected = sh_ok(
        &std::process::Command::new("openssl")
            .args(["x509", "-noout", "-fingerprint", "-sha256", "-in", kas_cert.cert.to_str().unwrap()])
            .output()
            .unwrap(),
    );
    assert_eq!(seen, expected, "the client must see the control plane's own certificate");
    let sni_log = std::fs::read_to_string(dir.path().join("nginx/sni.log")).unwrap_or_default();
    assert!(sni_log.contains("kubernetes.default.svc GET /version"), "SNI must reach the KAS untouched: {sni_log}");

    let (_, metrics) = http_get(admin, "/metrics").await.unwrap();
    assert!(metric_sum(&metrics, "tether_gateway_forwards_total", "result=\"ok\"") >= 2.0, "{metrics}");
    assert!(metric_sum(&metrics, "tether_gateway_forward_bytes_total", "from_controlplane") > 0.0);
    // One audit line per forward, with its outcome and bytes.
    let log = gateway.log_text();
    let audited: Vec<&str> =
        log.lines().filter(|l| l.contains(" audit: forward") && l.contains("destination=\"kube-apiserver\"")).collect();
    assert!(audited.len() >= 2, "{log}");
    let bytes_back = |line: &str| -> u64 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix("bytes_from_controlplane="))
            .and_then(|n| n.parse().ok())
            .unwrap_or_default()
    };
    assert!(
        audited.iter().all(|l| l.contains("result=\"ok\"") && l.contains("agent=\"node-1\"") && bytes_back(l) > 0),
        "{audited:#?}"
    );
}

/// Kills a child process when dropped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
