//! The gateway's configuration: one YAML file, every key overridable from the environment
//! (`TETHER__LISTEN__AGENTS=0.0.0.0:8443`), validated at start-up with errors that name the key
//! and say how to fix it.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tether_tunnel::duration::HumanDuration;
use tether_tunnel::settings::SettingsError;
use tether_tunnel::telemetry::LogConfig;

/// The whole gateway configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// Stable id of this replica; defaults to the host name (the pod name in Kubernetes).
    #[serde(default)]
    pub server_id: Option<String>,
    /// Listening addresses.
    #[serde(default)]
    pub listen: ListenConfig,
    /// TLS for the agent endpoint. Omit it to serve plain HTTP behind a TLS-terminating ingress.
    #[serde(default)]
    pub tls: Option<TlsFiles>,
    /// WebSocket keepalive towards agents.
    #[serde(default)]
    pub keepalive: KeepaliveConfig,
    /// Process-wide limits.
    #[serde(default)]
    pub limits: GlobalLimits,
    /// How long SIGTERM waits for streams to finish before closing sessions.
    #[serde(default = "defaults::drain_grace_period")]
    pub drain_grace_period: HumanDuration,
    /// After SIGTERM, keep accepting for this long while `/readyz` says draining, so load
    /// balancers that health-check (rather than Kubernetes endpoints) stop sending new
    /// connections before the listeners close. Set it to the balancer's check interval x fall count.
    #[serde(default)]
    pub drain_delay: HumanDuration,
    /// Logging.
    #[serde(default)]
    pub log: LogConfig,
    /// The async runtime (worker threads).
    #[serde(default)]
    pub runtime: tether_tunnel::cli::RuntimeConfig,
    /// A CONNECT frontend shared by several tenants over mutual TLS: the tenant is taken from the
    /// client certificate's DNS names (`tenants[].frontend.client_names`), never from SNI.
    #[serde(default)]
    pub shared_frontend: Option<SharedFrontendConfig>,
    /// Other replicas of this gateway: discovery, the peer endpoint, mutual TLS.
    #[serde(default)]
    pub peers: Option<PeersConfig>,
    /// How often the configuration file is checked for changes (hot reload); 0 disables.
    #[serde(default = "defaults::reload_interval")]
    pub reload_check_interval: HumanDuration,
    /// The tenant clusters this gateway serves.
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
}

/// Listening addresses.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenConfig {
    /// Agent endpoint (`GET /v1/tunnel`), behind the LB or ingress.
    #[serde(default = "defaults::agents_addr")]
    pub agents: SocketAddr,
    /// Admin endpoint: `/healthz`, `/readyz`, `/metrics`.
    #[serde(default = "defaults::admin_addr")]
    pub admin: SocketAddr,
    /// Every agent connection starts with a PROXY protocol (v1 or v2) header from an L4 load
    /// balancer; the agent's real address is taken from it.
    #[serde(default)]
    pub proxy_protocol: bool,
    /// Load balancers and ingresses whose PROXY headers and `X-Forwarded-For` are believed.
    /// With `proxy_protocol` and an empty list, any peer may send the header.
    #[serde(default)]
    pub trusted_proxies: Vec<ipnet::IpNet>,
}

impl Default for ListenConfig {
    fn default() -> Self {
        Self {
            agents: defaults::agents_addr(),
            admin: defaults::admin_addr(),
            proxy_protocol: false,
            trusted_proxies: Vec::new(),
        }
    }
}

impl ListenConfig {
    /// Whether `ip` is a configured load balancer or ingress.
    pub fn is_trusted_proxy(&self, ip: std::net::IpAddr) -> bool {
        let ip = match ip {
            std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map(std::net::IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        self.trusted_proxies.iter().any(|net| net.contains(&ip))
    }
}

/// A certificate and its key, in PEM files.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// Certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// Private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

/// Replicas find each other, learn which agents each holds, and forward dials one hop.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeersConfig {
    /// The peer endpoint every replica listens on (inventory and forwarded dials).
    pub listen: SocketAddr,
    /// Mutual TLS between replicas: a certificate valid for `server_name` that every replica
    /// presents as server and as client, and the CA that signs it.
    pub tls: PeerTls,
    /// A DNS name resolving to every replica (a headless Service); the peer port is `listen`'s.
    #[serde(default)]
    pub dns: Option<String>,
    /// Or a fixed list of replicas' peer endpoints.
    #[serde(default)]
    pub addresses: Vec<SocketAddr>,
    /// How often peers are rediscovered and their inventories fetched.
    #[serde(default = "defaults::peer_refresh")]
    pub refresh_interval: HumanDuration,
    /// Most inventory entries kept per peer (bounded memory); past it, peers are asked directly.
    #[serde(default = "defaults::peer_inventory")]
    pub max_inventory_entries: usize,
}

/// Mutual TLS between gateway replicas.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerTls {
    /// Certificate (server and client use) valid for `server_name`.
    pub cert_file: PathBuf,
    /// Its key.
    pub key_file: PathBuf,
    /// CA that signs every replica's peer certificate.
    pub ca_file: PathBuf,
    /// The name peers verify, e.g. `tether-gateway-peer`.
    pub server_name: String,
}

/// The shared mutual-TLS CONNECT frontend.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedFrontendConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Server certificate.
    pub tls: TlsFiles,
    /// CA that every client certificate must chain to.
    pub client_ca_file: PathBuf,
}

/// WebSocket keepalive settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeepaliveConfig {
    /// Ping every this often (keeps LB and proxy idle timers from firing).
    #[serde(default = "defaults::ping_interval")]
    pub ping_interval: HumanDuration,
    /// Declare a peer dead after this much silence past a ping interval.
    #[serde(default = "defaults::ping_timeout")]
    pub ping_timeout: HumanDuration,
}

impl Default for KeepaliveConfig {
    fn default() -> Self {
        Self { ping_interval: defaults::ping_interval(), ping_timeout: defaults::ping_timeout() }
    }
}

/// Limits that protect the whole process.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GlobalLimits {
    /// Agent sessions across all tenants.
    #[serde(default = "defaults::max_agent_sessions")]
    pub max_agent_sessions: usize,
    /// Streams one agent session may carry at once.
    #[serde(default = "defaults::max_streams_per_agent")]
    pub max_streams_per_agent: usize,
    /// Time allowed for TLS, the upgrade request and the agent's Hello.
    #[serde(default = "defaults::handshake_timeout")]
    pub handshake_timeout: HumanDuration,
    /// Time a CONNECT client has to send its request head.
    #[serde(default = "defaults::request_timeout")]
    pub connect_request_timeout: HumanDuration,
    /// Bytes read per WebSocket read call, and the initial read buffer (memory per idle agent).
    #[serde(default = "defaults::ws_read_buffer")]
    pub ws_read_buffer_size: usize,
    /// MiB by which the streams of one agent session may, together, grow their receive windows
    /// beyond the initial 256 KiB each, so a stream keeps up with a long, fast link (node ->
    /// control-plane downloads). 0 keeps every stream at 256 KiB per round trip.
    #[serde(default = "defaults::window_growth_mib")]
    pub window_growth_per_agent_mib: usize,
    /// Agent connections in their handshake at once (PROXY header, TLS, upgrade, token check);
    /// more are closed at once, before any work is spent on them.
    #[serde(default = "defaults::max_handshakes")]
    pub max_handshakes: usize,
    /// New agent connections per second from one source address (the PROXY protocol's client
    /// address when that is on), with twice that as a burst; 0 (default): no per-source limit.
    /// Behind a load balancer without the PROXY protocol every agent has the balancer's address:
    /// leave it off there.
    #[serde(default)]
    pub handshakes_per_source: u32,
}

impl Default for GlobalLimits {
    fn default() -> Self {
        Self {
            max_agent_sessions: defaults::max_agent_sessions(),
            max_streams_per_agent: defaults::max_streams_per_agent(),
            handshake_timeout: defaults::handshake_timeout(),
            connect_request_timeout: defaults::request_timeout(),
            ws_read_buffer_size: defaults::ws_read_buffer(),
            window_growth_per_agent_mib: defaults::window_growth_mib(),
            max_handshakes: defaults::max_handshakes(),
            handshakes_per_source: 0,
        }
    }
}

/// One tenant cluster.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Short name, used in logs and metric labels.
    pub name: String,
    /// Host names (Host header / TLS SNI) its agents connect to.
    pub hosts: Vec<String>,
    /// How its agents' tokens are checked.
    pub auth: AuthConfig,
    /// Where its kube-apiserver connects to reach its nodes.
    #[serde(default)]
    pub frontend: FrontendConfig,
    /// How a dial picks an agent, tried in order.
    #[serde(default = "defaults::routing")]
    pub routing: Vec<RoutingStrategy>,
    /// Limits for this tenant.
    #[serde(default)]
    pub limits: TenantLimits,
    /// Control-plane targets the tenant's nodes may reach through their agents (KEP-2025).
    /// Without it every forward stream is refused.
    #[serde(default)]
    pub node_to_controlplane: Option<NodeToControlPlane>,
    /// What an agent may claim to reach (addresses, networks, default route).
    #[serde(default)]
    pub claims: ClaimsConfig,
}

/// How a tenant's agents' declared addresses, networks and default-route flag are admitted.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimsConfig {
    /// `auto` (default): exclusive for agents whose token proves a node; `exclusive`: for every
    /// agent; `as_declared`: claims are taken as declared (any agent may claim anything).
    #[serde(default)]
    pub mode: ClaimMode,
    /// Addresses and networks per node, from a trusted source (e.g. the Node objects): for a node
    /// listed here, these are its claims (declared ones outside them are refused), and no other
    /// agent may claim them.
    #[serde(default)]
    pub trusted: BTreeMap<String, Vec<String>>,
    /// Agents (node names) that may be default routes when claims are exclusive; `"*"` allows
    /// every agent. Empty (default): none.
    #[serde(default)]
    pub default_route: Vec<String>,
}

/// An address (`10.0.0.5`, a /32 or /128) or a network (`10.244.1.0/24`) from
/// `claims.trusted`.
pub fn parse_claim(text: &str) -> Option<ipnet::IpNet> {
    match text.parse::<std::net::IpAddr>() {
        Ok(ip) => Some(ipnet::IpNet::from(ip)),
        Err(_) => text.parse::<ipnet::IpNet>().ok().map(|n| n.trunc()),
    }
}

/// See [`ClaimsConfig::mode`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimMode {
    /// Exclusive for agents with node-bound tokens, as declared for the others.
    #[default]
    Auto,
    /// Exclusive for every agent (by agent id).
    Exclusive,
    /// As declared.
    AsDeclared,
}

/// The node -> control-plane allow list of a tenant.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeToControlPlane {
    /// Named targets; agents ask for a name, never a free address.
    #[serde(default)]
    pub targets: Vec<ForwardTarget>,
}

/// One control-plane target agents may forward to.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForwardTarget {
    /// The name agents use, e.g. `kube-apiserver`.
    pub name: String,
    /// `host:port` the gateway connects to.
    pub address: String,
    /// Networks the resolved address must fall in. Required when `address` is a DNS name, so a
    /// name that starts resolving elsewhere (DNS rebinding) is refused; an IP literal allows itself.
    #[serde(default)]
    pub allowed_networks: Vec<ipnet::IpNet>,
}

/// Token checks for a tenant's agents.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// Expected `iss` claim.
    pub issuer: String,
    /// Accepted `aud` values (at least one must be in the token).
    pub audiences: Vec<String>,
    /// Accepted signature algorithms.
    #[serde(default = "defaults::algorithms")]
    pub algorithms: Vec<String>,
    /// Keys from a JWKS file (re-read on refresh).
    #[serde(default)]
    pub jwks_file: Option<PathBuf>,
    /// Keys from a JWKS URL.
    #[serde(default)]
    pub jwks_url: Option<String>,
    /// Keys by OIDC discovery: `<issuer>/.well-known/openid-configuration` -> `jwks_uri`.
    #[serde(default)]
    pub oidc_discovery: bool,
    /// Ask the tenant's kube-apiserver (TokenReview) instead of checking signatures locally.
    #[serde(default)]
    pub token_review: Option<TokenReviewConfig>,
    /// A shared HMAC secret (at least 32 bytes); the only way to accept HS256/HS384/HS512.
    #[serde(default)]
    pub hmac_secret_file: Option<PathBuf>,
    /// How keys are fetched over HTTPS (JWKS URL, discovery).
    #[serde(default)]
    pub fetch: FetchConfig,
    /// If set, only these subjects (`system:serviceaccount:<ns>:<name>`) may connect.
    #[serde(default)]
    pub allowed_subjects: Vec<String>,
    /// Clock skew tolerated on `exp` and `nbf`.
    #[serde(default = "defaults::leeway")]
    pub leeway: HumanDuration,
}

/// Fetching an issuer's keys over HTTPS.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FetchConfig {
    /// CA bundle for the issuer's certificate (default: the system roots).
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Bearer token sent when fetching (kube-apiserver may require one).
    #[serde(default)]
    pub bearer_token_file: Option<PathBuf>,
    /// Limit per request.
    #[serde(default = "defaults::fetch_timeout")]
    pub timeout: HumanDuration,
    /// Keys are re-fetched this often.
    #[serde(default = "defaults::refresh_interval")]
    pub refresh_interval: HumanDuration,
    /// An unknown key id triggers a refresh at most this often.
    #[serde(default = "defaults::min_refresh_interval")]
    pub min_refresh_interval: HumanDuration,
}

impl Default for FetchConfig {
    fn default() -> Self {
        Self {
            ca_file: None,
            bearer_token_file: None,
            timeout: defaults::fetch_timeout(),
            refresh_interval: defaults::refresh_interval(),
            min_refresh_interval: defaults::min_refresh_interval(),
        }
    }
}

/// Checking tokens with the tenant's kube-apiserver.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenReviewConfig {
    /// The kube-apiserver, e.g. `https://10.0.12.7:6443`.
    pub server: String,
    /// CA bundle for its certificate.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Token of an identity allowed to create TokenReviews (`system:auth-delegator`).
    pub bearer_token_file: PathBuf,
    /// How long an answer is reused.
    #[serde(default = "defaults::review_cache_ttl")]
    pub cache_ttl: HumanDuration,
    /// Limit per request.
    #[serde(default = "defaults::fetch_timeout")]
    pub timeout: HumanDuration,
    /// TokenReview calls in flight at once; more wait (up to `timeout`, then the agent gets 503).
    /// Agents presenting the same token share one call.
    #[serde(default = "defaults::review_concurrency")]
    pub max_concurrent: usize,
}

/// Where a tenant's kube-apiserver reaches the gateway, and the protocol it speaks there.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FrontendConfig {
    /// What the tenant's kube-apiserver speaks on its frontends (the Unix socket, the TCP listener
    /// and the shared frontend): its `EgressSelectorConfiguration`'s `proxyProtocol`.
    #[serde(default)]
    pub protocol: FrontendProtocol,
    /// Unix socket path (KAS `transport.uds.udsName`).
    #[serde(default)]
    pub uds: Option<PathBuf>,
    /// Permissions of the socket file, in octal (e.g. `"0660"` for a kube-apiserver running
    /// under another user in the same group); default: the process umask decides.
    #[serde(default)]
    pub uds_mode: Option<String>,
    /// TCP listener (KAS `transport.tcp.url`), optionally with TLS and client certificates.
    #[serde(default)]
    pub tcp: Option<TcpFrontendConfig>,
    /// DNS names in the tenant's kube-apiserver client certificate, for the shared frontend.
    #[serde(default)]
    pub client_names: Vec<String>,
}

impl FrontendConfig {
    /// The socket file's permission bits from `uds_mode`: `None` when unset, an error when it is
    /// not an octal mode of at most 0777.
    pub fn uds_permissions(&self) -> Option<Result<u32, InvalidMode>> {
        let mode = self.uds_mode.as_deref()?;
        Some(
            u32::from_str_radix(mode.trim_start_matches("0o"), 8)
                .ok()
                .filter(|bits| *bits <= 0o777)
                .ok_or_else(|| InvalidMode(mode.to_owned())),
        )
    }
}

/// The egress protocol of a tenant's frontends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FrontendProtocol {
    /// HTTP CONNECT (`proxyProtocol: HTTPConnect`; konnectivity-server `--mode=http-connect`).
    #[default]
    HttpConnect,
    /// Konnectivity's gRPC `ProxyService` over HTTP/2 (`proxyProtocol: GRPC`;
    /// konnectivity-server `--mode=grpc`).
    Grpc,
}

impl FrontendProtocol {
    /// The configuration spelling, also the `protocol` label of metrics and the audit log.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HttpConnect => "http-connect",
            Self::Grpc => "grpc",
        }
    }
}

/// A `uds_mode` that is not an octal permission mode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an octal mode such as \"0660\"")]
pub struct InvalidMode(pub String);

/// A TCP CONNECT frontend.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TcpFrontendConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Server certificate; omit for plain TCP (only on trusted networks).
    #[serde(default)]
    pub tls: Option<TlsFiles>,
    /// CA that client certificates must chain to; setting it requires mutual TLS.
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
    /// The protocol on this listener when it differs from `frontend.protocol` (e.g. while moving
    /// a kube-apiserver from one egress mode to the other).
    #[serde(default)]
    pub protocol: Option<FrontendProtocol>,
}

/// One step of a tenant's routing chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutingStrategy {
    /// The agent whose identifiers (host names, addresses, CIDRs) match the dial target.
    DestHost,
    /// Agents that declared themselves default routes.
    DefaultRoute,
    /// Any agent of the tenant, the least loaded of two picked at random.
    LeastLoaded,
}

/// Per-tenant limits.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantLimits {
    /// Agents connected to a replica; the sessions of one agent (held and busy ones, up to 32) share
    /// its slot.
    #[serde(default = "defaults::max_agents")]
    pub max_agents: usize,
    /// Concurrent tunnelled streams across all of the tenant's agents.
    #[serde(default = "defaults::max_streams")]
    pub max_streams: usize,
    /// Dials waiting for an agent's answer.
    #[serde(default = "defaults::max_pending_dials")]
    pub max_pending_dials: usize,
    /// How long a dial may take, agent connect included.
    #[serde(default = "defaults::dial_timeout")]
    pub dial_timeout: HumanDuration,
    /// New dials per second, sustained (a token bucket); 0: no limit. Over it, 429.
    #[serde(default = "defaults::dials_per_second")]
    pub dials_per_second: u32,
    /// New dials allowed at once above the sustained rate (the bucket's size).
    #[serde(default = "defaults::dial_burst")]
    pub dial_burst: u32,
}

impl Default for TenantLimits {
    fn default() -> Self {
        Self {
            max_agents: defaults::max_agents(),
            max_streams: defaults::max_streams(),
            max_pending_dials: defaults::max_pending_dials(),
            dial_timeout: defaults::dial_timeout(),
            dials_per_second: defaults::dials_per_second(),
            dial_burst: defaults::dial_burst(),
        }
    }
}

mod defaults {
    use super::*;

    pub fn agents_addr() -> SocketAddr {
        SocketAddr::from(([0, 0, 0, 0], 8443))
    }
    pub fn admin_addr() -> SocketAddr {
        SocketAddr::from(([0, 0, 0, 0], 9090))
    }
    pub fn ping_interval() -> HumanDuration {
        Duration::from_secs(20).into()
    }
    pub fn ping_timeout() -> HumanDuration {
        Duration::from_secs(20).into()
    }
    pub fn drain_grace_period() -> HumanDuration {
        Duration::from_secs(30).into()
    }
    pub fn peer_refresh() -> HumanDuration {
        Duration::from_secs(2).into()
    }
    pub fn peer_inventory() -> usize {
        100_000
    }
    pub fn reload_interval() -> HumanDuration {
        Duration::from_secs(5).into()
    }
    pub fn handshake_timeout() -> HumanDuration {
        Duration::from_secs(10).into()
    }
    pub fn request_timeout() -> HumanDuration {
        Duration::from_secs(10).into()
    }
    pub fn ws_read_buffer() -> usize {
        8 * 1024
    }
    pub fn max_agent_sessions() -> usize {
        50_000
    }
    pub fn max_streams_per_agent() -> usize {
        8192
    }
    pub fn window_growth_mib() -> usize {
        tether_tunnel::mux::DEFAULT_WINDOW_GROWTH >> 20
    }
    pub fn routing() -> Vec<RoutingStrategy> {
        vec![RoutingStrategy::DestHost, RoutingStrategy::DefaultRoute, RoutingStrategy::LeastLoaded]
    }
    pub fn algorithms() -> Vec<String> {
        vec!["RS256".into(), "ES256".into()]
    }
    pub fn fetch_timeout() -> HumanDuration {
        Duration::from_secs(10).into()
    }
    pub fn refresh_interval() -> HumanDuration {
        Duration::from_secs(300).into()
    }
    pub fn min_refresh_interval() -> HumanDuration {
        Duration::from_secs(10).into()
    }
    pub fn review_cache_ttl() -> HumanDuration {
        Duration::from_secs(60).into()
    }
    pub fn leeway() -> HumanDuration {
        Duration::from_secs(30).into()
    }
    pub fn max_agents() -> usize {
        10_000
    }
    pub fn max_streams() -> usize {
        100_000
    }
    pub fn max_pending_dials() -> usize {
        1_000
    }
    pub fn dial_timeout() -> HumanDuration {
        Duration::from_secs(10).into()
    }
    pub fn review_concurrency() -> usize {
        8
    }
    pub fn max_handshakes() -> usize {
        2_048
    }
    pub fn dials_per_second() -> u32 {
        1_000
    }
    pub fn dial_burst() -> u32 {
        2_000
    }
}

/// A configuration problem: the key and what to do about it.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {problem}")]
pub struct ConfigError {
    /// Dotted path of the offending key.
    pub key: String,
    /// What is wrong and how to fix it.
    pub problem: String,
}

fn problem(key: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError { key: key.into(), problem: problem.into() }
}

/// Asymmetric algorithms a tenant may allow. `none` never is.
pub const SUPPORTED_ALGORITHMS: &[&str] =
    &["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA"];

/// HMAC algorithms, accepted only with an explicit `auth.hmac_secret_file`.
pub const HMAC_ALGORITHMS: &[&str] = &["HS256", "HS384", "HS512"];

impl GatewayConfig {
    /// Loads the file (if any) plus environment overrides, then validates.
    pub fn load(file: Option<&Path>) -> Result<Self, SettingsError> {
        Self::load_checked(file, true)
    }

    /// Like [`load`](Self::load); with `check_files` false, referenced files need not exist
    /// (checking a configuration rendered for another machine, e.g. a Helm chart).
    pub fn load_checked(file: Option<&Path>, check_files: bool) -> Result<Self, SettingsError> {
        tether_tunnel::settings::load_validated(file, |c: &Self| c.validate_with(check_files))
    }

    /// Every problem found, each naming its key and the fix. Empty when the configuration is usable.
    pub fn validate(&self) -> Vec<ConfigError> {
        self.validate_with(true)
    }

    /// Like [`validate`](Self::validate); with `check_files` false, referenced files need not exist.
    pub fn validate_with(&self, check_files: bool) -> Vec<ConfigError> {
        let mut problems = Vec::new();
        let check_file = |problems: &mut Vec<ConfigError>, key: &str, path: &Path| {
            if check_files {
                check_file(problems, key, path);
            }
        };
        if self.keepalive.ping_interval.0 < Duration::from_secs(1) {
            problems.push(problem("keepalive.ping_interval", "must be at least 1s (default 20s)"));
        }
        if self.keepalive.ping_timeout.0 < Duration::from_secs(1) {
            problems.push(problem("keepalive.ping_timeout", "must be at least 1s (default 20s)"));
        }
        if let Some(p) = self.runtime.worker_threads_problem() {
            problems.push(problem("runtime.worker_threads", p));
        }
        if self.limits.max_handshakes == 0 {
            problems.push(problem("limits.max_handshakes", "must be at least 1 (default 2048)"));
        }
        if self.limits.max_streams_per_agent == 0 || self.limits.max_streams_per_agent > 1_000_000 {
            problems.push(problem("limits.max_streams_per_agent", "must be between 1 and 1000000"));
        }
        if self.limits.window_growth_per_agent_mib > 4096 {
            problems.push(problem("limits.window_growth_per_agent_mib", "must be at most 4096 (default 32)"));
        }
        if !(1024..=1024 * 1024).contains(&self.limits.ws_read_buffer_size) {
            problems.push(problem("limits.ws_read_buffer_size", "must be between 1024 and 1048576 bytes"));
        }
        if self.listen.agents == self.listen.admin && self.listen.agents.port() != 0 {
            problems.push(problem("listen.admin", "must differ from listen.agents"));
        }
        if let Some(tls) = &self.tls {
            check_file(&mut problems, "tls.cert_file", &tls.cert_file);
            check_file(&mut problems, "tls.key_file", &tls.key_file);
        }
        let mut names = HashSet::new();
        let mut hosts = HashSet::new();
        let mut sockets = HashSet::new();
        let mut ports = HashSet::from([self.listen.agents, self.listen.admin]);
        let mut client_names = HashSet::new();
        if let Some(peers) = &self.peers {
            if peers.listen.port() != 0 && !ports.insert(peers.listen) {
                problems.push(problem("peers.listen", format!("{} is already used", peers.listen)));
            }
            check_file(&mut problems, "peers.tls.cert_file", &peers.tls.cert_file);
            check_file(&mut problems, "peers.tls.key_file", &peers.tls.key_file);
            check_file(&mut problems, "peers.tls.ca_file", &peers.tls.ca_file);
            if peers.dns.is_none() && peers.addresses.is_empty() {
                problems.push(problem(
                    "peers",
                    "set peers.dns (a headless Service name) or peers.addresses so replicas can find each other",
                ));
            }
            if peers.refresh_interval.0 < Duration::from_millis(100) {
                problems.push(problem("peers.refresh_interval", "must be at least 100ms (default 2s)"));
            }
        }
        if let Some(shared) = &self.shared_frontend {
            if shared.listen.port() != 0 && !ports.insert(shared.listen) {
                problems.push(problem("shared_frontend.listen", format!("{} is already used", shared.listen)));
            }
            check_file(&mut problems, "shared_frontend.tls.cert_file", &shared.tls.cert_file);
            check_file(&mut problems, "shared_frontend.tls.key_file", &shared.tls.key_file);
            check_file(&mut problems, "shared_frontend.client_ca_file", &shared.client_ca_file);
        }
        for (i, tenant) in self.tenants.iter().enumerate() {
            let key = |field: &str| format!("tenants[{i}].{field}");
            if !valid_name(&tenant.name) {
                problems.push(problem(
                    key("name"),
                    format!("{:?} is not a valid name; use 1-63 lowercase letters, digits and '-'", tenant.name),
                ));
            } else if !names.insert(tenant.name.clone()) {
                problems.push(problem(key("name"), format!("tenant {:?} is defined twice", tenant.name)));
            }
            if tenant.hosts.is_empty() {
                problems.push(problem(
                    key("hosts"),
                    "list at least one host name its agents connect to, e.g. [acme.tunnel.example.com]",
                ));
            }
            for host in &tenant.hosts {
                let normal = host.to_ascii_lowercase();
                if normal.is_empty() || normal.contains(['/', ':', ' ']) {
                    problems
                        .push(problem(key("hosts"), format!("{host:?} is not a host name (no scheme, port or path)")));
                } else if !hosts.insert(normal) {
                    problems.push(problem(key("hosts"), format!("{host:?} is already used by another tenant")));
                }
            }
            let auth = &tenant.auth;
            if auth.issuer.is_empty() {
                problems.push(problem(key("auth.issuer"), "set the issuer URL of the tenant's ServiceAccount tokens"));
            }
            if auth.audiences.is_empty() || auth.audiences.iter().any(String::is_empty) {
                problems.push(problem(
                    key("auth.audiences"),
                    "list the audiences agent tokens are minted for, e.g. [tether]",
                ));
            }
            if auth.algorithms.is_empty() {
                problems.push(problem(key("auth.algorithms"), "list at least one algorithm, e.g. [RS256, ES256]"));
            }
            let hmac = auth.hmac_secret_file.is_some();
            for alg in &auth.algorithms {
                let asymmetric = SUPPORTED_ALGORITHMS.contains(&alg.as_str());
                let symmetric = HMAC_ALGORITHMS.contains(&alg.as_str());
                if symmetric && !hmac {
                    problems.push(problem(
                        key("auth.algorithms"),
                        format!("{alg:?} is not accepted without auth.hmac_secret_file (a shared secret)"),
                    ));
                } else if !asymmetric && !symmetric {
                    problems.push(problem(
                        key("auth.algorithms"),
                        format!("{alg:?} is not accepted; choose from {}", SUPPORTED_ALGORITHMS.join(", ")),
                    ));
                } else if hmac && asymmetric {
                    problems.push(problem(
                        key("auth.algorithms"),
                        format!("{alg:?} cannot be used with a shared secret; list only HS256, HS384 or HS512"),
                    ));
                }
            }
            let sources = [
                auth.jwks_file.is_some(),
                auth.jwks_url.is_some(),
                auth.oidc_discovery,
                auth.token_review.is_some(),
                hmac,
            ];
            if sources.iter().filter(|s| **s).count() != 1 {
                problems.push(problem(
                    key("auth"),
                    "set exactly one of jwks_file, jwks_url, oidc_discovery: true, token_review or hmac_secret_file",
                ));
            }
            if let Some(file) = &auth.jwks_file {
                check_file(&mut problems, &key("auth.jwks_file"), file);
            }
            if let Some(url) = &auth.jwks_url
                && !url.starts_with("https://")
            {
                problems.push(problem(key("auth.jwks_url"), "must be an https:// URL"));
            }
            if auth.oidc_discovery && !auth.issuer.starts_with("https://") {
                problems
                    .push(problem(key("auth.oidc_discovery"), "OIDC discovery needs an https:// issuer (auth.issuer)"));
            }
            if let Some(file) = &auth.hmac_secret_file {
                check_file(&mut problems, &key("auth.hmac_secret_file"), file);
            }
            if let Some(file) = &auth.fetch.ca_file {
                check_file(&mut problems, &key("auth.fetch.ca_file"), file);
            }
            if let Some(file) = &auth.fetch.bearer_token_file {
                check_file(&mut problems, &key("auth.fetch.bearer_token_file"), file);
            }
            if let Some(review) = &auth.token_review {
                if !review.server.starts_with("https://") {
                    problems.push(problem(key("auth.token_review.server"), "must be an https:// URL"));
                }
                check_file(&mut problems, &key("auth.token_review.bearer_token_file"), &review.bearer_token_file);
                if let Some(ca) = &review.ca_file {
                    check_file(&mut problems, &key("auth.token_review.ca_file"), ca);
                }
            }
            for subject in &auth.allowed_subjects {
                if subject.split(':').count() != 4 || !subject.starts_with("system:serviceaccount:") {
                    problems.push(problem(
                        key("auth.allowed_subjects"),
                        format!("{subject:?} is not of the form system:serviceaccount:<namespace>:<name>"),
                    ));
                }
            }
            let frontend = &tenant.frontend;
            if frontend.uds.is_none() && frontend.tcp.is_none() && frontend.client_names.is_empty() {
                problems.push(problem(
                    key("frontend"),
                    "set frontend.uds (a socket path), frontend.tcp.listen, or frontend.client_names (with shared_frontend) so the tenant's kube-apiserver can connect",
                ));
            }
            if !frontend.client_names.is_empty() && self.shared_frontend.is_none() {
                problems.push(problem(
                    key("frontend.client_names"),
                    "only used by the shared frontend: also set shared_frontend",
                ));
            }
            for name in &frontend.client_names {
                if !client_names.insert(name.to_ascii_lowercase()) {
                    problems.push(problem(
                        key("frontend.client_names"),
                        format!("{name:?} is already mapped to another tenant"),
                    ));
                }
            }
            if let Some(Err(reason)) = frontend.uds_permissions() {
                problems.push(problem(key("frontend.uds_mode"), reason.to_string()));
            }
            if let Some(path) = &frontend.uds {
                if !sockets.insert(path.clone()) {
                    problems
                        .push(problem(key("frontend.uds"), format!("{} is used by another tenant", path.display())));
                }
                if path.as_os_str().len() > 100 {
                    problems.push(problem(key("frontend.uds"), "socket paths must be shorter than 100 bytes"));
                }
            }
            if let Some(tcp) = &frontend.tcp {
                if tcp.listen.port() != 0 && !ports.insert(tcp.listen) {
                    problems.push(problem(key("frontend.tcp.listen"), format!("{} is already used", tcp.listen)));
                }
                if let Some(tls) = &tcp.tls {
                    check_file(&mut problems, &key("frontend.tcp.tls.cert_file"), &tls.cert_file);
                    check_file(&mut problems, &key("frontend.tcp.tls.key_file"), &tls.key_file);
                }
                if let Some(ca) = &tcp.client_ca_file {
                    if tcp.tls.is_none() {
                        problems.push(problem(
                            key("frontend.tcp.client_ca_file"),
                            "client certificates need TLS; also set frontend.tcp.tls",
                        ));
                    }
                    check_file(&mut problems, &key("frontend.tcp.client_ca_file"), ca);
                }
            }
            if tenant.routing.is_empty() {
                problems.push(problem(key("routing"), "list at least one of dest_host, default_route, least_loaded"));
            }
            let limits = &tenant.limits;
            for (field, value) in [
                ("limits.max_agents", limits.max_agents),
                ("limits.max_streams", limits.max_streams),
                ("limits.max_pending_dials", limits.max_pending_dials),
            ] {
                if value == 0 {
                    problems.push(problem(key(field), "must be at least 1"));
                }
            }
            if limits.dials_per_second > 0 && limits.dial_burst == 0 {
                problems.push(problem(key("limits.dial_burst"), "must be at least 1 when dials_per_second is set"));
            }
            if limits.dial_timeout.0 < Duration::from_millis(100) {
                problems.push(problem(key("limits.dial_timeout"), "must be at least 100ms (default 10s)"));
            }
            for (node, claims) in &tenant.claims.trusted {
                for claim in claims {
                    if parse_claim(claim).is_none() {
                        problems.push(problem(
                            key(&format!("claims.trusted.{node}")),
                            format!("{claim:?} is neither an address nor a network (e.g. 10.0.0.5 or 10.244.1.0/24)"),
                        ));
                    }
                }
            }
            if let Some(n2c) = &tenant.node_to_controlplane {
                let mut target_names = HashSet::new();
                for (t, target) in n2c.targets.iter().enumerate() {
                    let tkey = |field: &str| key(&format!("node_to_controlplane.targets[{t}].{field}"));
                    if !valid_name(&target.name) {
                        problems.push(problem(
                            tkey("name"),
                            format!("{:?} is not a valid name; use lowercase letters, digits and '-'", target.name),
                        ));
                    } else if !target_names.insert(target.name.clone()) {
                        problems.push(problem(tkey("name"), format!("{:?} is listed twice", target.name)));
                    }
                    match crate::target::DialTarget::parse(&target.address) {
                        Err(e) => problems.push(problem(tkey("address"), e.to_string())),
                        Ok(parsed) => {
                            if matches!(parsed.host, crate::target::TargetHost::Name(_))
                                && target.allowed_networks.is_empty()
                            {
                                problems.push(problem(
                                    tkey("allowed_networks"),
                                    format!(
                                        "{} is a DNS name: list the networks its addresses may be in, e.g. [10.96.0.0/12]",
                                        target.address
                                    ),
                                ));
                            }
                        }
                    }
                }
            }
        }
        problems
    }

    /// This replica's id: configured, else the host name, else `gateway`.
    pub fn server_id(&self) -> String {
        self.server_id
            .clone()
            .filter(|s| !s.is_empty())
            .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|s| s.trim().to_owned()))
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "gateway".into())
    }
}

fn check_file(problems: &mut Vec<ConfigError>, key: &str, path: &Path) {
    if !path.is_file() {
        problems.push(problem(key, format!("{} does not exist or is not a file", path.display())));
    }
}

/// DNS-label-like names: they end up in metric labels and file names.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<GatewayConfig, String> {
        let dir = std::env::temp_dir().join(format!("tether-config-test-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gateway.yaml");
        std::fs::write(&path, yaml).unwrap();
        std::fs::write(dir.join("jwks.json"), r#"{"keys":[]}"#).unwrap();
        let result = GatewayConfig::load(Some(&path)).map_err(|e| format!("{e:#}"));
        std::fs::remove_dir_all(&dir).unwrap();
        result
    }

    fn tenant_yaml(jwks: &str) -> String {
        format!(
            "tenants:\n  - name: acme\n    hosts: [acme.example.com]\n    auth:\n      issuer: https://issuer\n      audiences: [tether]\n      jwks_file: {jwks}\n    frontend:\n      uds: /tmp/acme.sock\n"
        )
    }

    #[test]
    fn a_minimal_config_gets_safe_defaults() {
        let dir = std::env::temp_dir().join(format!("tether-config-min-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        let jwks = dir.join("jwks.json");
        std::fs::write(&jwks, r#"{"keys":[]}"#).unwrap();
        let path = dir.join("gw.yaml");
        std::fs::write(&path, tenant_yaml(&jwks.display().to_string())).unwrap();
        let config = GatewayConfig::load(Some(&path)).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(config.listen.agents.port(), 8443);
        assert_eq!(config.keepalive.ping_interval.0, Duration::from_secs(20));
        let tenant = &config.tenants[0];
        assert_eq!(tenant.auth.algorithms, ["RS256", "ES256"]);
        assert_eq!(tenant.routing, defaults::routing());
        assert_eq!(tenant.limits.dial_timeout.0, Duration::from_secs(10));
        assert_eq!(config.limits.window_growth_per_agent_mib, 32);
    }

    #[test]
    fn problems_name_the_key_and_the_fix() {
        let err = parse(
            "limits:\n  window_growth_per_agent_mib: 5000\ntenants:\n  - name: Acme_Corp\n    hosts: []\n    auth:\n      issuer: ''\n      audiences: []\n      algorithms: [HS256, none]\n      jwks_file: /nonexistent/jwks.json\n    limits:\n      max_agents: 0\n      dial_timeout: 1ms\n",
        )
        .unwrap_err();
        for expected in [
            "tenants[0].name",
            "tenants[0].hosts",
            "tenants[0].auth.issuer",
            "tenants[0].auth.audiences",
            "\"HS256\" is not accepted",
            "\"none\" is not accepted",
            "tenants[0].auth.jwks_file: /nonexistent/jwks.json does not exist",
            "tenants[0].frontend",
            "tenants[0].limits.max_agents: must be at least 1",
            "tenants[0].limits.dial_timeout",
            "limits.window_growth_per_agent_mib: must be at most 4096",
        ] {
            assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
        }
    }

    #[test]
    fn unknown_keys_and_bad_types_are_rejected_with_their_key() {
        let err = parse("listen:\n  agnets: 0.0.0.0:1\n").unwrap_err();
        assert!(err.contains("agnets"), "{err}");
        let err = parse("keepalive:\n  ping_interval: soon\n").unwrap_err();
        assert!(err.contains("ping_interval") || err.contains("soon"), "{err}");
        let err = parse("listen:\n  admin: not-an-address\n").unwrap_err();
        assert!(err.contains("admin"), "{err}");
    }

    #[test]
    fn a_missing_file_is_named() {
        let err = GatewayConfig::load(Some(Path::new("/nonexistent/gw.yaml"))).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/gw.yaml") && err.contains("not found"), "{err}");
    }
}
