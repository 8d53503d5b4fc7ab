//! A complete deployment in this process, on loopback: dev PKI and issuer, one gateway with one
//! tenant, agents, and their node-side servers. Used by the demo, the in-process load tests and
//! the integration tests.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tether_agent::config::{AgentConfig, AllowRule, GatewayConnection, IdentifiersConfig};
use tether_agent::{Agent, AgentState};
use tether_gateway::config::{
    AuthConfig, FrontendConfig, FrontendProtocol, GatewayConfig, KeepaliveConfig, ListenConfig, TcpFrontendConfig,
    TenantConfig, TenantLimits, TlsFiles,
};
use tether_gateway::{Gateway, GatewayHandle};
use tether_tunnel::duration::HumanDuration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::devpki::{DevCa, DevIssuer, IssuerKey};

/// The audience agent tokens are minted for.
pub const AUDIENCE: &str = "tether";

/// A directory removed when dropped.
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// Creates `<tmp>/<prefix>-<pid>-<random>`.
    pub fn new(prefix: &str) -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("{prefix}-{}-{:08x}", std::process::id(), fastrand::u32(..)));
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        Ok(Self(dir))
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One agent of a local deployment.
#[derive(Debug, Clone)]
pub struct AgentSpec {
    /// Agent id (node name).
    pub id: String,
    /// Addresses it declares.
    pub addresses: Vec<IpAddr>,
    /// What it may dial.
    pub allow: Vec<AllowRule>,
    /// Whether it is a default route.
    pub default_route: bool,
}

/// A change applied to the gateway configuration before start.
pub type GatewayTweak = Box<dyn FnOnce(&mut GatewayConfig) + Send>;

/// A change applied to each agent's configuration (with the agent's id) before it starts.
pub type AgentTweak = Arc<dyn Fn(&str, &mut AgentConfig) + Send + Sync>;

/// What to deploy.
pub struct LocalOptions {
    /// Tenant name.
    pub tenant: String,
    /// Host name agents use (SNI/Host).
    pub host: String,
    /// Serve the agent endpoint over TLS.
    pub tls: bool,
    /// Agents to start.
    pub agents: Vec<AgentSpec>,
    /// Ping interval on both ends.
    pub ping_interval: Duration,
    /// What the Unix socket frontend speaks (the TCP frontend always speaks CONNECT).
    pub uds_protocol: FrontendProtocol,
    /// Adjusts the gateway configuration before start.
    pub tweak_gateway: Option<GatewayTweak>,
    /// Adjusts every agent's configuration before it starts.
    pub tweak_agent: Option<AgentTweak>,
}

impl Default for LocalOptions {
    fn default() -> Self {
        Self {
            tenant: "demo".into(),
            host: "demo.tether.local".into(),
            tls: true,
            agents: Vec::new(),
            ping_interval: Duration::from_secs(20),
            uds_protocol: FrontendProtocol::HttpConnect,
            tweak_gateway: None,
            tweak_agent: None,
        }
    }
}

/// A running agent of the deployment.
pub struct LocalAgent {
    /// Its id.
    pub id: String,
    /// Live state.
    pub state: Arc<AgentState>,
    /// Cancel to stop it.
    pub stop: CancellationToken,
    /// Its admin address.
    pub admin: Option<SocketAddr>,
    /// Its token file.
    pub token_file: PathBuf,
    /// Its node -> control-plane listeners: (bound address, target).
    pub forward_addrs: Vec<(SocketAddr, String)>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl LocalAgent {
    /// Stops the agent and waits for it.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// A running local deployment.
pub struct LocalDeployment {
    /// Scratch directory with certificates, keys, tokens and sockets.
    pub dir: ScratchDir,
    /// The dev CA (signs the gateway's certificate).
    pub ca: DevCa,
    /// The dev token issuer.
    pub issuer: DevIssuer,
    /// The gateway's configuration.
    pub gateway_config: GatewayConfig,
    /// Control of the running gateway.
    pub gateway: GatewayHandle,
    /// Agent endpoint.
    pub agent_addr: SocketAddr,
    /// Gateway admin endpoint.
    pub admin_addr: SocketAddr,
    /// The tenant's TCP CONNECT frontend.
    pub frontend_addr: SocketAddr,
    /// The tenant's Unix-socket CONNECT frontend.
    pub frontend_uds: PathBuf,
    /// Running agents.
    pub agents: Vec<LocalAgent>,
    gateway_task: Option<JoinHandle<Result<(), tether_gateway::error::SetupError>>>,
    options_host: String,
    tls: bool,
    ping_interval: Duration,
    tweak_agent: Option<AgentTweak>,
}

impl LocalDeployment {
    /// Generates credentials, starts the gateway and the agents (without waiting for them).
    pub async fn start(mut options: LocalOptions) -> anyhow::Result<Self> {
        tether_tunnel::tls::install_default_provider();
        let dir = ScratchDir::new("tether-local")?;
        let ca = DevCa::create(dir.path(), "tether-dev")?;
        let issuer = DevIssuer::create(dir.path(), &options.tenant, "https://issuer.tether.local", IssuerKey::Es256)?;
        let gateway_cert = ca.server("gateway", &[&options.host, "localhost", "127.0.0.1"])?;
        let frontend_uds = dir.path().join(format!("{}.sock", options.tenant));
        let keepalive =
            KeepaliveConfig { ping_interval: options.ping_interval.into(), ping_timeout: options.ping_interval.into() };
        let mut config: GatewayConfig = serde_json::from_value(serde_json::json!({}))?;
        config.server_id = Some("gateway-0".into());
        config.listen = ListenConfig { agents: loopback(0), admin: loopback(0), ..ListenConfig::default() };
        config.tls =
            options.tls.then(|| TlsFiles { cert_file: gateway_cert.cert.clone(), key_file: gateway_cert.key.clone() });
        config.keepalive = keepalive;
        config.drain_grace_period = HumanDuration(Duration::from_secs(5));
        config.tenants = vec![TenantConfig {
            name: options.tenant.clone(),
            hosts: vec![options.host.clone()],
            auth: AuthConfig {
                issuer: issuer.issuer.clone(),
                audiences: vec![AUDIENCE.into()],
                algorithms: vec!["ES256".into(), "RS256".into()],
                jwks_file: Some(issuer.jwks_file.clone()),
                jwks_url: None,
                oidc_discovery: false,
                token_review: None,
                hmac_secret_file: None,
                fetch: Default::default(),
                allowed_subjects: vec![],
                leeway: HumanDuration(Duration::from_secs(5)),
            },
            frontend: FrontendConfig {
                protocol: options.uds_protocol,
                uds: Some(frontend_uds.clone()),
                uds_mode: None,
                // The TCP frontend speaks CONNECT whatever the Unix socket speaks.
                tcp: Some(TcpFrontendConfig {
                    listen: loopback(0),
                    tls: None,
                    client_ca_file: None,
                    protocol: Some(FrontendProtocol::HttpConnect),
                }),
                client_names: vec![],
            },
            routing: vec![
                tether_gateway::config::RoutingStrategy::DestHost,
                tether_gateway::config::RoutingStrategy::DefaultRoute,
                tether_gateway::config::RoutingStrategy::LeastLoaded,
            ],
            // The load-test scenarios dial faster than the default per-tenant rate.
            limits: TenantLimits { dials_per_second: 0, ..TenantLimits::default() },
            node_to_controlplane: None,
            claims: Default::default(),
        }];
        if let Some(tweak) = options.tweak_gateway.take() {
            tweak(&mut config);
        }
        // What is left on port 0 gets a port below the ephemeral range: a restarted gateway binds
        // the same addresses again, and a port of that range can go to any outgoing connection
        // while the gateway is down.
        for addr in std::iter::once(&mut config.listen.agents)
            .chain(std::iter::once(&mut config.listen.admin))
            .chain(config.tenants.iter_mut().filter_map(|t| t.frontend.tcp.as_mut()).map(|tcp| &mut tcp.listen))
        {
            if addr.port() == 0 {
                *addr = crate::procs::free_loopback()?;
            }
        }
        let problems = config.validate();
        anyhow::ensure!(problems.is_empty(), "local gateway configuration: {problems:?}");
        let metrics = tether_tunnel::telemetry::install_metrics().ok();
        let gateway = Gateway::bind(config.clone(), metrics).await?;
        let agent_addr = gateway.agent_addr();
        let admin_addr = gateway.admin_addr();
        let frontend_addr = gateway.frontend_addr(&options.tenant).context("tcp frontend")?;
        let handle = gateway.handle();
        let gateway_task = tokio::spawn(gateway.run(std::future::pending()));
        let mut deployment = Self {
            dir,
            ca,
            issuer,
            gateway_config: config,
            gateway: handle,
            agent_addr,
            admin_addr,
            frontend_addr,
            frontend_uds,
            agents: Vec::new(),
            gateway_task: Some(gateway_task),
            options_host: options.host.clone(),
            tls: options.tls,
            ping_interval: options.ping_interval,
            tweak_agent: options.tweak_agent.take(),
        };
        for spec in options.agents {
            deployment.add_agent(spec).await?;
        }
        Ok(deployment)
    }

    /// The configuration an agent of this deployment runs with (token file written).
    pub fn agent_config(&self, spec: &AgentSpec) -> anyhow::Result<AgentConfig> {
        let token = self.issuer.service_account_token(
            "kube-system",
            "tether-agent",
            AUDIENCE,
            Duration::from_secs(24 * 3600),
            Some(&spec.id),
        )?;
        let token_file = self.dir.path().join(format!("{}.token", spec.id));
        crate::devpki::write_private(&token_file, token.as_bytes())?;
        let scheme = if self.tls { "wss" } else { "ws" };
        let mut config: AgentConfig = serde_json::from_value(serde_json::json!({
            "gateway": { "url": format!("{scheme}://{}/v1/tunnel", self.agent_addr), "token_file": token_file }
        }))?;
        config.agent_id = Some(spec.id.clone());
        config.admin_listen = loopback(0);
        // Tests stop agents with streams open; they need not wait the production grace period.
        config.shutdown_grace_period = Duration::from_secs(1).into();
        config.gateway = GatewayConnection {
            ca_file: Some(self.ca.ca_cert.clone()),
            system_roots: Some(false),
            server_name: Some(self.options_host.clone()),
            reconnect_initial: Duration::from_millis(100).into(),
            reconnect_max: Duration::from_secs(2).into(),
            ping_interval: self.ping_interval.into(),
            ping_timeout: self.ping_interval.into(),
            token_check_interval: Duration::from_secs(1).into(),
            ..config.gateway
        };
        config.identifiers = IdentifiersConfig {
            hosts: vec![spec.id.clone()],
            addresses: spec.addresses.clone(),
            cidrs: vec![],
            default_route: spec.default_route,
        };
        config.allow = spec.allow.clone();
        if let Some(tweak) = &self.tweak_agent {
            tweak(&spec.id, &mut config);
        }
        Ok(config)
    }

    /// Starts one more agent.
    pub async fn add_agent(&mut self, spec: AgentSpec) -> anyhow::Result<()> {
        let config = self.agent_config(&spec)?;
        let token_file = config.gateway.token_file.clone();
        let problems = config.validate();
        anyhow::ensure!(problems.is_empty(), "local agent configuration: {problems:?}");
        let agent = Agent::bind(config, tether_tunnel::telemetry::install_metrics().ok()).await?;
        let state = agent.state();
        let stop = agent.stop_token();
        let admin = agent.admin_addr();
        let forward_addrs = agent.forward_addrs();
        let task = tokio::spawn(agent.run(std::future::pending()));
        self.agents.push(LocalAgent { id: spec.id, state, stop, admin, token_file, forward_addrs, task });
        Ok(())
    }

    /// Waits until every agent holds a session and the gateway has registered them all.
    pub async fn wait_connected(&self, timeout: Duration) -> anyhow::Result<()> {
        let expected = self.agents.len();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let registered: usize = self.gateway.sessions().values().sum();
            let live = self.agents.iter().filter(|a| a.state.live_sessions() > 0).count();
            if registered >= expected && live == expected {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                let errors: Vec<String> =
                    self.agents.iter().filter_map(|a| a.state.last_error().map(|e| format!("{}: {e}", a.id))).collect();
                anyhow::bail!("only {live}/{expected} agents connected ({registered} registered): {errors:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Client settings that reach this deployment's gateway, for tests that speak the protocol
    /// themselves.
    pub fn client_settings(&self) -> anyhow::Result<tether_tunnel::client::ClientSettings> {
        let scheme = if self.tls { "wss" } else { "ws" };
        let roots = tether_tunnel::tls::ClientRoots { ca_file: Some(self.ca.ca_cert.clone()), system_roots: false };
        let tls = tether_tunnel::tls::client_config(&roots, None, &[tether_tunnel::tls::ALPN_HTTP11])?;
        Ok(tether_tunnel::client::ClientSettings {
            url: format!("{scheme}://{}/v1/tunnel", self.agent_addr).parse()?,
            tls: Some(Arc::new(tls)),
            tls_server_name: Some(self.options_host.clone()),
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            ws: tether_tunnel::ws::WsSettings::default(),
            user_agent: "tether-test".into(),
            proxy: None,
        })
    }

    /// Stops the gateway (drain included) and starts a new one on the same addresses.
    pub async fn restart_gateway(&mut self) -> anyhow::Result<()> {
        self.stop_gateway().await;
        self.start_gateway_again().await
    }

    /// Drains and stops the gateway, leaving the agents running.
    pub async fn stop_gateway(&mut self) {
        self.gateway.shutdown();
        if let Some(task) = self.gateway_task.take() {
            let _ = task.await;
        }
    }

    /// Starts a stopped gateway again on the addresses it had.
    pub async fn start_gateway_again(&mut self) -> anyhow::Result<()> {
        let mut config = self.gateway_config.clone();
        config.listen.agents = self.agent_addr;
        config.listen.admin = self.admin_addr;
        for tenant in &mut config.tenants {
            if let Some(tcp) = tenant.frontend.tcp.as_mut() {
                tcp.listen = self.frontend_addr;
            }
        }
        let gateway = Gateway::bind(config, tether_tunnel::telemetry::install_metrics().ok()).await?;
        self.gateway = gateway.handle();
        self.gateway_task = Some(tokio::spawn(gateway.run(std::future::pending())));
        Ok(())
    }

    /// Stops agents, then drains and stops the gateway.
    pub async fn shutdown(mut self) {
        for agent in self.agents.drain(..) {
            agent.stop().await;
        }
        self.gateway.shutdown();
        if let Some(task) = self.gateway_task.take() {
            let _ = task.await;
        }
    }
}

/// `127.0.0.1:port`.
pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Allows `ip` on `ports`.
pub fn allow(ip: IpAddr, ports: &[u16]) -> AllowRule {
    AllowRule {
        cidr: Some(ipnet::IpNet::from(ip)),
        own_addresses: false,
        ports: ports.iter().map(|p| tether_agent::allowlist::PortSpec::One(*p)).collect(),
    }
}
