//! Tether node agent: dials out to the gateway over WSS (so it passes NAT, firewalls, HTTPS load
//! balancers and corporate proxies), and serves the dials the gateway sends to node-side targets
//! within its allow list.

#![forbid(unsafe_code)]

pub mod admin;
pub mod allowlist;
pub mod config;
pub mod connection;
pub mod dialer;
pub mod forwarder;
pub mod metrics;
pub mod proxy;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use metrics_exporter_prometheus::PrometheusHandle;
use tether_tunnel::client::ClientSettings;
use tether_tunnel::mux::MuxSettings;
use tether_tunnel::protocol::Identifiers;
use tether_tunnel::tls::{self, ALPN_HTTP11, ClientRoots};
use tether_tunnel::ws::{KeepaliveSettings, WsSettings};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::AgentConfig;
pub use connection::AgentState;
use connection::{ConnectionContext, LazySessionThreads};
use dialer::DialPolicy;

/// An agent with its admin listener bound, ready to [`run`](Agent::run).
pub struct Agent {
    context: Arc<ConnectionContext>,
    admin: TcpListener,
    forward_listeners: Vec<forwarder::ForwardListener>,
    forward_wait: Duration,
    metrics: Option<PrometheusHandle>,
    stop: CancellationToken,
}

impl Agent {
    /// Builds the TLS client, the dial policy and binds the admin endpoint.
    pub async fn bind(config: AgentConfig, metrics: Option<PrometheusHandle>) -> anyhow::Result<Self> {
        let gw = &config.gateway;
        let url: http::Uri = gw.url.parse().context("gateway.url")?;
        let (_, _, uses_tls) = tether_tunnel::client::target(&url)?;
        let tls_config = if uses_tls {
            let roots = ClientRoots {
                ca_file: gw.ca_file.clone(),
                system_roots: gw.system_roots.unwrap_or(gw.ca_file.is_none()),
            };
            Some(Arc::new(tls::client_config(&roots, None, &[ALPN_HTTP11]).context("gateway.ca_file")?))
        } else {
            None
        };
        let allow = allowlist::AllowList::new(&config.allow, &config.identifiers.addresses);
        if allow.is_empty() {
            tracing::warn!("the allow list is empty: every dial from the gateway will be refused");
        }
        let client = ClientSettings {
            url,
            tls: tls_config,
            tls_server_name: gw.server_name.clone(),
            connect_timeout: gw.connect_timeout.0,
            handshake_timeout: gw.handshake_timeout.0,
            ws: WsSettings {
                keepalive: Some(KeepaliveSettings {
                    ping_interval: gw.ping_interval.0,
                    ping_timeout: gw.ping_timeout.0,
                }),
                ..WsSettings::default()
            },
            user_agent: format!("tether-agent/{}", env!("CARGO_PKG_VERSION")),
            proxy: None,
        };
        let mut client = client;
        client.proxy = proxy::resolve(&gw.proxy, &client.url)?;
        match &client.proxy {
            Some(p) => {
                tracing::info!(proxy = %p.display(), authenticated = p.authorization.is_some(), "reaching the gateway through an HTTP proxy")
            }
            None => tracing::debug!("connecting to the gateway directly"),
        }
        let ids = &config.identifiers;
        let agent_id = config.agent_id();
        let mut hosts = ids.hosts.clone();
        if !hosts.iter().any(|h| h.eq_ignore_ascii_case(&agent_id)) {
            hosts.push(agent_id.clone());
        }
        let context = Arc::new(ConnectionContext {
            client,
            token_file: gw.token_file.clone(),
            token_check_interval: gw.token_check_interval.0,
            agent_id,
            identifiers: Identifiers {
                hosts,
                addresses: ids.addresses.clone(),
                cidrs: ids.cidrs.iter().map(ToString::to_string).collect(),
                default_route: ids.default_route,
            },
            reconnect: (gw.reconnect_initial.0, gw.reconnect_max.0),
            mux: MuxSettings { window_growth: gw.window_growth_mib << 20, ..MuxSettings::default() },
            policy: Arc::new(DialPolicy { allow, max_timeout: config.dial_timeout.0 }),
            state: Arc::new(AgentState::new(
                gw.pool.mode,
                gw.pool.sessions_per_replica,
                gw.pool.busy_sessions(),
                gw.pool.busy_mib_per_second.saturating_mul(1 << 20),
            )),
            busy_linger: gw.pool.busy_linger.0,
            tasks: TaskTracker::new(),
            duplicate_retry_max: gw.pool.duplicate_retry_max.0,
            drain_reconnect_window: gw.pool.drain_reconnect_window.0,
            shutdown_grace_period: config.shutdown_grace_period.0,
            threads: LazySessionThreads::new(gw.pool.busy_sessions()),
        });
        let admin = TcpListener::bind(config.admin_listen)
            .await
            .with_context(|| format!("admin_listen: cannot listen on {}", config.admin_listen))?;
        let mut forward_listeners = Vec::new();
        for (i, listener) in config.listeners.iter().enumerate() {
            let bound = TcpListener::bind(listener.bind).await.with_context(|| {
                format!(
                    "listeners[{i}].bind: cannot listen on {} (is the host-scoped address configured? see docs/node-to-controlplane.md)",
                    listener.bind
                )
            })?;
            forward_listeners.push(forwarder::ForwardListener::new(
                bound,
                listener.target.as_str(),
                listener.max_connections,
            ));
        }
        Ok(Self {
            context,
            admin,
            forward_listeners,
            forward_wait: config.forward_wait.0,
            metrics,
            stop: CancellationToken::new(),
        })
    }

    /// The admin endpoint's address.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.local_addr().ok()
    }

    /// The bound node -> control-plane listeners: (address, target).
    pub fn forward_addrs(&self) -> Vec<(SocketAddr, String)> {
        self.forward_listeners.iter().filter_map(|l| Some((l.local_addr()?, l.target.to_string()))).collect()
    }

    /// Live state (sessions, last error).
    pub fn state(&self) -> Arc<AgentState> {
        self.context.state.clone()
    }

    /// A token that stops the agent when cancelled.
    pub fn stop_token(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Runs until `shutdown` resolves or the stop token is cancelled; open streams get a few
    /// seconds to finish.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let Self { context, admin, forward_listeners, forward_wait, metrics, stop } = self;
        crate::metrics::describe();
        let router = admin::router(context.state.clone(), metrics);
        let admin_stop = stop.clone();
        let admin_task = tokio::spawn(async move {
            let served = axum::serve(admin, router).with_graceful_shutdown(admin_stop.cancelled_owned());
            if let Err(e) = served.await {
                tracing::error!(error = %e, "admin endpoint failed");
            }
        });
        let connection = tokio::spawn(connection::maintain(context.clone(), stop.clone()));
        let forward = forwarder::ForwardContext {
            state: context.state.clone(),
            wait: forward_wait,
            tasks: context.tasks.clone(),
        };
        for listener in forward_listeners {
            tracing::info!(bind = ?listener.local_addr(), target = %listener.target, "forwarding node-side connections");
            tokio::spawn(forwarder::serve(listener, forward.clone(), stop.clone()));
        }
        tokio::select! {
            () = shutdown => stop.cancel(),
            () = stop.cancelled() => {}
        }
        let _ = connection.await;
        context.tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(5), context.tasks.wait()).await;
        let _ = admin_task.await;
        tracing::info!("agent stopped");
        Ok(())
    }
}
