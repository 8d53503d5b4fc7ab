//! Through real load balancers, ingresses and corporate proxies. Every path carries a CONNECT
//! dial to a node-side server and a checksummed bulk transfer in both directions:
//!
//! - direct TLS to the gateway;
//! - nginx terminating TLS as an ingress (WebSocket upgrade) in front of a plain-HTTP gateway;
//! - nginx `stream` + `ssl_preread` routing by SNI to two gateways, TLS passed through;
//! - haproxy `mode tcp` SNI passthrough with `send-proxy-v2` to a gateway reading PROXY v2;
//! - each of these with the agent behind squid requiring Basic auth, and tinyproxy with Basic auth;
//! - wrong proxy credentials give a clear proxy-authentication error.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use tether_e2e::bins::{Process, eventually, free_port, http_get, metric_sum, start_agent, start_gateway};
use tether_e2e::daemons::{self, Daemon};
use tether_e2e::netns::{self, Netns};
use tether_e2e::nginx::{Nginx, wait_listening};
use tether_loadtest::backends;
use tether_loadtest::connect_client::connect_tcp;
use tether_loadtest::devpki::{DevCa, DevIssuer, IssuerKey, PemPair, write_private};
use tether_loadtest::local::{AUDIENCE, ScratchDir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::node_listener;

const BULK: u64 = 8 << 20;

/// Credentials, a node-side bulk server and helpers shared by the paths.
struct World {
    dir: ScratchDir,
    ca: DevCa,
    cert: PemPair,
    issuers: Vec<DevIssuer>,
    bulk: SocketAddr,
}

impl World {
    async fn new() -> Self {
        let dir = ScratchDir::new("tether-paths").unwrap();
        let ca = DevCa::create(dir.path(), "paths").unwrap();
        let cert = ca.server("gateway", &["t1.tether.local", "t2.tether.local", "127.0.0.1"]).unwrap();
        let issuers = ["t1", "t2"]
            .iter()
            .map(|t| DevIssuer::create(dir.path(), t, &format!("https://{t}.issuer"), IssuerKey::Es256).unwrap())
            .collect();
        let (listener, bulk) = node_listener().await;
        backends::spawn_bulk(listener);
        Self { dir, ca, cert, issuers, bulk }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A gateway config serving `tenants` (indices into t1, t2), with TLS unless `plain`.
    fn gateway_config(
        &self,
        agents: SocketAddr,
        admin: SocketAddr,
        tenants: &[usize],
        plain: bool,
    ) -> (serde_json::Value, Vec<SocketAddr>) {
        let frontends: Vec<SocketAddr> =
            tenants.iter().map(|_| SocketAddr::from(([127, 0, 0, 1], free_port()))).collect();
        let tenant_configs: Vec<serde_json::Value> = tenants
            .iter()
            .zip(&frontends)
            .map(|(&i, frontend)| {
                let name = format!("t{}", i + 1);
                serde_json::json!({
                    "name": name,
                    "hosts": [format!("{name}.tether.local")],
                    "auth": { "issuer": self.issuers[i].issuer, "audiences": [AUDIENCE], "jwks_file": self.issuers[i].jwks_file },
                    "frontend": { "tcp": { "listen": frontend.to_string() } },
                })
            })
            .collect();
        let mut config = serde_json::json!({
            "server_id": format!("gw-{}", agents.port()),
            "listen": { "agents": agents.to_string(), "admin": admin.to_string() },
            "keepalive": { "ping_interval": "1s", "ping_timeout": "2s" },
            "drain_grace_period": "1s",
            "tenants": tenant_configs,
        });
        if !plain {
            config["tls"] = serde_json::json!({ "cert_file": self.cert.cert, "key_file": self.cert.key });
        }
        (config, frontends)
    }

    /// An agent config for tenant `index` dialing `url` with SNI/Host `t<index+1>.tether.local`.
    fn agent_config(&self, index: usize, url: &str, ping: &str) -> (serde_json::Value, SocketAddr) {
        self.agent_config_for(index, url, ping, self.bulk)
    }

    /// Like [`agent_config`](Self::agent_config), serving `target` instead of the bulk server.
    fn agent_config_for(
        &self,
        index: usize,
        url: &str,
        ping: &str,
        target: SocketAddr,
    ) -> (serde_json::Value, SocketAddr) {
        let node = format!("node-t{}-{:04x}", index + 1, fastrand::u16(..));
        let token = self.issuers[index]
            .service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(3600), Some(&node))
            .unwrap();
        let token_file = self.path().join(format!("{node}.token"));
        write_private(&token_file, token.as_bytes()).unwrap();
        let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let config = serde_json::json!({
            "agent_id": node,
            "gateway": {
                "url": url,
                "server_name": format!("t{}.tether.local", index + 1),
                "token_file": token_file,
                "ca_file": self.ca.ca_cert,
                "reconnect_initial": "200ms",
                "reconnect_max": "1s",
                "ping_interval": ping,
                "ping_timeout": ping,
            },
            "admin_listen": admin.to_string(),
            "identifiers": { "addresses": [target.ip().to_string()] },
            "allow": [{ "cidr": format!("{}/32", target.ip()), "ports": [target.port()] }],
        });
        (config, admin)
    }
}

/// Waits for the agent's readiness, then dials through `frontend` and moves BULK bytes each way.
async fn prove_path(name: &str, agent: &Process, agent_admin: SocketAddr, frontend: SocketAddr, bulk: SocketAddr) {
    let ready =
        eventually(Duration::from_secs(20), async || matches!(http_get(agent_admin, "/readyz").await, Ok((200, _))))
            .await;
    assert!(ready, "{name}: agent not connected:\n{}", agent.log_text());
    bulk_both_ways(frontend, bulk).await.unwrap_or_else(|e| panic!("{name}: {e}\n{}", agent.log_text()));
}

/// Downloads and uploads BULK bytes through a CONNECT tunnel, checking every byte / the count.
async fn bulk_both_ways(frontend: SocketAddr, bulk: SocketAddr) -> Result<(), String> {
    let pattern = backends::pattern(256 * 1024);
    let mut down =
        connect_tcp(frontend, &bulk.to_string()).await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    down.write_all(b"D").await.map_err(|e| e.to_string())?;
    down.write_all(&BULK.to_be_bytes()).await.map_err(|e| e.to_string())?;
    let mut got = Vec::with_capacity(BULK as usize);
    down.read_to_end(&mut got).await.map_err(|e| e.to_string())?;
    if got.len() as u64 != BULK || got.chunks(pattern.len()).any(|c| c != &pattern[..c.len()]) {
        return Err(format!("download corrupted ({} bytes)", got.len()));
    }
    let mut up =
        connect_tcp(frontend, &bulk.to_string()).await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    up.write_all(b"U").await.map_err(|e| e.to_string())?;
    for _ in 0..BULK / pattern.len() as u64 {
        up.write_all(&pattern).await.map_err(|e| e.to_string())?;
    }
    up.shutdown().await.map_err(|e| e.to_string())?;
    let mut count = [0u8; 8];
    up.read_exact(&mut count).await.map_err(|e| e.to_string())?;
    if u64::from_be_bytes(count) != BULK {
        return Err(format!("upload: the node received {} bytes", u64::from_be_bytes(count)));
    }
    Ok(())
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// A running squid requiring `tether`/`proxy-pass`, and the proxy URLs with good and bad credentials.
async fn squid(world: &World, listen: SocketAddr) -> (Daemon, String, String) {
    let squid = daemons::squid(&world.path().join(format!("squid-{}", listen.port())), listen, "tether", "proxy-pass");
    assert!(wait_listening(listen, Duration::from_secs(20)).await, "squid did not start");
    (squid, format!("http://tether:proxy-pass@{listen}"), format!("http://tether:wrong@{listen}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_tls_with_and_without_squid_and_tinyproxy() {
    let world = World::new().await;
    let (agents, admin) = (loopback(), loopback());
    let (config, frontends) = world.gateway_config(agents, admin, &[0], false);
    let _gateway = start_gateway(world.path(), "gateway", &config, admin).await;
    let url = format!("wss://{agents}/v1/tunnel");

    let (agent_config, agent_admin) = world.agent_config(0, &url, "20s");
    let agent = start_agent(world.path(), "agent-direct", &agent_config, &[]);
    prove_path("direct TLS", &agent, agent_admin, frontends[0], world.bulk).await;
    drop(agent);

    // Behind squid with Basic auth, configured through HTTPS_PROXY as on most corporate hosts.
    let (_squid, good, bad) = squid(&world, loopback()).await;
    let (agent_config, agent_admin) = world.agent_config(0, &url, "20s");
    let agent = start_agent(world.path(), "agent-squid", &agent_config, &[("HTTPS_PROXY", &good), ("NO_PROXY", "")]);
    prove_path("direct TLS via squid", &agent, agent_admin, frontends[0], world.bulk).await;
    drop(agent);

    // Wrong credentials: a proxy-authentication error naming the proxy, not a gateway failure.
    let (agent_config, agent_admin) = world.agent_config(0, &url, "20s");
    let agent = start_agent(world.path(), "agent-badproxy", &agent_config, &[("HTTPS_PROXY", &bad)]);
    let refused = eventually(Duration::from_secs(20), async || {
        http_get(agent_admin, "/metrics")
            .await
            .is_ok_and(|(_, m)| metric_sum(&m, "tether_agent_connects_total", "result=\"proxy_auth\"") >= 1.0)
    })
    .await;
    assert!(refused, "{}", agent.log_text());
    let log = agent.log_text();
    assert!(log.contains("proxy authentication failed") && log.contains("refused the credentials (HTTP 407)"), "{log}");
    assert!(!log.contains("wrong") && !log.contains("proxy-pass"), "credentials must never be logged");
    let (status, body) = http_get(agent_admin, "/readyz").await.unwrap();
    assert_eq!(status, 503);
    assert!(body.contains("proxy") && body.contains("credentials"), "{body}");
    drop(agent);

    // tinyproxy answers bad credentials with 401; good ones pass.
    let tiny_addr = loopback();
    let _tiny = daemons::tinyproxy(&world.path().join("tinyproxy"), tiny_addr, "tether", "tiny-pass");
    assert!(wait_listening(tiny_addr, Duration::from_secs(10)).await, "tinyproxy did not start");
    let (mut agent_config, agent_admin) = world.agent_config(0, &url, "20s");
    agent_config["gateway"]["proxy"] = serde_json::json!({ "url": format!("http://{tiny_addr}"), "username": "tether", "password_file": write_password(&world, "tiny-pass") });
    let agent = start_agent(world.path(), "agent-tinyproxy", &agent_config, &[]);
    prove_path("direct TLS via tinyproxy", &agent, agent_admin, frontends[0], world.bulk).await;
    drop(agent);
    let (mut agent_config, agent_admin) = world.agent_config(0, &url, "20s");
    agent_config["gateway"]["proxy"] = serde_json::json!({ "url": format!("http://tether:nope@{tiny_addr}") });
    let agent = start_agent(world.path(), "agent-tinyproxy-bad", &agent_config, &[]);
    let refused = eventually(Duration::from_secs(20), async || {
        http_get(agent_admin, "/metrics")
            .await
            .is_ok_and(|(_, m)| metric_sum(&m, "tether_agent_connects_total", "result=\"proxy_auth\"") >= 1.0)
    })
    .await;
    assert!(refused && agent.log_text().contains("(HTTP 401)"), "{}", agent.log_text());
}

fn write_password(world: &World, password: &str) -> String {
    let file = world.path().join(format!("proxy-password-{:04x}", fastrand::u16(..)));
    write_private(&file, password.as_bytes()).unwrap();
    file.display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_ingress_terminating_tls_in_front_of_a_plain_http_gateway() {
    let world = World::new().await;
    let (agents, admin) = (loopback(), loopback());
    let (mut config, frontends) = world.gateway_config(agents, admin, &[0], true);
    // The ingress is trusted to say who the agent is.
    config["listen"]["trusted_proxies"] = serde_json::json!(["127.0.0.1/32"]);
    let gateway = start_gateway(world.path(), "gateway", &config, admin).await;
    let ingress = loopback();
    let _nginx = Nginx::start(&world.path().join("nginx"), &ingress_config(&world, ingress, agents, "3600s"), None);
    assert!(wait_listening(ingress, Duration::from_secs(10)).await);
    let url = format!("wss://{ingress}/v1/tunnel");

    let (agent_config, agent_admin) = world.agent_config(0, &url, "20s");
    let agent = start_agent(world.path(), "agent-ingress", &agent_config, &[]);
    prove_path("nginx ingress", &agent, agent_admin, frontends[0], world.bulk).await;
    drop(agent);
    let (_squid, good, _) = squid(&world, loopback()).await;
    let (agent_config, agent_admin) = world.agent_config(0, &url, "20s");
    let agent = start_agent(world.path(), "agent-ingress-squid", &agent_config, &[("HTTPS_PROXY", &good)]);
    prove_path("nginx ingress via squid", &agent, agent_admin, frontends[0], world.bulk).await;
    assert!(gateway.log_text().contains("agent connected"), "{}", gateway.log_text());
}

/// nginx as a TLS-terminating ingress proxying WebSocket upgrades to a plain-HTTP gateway.
fn ingress_config(world: &World, listen: SocketAddr, gateway: SocketAddr, read_timeout: &str) -> String {
    format!(
        r#"http {{
  {preamble}
  map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
  server {{
    listen {listen} ssl;
    server_name t1.tether.local;
    ssl_certificate {cert};
    ssl_certificate_key {key};
    location / {{
      proxy_pass http://{gateway};
      proxy_http_version 1.1;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_set_header Host $host;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_buffering off;
      proxy_read_timeout {read_timeout};
      proxy_send_timeout {read_timeout};
    }}
  }}
}}"#,
        preamble = Nginx::http_preamble(),
        cert = world.cert.cert.display(),
        key = world.cert.key.display(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_stream_routes_by_sni_to_two_gateways_with_tls_passed_through() {
    let world = World::new().await;
    let (agents1, admin1, agents2, admin2) = (loopback(), loopback(), loopback(), loopback());
    let (config1, frontends1) = world.gateway_config(agents1, admin1, &[0], false);
    let (config2, frontends2) = world.gateway_config(agents2, admin2, &[1], false);
    let _gw1 = start_gateway(world.path(), "gateway-1", &config1, admin1).await;
    let _gw2 = start_gateway(world.path(), "gateway-2", &config2, admin2).await;
    let lb = loopback();
    let stream = format!(
        "stream {{\n  map $ssl_preread_server_name $gateway {{ t1.tether.local {agents1}; t2.tether.local {agents2}; }}\n  server {{ listen {lb}; ssl_preread on; proxy_pass $gateway; }}\n}}"
    );
    let _nginx = Nginx::start(&world.path().join("nginx-stream"), &stream, None);
    assert!(wait_listening(lb, Duration::from_secs(10)).await);
    let url = format!("wss://{lb}/v1/tunnel");
    let (_squid, good, _) = squid(&world, loopback()).await;
    for (index, frontend) in [(0, frontends1[0]), (1, frontends2[0])] {
        let (agent_config, agent_admin) = world.agent_config(index, &url, "20s");
        let agent = start_agent(world.path(), &format!("agent-sni-{index}"), &agent_config, &[]);
        prove_path(&format!("nginx SNI routing to tenant {index}"), &agent, agent_admin, frontend, world.bulk).await;
        drop(agent);
        let (agent_config, agent_admin) = world.agent_config(index, &url, "20s");
        let agent =
            start_agent(world.path(), &format!("agent-sni-squid-{index}"), &agent_config, &[("HTTPS_PROXY", &good)]);
        prove_path(
            &format!("nginx SNI routing to tenant {index} via squid"),
            &agent,
            agent_admin,
            frontend,
            world.bulk,
        )
        .await;
    }
    // Each gateway holds only its own tenant's agents.
    let (_, m1) = http_get(admin1, "/metrics").await.unwrap();
    let (_, m2) = http_get(admin2, "/metrics").await.unwrap();
    assert!(metric_sum(&m1, "tether_gateway_agent_connects_total", "tenant=\"t1\",result=\"ok\"") >= 2.0, "{m1}");
    assert!(metric_sum(&m2, "tether_gateway_agent_connects_total", "tenant=\"t2\",result=\"ok\"") >= 2.0, "{m2}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn haproxy_sni_passthrough_with_proxy_protocol_v2_shows_the_agents_address() {
    if !netns::available() {
        eprintln!("SKIPPED: needs root for network namespaces (CI runs as root)");
        return;
    }
    let world = World::new().await;
    // The agent runs in its own namespace, so its address differs from the balancer's.
    let net = fastrand::u8(1..250);
    let (outer, inner) = (format!("10.215.{net}.1"), format!("10.215.{net}.2"));
    let tag = format!("{:04x}", fastrand::u16(..));
    let node = Netns::new("tpath");
    node.link_to_root(&format!("tp{tag}h"), &format!("{outer}/30"), &format!("tp{tag}n"), &format!("{inner}/30"));

    let (agents, admin) = (loopback(), loopback());
    let (mut config, frontends) = world.gateway_config(agents, admin, &[0], false);
    config["listen"]["proxy_protocol"] = serde_json::json!(true);
    config["listen"]["trusted_proxies"] = serde_json::json!(["127.0.0.1/32"]);
    let gateway = start_gateway(world.path(), "gateway", &config, admin).await;
    let lb: SocketAddr = format!("{outer}:{}", free_port()).parse().unwrap();
    let _haproxy = daemons::haproxy(
        &world.path().join("haproxy"),
        &format!(
            "frontend agents\n  bind {lb}\n  tcp-request inspect-delay 5s\n  tcp-request content accept if {{ req_ssl_hello_type 1 }}\n  use_backend gateway if {{ req.ssl_sni -i t1.tether.local }}\n\nbackend gateway\n  server gw {agents} send-proxy-v2\n"
        ),
    );
    assert!(wait_listening(lb, Duration::from_secs(10)).await, "haproxy did not start");
    let squid_addr: SocketAddr = format!("{outer}:{}", free_port()).parse().unwrap();
    let (_squid, good, _) = squid(&world, squid_addr).await;
    let url = format!("wss://{lb}/v1/tunnel");
    // A node-side server the agent's namespace can reach.
    let listener = tokio::net::TcpListener::bind((outer.parse::<std::net::IpAddr>().unwrap(), 0)).await.unwrap();
    let target = listener.local_addr().unwrap();
    backends::spawn_bulk(listener);

    for (name, env) in [("haproxy PROXY v2", None), ("haproxy PROXY v2 via squid", Some(good.as_str()))] {
        let (mut agent_config, _) = world.agent_config_for(0, &url, "20s", target);
        if let Some(proxy) = env {
            agent_config["gateway"]["proxy"] = serde_json::json!({ "url": proxy });
        }
        // The agent's admin port lives inside its namespace; readiness is checked at the gateway.
        let agent = node.spawn_agent(&agent_config, world.path(), &name.replace(' ', "-"));
        // Directly, the balancer passes on the agent's address; through squid, the proxy's.
        let expected = if env.is_some() { format!("peer={outer}:") } else { format!("peer={inner}:") };
        let connected = eventually(Duration::from_secs(20), async || gateway.log_text().contains(&expected)).await;
        assert!(
            connected,
            "{name}: the gateway must log the client address ({expected}):\n{}\n{}",
            gateway.log_text(),
            agent.log_text()
        );
        // Wait for its session to be registered, then prove the data path.
        let registered = eventually(Duration::from_secs(10), async || {
            http_get(admin, "/readyz")
                .await
                .is_ok_and(|(_, body)| body.contains("tenant t1: 1 agent sessions, 1 agents"))
        })
        .await;
        assert!(registered, "{name}");
        bulk_both_ways(frontends[0], target).await.unwrap_or_else(|e| panic!("{name}: {e}"));
        drop(agent);
        assert!(
            eventually(Duration::from_secs(10), async || http_get(admin, "/readyz")
                .await
                .is_ok_and(|(_, b)| b.contains("tenant t1: 0 agent sessions")))
            .await,
            "the killed agent must leave routing"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pings_keep_a_tunnel_alive_through_an_ingress_idle_timeout() {
    let world = World::new().await;
    let (agents, admin) = (loopback(), loopback());
    let (mut config, frontends) = world.gateway_config(agents, admin, &[0], true);
    // The gateway pings rarely here, so only the agent's pings (and the pongs they draw) move.
    config["keepalive"] = serde_json::json!({ "ping_interval": "10s", "ping_timeout": "10s" });
    let _gateway = start_gateway(world.path(), "gateway", &config, admin).await;
    // nginx closes connections idle for 2 s.
    let ingress = loopback();
    let _nginx = Nginx::start(&world.path().join("nginx"), &ingress_config(&world, ingress, agents, "2s"), None);
    assert!(wait_listening(ingress, Duration::from_secs(10)).await);
    let url = format!("wss://{ingress}/v1/tunnel");
    let connects = async |admin: SocketAddr| {
        http_get(admin, "/metrics")
            .await
            .map(|(_, m)| metric_sum(&m, "tether_agent_connects_total", "result=\"ok\""))
            .unwrap_or(0.0)
    };

    // Control: with pings every 10 s, nginx cuts the idle tunnel and the agent has to reconnect.
    let (agent_config, slow_admin) = world.agent_config(0, &url, "10s");
    let slow = start_agent(world.path(), "agent-slow-pings", &agent_config, &[]);
    assert!(
        eventually(Duration::from_secs(20), async || connects(slow_admin).await >= 1.0).await,
        "{}",
        slow.log_text()
    );
    assert!(
        eventually(Duration::from_secs(15), async || connects(slow_admin).await >= 2.0).await,
        "nginx must cut a silent tunnel: {}",
        slow.log_text()
    );
    drop(slow);

    // With pings every second the same tunnel outlives several idle timeouts.
    let (agent_config, agent_admin) = world.agent_config(0, &url, "1s");
    let agent = start_agent(world.path(), "agent-pings", &agent_config, &[]);
    assert!(eventually(Duration::from_secs(20), async || connects(agent_admin).await >= 1.0).await);
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(connects(agent_admin).await, 1.0, "the tunnel must survive idle periods: {}", agent.log_text());
    bulk_both_ways(frontends[0], world.bulk).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_path_is_detected_and_the_agent_returns_when_it_heals() {
    if !netns::available() {
        eprintln!("SKIPPED: needs root for network namespaces (CI runs as root)");
        return;
    }
    let world = World::new().await;
    let net = fastrand::u8(1..250);
    let (outer, inner) = (format!("10.216.{net}.1"), format!("10.216.{net}.2"));
    let tag = format!("{:04x}", fastrand::u16(..));
    let node = Netns::new("tblack");
    node.link_to_root(&format!("tb{tag}h"), &format!("{outer}/30"), &format!("tb{tag}n"), &format!("{inner}/30"));
    let agents: SocketAddr = format!("{outer}:{}", free_port()).parse().unwrap();
    let admin = loopback();
    let (mut config, frontends) = world.gateway_config(agents, admin, &[0], false);
    config["keepalive"] = serde_json::json!({ "ping_interval": "1s", "ping_timeout": "2s" });
    let gateway = start_gateway(world.path(), "gateway", &config, admin).await;

    // The node-side server must be reachable from the node's namespace: it listens on the link.
    let listener = tokio::net::TcpListener::bind((outer.parse::<std::net::IpAddr>().unwrap(), 0)).await.unwrap();
    let target = listener.local_addr().unwrap();
    backends::spawn_bulk(listener);
    let (agent_config, _) = world.agent_config_for(0, &format!("wss://{agents}/v1/tunnel"), "1s", target);
    let agent = node.spawn_agent(&agent_config, world.path(), "agent");
    let sessions = async || {
        http_get(admin, "/metrics")
            .await
            .map(|(_, m)| metric_sum(&m, "tether_gateway_agent_sessions", "tenant=\"t1\""))
            .unwrap_or(-1.0)
    };
    assert!(eventually(Duration::from_secs(20), async || sessions().await == 1.0).await, "{}", gateway.log_text());

    // Drop every packet between the node and the gateway, silently.
    let blackhole = format!(
        "nft add table inet tether && nft 'add chain inet tether out {{ type filter hook output priority 0; }}' && nft add rule inet tether out ip daddr {outer} drop"
    );
    let output = node.sh(&blackhole);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    // Both ends notice within ping interval + timeout: the gateway drops the agent from routing.
    assert!(
        eventually(Duration::from_secs(15), async || sessions().await == 0.0).await,
        "the gateway must drop a dead agent"
    );
    let refused = connect_tcp(frontends[0], &target.to_string()).await.unwrap().unwrap_err();
    assert_eq!(refused.status, 503, "{}", refused.reason);
    assert!(
        eventually(Duration::from_secs(10), async || agent.log_text().contains("declaring it dead")).await,
        "{}",
        agent.log_text()
    );

    // The path heals; the agent comes back on its own.
    let output = node.sh("nft delete table inet tether");
    assert!(output.status.success());
    assert!(eventually(Duration::from_secs(20), async || sessions().await == 1.0).await, "{}", agent.log_text());
    bulk_both_ways(frontends[0], target).await.unwrap();
}

/// Benchmark, not a test: throughput and CONNECT latency through each load-balancer path,
/// relative to the direct path and to plain loopback TCP, in one run. Run with
/// `cargo test --release -p tether-e2e --test suite bench_lb_paths -- --ignored --nocapture`;
/// figures go to stdout and `target/bench-lb-paths.json` (see docs/benchmarks.md).
#[tokio::test(flavor = "multi_thread")]
#[ignore = "benchmark; run explicitly"]
async fn bench_lb_paths() {
    let world = World::new().await;
    let mut rows: Vec<(String, f64, f64, f64, f64)> = Vec::new();
    let bytes: u64 = 256 << 20;
    // Baseline: the node-side server directly over loopback TCP.
    let (down, up) = bulk_rates(None, world.bulk, bytes).await;
    let (p50, p99) = dial_latencies(None, world.bulk, 300).await;
    rows.push(("loopback TCP (no tunnel)".into(), down, up, p50, p99));

    let (agents, admin) = (loopback(), loopback());
    let (config, frontends) = world.gateway_config(agents, admin, &[0], false);
    let _gw = start_gateway(world.path(), "gw-direct", &config, admin).await;
    let (plain_agents, plain_admin) = (loopback(), loopback());
    let (mut plain, plain_frontends) = world.gateway_config(plain_agents, plain_admin, &[0], true);
    plain["listen"]["trusted_proxies"] = serde_json::json!(["127.0.0.1/32"]);
    let _gw_plain = start_gateway(world.path(), "gw-plain", &plain, plain_admin).await;
    let (pp_agents, pp_admin) = (loopback(), loopback());
    let (mut pp, pp_frontends) = world.gateway_config(pp_agents, pp_admin, &[0], false);
    pp["listen"]["proxy_protocol"] = serde_json::json!(true);
    let _gw_pp = start_gateway(world.path(), "gw-pp", &pp, pp_admin).await;

    let ingress = loopback();
    let _ingress = Nginx::start(
        &world.path().join("nginx-ingress"),
        &ingress_config(&world, ingress, plain_agents, "3600s"),
        None,
    );
    let sni = loopback();
    let _sni = Nginx::start(
        &world.path().join("nginx-sni"),
        &format!(
            "stream {{\n  map $ssl_preread_server_name $gw {{ t1.tether.local {agents}; }}\n  server {{ listen {sni}; ssl_preread on; proxy_pass $gw; }}\n}}"
        ),
        None,
    );
    let hap = loopback();
    let _haproxy = daemons::haproxy(
        &world.path().join("haproxy"),
        &format!(
            "frontend f\n  bind {hap}\n  tcp-request inspect-delay 5s\n  tcp-request content accept if {{ req_ssl_hello_type 1 }}\n  default_backend b\nbackend b\n  server g {pp_agents} send-proxy-v2\n"
        ),
    );
    let (_squid, good, _) = squid(&world, loopback()).await;
    for addr in [ingress, sni, hap] {
        assert!(wait_listening(addr, Duration::from_secs(10)).await);
    }
    let paths: Vec<(&str, String, SocketAddr, Option<String>)> = vec![
        ("direct TLS to the gateway", format!("wss://{agents}/v1/tunnel"), frontends[0], None),
        ("direct TLS, agent behind squid", format!("wss://{agents}/v1/tunnel"), frontends[0], Some(good.clone())),
        ("nginx ingress (TLS terminated)", format!("wss://{ingress}/v1/tunnel"), plain_frontends[0], None),
        ("nginx stream SNI passthrough", format!("wss://{sni}/v1/tunnel"), frontends[0], None),
        ("haproxy SNI passthrough + PROXY v2", format!("wss://{hap}/v1/tunnel"), pp_frontends[0], None),
    ];
    for (name, url, frontend, proxy) in paths {
        let (config, agent_admin) = world.agent_config(0, &url, "20s");
        let env: Vec<(&str, &str)> = proxy.as_deref().map(|p| vec![("HTTPS_PROXY", p)]).unwrap_or_default();
        let agent = start_agent(world.path(), &format!("bench-{}", name.len()), &config, &env);
        assert!(
            eventually(Duration::from_secs(20), async || matches!(
                http_get(agent_admin, "/readyz").await,
                Ok((200, _))
            ))
            .await,
            "{name}"
        );
        let (down, up) = bulk_rates(Some(frontend), world.bulk, bytes).await;
        let (p50, p99) = dial_latencies(Some(frontend), world.bulk, 300).await;
        rows.push((name.to_owned(), down, up, p50, p99));
        drop(agent);
    }
    let direct = rows[1].clone();
    println!(
        "\n{:<38} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "path", "down MiB/s", "up MiB/s", "vs direct", "p50 us", "p99 us", "p50 +us"
    );
    let mut json = Vec::new();
    for (name, down, up, p50, p99) in &rows {
        let ratio = (down + up) / (direct.1 + direct.2);
        println!(
            "{name:<38} {down:>10.0} {up:>10.0} {ratio:>8.0}% {p50:>9.0} {p99:>9.0} {:>9.0}",
            p50 - direct.3,
            ratio = ratio * 100.0
        );
        json.push(serde_json::json!({ "path": name, "download_mib_s": down, "upload_mib_s": up, "vs_direct_tls": ratio, "connect_p50_us": p50, "connect_p99_us": p99 }));
    }
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-lb-paths.json");
    std::fs::write(out, serde_json::to_string_pretty(&json).unwrap()).unwrap();
}

/// MiB/s downloading and uploading `bytes`, through a CONNECT `frontend` or directly.
async fn bulk_rates(frontend: Option<SocketAddr>, bulk: SocketAddr, bytes: u64) -> (f64, f64) {
    let open = async || -> tokio::net::TcpStream {
        match frontend {
            Some(f) => connect_tcp(f, &bulk.to_string()).await.unwrap().unwrap(),
            None => tokio::net::TcpStream::connect(bulk).await.unwrap(),
        }
    };
    let mut down = open().await;
    let started = std::time::Instant::now();
    down.write_all(b"D").await.unwrap();
    down.write_all(&bytes.to_be_bytes()).await.unwrap();
    let mut buf = vec![0u8; 256 * 1024];
    let mut got = 0u64;
    loop {
        let n = down.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        got += n as u64;
    }
    assert_eq!(got, bytes);
    let down_rate = bytes as f64 / 1048576.0 / started.elapsed().as_secs_f64();
    let chunk = backends::pattern(256 * 1024);
    let mut up = open().await;
    let started = std::time::Instant::now();
    up.write_all(b"U").await.unwrap();
    for _ in 0..bytes / chunk.len() as u64 {
        up.write_all(&chunk).await.unwrap();
    }
    up.shutdown().await.unwrap();
    let mut count = [0u8; 8];
    up.read_exact(&mut count).await.unwrap();
    assert_eq!(u64::from_be_bytes(count), bytes);
    (down_rate, bytes as f64 / 1048576.0 / started.elapsed().as_secs_f64())
}

/// p50 and p99 microseconds from connecting (CONNECT included) to the first byte of an answer.
async fn dial_latencies(frontend: Option<SocketAddr>, bulk: SocketAddr, dials: usize) -> (f64, f64) {
    let mut samples = Vec::with_capacity(dials);
    for _ in 0..dials {
        let started = std::time::Instant::now();
        let mut stream = match frontend {
            Some(f) => connect_tcp(f, &bulk.to_string()).await.unwrap().unwrap(),
            None => tokio::net::TcpStream::connect(bulk).await.unwrap(),
        };
        stream.write_all(b"D").await.unwrap();
        stream.write_all(&1u64.to_be_bytes()).await.unwrap();
        let mut one = [0u8; 1];
        stream.read_exact(&mut one).await.unwrap();
        samples.push(started.elapsed().as_secs_f64() * 1e6);
    }
    samples.sort_by(f64::total_cmp);
    (samples[samples.len() / 2], samples[samples.len() * 99 / 100])
}
