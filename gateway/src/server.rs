//! The gateway process: binds every listener up front (so tests bind port 0 and read the real
//! addresses back), serves until asked to stop, then drains.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::PrometheusHandle;
use tether_tunnel::mux::MuxSettings;
use tether_tunnel::tls::{self, ALPN_HTTP11, ReloadableCert};
use tether_tunnel::transport::Transport;
use tether_tunnel::ws::{KeepaliveSettings, WsSettings};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::agent_endpoint::{self, ConnInfo};
use crate::config::GatewayConfig;
use crate::frontend;
use crate::metrics::DRAINING;
use crate::tenant::{Tenant, Tenants};

/// State shared by every task of the gateway.
pub struct Shared {
    /// This replica's id.
    pub server_id: String,
    /// The configuration it runs with.
    pub config: GatewayConfig,
    /// The tenants.
    pub tenants: Tenants,
    /// Cancelled when draining starts: listeners stop, agents are told to move.
    pub drain_started: CancellationToken,
    /// Cancelled when the grace period is over: everything still open is closed.
    pub hard_stop: CancellationToken,
    /// Tunnelled frontend connections.
    pub conn_tasks: TaskTracker,
    /// Agent sessions.
    pub session_tasks: TaskTracker,
    /// Agent sessions across all tenants.
    pub session_slots: Arc<Semaphore>,
    /// Source of session ids.
    pub next_conn_id: AtomicU64,
    /// WebSocket settings for agent connections.
    pub ws: WsSettings,
    /// Multiplexer settings for agent sessions.
    pub mux: MuxSettings,
    /// Set once every listener is serving.
    pub listeners_up: AtomicBool,
}

enum FrontendListener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener, Option<TlsAcceptor>),
}

/// A gateway with its listeners bound, ready to [`run`](Gateway::run).
pub struct Gateway {
    shared: Arc<Shared>,
    agents: TcpListener,
    admin: TcpListener,
    agent_tls: Option<(Arc<ReloadableCert>, TlsAcceptor)>,
    frontends: Vec<(Arc<Tenant>, FrontendListener)>,
    metrics: Option<PrometheusHandle>,
    stop: CancellationToken,
}

/// Controls a running gateway from outside (tests, signal handlers).
#[derive(Clone)]
pub struct GatewayHandle {
    shared: Arc<Shared>,
    stop: CancellationToken,
    agent_cert: Option<Arc<ReloadableCert>>,
}

impl GatewayHandle {
    /// Starts the drain; [`Gateway::run`] returns when it is done.
    pub fn shutdown(&self) {
        self.stop.cancel();
    }

    /// Re-reads the agent endpoint's certificate and key; the old pair stays on error.
    pub fn reload_certificates(&self) -> Result<(), tls::TlsError> {
        match &self.agent_cert {
            Some(cert) => cert.reload(),
            None => Ok(()),
        }
    }

    /// Agent sessions per tenant.
    pub fn sessions(&self) -> HashMap<String, usize> {
        self.shared.tenants.iter().map(|t| (t.name.to_string(), t.registry.len())).collect()
    }

    /// The shared state (for tests and embedding).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

impl Gateway {
    /// Builds tenants and binds every listener; nothing is served until [`run`](Self::run).
    pub async fn bind(config: GatewayConfig, metrics: Option<PrometheusHandle>) -> anyhow::Result<Self> {
        let tenants = Tenants::build(&config.tenants).await?;
        let agents = bind_tcp(config.listen.agents).await.context("listen.agents")?;
        let admin = bind_tcp(config.listen.admin).await.context("listen.admin")?;
        let agent_tls = match &config.tls {
            Some(files) => {
                let cert = ReloadableCert::load(&files.cert_file, &files.key_file).context("tls")?;
                let server = tls::server_config(cert.clone(), None, &[ALPN_HTTP11]).context("tls")?;
                Some((cert, TlsAcceptor::from(Arc::new(server))))
            }
            None => None,
        };
        let mut frontends = Vec::new();
        for tenant in tenants.iter() {
            let key = |field: &str| format!("tenants[{}].frontend.{field}", tenant.name);
            if let Some(path) = &tenant.config.frontend.uds {
                let listener = bind_unix(path).with_context(|| key("uds"))?;
                frontends.push((tenant.clone(), FrontendListener::Unix(listener, path.clone())));
            }
            if let Some(tcp) = &tenant.config.frontend.tcp {
                let listener = bind_tcp(tcp.listen).await.with_context(|| key("tcp.listen"))?;
                let acceptor = match &tcp.tls {
                    Some(files) => {
                        let cert =
                            ReloadableCert::load(&files.cert_file, &files.key_file).with_context(|| key("tcp.tls"))?;
                        let server = tls::server_config(cert, tcp.client_ca_file.as_deref(), &[])
                            .with_context(|| key("tcp.client_ca_file"))?;
                        Some(frontend::tls_acceptor(server))
                    }
                    None => None,
                };
                frontends.push((tenant.clone(), FrontendListener::Tcp(listener, acceptor)));
            }
        }
        let keepalive = KeepaliveSettings {
            ping_interval: config.keepalive.ping_interval.0,
            ping_timeout: config.keepalive.ping_timeout.0,
        };
        let shared = Arc::new(Shared {
            server_id: config.server_id(),
            tenants,
            drain_started: CancellationToken::new(),
            hard_stop: CancellationToken::new(),
            conn_tasks: TaskTracker::new(),
            session_tasks: TaskTracker::new(),
            session_slots: Arc::new(Semaphore::new(config.limits.max_agent_sessions)),
            next_conn_id: AtomicU64::new(1),
            ws: WsSettings {
                read_buffer_size: config.limits.ws_read_buffer_size,
                keepalive: Some(keepalive),
                ..WsSettings::default()
            },
            mux: MuxSettings { max_streams: config.limits.max_streams_per_agent, ..MuxSettings::default() },
            listeners_up: AtomicBool::new(false),
            config,
        });
        Ok(Self { shared, agents, admin, agent_tls, frontends, metrics, stop: CancellationToken::new() })
    }

    /// The agent endpoint's address.
    pub fn agent_addr(&self) -> SocketAddr {
        self.agents.local_addr().unwrap_or_else(|_| self.shared.config.listen.agents)
    }

    /// The admin endpoint's address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.local_addr().unwrap_or_else(|_| self.shared.config.listen.admin)
    }

    /// The TCP frontend address of a tenant, if it has one.
    pub fn frontend_addr(&self, tenant: &str) -> Option<SocketAddr> {
        self.frontends.iter().find_map(|(t, listener)| match listener {
            FrontendListener::Tcp(l, _) if &*t.name == tenant => l.local_addr().ok(),
            _ => None,
        })
    }

    /// A handle to stop or reload the gateway once it runs.
    pub fn handle(&self) -> GatewayHandle {
        GatewayHandle {
            shared: self.shared.clone(),
            stop: self.stop.clone(),
            agent_cert: self.agent_tls.as_ref().map(|(cert, _)| cert.clone()),
        }
    }

    /// Serves until `shutdown` resolves or the handle asks to stop, then drains: listeners
    /// close, agents get Drain, open connections get the grace period, then everything closes.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let Self { shared, agents, admin, agent_tls, frontends, metrics, stop } = self;
        crate::metrics::describe();
        let mut sockets = Vec::new();
        let mut listeners = Vec::new();
        listeners.push(tokio::spawn(serve_agents(agents, agent_tls.map(|(_, a)| a), shared.clone())));
        for (tenant, listener) in frontends {
            listeners.push(match listener {
                FrontendListener::Unix(l, path) => {
                    sockets.push(path);
                    tokio::spawn(frontend::serve_uds(l, tenant, shared.clone()))
                }
                FrontendListener::Tcp(l, tls) => tokio::spawn(frontend::serve_tcp(l, tls, tenant, shared.clone())),
            });
        }
        for tenant in shared.tenants.iter() {
            tokio::spawn(tenant.clone().refresh_keys_periodically(shared.hard_stop.clone()));
        }
        let admin_router = crate::admin::router(shared.clone(), metrics);
        let admin_stop = shared.hard_stop.clone();
        let admin_task = tokio::spawn(async move {
            let served = axum::serve(admin, admin_router).with_graceful_shutdown(admin_stop.cancelled_owned());
            if let Err(e) = served.await {
                tracing::error!(error = %e, "admin endpoint failed");
            }
        });
        shared.listeners_up.store(true, Ordering::Relaxed);
        tracing::info!(server_id = %shared.server_id, tenants = shared.tenants.iter().count(), "gateway serving");

        tokio::select! {
            () = shutdown => {}
            () = stop.cancelled() => {}
        }

        let grace = shared.config.drain_grace_period.0;
        tracing::info!(grace_period_s = grace.as_secs(), "draining: no new agents or connections; agents told to move");
        metrics::gauge!(DRAINING).set(1.0);
        shared.drain_started.cancel();
        for listener in listeners {
            let _ = listener.await;
        }
        for path in &sockets {
            let _ = std::fs::remove_file(path);
        }
        shared.conn_tasks.close();
        if tokio::time::timeout(grace, shared.conn_tasks.wait()).await.is_err() {
            tracing::warn!(open = shared.conn_tasks.len(), "grace period over; closing remaining connections");
        }
        shared.hard_stop.cancel();
        shared.session_tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(5), shared.conn_tasks.wait()).await;
        let _ = tokio::time::timeout(Duration::from_secs(5), shared.session_tasks.wait()).await;
        let _ = admin_task.await;
        tracing::info!("gateway stopped");
        Ok(())
    }
}

/// Accepts agent connections: TLS if configured, then HTTP/1.1 with upgrades.
async fn serve_agents(listener: TcpListener, tls: Option<TlsAcceptor>, shared: Arc<Shared>) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shared.drain_started.cancelled() => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "agent endpoint accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (tls, shared) = (tls.clone(), shared.clone());
        tokio::spawn(async move {
            let handshake_timeout = shared.config.limits.handshake_timeout.0;
            let (transport, sni) = match tls {
                None => (Transport::Plain(stream), None),
                Some(acceptor) => match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                    Ok(Ok(tls_stream)) => {
                        let sni = tls_stream.get_ref().1.server_name().map(str::to_owned);
                        (Transport::ServerTls(Box::new(tls_stream)), sni)
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "agent TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "agent TLS handshake timed out");
                        return;
                    }
                },
            };
            let conn = ConnInfo { peer, sni };
            let service = service_fn(move |req| agent_endpoint::handle(req, conn.clone(), shared.clone()));
            let served = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(handshake_timeout)
                .max_buf_size(64 * 1024)
                .serve_connection(TokioIo::new(transport), service)
                .with_upgrades();
            if let Err(e) = served.await {
                tracing::debug!(%peer, error = %e, "agent HTTP connection ended with an error");
            }
        });
    }
}

async fn bind_tcp(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    // A deep backlog absorbs reconnect storms instead of dropping SYNs.
    Ok(socket.listen(4096)?)
}

fn bind_unix(path: &std::path::Path) -> anyhow::Result<UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if meta.file_type().is_socket() {
            // A socket left behind by a previous run.
            std::fs::remove_file(path).with_context(|| format!("cannot remove stale socket {}", path.display()))?;
        } else {
            anyhow::bail!("{} exists and is not a socket; remove it or choose another path", path.display());
        }
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))
}
