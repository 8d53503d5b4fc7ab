//! The agent's configuration: one YAML file, every key overridable from the environment
//! (`TETHER__GATEWAY__URL=wss://...`), validated at start-up with errors that name the key.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use tether_tunnel::duration::HumanDuration;
use tether_tunnel::telemetry::LogConfig;

use crate::allowlist::PortSpec;

/// The whole agent configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// This agent's id; defaults to `NODE_NAME`, then the host name.
    #[serde(default)]
    pub agent_id: Option<String>,
    /// How to reach the gateway.
    pub gateway: GatewayConnection,
    /// What the agent declares it can reach (used by the gateway to route dials here).
    #[serde(default)]
    pub identifiers: IdentifiersConfig,
    /// What the gateway may dial through this agent. Nothing is allowed unless listed.
    #[serde(default)]
    pub allow: Vec<AllowRule>,
    /// Node -> control-plane listeners: each accepts TCP and forwards it to a named target.
    #[serde(default)]
    pub listeners: Vec<ListenerConfig>,
    /// How long a node-side connection waits for a session to the gateway (e.g. during a restart).
    #[serde(default = "defaults::forward_wait")]
    pub forward_wait: HumanDuration,
    /// Longest time a dial to a node-side target may take.
    #[serde(default = "defaults::dial_timeout")]
    pub dial_timeout: HumanDuration,
    /// On SIGTERM: how long open streams (exec, logs -f, the kubelet's own connections through the
    /// node -> control-plane listeners) may take to finish before the agent closes its sessions
    /// and exits. New node-side connections are refused and the gateway routes no new dials here
    /// meanwhile. 0: close at once.
    #[serde(default = "defaults::shutdown_grace_period")]
    pub shutdown_grace_period: HumanDuration,
    /// Admin endpoint: `/healthz`, `/readyz`, `/metrics`.
    #[serde(default = "defaults::admin")]
    pub admin_listen: SocketAddr,
    /// Logging.
    #[serde(default)]
    pub log: LogConfig,
    /// The async runtime: `worker_threads` defaults to [`DEFAULT_WORKER_THREADS`] here.
    #[serde(default)]
    pub runtime: tether_tunnel::cli::RuntimeConfig,
}

/// The agent's worker threads unless `runtime.worker_threads` says otherwise. One thread moves a
/// session's bytes without handing every chunk to another thread: on the peer benchmark it cut
/// context switches from about 8,800 to 800 per GB and CPU per GB by a fifth, with the same or more
/// throughput (docs/benchmarks.md). It also keeps an agent on a 64-CPU node from starting 64
/// threads. Bulk traffic of many streams goes over several sessions instead (while busy,
/// `gateway.pool.busy_sessions_per_replica`), each on a session thread of its own.
pub const DEFAULT_WORKER_THREADS: usize = 1;

/// How to reach the gateway.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConnection {
    /// `wss://<tenant host>/v1/tunnel`.
    pub url: String,
    /// File holding the bearer token (a projected ServiceAccount token); re-read on every
    /// connect and watched for rotation.
    pub token_file: PathBuf,
    /// CA bundle that signs the gateway's (or a TLS-inspecting proxy's) certificate.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Also trust the system's CA roots; defaults to true when no `ca_file` is given.
    #[serde(default)]
    pub system_roots: Option<bool>,
    /// TLS server name (and Host) to use instead of the URL's host.
    #[serde(default)]
    pub server_name: Option<String>,
    /// TCP connect limit.
    #[serde(default = "defaults::connect_timeout")]
    pub connect_timeout: HumanDuration,
    /// TLS + WebSocket upgrade + Hello limit.
    #[serde(default = "defaults::handshake_timeout")]
    pub handshake_timeout: HumanDuration,
    /// First reconnect delay ceiling (delays use full jitter).
    #[serde(default = "defaults::reconnect_initial")]
    pub reconnect_initial: HumanDuration,
    /// Largest reconnect delay.
    #[serde(default = "defaults::reconnect_max")]
    pub reconnect_max: HumanDuration,
    /// How often to send a WebSocket ping.
    #[serde(default = "defaults::ping_interval")]
    pub ping_interval: HumanDuration,
    /// Declare the gateway dead after this much silence past a ping interval.
    #[serde(default = "defaults::ping_timeout")]
    pub ping_timeout: HumanDuration,
    /// How often the token file is checked for a rotated token.
    #[serde(default = "defaults::token_check_interval")]
    pub token_check_interval: HumanDuration,
    /// A corporate HTTP proxy on the way to the gateway.
    #[serde(default)]
    pub proxy: ProxyConfig,
    /// Sessions to the gateway replicas behind the load balancer.
    #[serde(default)]
    pub pool: PoolConfig,
    /// MiB by which the streams of one session may, together, grow their receive windows beyond
    /// the initial 256 KiB each, so a stream keeps up with a long, fast link (control plane ->
    /// node uploads). 0 keeps every stream at 256 KiB per round trip.
    #[serde(default = "defaults::window_growth_mib")]
    pub window_growth_mib: usize,
}

/// Most sessions an agent keeps to one replica.
pub const MAX_SESSIONS_PER_REPLICA: usize = 16;

/// How many gateway replicas the agent holds sessions to.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// `all`: one session to every replica (the gateway reports how many); `one`: a single session.
    #[serde(default)]
    pub mode: crate::connection::PoolMode,
    /// Sessions to each replica (mode `one`: in all), each its own TLS connection and driver
    /// task, so the bulk traffic of many streams uses more than one core on each end: with two or
    /// more, each session runs on a thread of its own. Dials are spread over them; the gateway
    /// counts them as one agent.
    #[serde(default = "defaults::sessions_per_replica")]
    pub sessions_per_replica: usize,
    /// Sessions to each replica while the agent is busy: its sessions together move
    /// `busy_mib_per_second` or more, and until `busy_linger` after they last did. The extra ones
    /// are dialed when the agent becomes busy and retired when it is quiet again (gracefully: the
    /// gateway routes nothing new to them, and the streams still on them finish). Streams opened
    /// while busy spread over all of them, so bulk traffic of many streams uses several TCP
    /// connections and the cores on both ends, while an agent that is idle or carries small
    /// requests holds only `sessions_per_replica`. Never fewer than `sessions_per_replica`; set it
    /// to `sessions_per_replica` to hold a fixed number.
    #[serde(default = "defaults::busy_sessions_per_replica")]
    pub busy_sessions_per_replica: usize,
    /// The traffic (MiB per second, both directions, all sessions together, sampled every half
    /// second) at which the agent counts as busy.
    #[serde(default = "defaults::busy_mib_per_second")]
    pub busy_mib_per_second: u64,
    /// How long the agent stays busy after its traffic last reached `busy_mib_per_second`.
    #[serde(default = "defaults::busy_linger")]
    pub busy_linger: HumanDuration,
    /// Longest pause before dialing again after landing on a replica already held.
    #[serde(default = "defaults::duplicate_retry_max")]
    pub duplicate_retry_max: HumanDuration,
    /// After a replica's drain message, the agent waits a random delay up to this long (and at
    /// most half the drain deadline) before dialing again, so a drained replica's agents do not
    /// all arrive at the others in the same instant. 0 redials at once.
    #[serde(default = "defaults::drain_reconnect_window")]
    pub drain_reconnect_window: HumanDuration,
}

impl PoolConfig {
    /// Sessions to each replica while busy: `busy_sessions_per_replica`, never fewer than
    /// `sessions_per_replica`.
    pub fn busy_sessions(&self) -> usize {
        self.busy_sessions_per_replica.max(self.sessions_per_replica)
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            mode: Default::default(),
            sessions_per_replica: defaults::sessions_per_replica(),
            busy_sessions_per_replica: defaults::busy_sessions_per_replica(),
            busy_mib_per_second: defaults::busy_mib_per_second(),
            busy_linger: defaults::busy_linger(),
            duplicate_retry_max: defaults::duplicate_retry_max(),
            drain_reconnect_window: defaults::drain_reconnect_window(),
        }
    }
}

/// The HTTP proxy between the agent and the gateway.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyConfig {
    /// `http://host:port` (credentials may be in the URL). Without it, `HTTPS_PROXY`,
    /// `https_proxy` or `ALL_PROXY` and `NO_PROXY` are used, with curl's rules.
    #[serde(default)]
    pub url: Option<String>,
    /// Read the proxy from the environment when `url` is not set.
    #[serde(default = "defaults::yes")]
    pub from_environment: bool,
    /// Basic-auth user (overrides credentials in the URL).
    #[serde(default)]
    pub username: Option<String>,
    /// File holding the password for `username`; else the `TETHER_PROXY_PASSWORD` variable.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// Limit for reaching the proxy and its answer to CONNECT.
    #[serde(default = "defaults::connect_timeout")]
    pub connect_timeout: HumanDuration,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            url: None,
            from_environment: true,
            username: None,
            password_file: None,
            connect_timeout: defaults::connect_timeout(),
        }
    }
}

/// Identifiers the agent declares.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentifiersConfig {
    /// Host names (node name, FQDN).
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Addresses (node InternalIP, ...).
    #[serde(default)]
    pub addresses: Vec<IpAddr>,
    /// Networks behind this agent.
    #[serde(default)]
    pub cidrs: Vec<IpNet>,
    /// Offer this agent for dials that match no other agent.
    #[serde(default)]
    pub default_route: bool,
}

/// One allow-list rule: a network and the ports allowed in it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllowRule {
    /// Network, e.g. `10.0.0.5/32` or `10.0.0.0/8`.
    #[serde(default)]
    pub cidr: Option<IpNet>,
    /// Instead of `cidr`: each of the agent's own `identifiers.addresses` (e.g. the node's IP
    /// from the downward API), so a DaemonSet can allow "this node's kubelet" without templating.
    #[serde(default)]
    pub own_addresses: bool,
    /// Ports: numbers or ranges like `"30000-32767"`. Empty means no port.
    pub ports: Vec<PortSpec>,
}

/// A node -> control-plane listener.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    /// Address to listen on, usually a host-scoped address such as `100.64.0.1:6443`.
    pub bind: SocketAddr,
    /// Name of the control-plane target (in the tenant's gateway allow list).
    pub target: String,
    /// Node-side connections open at once through this listener; more are closed at once
    /// (counted as `result="too_many_connections"`).
    #[serde(default = "defaults::max_connections")]
    pub max_connections: usize,
}

impl ListenerConfig {
    /// A listener on `bind` for `target`, with the default connection limit.
    pub fn new(bind: SocketAddr, target: impl Into<String>) -> Self {
        Self { bind, target: target.into(), max_connections: defaults::max_connections() }
    }
}

mod defaults {
    use super::*;

    pub fn max_connections() -> usize {
        4096
    }
    pub fn forward_wait() -> HumanDuration {
        Duration::from_secs(10).into()
    }
    pub fn dial_timeout() -> HumanDuration {
        Duration::from_secs(10).into()
    }
    pub fn admin() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 9091))
    }
    pub fn connect_timeout() -> HumanDuration {
        Duration::from_secs(10).into()
    }
    pub fn handshake_timeout() -> HumanDuration {
        Duration::from_secs(15).into()
    }
    pub fn reconnect_initial() -> HumanDuration {
        Duration::from_secs(1).into()
    }
    pub fn reconnect_max() -> HumanDuration {
        Duration::from_secs(60).into()
    }
    pub fn ping_interval() -> HumanDuration {
        Duration::from_secs(20).into()
    }
    pub fn ping_timeout() -> HumanDuration {
        Duration::from_secs(20).into()
    }
    pub fn token_check_interval() -> HumanDuration {
        Duration::from_secs(30).into()
    }
    pub fn window_growth_mib() -> usize {
        tether_tunnel::mux::DEFAULT_WINDOW_GROWTH >> 20
    }
    pub fn sessions_per_replica() -> usize {
        1
    }
    pub fn busy_sessions_per_replica() -> usize {
        2
    }
    pub fn busy_mib_per_second() -> u64 {
        64
    }
    pub fn busy_linger() -> HumanDuration {
        Duration::from_secs(60).into()
    }
    pub fn duplicate_retry_max() -> HumanDuration {
        Duration::from_secs(2).into()
    }
    pub fn shutdown_grace_period() -> HumanDuration {
        Duration::from_secs(20).into()
    }
    pub fn drain_reconnect_window() -> HumanDuration {
        Duration::from_secs(5).into()
    }
    pub fn yes() -> bool {
        true
    }
}

impl AgentConfig {
    /// The runtime this agent runs on: the configured one, with the agent's default thread count.
    pub fn runtime(&self) -> tether_tunnel::cli::RuntimeConfig {
        tether_tunnel::cli::RuntimeConfig {
            worker_threads: Some(self.runtime.worker_threads.unwrap_or(DEFAULT_WORKER_THREADS)),
        }
    }

    /// Loads the file (if any) plus environment overrides, then validates.
    pub fn load(file: Option<&Path>) -> anyhow::Result<Self> {
        Self::load_checked(file, true)
    }

    /// Like [`load`](Self::load); with `check_files` false, referenced files need not exist
    /// (checking a configuration rendered for another machine, e.g. a Helm chart).
    pub fn load_checked(file: Option<&Path>, check_files: bool) -> anyhow::Result<Self> {
        Ok(tether_tunnel::settings::load_validated(file, |c: &Self| c.validate_with(check_files))?)
    }

    /// Every problem found, as `key: problem and fix`.
    pub fn validate(&self) -> Vec<String> {
        self.validate_with(true)
    }

    /// Like [`validate`](Self::validate); with `check_files` false, referenced files need not exist.
    pub fn validate_with(&self, check_files: bool) -> Vec<String> {
        let mut problems = Vec::new();
        let gw = &self.gateway;
        match gw.url.parse::<http::Uri>() {
            Ok(uri) => match tether_tunnel::client::target(&uri) {
                Ok((_, _, tls)) => {
                    if !tls && !is_loopback_url(&uri) {
                        problems.push(
                            "gateway.url: plain ws:// is only allowed to loopback; use wss://<host>/v1/tunnel".into(),
                        );
                    }
                }
                Err(e) => problems.push(format!("gateway.url: {e}")),
            },
            Err(e) => {
                problems.push(format!("gateway.url: {:?} is not a URL ({e}); use wss://<host>/v1/tunnel", gw.url))
            }
        }
        if check_files && !gw.token_file.is_file() {
            problems.push(format!(
                "gateway.token_file: {} does not exist; point it at the projected ServiceAccount token",
                gw.token_file.display()
            ));
        }
        if let Some(ca) = &gw.ca_file
            && check_files
            && !ca.is_file()
        {
            problems.push(format!("gateway.ca_file: {} does not exist", ca.display()));
        }
        if gw.ca_file.is_none() && gw.system_roots == Some(false) {
            problems.push("gateway.system_roots: false needs gateway.ca_file, or nothing is trusted".into());
        }
        if !(1..=MAX_SESSIONS_PER_REPLICA).contains(&gw.pool.sessions_per_replica) {
            problems.push(format!(
                "gateway.pool.sessions_per_replica: must be 1-{MAX_SESSIONS_PER_REPLICA} (more sessions than cores gain nothing)"
            ));
        }
        if !(1..=MAX_SESSIONS_PER_REPLICA).contains(&gw.pool.busy_sessions_per_replica) {
            problems.push(format!(
                "gateway.pool.busy_sessions_per_replica: must be 1-{MAX_SESSIONS_PER_REPLICA} (more sessions than cores gain nothing)"
            ));
        }
        if gw.pool.busy_mib_per_second == 0 {
            problems.push("gateway.pool.busy_mib_per_second: must be at least 1".into());
        }
        if gw.reconnect_initial.0.is_zero() || gw.reconnect_max.0 < gw.reconnect_initial.0 {
            problems
                .push("gateway.reconnect_max: must be at least gateway.reconnect_initial, which must be > 0".into());
        }
        if gw.ping_interval.0 < Duration::from_secs(1) || gw.ping_timeout.0 < Duration::from_secs(1) {
            problems.push("gateway.ping_interval / gateway.ping_timeout: must be at least 1s".into());
        }
        if let Some(p) = self.runtime.worker_threads_problem() {
            problems.push(format!("runtime.worker_threads: {p}"));
        }
        if gw.window_growth_mib > 4096 {
            problems.push("gateway.window_growth_mib: must be at most 4096 (default 32)".into());
        }
        if let Some(url) = &gw.proxy.url {
            match url.parse::<http::Uri>() {
                Ok(uri) if uri.scheme_str() == Some("http") && uri.host().is_some() => {}
                _ => problems.push(format!(
                    "gateway.proxy.url: {:?} is not an http://host:port proxy URL",
                    crate::proxy::redact(url)
                )),
            }
        }
        if let Some(file) = &gw.proxy.password_file {
            if check_files && !file.is_file() {
                problems.push(format!("gateway.proxy.password_file: {} does not exist", file.display()));
            }
            if gw.proxy.username.is_none() {
                problems.push("gateway.proxy.password_file: also set gateway.proxy.username".into());
            }
        }
        for (i, listener) in self.listeners.iter().enumerate() {
            if listener.max_connections == 0 {
                problems.push(format!("listeners[{i}].max_connections: must be at least 1 (default 4096)"));
            }
        }
        if self.shutdown_grace_period.0 > Duration::from_secs(3600) {
            problems.push("shutdown_grace_period: at most 1h (default 20s)".into());
        }
        if gw.pool.drain_reconnect_window.0 > Duration::from_secs(600) {
            problems.push("gateway.pool.drain_reconnect_window: at most 10m (default 5s)".into());
        }
        if gw.token_check_interval.0 < Duration::from_secs(1) {
            problems.push("gateway.token_check_interval: must be at least 1s".into());
        }
        for (i, rule) in self.allow.iter().enumerate() {
            if rule.cidr.is_some() == rule.own_addresses {
                problems.push(format!("allow[{i}]: set exactly one of cidr or own_addresses: true"));
            }
            if rule.own_addresses && self.identifiers.addresses.is_empty() {
                problems.push(format!(
                    "allow[{i}].own_addresses: identifiers.addresses is empty (set it, e.g. from the node IP)"
                ));
            }
            if rule.ports.is_empty() {
                problems.push(format!("allow[{i}].ports: list the allowed ports, e.g. [10250]"));
            }
            for port in &rule.ports {
                if let Err(e) = port.range() {
                    problems.push(format!("allow[{i}].ports: {e}"));
                }
            }
        }
        let mut binds = std::collections::HashSet::new();
        for (i, listener) in self.listeners.iter().enumerate() {
            let name = &listener.target;
            let valid = !name.is_empty()
                && name.len() <= 63
                && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
            if !valid {
                problems.push(format!(
                    "listeners[{i}].target: {name:?} is not a target name; use lowercase letters, digits and '-' as in the gateway's node_to_controlplane list"
                ));
            }
            if listener.bind.port() != 0 && !binds.insert(listener.bind) {
                problems.push(format!("listeners[{i}].bind: {} is listed twice", listener.bind));
            }
        }
        if self.dial_timeout.0 < Duration::from_millis(100) {
            problems.push("dial_timeout: must be at least 100ms".into());
        }
        if let Some(id) = &self.agent_id
            && (id.is_empty() || id.len() > 253 || !id.chars().all(|c| c.is_ascii_graphic()))
        {
            problems.push("agent_id: must be 1-253 printable ASCII characters".into());
        }
        problems
    }

    /// The agent id: configured, else `NODE_NAME`, else the host name.
    pub fn agent_id(&self) -> String {
        self.agent_id
            .clone()
            .filter(|s| !s.is_empty())
            .or_else(|| std::env::var("NODE_NAME").ok().filter(|s| !s.is_empty()))
            .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|s| s.trim().to_owned()))
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "agent".into())
    }
}

fn is_loopback_url(uri: &http::Uri) -> bool {
    match uri.host().map(|h| h.trim_start_matches('[').trim_end_matches(']')) {
        Some("localhost") => true,
        Some(host) => host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback()),
        None => false,
    }
}
