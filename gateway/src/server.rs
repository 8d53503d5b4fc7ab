//! The gateway process: binds every listener up front (so tests bind port 0 and read the real
//! addresses back), serves until asked to stop, reloads its configuration live, then drains.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use anyhow::Context as _;
use arc_swap::ArcSwap;
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
use crate::frontend::{self, FrontendListener};
use crate::metrics::{CONFIG_RELOADS, DRAINING};
use crate::peers::PeerSet;
use crate::proxy_protocol;
use crate::tenant::{Tenant, Tenants};

/// State shared by every task of the gateway.
pub struct Shared {
    /// This replica's id.
    pub server_id: String,
    /// The configuration the process started with (listeners, global limits, keepalive).
    pub config: GatewayConfig,
    /// The file the configuration came from, for reloads.
    pub config_path: Option<PathBuf>,
    /// The tenants in force; replaced as a whole on reload.
    pub tenants: ArcSwap<Tenants>,
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
    /// Set at SIGTERM, before the drain starts (and so also throughout it): `/readyz` fails so
    /// balancers move away.
    pub unready: AtomicBool,
    /// Every certificate loaded from files, re-read on reload.
    pub certs: CertRegistry,
    /// The other replicas, when `peers` is configured.
    pub peers: Option<Arc<PeerSet>>,
    reload_lock: tokio::sync::Mutex<()>,
}

/// Certificates to re-read on reload (rotation without restart).
#[derive(Default)]
pub struct CertRegistry {
    certs: Mutex<Vec<Weak<ReloadableCert>>>,
}

impl CertRegistry {
    /// Remembers a certificate for reloads.
    pub fn register(&self, cert: &Arc<ReloadableCert>) {
        if let Ok(mut certs) = self.certs.lock() {
            certs.retain(|c| c.strong_count() > 0);
            certs.push(Arc::downgrade(cert));
        }
    }

    /// The certificate and key files of every live certificate.
    pub fn files(&self) -> Vec<PathBuf> {
        let live: Vec<Arc<ReloadableCert>> =
            self.certs.lock().map(|c| c.iter().filter_map(Weak::upgrade).collect()).unwrap_or_default();
        live.iter().flat_map(|c| c.files().map(std::path::Path::to_path_buf)).collect()
    }

    /// Re-reads every live certificate; failures keep the old pair and are returned.
    pub fn reload_all(&self) -> Vec<String> {
        let live: Vec<Arc<ReloadableCert>> =
            self.certs.lock().map(|c| c.iter().filter_map(Weak::upgrade).collect()).unwrap_or_default();
        live.iter().filter_map(|cert| cert.reload().err().map(|e| e.to_string())).collect()
    }
}

/// A gateway with its listeners bound, ready to [`run`](Gateway::run).
pub struct Gateway {
    shared: Arc<Shared>,
    agents: TcpListener,
    admin: TcpListener,
    agent_tls: Option<TlsAcceptor>,
    frontends: Vec<(Arc<Tenant>, Vec<FrontendListener>)>,
    shared_frontend: Option<(TcpListener, TlsAcceptor)>,
    peer_endpoint: Option<(TcpListener, TlsAcceptor)>,
    metrics: Option<PrometheusHandle>,
    stop: CancellationToken,
}

/// Controls a running gateway from outside (tests, signal handlers).
#[derive(Clone)]
pub struct GatewayHandle {
    shared: Arc<Shared>,
    stop: CancellationToken,
}

impl GatewayHandle {
    /// Starts the drain; [`Gateway::run`] returns when it is done.
    pub fn shutdown(&self) {
        self.stop.cancel();
    }

    /// Re-reads the configuration file and applies it (see [`apply`](Self::apply)).
    pub async fn reload(&self) -> anyhow::Result<ReloadSummary> {
        let path = self.shared.config_path.clone();
        let result = match GatewayConfig::load(path.as_deref()) {
            Ok(config) => self.apply(config).await,
            Err(e) => Err(e),
        };
        record_reload(&result);
        result
    }

    /// Applies a new configuration: tenants are added, changed in place or removed (their agents
    /// drained), certificates re-read. Other tenants' connections are untouched. If anything in
    /// the new configuration is invalid, nothing changes. Listener addresses and process-wide
    /// settings need a restart; changes to them are reported and ignored.
    pub async fn apply(&self, config: GatewayConfig) -> anyhow::Result<ReloadSummary> {
        apply(&self.shared, config).await
    }

    /// Agent sessions per tenant.
    pub fn sessions(&self) -> HashMap<String, usize> {
        self.shared.tenants.load().iter().map(|t| (t.name.to_string(), t.registry.len())).collect()
    }

    /// The shared state (for tests and embedding).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

/// What a reload changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReloadSummary {
    /// Tenants added.
    pub added: Vec<String>,
    /// Tenants whose configuration changed.
    pub changed: Vec<String>,
    /// Tenants removed (their agents are drained).
    pub removed: Vec<String>,
    /// Settings that changed but need a restart.
    pub needs_restart: Vec<String>,
}

impl Gateway {
    /// Builds tenants and binds every listener; nothing is served until [`run`](Self::run).
    pub async fn bind(config: GatewayConfig, metrics: Option<PrometheusHandle>) -> anyhow::Result<Self> {
        Self::bind_with_path(config, None, metrics).await
    }

    /// Like [`bind`](Self::bind), remembering the file for reloads.
    pub async fn bind_with_path(
        config: GatewayConfig,
        config_path: Option<PathBuf>,
        metrics: Option<PrometheusHandle>,
    ) -> anyhow::Result<Self> {
        let tenants = Tenants::build(&config.tenants).await?;
        let certs = CertRegistry::default();
        let agents = bind_tcp(config.listen.agents).await.context("listen.agents")?;
        let admin = bind_tcp(config.listen.admin).await.context("listen.admin")?;
        let agent_tls = match &config.tls {
            Some(files) => {
                let cert = ReloadableCert::load(&files.cert_file, &files.key_file).context("tls")?;
                certs.register(&cert);
                let server = tls::server_config(cert, None, &[ALPN_HTTP11]).context("tls")?;
                Some(TlsAcceptor::from(Arc::new(server)))
            }
            None => None,
        };
        let mut frontends = Vec::new();
        for tenant in tenants.iter() {
            frontends.push((tenant.clone(), frontend::bind(tenant, &certs).await?));
        }
        let shared_frontend = match &config.shared_frontend {
            Some(sf) => {
                let listener = bind_tcp(sf.listen).await.context("shared_frontend.listen")?;
                let cert = ReloadableCert::load(&sf.tls.cert_file, &sf.tls.key_file).context("shared_frontend.tls")?;
                certs.register(&cert);
                let server = tls::server_config(cert, Some(&sf.client_ca_file), &[])
                    .context("shared_frontend.client_ca_file")?;
                Some((listener, TlsAcceptor::from(Arc::new(server))))
            }
            None => None,
        };
        let server_id = config.server_id();
        let (peers, peer_endpoint) = match &config.peers {
            Some(p) => {
                let listener = bind_tcp(p.listen).await.context("peers.listen")?;
                let cert = ReloadableCert::load(&p.tls.cert_file, &p.tls.key_file).context("peers.tls")?;
                certs.register(&cert);
                let server =
                    tls::server_config(cert, Some(&p.tls.ca_file), &[ALPN_HTTP11]).context("peers.tls.ca_file")?;
                let set = Arc::new(PeerSet::new(p.clone(), server_id.clone()).context("peers.tls")?);
                (Some(set), Some((listener, TlsAcceptor::from(Arc::new(server)))))
            }
            None => (None, None),
        };
        let keepalive = KeepaliveSettings {
            ping_interval: config.keepalive.ping_interval.0,
            ping_timeout: config.keepalive.ping_timeout.0,
        };
        let shared = Arc::new(Shared {
            server_id,
            peers,
            config_path,
            tenants: ArcSwap::from_pointee(tenants),
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
            mux: MuxSettings {
                max_streams: config.limits.max_streams_per_agent,
                window_growth: config.limits.window_growth_per_agent_mib << 20,
                ..MuxSettings::default()
            },
            listeners_up: AtomicBool::new(false),
            unready: AtomicBool::new(false),
            certs,
            reload_lock: tokio::sync::Mutex::new(()),
            config,
        });
        Ok(Self {
            shared,
            agents,
            admin,
            agent_tls,
            frontends,
            shared_frontend,
            peer_endpoint,
            metrics,
            stop: CancellationToken::new(),
        })
    }

    /// The agent endpoint's address.
    pub fn agent_addr(&self) -> SocketAddr {
        self.agents.local_addr().unwrap_or(self.shared.config.listen.agents)
    }

    /// The admin endpoint's address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.local_addr().unwrap_or(self.shared.config.listen.admin)
    }

    /// The TCP frontend address of a tenant, if it has one.
    pub fn frontend_addr(&self, tenant: &str) -> Option<SocketAddr> {
        self.frontends
            .iter()
            .filter(|(t, _)| &*t.name == tenant)
            .flat_map(|(_, listeners)| listeners.iter())
            .find_map(FrontendListener::tcp_addr)
    }

    /// The peer endpoint's address, if peers are configured.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer_endpoint.as_ref().and_then(|(l, _)| l.local_addr().ok())
    }

    /// The shared mutual-TLS frontend's address, if configured.
    pub fn shared_frontend_addr(&self) -> Option<SocketAddr> {
        self.shared_frontend.as_ref().and_then(|(l, _)| l.local_addr().ok())
    }

    /// A handle to stop or reload the gateway once it runs.
    pub fn handle(&self) -> GatewayHandle {
        GatewayHandle { shared: self.shared.clone(), stop: self.stop.clone() }
    }

    /// Serves until `shutdown` resolves or the handle asks to stop, then drains: listeners
    /// close, agents get Drain, open connections get the grace period, then everything closes.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let Self { shared, agents, admin, agent_tls, frontends, shared_frontend, peer_endpoint, metrics, stop } = self;
        crate::metrics::describe();
        let mut listeners = vec![tokio::spawn(serve_agents(agents, agent_tls, shared.clone()))];
        for (tenant, bound) in frontends {
            listeners.extend(frontend::spawn(bound, &tenant, &shared, &tenant.frontends_stop()));
        }
        if let Some((listener, acceptor)) = shared_frontend {
            listeners.push(tokio::spawn(frontend::shared::serve(listener, acceptor, shared.clone())));
        }
        if let (Some((listener, acceptor)), Some(peers)) = (peer_endpoint, shared.peers.clone()) {
            tokio::spawn(crate::peers::endpoint::serve(listener, acceptor, shared.clone()));
            tokio::spawn(peers.clone().run(shared.hard_stop.clone()));
            let mut count = peers.watch_count();
            tokio::spawn(async move {
                loop {
                    metrics::gauge!(crate::metrics::REPLICAS).set(f64::from(*count.borrow_and_update()));
                    if count.changed().await.is_err() {
                        return;
                    }
                }
            });
        } else {
            metrics::gauge!(crate::metrics::REPLICAS).set(1.0);
        }
        for tenant in shared.tenants.load().iter() {
            tokio::spawn(tenant.clone().refresh_keys_periodically(shared.hard_stop.clone()));
        }
        if shared.config_path.is_some() && !shared.config.reload_check_interval.0.is_zero() {
            tokio::spawn(watch_config(GatewayHandle { shared: shared.clone(), stop: stop.clone() }));
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
        tracing::info!(server_id = %shared.server_id, tenants = shared.tenants.load().iter().count(), "gateway serving");

        tokio::select! {
            () = shutdown => {}
            () = stop.cancelled() => {}
        }

        let grace = shared.config.drain_grace_period.0;
        shared.unready.store(true, Ordering::Relaxed);
        metrics::gauge!(DRAINING).set(1.0);
        let delay = shared.config.drain_delay.0;
        if !delay.is_zero() {
            tracing::info!(
                delay_ms = delay.as_millis() as u64,
                "not ready; still accepting while load balancers notice"
            );
            tokio::time::sleep(delay).await;
        }
        tracing::info!(grace_period_s = grace.as_secs(), "draining: no new agents or connections; agents told to move");
        shared.drain_started.cancel();
        for listener in listeners {
            let _ = listener.await;
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

async fn apply(shared: &Arc<Shared>, config: GatewayConfig) -> anyhow::Result<ReloadSummary> {
    let _one_at_a_time = shared.reload_lock.lock().await;
    let problems = config.validate();
    if !problems.is_empty() {
        let list: Vec<String> = problems.iter().map(|p| format!("  - {p}")).collect();
        anyhow::bail!("invalid configuration; keeping the one in force:\n{}", list.join("\n"));
    }
    let mut summary = ReloadSummary::default();
    let started = &shared.config;
    for (setting, same) in [
        ("listen", json(&started.listen) == json(&config.listen)),
        ("tls", json(&started.tls) == json(&config.tls)),
        ("keepalive", json(&started.keepalive) == json(&config.keepalive)),
        ("limits", json(&started.limits) == json(&config.limits)),
        ("shared_frontend", json(&started.shared_frontend) == json(&config.shared_frontend)),
        (
            "peers.listen/peers.tls",
            json(&started.peers.as_ref().map(|p| (&p.listen, &p.tls)))
                == json(&config.peers.as_ref().map(|p| (&p.listen, &p.tls))),
        ),
        ("server_id", started.server_id == config.server_id),
    ] {
        if !same {
            summary.needs_restart.push(setting.to_owned());
        }
    }

    let current = shared.tenants.load_full();
    // Build what can fail first, so a bad tenant leaves everything as it was.
    let mut added = Vec::new();
    for tenant_config in &config.tenants {
        if current.by_name(&tenant_config.name).is_none() {
            let tenant = Arc::new(Tenant::build(tenant_config.clone()).await?);
            let listeners = frontend::bind(&tenant, &shared.certs).await?;
            added.push((tenant, listeners));
        }
    }
    let mut list: Vec<Arc<Tenant>> = Vec::new();
    for tenant_config in &config.tenants {
        let Some(tenant) = current.by_name(&tenant_config.name) else { continue };
        if json(&*tenant.config()) != json(tenant_config) {
            let frontends_changed = tenant.update(tenant_config.clone()).await?;
            if frontends_changed {
                let stop = tenant.restart_frontends();
                // The old listeners release their addresses as they stop.
                tokio::time::sleep(Duration::from_millis(50)).await;
                let listeners = frontend::bind(&tenant, &shared.certs).await?;
                frontend::spawn(listeners, &tenant, shared, &stop);
            }
            summary.changed.push(tenant.name.to_string());
        }
        list.push(tenant);
    }
    for (tenant, listeners) in added {
        frontend::spawn(listeners, &tenant, shared, &tenant.frontends_stop());
        tokio::spawn(tenant.clone().refresh_keys_periodically(shared.hard_stop.clone()));
        summary.added.push(tenant.name.to_string());
        list.push(tenant);
    }
    for tenant in current.iter() {
        if !config.tenants.iter().any(|t| t.name == *tenant.name) {
            tenant.restart_frontends().cancel();
            tenant.removed.cancel();
            summary.removed.push(tenant.name.to_string());
        }
    }
    shared.tenants.store(Arc::new(Tenants::from_list(list)));
    if let (Some(peers), Some(peer_config)) = (&shared.peers, &config.peers) {
        peers.reconfigure(peer_config.clone());
        peers.refresh().await;
    }
    for error in shared.certs.reload_all() {
        tracing::error!(%error, "certificate reload failed; keeping the old certificate");
    }
    tracing::info!(
        added = ?summary.added,
        changed = ?summary.changed,
        removed = ?summary.removed,
        needs_restart = ?summary.needs_restart,
        "configuration reloaded"
    );
    Ok(summary)
}

fn json<T: serde::Serialize>(value: &T) -> Option<serde_json::Value> {
    serde_json::to_value(value).ok()
}

fn record_reload(result: &anyhow::Result<ReloadSummary>) {
    let label = if result.is_ok() { "ok" } else { "error" };
    metrics::counter!(CONFIG_RELOADS, "result" => label).increment(1);
    metrics::gauge!(crate::metrics::CONFIG_LAST_RELOAD_OK).set(if result.is_ok() { 1.0 } else { 0.0 });
    if let Err(e) = result {
        tracing::error!(error = %format!("{e:#}"), "configuration reload failed; the previous configuration stays in force");
    }
}

/// Reloads when the configuration file or a certificate or key file changes (Kubernetes
/// ConfigMap and Secret updates swap a symlink, so contents are compared, not modification
/// times; a cert-manager renewal is picked up without a SIGHUP).
async fn watch_config(handle: GatewayHandle) {
    let Some(path) = handle.shared.config_path.clone() else { return };
    let interval = handle.shared.config.reload_check_interval.0;
    let snapshot = |shared: &Shared| {
        let mut files = vec![path.clone()];
        files.extend(shared.certs.files());
        files.iter().map(|f| std::fs::read(f).ok()).collect::<Vec<_>>()
    };
    let mut last = snapshot(&handle.shared);
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = handle.shared.drain_started.cancelled() => return,
        }
        let now = snapshot(&handle.shared);
        if now.first().is_some_and(Option::is_some) && now != last {
            tracing::info!(file = %path.display(), "configuration or certificate files changed; reloading");
            let _ = handle.reload().await;
            last = snapshot(&handle.shared);
        }
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
            let mut stream = stream;
            let mut peer = peer;
            let listen = &shared.config.listen;
            if listen.proxy_protocol {
                if !listen.trusted_proxies.is_empty() && !listen.is_trusted_proxy(peer.ip()) {
                    tracing::warn!(%peer, "PROXY protocol header from an untrusted address; connection closed");
                    return;
                }
                match tokio::time::timeout(handshake_timeout, proxy_protocol::read_header(&mut stream)).await {
                    Ok(Ok(Some(client))) => peer = client,
                    Ok(Ok(None)) => {}
                    Ok(Err(e)) => {
                        tracing::info!(%peer, error = %e, "connection closed");
                        return;
                    }
                    Err(_) => {
                        tracing::info!(%peer, "no PROXY protocol header in time; connection closed");
                        return;
                    }
                }
            }
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

/// Binds a TCP listener with a deep backlog.
pub async fn bind_tcp(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    // A deep backlog absorbs reconnect storms instead of dropping SYNs.
    Ok(socket.listen(4096)?)
}

/// Binds a Unix socket, replacing a stale socket file left by a previous run.
pub fn bind_unix(path: &std::path::Path) -> anyhow::Result<UnixListener> {
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
