//! Multi-tenant gateway in one process: isolation between tenants, per-tenant limits, token
//! refresh and expiry, and hot reload.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tether_agent::{Agent, AgentConfig, AgentState};
use tether_e2e::bins::{http_get, metric_sum};
use tether_gateway::{Gateway, GatewayConfig, GatewayHandle};
use tether_loadtest::connect_client::connect_tcp;
use tether_loadtest::devpki::{DevCa, DevIssuer, IssuerKey, write_private};
use tether_loadtest::local::{AUDIENCE, ScratchDir, loopback};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::support::echo_server;

/// A gateway serving several tenants, each with its own issuer and TCP frontend.
pub struct Fleet {
    pub dir: ScratchDir,
    pub ca: DevCa,
    pub gateway_cert: tether_loadtest::devpki::PemPair,
    pub issuers: Vec<DevIssuer>,
    pub config: GatewayConfig,
    pub handle: GatewayHandle,
    pub agent_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub frontends: Vec<SocketAddr>,
    pub shared: Option<SocketAddr>,
    task: tokio::task::JoinHandle<Result<(), tether_gateway::error::SetupError>>,
}

pub fn tenant_json(
    name: &str,
    issuer: &DevIssuer,
    frontend: SocketAddr,
    limits: &serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({
        "name": name,
        "hosts": [format!("{name}.tether.local")],
        "auth": { "issuer": issuer.issuer, "audiences": [AUDIENCE], "jwks_file": issuer.jwks_file, "leeway": "1s" },
        "frontend": { "tcp": { "listen": frontend.to_string() } },
        "limits": limits,
    })
}

impl Fleet {
    /// Starts a gateway with tenants `names`; `limits` per tenant (JSON, may be `{}`).
    pub async fn start(names: &[&str], limits: &[serde_json::Value]) -> Self {
        Self::start_with(names, limits, false).await
    }

    /// Like [`start`](Self::start); with `shared_frontend`, a shared mutual-TLS frontend maps the
    /// client certificate name `kas.<tenant>` to each tenant.
    pub async fn start_with(names: &[&str], limits: &[serde_json::Value], shared_frontend: bool) -> Self {
        tether_tunnel::tls::install_default_provider();
        let dir = ScratchDir::new("tether-fleet").unwrap();
        let ca = DevCa::create(dir.path(), "fleet").unwrap();
        let hosts: Vec<String> = names.iter().map(|n| format!("{n}.tether.local")).collect();
        let host_refs: Vec<&str> = hosts.iter().map(String::as_str).collect();
        let gateway_cert = ca.server("gateway", &host_refs).unwrap();
        let issuers: Vec<DevIssuer> = names
            .iter()
            .map(|n| DevIssuer::create(dir.path(), n, &format!("https://{n}.issuer.local"), IssuerKey::Es256).unwrap())
            .collect();
        let tenants: Vec<serde_json::Value> = names
            .iter()
            .zip(&issuers)
            .zip(limits.iter().chain(std::iter::repeat(&serde_json::json!({}))))
            .map(|((n, issuer), l)| tenant_json(n, issuer, loopback(0), l))
            .collect();
        let mut config = serde_json::json!({
            "server_id": "fleet-0",
            "listen": { "agents": "127.0.0.1:0", "admin": "127.0.0.1:0" },
            "tls": { "cert_file": gateway_cert.cert, "key_file": gateway_cert.key },
            "drain_grace_period": "2s",
            "tenants": tenants,
        });
        if shared_frontend {
            config["shared_frontend"] = serde_json::json!({
                "listen": "127.0.0.1:0",
                "tls": { "cert_file": gateway_cert.cert, "key_file": gateway_cert.key },
                "client_ca_file": ca.ca_cert,
            });
            for (tenant, name) in config["tenants"].as_array_mut().unwrap().iter_mut().zip(names) {
                tenant["frontend"]["client_names"] = serde_json::json!([format!("kas.{name}")]);
            }
        }
        let config: GatewayConfig = serde_json::from_value(config).unwrap();
        assert!(config.validate().is_empty(), "{:?}", config.validate());
        let metrics = tether_tunnel::telemetry::install_metrics().ok();
        let gateway = Gateway::bind(config.clone(), metrics).await.unwrap();
        let frontends = names.iter().map(|n| gateway.frontend_addr(n).unwrap()).collect();
        let shared = gateway.shared_frontend_addr();
        let (agent_addr, admin_addr, handle) = (gateway.agent_addr(), gateway.admin_addr(), gateway.handle());
        let task = tokio::spawn(gateway.run(std::future::pending()));
        Self { dir, ca, gateway_cert, issuers, config, handle, agent_addr, admin_addr, frontends, shared, task }
    }

    /// Agent configuration for tenant `index`, node `node`, serving `serves` (token written).
    pub fn agent_config(&self, index: usize, node: &str, serves: SocketAddr, token_ttl: Duration) -> AgentConfig {
        self.agent_config_serving(index, node, &[serves], token_ttl)
    }

    /// Like [`agent_config`](Self::agent_config), allowing several targets.
    pub fn agent_config_serving(
        &self,
        index: usize,
        node: &str,
        serves: &[SocketAddr],
        token_ttl: Duration,
    ) -> AgentConfig {
        let tenant = &self.config.tenants[index].name;
        let token = self.issuers[index]
            .service_account_token("kube-system", "tether-agent", AUDIENCE, token_ttl, Some(node))
            .unwrap();
        let token_file = self.dir.path().join(format!("{tenant}-{node}.token"));
        write_private(&token_file, token.as_bytes()).unwrap();
        serde_json::from_value(serde_json::json!({
            "agent_id": node,
            "gateway": {
                "url": format!("wss://{}/v1/tunnel", self.agent_addr),
                "server_name": format!("{tenant}.tether.local"),
                "token_file": token_file,
                "ca_file": self.ca.ca_cert,
                "reconnect_initial": "100ms",
                "reconnect_max": "500ms",
                "token_check_interval": "200ms",
            },
            "admin_listen": "127.0.0.1:0",
            "shutdown_grace_period": "1s",
            "identifiers": { "addresses": serves.iter().map(|a| a.ip().to_string()).collect::<Vec<_>>() },
            "allow": serves.iter().map(|a| serde_json::json!({ "cidr": format!("{}/32", a.ip()), "ports": [a.port()] })).collect::<Vec<_>>(),
        }))
        .unwrap()
    }

    pub async fn shutdown(self) {
        self.handle.shutdown();
        let _ = self.task.await;
    }

    pub async fn metrics(&self) -> String {
        http_get(self.admin_addr, "/metrics").await.unwrap().1
    }
}

/// A running in-process agent.
pub struct RunningAgent {
    pub state: std::sync::Arc<AgentState>,
    pub admin: Option<SocketAddr>,
    pub stop: CancellationToken,
    pub token_file: PathBuf,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl RunningAgent {
    pub async fn start(config: AgentConfig) -> Self {
        let token_file = config.gateway.token_file.clone();
        let agent = Agent::bind(config, tether_tunnel::telemetry::install_metrics().ok()).await.unwrap();
        let (state, stop, admin) = (agent.state(), agent.stop_token(), agent.admin_addr());
        let task = tokio::spawn(agent.run(std::future::pending()));
        Self { state, stop, admin, token_file, task }
    }

    pub async fn wait_live(&self, timeout: Duration) -> bool {
        crate::tunnel::wait_for(timeout, || self.state.live_sessions() > 0).await
    }

    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// Client settings for a raw connection to the fleet's gateway as tenant `host`.
fn client_settings(fleet: &Fleet, host: &str) -> tether_tunnel::client::ClientSettings {
    let roots = tether_tunnel::tls::ClientRoots { ca_file: Some(fleet.ca.ca_cert.clone()), system_roots: false };
    let tls = tether_tunnel::tls::client_config(&roots, None, &[tether_tunnel::tls::ALPN_HTTP11]).unwrap();
    tether_tunnel::client::ClientSettings {
        url: format!("wss://{}/v1/tunnel", fleet.agent_addr).parse().unwrap(),
        tls: Some(std::sync::Arc::new(tls)),
        tls_server_name: Some(host.into()),
        connect_timeout: Duration::from_secs(5),
        handshake_timeout: Duration::from_secs(5),
        ws: tether_tunnel::ws::WsSettings::default(),
        user_agent: "tether-test".into(),
        proxy: None,
    }
}

/// Dials `fleet`'s tenant `index` as a new agent `node` and expects 503 for its agent limit;
/// returns the settings and the token used.
async fn refused_for_the_agent_limit(
    fleet: &Fleet,
    index: usize,
    node: &str,
) -> (tether_tunnel::client::ClientSettings, String) {
    let settings = client_settings(fleet, &format!("{}.tether.local", fleet.config.tenants[index].name));
    let token = fleet.issuers[index]
        .service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600), Some(node))
        .unwrap();
    match tether_tunnel::client::connect(&settings, Some(&token)).await {
        Err(tether_tunnel::client::ConnectError::Rejected { status, reason, .. }) => {
            assert_eq!(status, 503);
            assert!(reason.contains("agent limit"), "{reason}");
        }
        other => panic!("expected 503, got {:?}", other.map(|_| ())),
    }
    (settings, token)
}

/// A TCP address whose connects hang: a listener with a full accept queue that never accepts.
async fn hanging_target() -> ((tokio::net::TcpListener, Vec<tokio::net::TcpStream>), SocketAddr) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from(([127, 0, fastrand::u8(1..250), fastrand::u8(1..250)], 0))).unwrap();
    let listener = socket.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    // Fill the accept queue; later SYNs are dropped, so connects wait until they time out.
    let mut fillers = Vec::new();
    for _ in 0..4 {
        match tokio::time::timeout(Duration::from_millis(200), tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => fillers.push(stream),
            _ => break,
        }
    }
    ((listener, fillers), addr)
}

async fn echo_via(frontend: SocketAddr, target: SocketAddr) -> Result<(), (u16, String)> {
    match connect_tcp(frontend, &target.to_string()).await {
        Ok(Ok(mut tunnel)) => {
            tunnel.write_all(b"hi").await.map_err(|e| (0, e.to_string()))?;
            let mut got = [0u8; 2];
            tunnel.read_exact(&mut got).await.map_err(|e| (0, e.to_string()))?;
            Ok(())
        }
        Ok(Err(refused)) => Err((refused.status, refused.reason)),
        Err(e) => Err((0, e.to_string())),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenants_frontend_reaches_only_its_own_agents() {
    let fleet = Fleet::start(&["alpha", "beta"], &[]).await;
    let (x, y) = (echo_server().await, echo_server().await);
    let a = RunningAgent::start(fleet.agent_config(0, "node-a", x, Duration::from_secs(3600))).await;
    let b = RunningAgent::start(fleet.agent_config(1, "node-b", y, Duration::from_secs(3600))).await;
    assert!(a.wait_live(Duration::from_secs(10)).await && b.wait_live(Duration::from_secs(10)).await);

    assert_eq!(echo_via(fleet.frontends[0], x).await, Ok(()));
    assert_eq!(echo_via(fleet.frontends[1], y).await, Ok(()));
    // y is served only by beta's agent (destHost); alpha's frontend must not reach it.
    let (status, reason) = echo_via(fleet.frontends[0], y).await.unwrap_err();
    assert_eq!(status, 403, "{reason}");
    assert!(reason.contains("node-a"), "the refusal comes from alpha's own agent: {reason}");
    let (status, reason) = echo_via(fleet.frontends[1], x).await.unwrap_err();
    assert_eq!(status, 403, "{reason}");
    assert!(reason.contains("node-b"), "{reason}");
    // The node name proven by a token cannot be claimed by another tenant's agent either: dials
    // by name go to the agent whose token proves it.
    let sessions = fleet.handle.sessions();
    assert_eq!((sessions["alpha"], sessions["beta"]), (1, 1));
    a.stop().await;
    b.stop().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_limits_refuse_with_a_reason_while_other_tenants_work() {
    let fleet = Fleet::start(
        &["small", "big"],
        &[serde_json::json!({ "max_agents": 1, "max_pending_dials": 1, "dial_timeout": "3s" }), serde_json::json!({})],
    )
    .await;
    let (x, y) = (echo_server().await, echo_server().await);
    let (_hang, hang) = hanging_target().await;
    let first =
        RunningAgent::start(fleet.agent_config_serving(0, "small-1", &[x, hang], Duration::from_secs(3600))).await;
    assert!(first.wait_live(Duration::from_secs(10)).await);
    let other = RunningAgent::start(fleet.agent_config(1, "big-1", y, Duration::from_secs(3600))).await;
    assert!(other.wait_live(Duration::from_secs(10)).await);

    // A second agent for "small" is refused before the upgrade: 503 with Retry-After.
    refused_for_the_agent_limit(&fleet, 0, "small-2").await;

    // One dial to a target that never answers holds small's only pending-dial slot...
    let frontend = fleet.frontends[0];
    let pending = tokio::spawn(async move { connect_tcp(frontend, &hang.to_string()).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // ...so the next dial is refused with 429, while "big" keeps working.
    let (status, reason) = echo_via(fleet.frontends[0], x).await.unwrap_err();
    assert_eq!(status, 429, "{reason}");
    assert!(reason.contains("pending dials"), "{reason}");
    assert_eq!(echo_via(fleet.frontends[1], y).await, Ok(()));
    let _ = pending.await;

    let metrics = fleet.metrics().await;
    assert!(
        metric_sum(&metrics, "tether_gateway_agent_connects_total", "tenant=\"small\",result=\"limit\"") >= 1.0,
        "{metrics}"
    );
    assert!(metric_sum(&metrics, "tether_gateway_dials_total", "tenant=\"small\",result=\"too_many_pending\"") >= 1.0);
    first.stop().await;
    other.stop().await;
    fleet.shutdown().await;
}

/// `max_agents` counts agents, not sessions: an agent that holds two sessions
/// (`pool.sessions_per_replica: 2`; busy sessions alike) takes one of the tenant's agent slots.
/// Another agent is refused - before the upgrade, or at its Hello when it says it holds a session
/// already but holds none here - and gets in once the first agent's last session has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_with_several_sessions_takes_one_agent_slot() {
    use tether_tunnel::protocol::ErrorCode;
    let fleet = Fleet::start(&["one"], &[serde_json::json!({ "max_agents": 1 })]).await;
    let x = echo_server().await;
    let mut config = fleet.agent_config(0, "node-a", x, Duration::from_secs(3600));
    config.gateway.pool.sessions_per_replica = 2;
    let a = RunningAgent::start(config).await;
    assert!(
        tether_e2e::bins::eventually(Duration::from_secs(10), async || a.state.live_sessions() == 2).await,
        "node-a holds both of its sessions"
    );
    assert_eq!(fleet.handle.sessions()["one"], 2);
    assert_eq!(echo_via(fleet.frontends[0], x).await, Ok(()));

    let (settings, token) = refused_for_the_agent_limit(&fleet, 0, "node-b").await;
    // Saying "additional" gets node-b past the upgrade, not past its Hello.
    let ws = tether_tunnel::client::connect_session(&settings, Some(&token), true).await.unwrap();
    let (session, _incoming, _control, result) = crate::support::hello_as(ws, "node-b").await;
    assert_eq!(result.code, Some(ErrorCode::LimitExceeded), "{result:?}");
    assert!(result.message.unwrap_or_default().contains("agent limit"));
    session.close();
    let metrics = fleet.metrics().await;
    assert!(
        metric_sum(&metrics, "tether_gateway_agent_connects_total", "tenant=\"one\",result=\"limit\"") >= 2.0,
        "{metrics}"
    );

    // node-a leaves; once both its sessions have ended, its slot is node-b's.
    a.stop().await;
    let b = RunningAgent::start(fleet.agent_config(0, "node-b", x, Duration::from_secs(3600))).await;
    assert!(b.wait_live(Duration::from_secs(10)).await);
    assert_eq!(echo_via(fleet.frontends[0], x).await, Ok(()));
    b.stop().await;
    fleet.shutdown().await;
}

/// One tenant's runaway client hits its own stream cap (503) and dial rate (429, `Retry-After`)
/// while another tenant on the same gateway dials at full speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_stream_cap_and_dial_rate_do_not_touch_other_tenants() {
    let fleet = Fleet::start(
        &["busy", "calm"],
        &[serde_json::json!({ "max_streams": 3, "dials_per_second": 10, "dial_burst": 10 }), serde_json::json!({})],
    )
    .await;
    let (x, y) = (echo_server().await, echo_server().await);
    let busy = RunningAgent::start(fleet.agent_config(0, "busy-1", x, Duration::from_secs(3600))).await;
    let calm = RunningAgent::start(fleet.agent_config(1, "calm-1", y, Duration::from_secs(3600))).await;
    assert!(busy.wait_live(Duration::from_secs(10)).await && calm.wait_live(Duration::from_secs(10)).await);

    // Three open tunnels fill busy's max_streams: the fourth dial gets 503, calm's still work.
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(connect_tcp(fleet.frontends[0], &x.to_string()).await.unwrap().unwrap());
    }
    let (status, reason) = echo_via(fleet.frontends[0], x).await.unwrap_err();
    assert_eq!(status, 503, "{reason}");
    assert!(reason.contains("too many open tunnelled connections"), "{reason}");
    assert_eq!(echo_via(fleet.frontends[1], y).await, Ok(()));
    // A closed tunnel frees its slot.
    drop(open.pop());
    assert!(
        tether_e2e::bins::eventually(Duration::from_secs(5), async || echo_via(fleet.frontends[0], x).await.is_ok())
            .await
    );
    drop(open);

    // 40 dials back to back (one open at a time, under max_streams): busy serves its bucket (10,
    // plus what refills meanwhile) and refuses the rest with 429; calm serves 40 at once meanwhile.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let back_to_back = async {
        let mut results = Vec::new();
        for _ in 0..40 {
            results.push(echo_via(fleet.frontends[0], x).await);
        }
        results
    };
    let at_once = futures::future::join_all((0..40).map(|_| echo_via(fleet.frontends[1], y)));
    let (busy_results, calm_results) = tokio::join!(back_to_back, at_once);
    let served = busy_results.iter().filter(|r| r.is_ok()).count();
    let limited: Vec<_> = busy_results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!((10..=20).contains(&served), "busy served {served} of 40");
    assert!(
        limited.iter().all(|(status, reason)| *status == 429 && reason.contains("too many new dials")),
        "{limited:?}"
    );
    assert!(calm_results.iter().all(Result::is_ok), "{calm_results:?}");

    let metrics = fleet.metrics().await;
    let dials = |labels: &str| metric_sum(&metrics, "tether_gateway_dials_total", labels);
    assert!(dials("tenant=\"busy\",result=\"too_many_streams\"") >= 1.0, "{metrics}");
    assert!(dials("tenant=\"busy\",result=\"rate_limited\"") >= 20.0, "{metrics}");
    assert_eq!(
        dials("tenant=\"calm\",result=\"rate_limited\"") + dials("tenant=\"calm\",result=\"too_many_streams\""),
        0.0
    );
    busy.stop().await;
    calm.stop().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refreshed_token_keeps_the_session_and_an_expired_one_ends_it() {
    let fleet = Fleet::start(&["fresh", "stale"], &[]).await;
    let (x, y) = (echo_server().await, echo_server().await);
    // Both agents start with tokens valid for 4 seconds.
    let fresh = RunningAgent::start(fleet.agent_config(0, "node-fresh", x, Duration::from_secs(4))).await;
    let stale = RunningAgent::start(fleet.agent_config(1, "node-stale", y, Duration::from_secs(4))).await;
    assert!(fresh.wait_live(Duration::from_secs(10)).await && stale.wait_live(Duration::from_secs(10)).await);
    // The kubelet rotates "fresh"'s token file; the agent sends it on its live session.
    let rotated = fleet.issuers[0]
        .service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(3600), Some("node-fresh"))
        .unwrap();
    write_private(&fresh.token_file, rotated.as_bytes()).unwrap();
    tokio::time::sleep(Duration::from_secs(6)).await;

    assert_eq!(fresh.state.live_sessions(), 1, "the refreshed session must survive the first token's expiry");
    assert_eq!(echo_via(fleet.frontends[0], x).await, Ok(()));
    let metrics = fleet.metrics().await;
    assert!(
        metric_sum(&metrics, "tether_gateway_token_refreshes_total", "tenant=\"fresh\",result=\"ok\"") >= 1.0,
        "{metrics}"
    );
    assert_eq!(metric_sum(&metrics, "tether_gateway_sessions_closed_total", "tenant=\"fresh\""), 0.0, "{metrics}");
    assert!(
        metric_sum(&metrics, "tether_gateway_sessions_closed_total", "tenant=\"stale\",reason=\"token_expired\"")
            >= 1.0,
        "{metrics}"
    );
    // The stale agent cannot come back with its expired token.
    assert_eq!(stale.state.live_sessions(), 0);
    assert_eq!(fleet.handle.sessions()["stale"], 0);
    fresh.stop().await;
    stale.stop().await;
    fleet.shutdown().await;
}

/// A token nobody rotates: the gateway ends the session once, at expiry plus leeway, and the agent
/// does not come back with the same token (no reconnect storm); an agent started with an expired
/// token never presents it. Both say why in `/readyz` and metrics, and connect as soon as the file
/// holds a valid token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_token_is_never_presented_again_and_a_new_one_connects() {
    let fleet = Fleet::start(&["lapsed", "late"], &[]).await;
    let (x, y) = (echo_server().await, echo_server().await);
    // "lapsed" starts with a token valid for 3 s; the gateway's leeway is 1 s.
    let lapsed = RunningAgent::start(fleet.agent_config(0, "node-lapsed", x, Duration::from_secs(3))).await;
    assert!(lapsed.wait_live(Duration::from_secs(10)).await);
    // "late" starts with a token that expired 10 s ago (say, a static pod started before the kubelet).
    let config = fleet.agent_config(1, "node-late", y, Duration::from_secs(3600));
    let mut claims = fleet.issuers[1].claims("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600));
    claims.exp = tether_loadtest::devpki::now() - 10;
    write_private(&config.gateway.token_file, fleet.issuers[1].sign(&claims).unwrap().as_bytes()).unwrap();
    let late = RunningAgent::start(config).await;
    tokio::time::sleep(Duration::from_secs(7)).await;

    let metrics = fleet.metrics().await;
    let closed = |tenant: &str| {
        metric_sum(
            &metrics,
            "tether_gateway_sessions_closed_total",
            &format!("tenant=\"{tenant}\",reason=\"token_expired\""),
        )
    };
    let connects = |tenant: &str, result: &str| {
        metric_sum(&metrics, "tether_gateway_agent_connects_total", &format!("tenant=\"{tenant}\",result=\"{result}\""))
    };
    assert_eq!(closed("lapsed"), 1.0, "one session, closed once at expiry: {metrics}");
    assert_eq!(connects("lapsed", "ok"), 1.0, "the agent did not come back with the expired token: {metrics}");
    assert_eq!(
        connects("lapsed", "expired") + connects("late", "expired"),
        0.0,
        "no expired token was presented: {metrics}"
    );
    assert_eq!(connects("late", "ok"), 0.0);
    assert_eq!(metric_sum(&metrics, "tether_agent_token_usable", ""), 0.0, "{metrics}");
    for agent in [&lapsed, &late] {
        assert_eq!(agent.state.live_sessions(), 0);
        let (status, body) = http_get(agent.admin.unwrap(), "/readyz").await.unwrap();
        assert_eq!(status, 503);
        assert!(body.contains("token expired at ") && body.contains("waiting for a new token in"), "{body}");
        assert!(body.contains(&agent.token_file.display().to_string()), "{body}");
    }

    // The kubelet (or the operator) writes a fresh token: both connect without waiting for a backoff.
    for (index, agent, node) in [(0, &lapsed, "node-lapsed"), (1, &late, "node-late")] {
        let fresh = fleet.issuers[index]
            .service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(3600), Some(node))
            .unwrap();
        write_private(&agent.token_file, fresh.as_bytes()).unwrap();
    }
    assert!(lapsed.wait_live(Duration::from_secs(3)).await && late.wait_live(Duration::from_secs(3)).await);
    assert_eq!(echo_via(fleet.frontends[1], y).await, Ok(()));
    let (status, _) = http_get(late.admin.unwrap(), "/readyz").await.unwrap();
    assert_eq!(status, 200);
    lapsed.stop().await;
    late.stop().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_reload_adds_and_removes_tenants_and_ignores_a_broken_config() {
    let fleet = Fleet::start(&["keep", "drop"], &[]).await;
    let (x, y, z) = (echo_server().await, echo_server().await, echo_server().await);
    let keep = RunningAgent::start(fleet.agent_config(0, "node-keep", x, Duration::from_secs(3600))).await;
    let dropped = RunningAgent::start(fleet.agent_config(1, "node-drop", y, Duration::from_secs(3600))).await;
    assert!(keep.wait_live(Duration::from_secs(10)).await && dropped.wait_live(Duration::from_secs(10)).await);
    let mut long_lived = connect_tcp(fleet.frontends[0], &x.to_string()).await.unwrap().unwrap();

    // Add "late", remove "drop".
    let late_issuer =
        DevIssuer::create(fleet.dir.path(), "late", "https://late.issuer.local", IssuerKey::Es256).unwrap();
    let late_frontend = SocketAddr::from(([127, 0, 0, 1], tether_e2e::bins::free_port()));
    let mut config = fleet.config.clone();
    config.tenants.remove(1);
    let late: tether_gateway::config::TenantConfig =
        serde_json::from_value(tenant_json("late", &late_issuer, late_frontend, &serde_json::json!({}))).unwrap();
    config.tenants.push(late);
    // The gateway's certificate must cover the new host name: rotate it on the same files.
    let rotated = fleet.ca.server("gateway", &["keep.tether.local", "drop.tether.local", "late.tether.local"]).unwrap();
    assert_eq!(rotated.cert, fleet.gateway_cert.cert);
    let summary = fleet.handle.apply(config.clone()).await.unwrap();
    assert_eq!(summary.added, ["late"]);
    assert_eq!(summary.removed, ["drop"]);

    // The new tenant's agents connect and its frontend works.
    let token = late_issuer
        .service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(3600), Some("node-late"))
        .unwrap();
    let mut late_config = fleet.agent_config(0, "node-late", z, Duration::from_secs(3600));
    late_config.gateway.server_name = Some("late.tether.local".into());
    write_private(&late_config.gateway.token_file, token.as_bytes()).unwrap();
    let late_agent = RunningAgent::start(late_config).await;
    assert!(late_agent.wait_live(Duration::from_secs(10)).await, "{:?}", late_agent.state.last_error());
    assert_eq!(echo_via(late_frontend, z).await, Ok(()));
    // The removed tenant's agent was drained and is refused from now on.
    assert!(crate::tunnel::wait_for(Duration::from_secs(10), || dropped.state.live_sessions() == 0).await);
    assert!(!fleet.handle.sessions().contains_key("drop"));
    // The kept tenant's connection was never interrupted.
    long_lived.write_all(b"still here").await.unwrap();
    let mut got = [0u8; 10];
    long_lived.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"still here");

    // A broken configuration changes nothing.
    let mut broken = config.clone();
    broken.tenants[0].hosts.clear();
    assert!(fleet.handle.apply(broken).await.is_err());
    assert_eq!(echo_via(fleet.frontends[0], x).await, Ok(()));
    assert_eq!(echo_via(late_frontend, z).await, Ok(()));
    keep.stop().await;
    dropped.stop().await;
    late_agent.stop().await;
    fleet.shutdown().await;
}

/// A reload is one transaction: a frontend moves to a new address in place (the old one closes);
/// when a later tenant's change fails - its key file does not parse, or a new port is taken -
/// nothing changes, and the earlier tenant keeps serving on its old listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_applies_everything_or_nothing() {
    let fleet = Fleet::start(&["alpha", "beta"], &[]).await;
    let (x, y) = (echo_server().await, echo_server().await);
    let alpha = RunningAgent::start(fleet.agent_config(0, "node-alpha", x, Duration::from_secs(3600))).await;
    let beta = RunningAgent::start(fleet.agent_config(1, "node-beta", y, Duration::from_secs(3600))).await;
    assert!(alpha.wait_live(Duration::from_secs(10)).await && beta.wait_live(Duration::from_secs(10)).await);
    let listen = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));

    // In place: alpha's frontend moves to a new port; the old port closes.
    let moved = listen(tether_e2e::bins::free_port());
    let mut config = fleet.config.clone();
    config.tenants[0].frontend.tcp.as_mut().unwrap().listen = moved;
    let summary = fleet.handle.apply(config.clone()).await.unwrap();
    assert_eq!(summary.changed, ["alpha"]);
    assert_eq!(echo_via(moved, x).await, Ok(()));
    assert!(tokio::net::TcpStream::connect(fleet.frontends[0]).await.is_err(), "the old address is closed");
    assert_eq!(echo_via(fleet.frontends[1], y).await, Ok(()), "beta is untouched");

    // Midway failure: alpha would move again, but beta's new key file does not parse.
    let garbage = fleet.dir.path().join("beta-broken-jwks.json");
    std::fs::write(&garbage, "this is not a JWKS document").unwrap();
    let again = listen(tether_e2e::bins::free_port());
    let mut failing = config.clone();
    failing.tenants[0].frontend.tcp.as_mut().unwrap().listen = again;
    failing.tenants[1].auth.jwks_file = Some(garbage);
    let error = fleet.handle.apply(failing).await.unwrap_err().to_string();
    assert!(error.contains("jwks_file") && error.contains("keeping the configuration in force"), "{error}");
    assert_eq!(echo_via(moved, x).await, Ok(()), "alpha keeps its listener");
    assert!(tokio::net::TcpStream::connect(again).await.is_err(), "alpha's new address was not kept open");
    assert_eq!(echo_via(fleet.frontends[1], y).await, Ok(()), "beta keeps its keys");

    // Midway failure: beta's new port is taken.
    let taken = tokio::net::TcpListener::bind(listen(tether_e2e::bins::free_port())).await.unwrap();
    let mut failing = config.clone();
    failing.tenants[0].limits.max_pending_dials = 7;
    failing.tenants[1].frontend.tcp.as_mut().unwrap().listen = taken.local_addr().unwrap();
    let error = fleet.handle.apply(failing).await.unwrap_err().to_string();
    assert!(error.contains("tenants[beta].frontend.tcp.listen"), "{error}");
    assert_eq!(echo_via(moved, x).await, Ok(()));
    assert_eq!(echo_via(fleet.frontends[1], y).await, Ok(()));
    // The same configuration applied again changes nothing: the transaction left no trace.
    assert_eq!(fleet.handle.apply(config).await.unwrap().changed, Vec::<String>::new());
    alpha.stop().await;
    beta.stop().await;
    fleet.shutdown().await;
}

/// A Unix-socket frontend changed and changed back: each time the new socket serves and the old
/// file is gone - the old listener never removes the socket its successor serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_socket_frontend_changed_and_changed_back_keeps_serving() {
    let fleet = Fleet::start(&["uds"], &[]).await;
    let x = echo_server().await;
    let agent = RunningAgent::start(fleet.agent_config(0, "node-uds", x, Duration::from_secs(3600))).await;
    assert!(agent.wait_live(Duration::from_secs(10)).await);
    let (first, second) = (fleet.dir.path().join("kas-1.sock"), fleet.dir.path().join("kas-2.sock"));
    let works = async |path: &std::path::Path| {
        let mut tunnel = tether_loadtest::connect_client::connect_uds(path, &x.to_string()).await.ok()?.ok()?;
        tunnel.write_all(b"hi").await.ok()?;
        let mut got = [0u8; 2];
        tunnel.read_exact(&mut got).await.ok()?;
        Some(())
    };
    let mut config = fleet.config.clone();
    for (now, before) in [(&first, None), (&second, Some(&first)), (&first, Some(&second))] {
        config.tenants[0].frontend.uds = Some(now.clone());
        fleet.handle.apply(config.clone()).await.unwrap();
        assert!(works(now).await.is_some(), "{} serves", now.display());
        if let Some(before) = before {
            assert!(!before.exists(), "{} was removed", before.display());
        }
        // The TCP frontend of the same tenant stayed open throughout.
        assert_eq!(echo_via(fleet.frontends[0], x).await, Ok(()));
    }
    assert!(first.exists());
    agent.stop().await;
    fleet.shutdown().await;
    assert!(!first.exists(), "the drain removes the socket");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_mtls_frontend_takes_the_tenant_from_the_client_certificate() {
    let fleet = Fleet::start_with(&["red", "blue"], &[], true).await;
    let (listener, red_node) = crate::support::node_listener().await;
    tether_loadtest::backends::spawn_http(listener, "red-node".into());
    let (listener, blue_node) = crate::support::node_listener().await;
    tether_loadtest::backends::spawn_http(listener, "blue-node".into());
    let red = RunningAgent::start(fleet.agent_config(0, "red-1", red_node, Duration::from_secs(3600))).await;
    let blue = RunningAgent::start(fleet.agent_config(1, "blue-1", blue_node, Duration::from_secs(3600))).await;
    assert!(red.wait_live(Duration::from_secs(10)).await && blue.wait_live(Duration::from_secs(10)).await);
    let port = fleet.shared.unwrap().port();
    let ca = fleet.ca.ca_cert.display().to_string();
    let curl = |cert: tether_loadtest::devpki::PemPair, sni: &str, target: SocketAddr| {
        let (ca, sni) = (ca.clone(), sni.to_owned());
        tokio::task::spawn_blocking(move || {
            // The proxy host name becomes the SNI; it is the client's to choose and must not
            // select the tenant.
            let output = std::process::Command::new("curl")
                .args(["-sS", "--max-time", "15", "-p", "-x", &format!("https://{sni}:{port}"), "--proxy-cacert", &ca])
                .args(["--resolve", &format!("{sni}:{port}:127.0.0.1")])
                .args([
                    "--proxy-cert",
                    &cert.cert.display().to_string(),
                    "--proxy-key",
                    &cert.key.display().to_string(),
                ])
                .arg(format!("http://{target}/x"))
                .output()
                .unwrap();
            (String::from_utf8_lossy(&output.stdout).into_owned(), String::from_utf8_lossy(&output.stderr).into_owned())
        })
    };
    let red_cert = fleet.ca.client("kas-red", "kas.red").unwrap();
    let blue_cert = fleet.ca.client("kas-blue", "kas.blue").unwrap();
    let stranger = fleet.ca.client("kas-green", "kas.green").unwrap();

    let (body, err) = curl(red_cert.clone(), "blue.tether.local", red_node).await.unwrap();
    assert!(body.contains("hello from red-node"), "{body}{err}");
    let (body, err) = curl(blue_cert, "red.tether.local", blue_node).await.unwrap();
    assert!(body.contains("hello from blue-node"), "{body}{err}");
    // Red's KAS cannot reach blue's node, whatever it asks for.
    let (body, err) = curl(red_cert, "blue.tether.local", blue_node).await.unwrap();
    assert!(!body.contains("blue-node") && err.contains("403"), "{body}{err}");
    // A certificate mapped to no tenant is refused.
    let (body, err) = curl(stranger, "red.tether.local", red_node).await.unwrap();
    assert!(!body.contains("red-node") && err.contains("403"), "{body}{err}");
    red.stop().await;
    blue.stop().await;
    fleet.shutdown().await;
}

/// A stand-in for the tenant's kube-apiserver TokenReview API (a real kube-apiserver cannot be
/// installed here): Python's HTTPS server answering like the KAS and counting requests.
const FAKE_TOKEN_REVIEW: &str = r#"
import json, ssl, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
host, port, cert, key, good, count_file = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
lock, state = threading.Lock(), {"now": 0, "max": 0}
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_POST(self):
        with lock:
            state["now"] += 1; state["max"] = max(state["max"], state["now"])
            with open(count_file, "a") as f: f.write("x")
            with open(count_file + ".max", "w") as f: f.write(str(state["max"]))
        time.sleep(0.2)  # a busy apiserver: calls overlap
        with lock: state["now"] -= 1
        if self.path != "/apis/authentication.k8s.io/v1/tokenreviews" or self.headers.get("Authorization") != "Bearer reviewer-token":
            self.send_response(403); self.end_headers(); return
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ok = review["spec"]["token"] == good and review["spec"]["audiences"] == ["tether"]
        status = {"authenticated": True, "audiences": ["tether"], "user": {"username": "system:serviceaccount:kube-system:tether-agent",
                  "extra": {"authentication.kubernetes.io/node-name": ["node-7"]}}} if ok else {"authenticated": False, "error": "invalid bearer token"}
        body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status}).encode()
        self.send_response(201); self.send_header("Content-Type", "application/json"); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
server = ThreadingHTTPServer((host, port), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(cert, key)
server.socket = ctx.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_review_asks_the_tenants_apiserver_and_caches_the_answer() {
    tether_tunnel::tls::install_default_provider();
    let dir = ScratchDir::new("tether-review").unwrap();
    let ca = DevCa::create(dir.path(), "review").unwrap();
    let kas_cert = ca.server("kas", &["127.0.0.1"]).unwrap();
    let gateway_cert = ca.server("gateway", &["review.tether.local"]).unwrap();
    let issuer = DevIssuer::create(dir.path(), "review", "https://review.issuer.local", IssuerKey::Es256).unwrap();
    let good =
        issuer.service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600), None).unwrap();
    let reviewer_token = dir.path().join("reviewer.token");
    std::fs::write(&reviewer_token, "reviewer-token\n").unwrap();
    let count_file = dir.path().join("count");
    let kas_port = tether_e2e::bins::free_port();
    let mut kas = std::process::Command::new("python3")
        .args(["-c", FAKE_TOKEN_REVIEW, "127.0.0.1", &kas_port.to_string()])
        .args([kas_cert.cert.to_str().unwrap(), kas_cert.key.to_str().unwrap(), &good, count_file.to_str().unwrap()])
        .spawn()
        .unwrap();
    assert!(
        tether_e2e::nginx::wait_listening(SocketAddr::from(([127, 0, 0, 1], kas_port)), Duration::from_secs(10)).await
    );

    let config: GatewayConfig = serde_json::from_value(serde_json::json!({
        "listen": { "agents": "127.0.0.1:0", "admin": "127.0.0.1:0" },
        "tls": { "cert_file": gateway_cert.cert, "key_file": gateway_cert.key },
        "tenants": [{
            "name": "review",
            "hosts": ["review.tether.local"],
            "auth": {
                "issuer": issuer.issuer,
                "audiences": [AUDIENCE],
                "token_review": {
                    "server": format!("https://127.0.0.1:{kas_port}"),
                    "ca_file": ca.ca_cert,
                    "bearer_token_file": reviewer_token,
                    "cache_ttl": "60s",
                    "max_concurrent": 2,
                },
            },
            "frontend": { "uds": dir.path().join("review.sock") },
        }],
    }))
    .unwrap();
    let gateway = Gateway::bind(config, tether_tunnel::telemetry::install_metrics().ok()).await.unwrap();
    let agents = gateway.agent_addr();
    let handle = gateway.handle();
    let task = tokio::spawn(gateway.run(std::future::pending()));
    let roots = tether_tunnel::tls::ClientRoots { ca_file: Some(ca.ca_cert.clone()), system_roots: false };
    let tls = tether_tunnel::tls::client_config(&roots, None, &[tether_tunnel::tls::ALPN_HTTP11]).unwrap();
    let settings = tether_tunnel::client::ClientSettings {
        url: format!("wss://{agents}/v1/tunnel").parse().unwrap(),
        tls: Some(std::sync::Arc::new(tls)),
        tls_server_name: Some("review.tether.local".into()),
        connect_timeout: Duration::from_secs(5),
        handshake_timeout: Duration::from_secs(10),
        ws: tether_tunnel::ws::WsSettings::default(),
        user_agent: "tether-test".into(),
        proxy: None,
    };
    let connect = |token: String| {
        let settings = settings.clone();
        async move {
            match tether_tunnel::client::connect(&settings, Some(&token)).await {
                Ok(_) => Ok(()),
                Err(tether_tunnel::client::ConnectError::Rejected { status, reason, .. }) => Err((status, reason)),
                Err(e) => Err((0, e.to_string())),
            }
        }
    };
    let requests = || std::fs::read_to_string(&count_file).unwrap_or_default().len();

    // Ten agents with the same token at once (a reconnect storm): one TokenReview call.
    let storm = futures::future::join_all((0..10).map(|_| connect(good.clone()))).await;
    assert!(storm.iter().all(Result::is_ok), "{storm:?}");
    assert_eq!(requests(), 1, "concurrent checks of one token must share one call");
    assert_eq!(connect(good.clone()).await, Ok(()));
    assert_eq!(requests(), 1, "a later connect must be answered from the cache");
    let stranger_issuer = DevIssuer::create(dir.path(), "stranger", "https://x", IssuerKey::Es256).unwrap();
    let stranger_token = |name: &str| {
        stranger_issuer.service_account_token("kube-system", name, AUDIENCE, Duration::from_secs(600), None).unwrap()
    };
    let stranger = stranger_token("tether-agent");
    let (status, reason) = connect(stranger.clone()).await.unwrap_err();
    assert_eq!(status, 401, "{reason}");
    assert!(reason.contains("token review rejected"), "{reason}");
    let (status, _) = connect(stranger.clone()).await.unwrap_err();
    assert_eq!((status, requests()), (401, 2), "a rejection is remembered for a while");
    // Eight different tokens at once: never more than token_review.max_concurrent (2) calls.
    let distinct = futures::future::join_all((0..8).map(|i| connect(stranger_token(&format!("agent-{i}"))))).await;
    assert!(distinct.iter().all(|r| matches!(r, Err((401, _)))), "{distinct:?}");
    assert_eq!(requests(), 10);
    let most = std::fs::read_to_string(count_file.with_extension("max")).unwrap_or_default();
    assert_eq!(most.trim(), "2", "calls in flight at once");
    // With the apiserver unreachable, an unknown token cannot be checked: 503, retry later.
    let _ = kas.kill();
    let _ = kas.wait();
    let (status, reason) = connect(format!("{stranger}x")).await.unwrap_err();
    assert_eq!(status, 503, "{reason}");
    assert_eq!(connect(good).await, Ok(()), "a cached answer still serves while the apiserver is down");
    handle.shutdown();
    let _ = task.await;
}
