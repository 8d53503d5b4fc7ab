//! The gateway process - the composition root: binds every listener up front (so tests bind port 0
//! and read the real addresses back), wires the parts together, serves until asked to stop,
//! reloads its configuration live, then drains.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::PrometheusHandle;
use tether_tunnel::tls::{self, ALPN_HTTP11, ReloadableCert};
use tether_tunnel::transport::Transport;
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::admin::{self, AdminState};
use crate::admission::Admission;
use crate::agent_endpoint::{self, AgentEndpoint, ConnInfo};
use crate::agent_session::Sessions;
use crate::certs::{CertRegistry, Fingerprint};
use crate::config::GatewayConfig;
use crate::dial::Dialer;
use crate::error::SetupError;
use crate::frontend::{self, Frontend, FrontendContext, FrontendSet};
use crate::lifecycle::Lifecycle;
use crate::metrics::{DRAINING, REPLICAS};
use crate::peer_endpoint::{self, PeerEndpoint};
use crate::peers::PeerSet;
use crate::proxy_protocol;
use crate::reload::{ReloadError, ReloadSummary, Reloader};
use crate::settings::{FrontendSettings, SessionSettings};
use crate::tenant::{Tenant, TenantSet, Tenants};
use tether_tunnel::session_threads::{SessionThreads, ThreadLoad};

/// A gateway with its listeners bound, ready to [`run`](Gateway::run).
pub struct Gateway {
    config: GatewayConfig,
    lifecycle: Arc<Lifecycle>,
    tenants: Arc<TenantSet>,
    frontends: Arc<FrontendSet>,
    /// Frontends bound by `bind`, served from `run` on.
    bound_frontends: Vec<(Arc<Tenant>, Vec<Frontend>)>,
    frontend_context: Arc<FrontendContext>,
    sessions: Arc<Sessions>,
    peers: Option<Arc<PeerSet>>,
    dialer: Dialer,
    reloader: Arc<Reloader>,
    agents: TcpListener,
    admin: TcpListener,
    agent_tls: Option<TlsAcceptor>,
    shared_frontend: Option<(TcpListener, TlsAcceptor)>,
    peer_endpoint: Option<(TcpListener, TlsAcceptor)>,
    metrics: Option<PrometheusHandle>,
    stop: CancellationToken,
}

/// Controls a running gateway from outside (tests, signal handlers).
#[derive(Clone)]
pub struct GatewayHandle {
    reloader: Arc<Reloader>,
    tenants: Arc<TenantSet>,
    stop: CancellationToken,
}

impl GatewayHandle {
    /// Starts the drain; [`Gateway::run`] returns when it is done.
    pub fn shutdown(&self) {
        self.stop.cancel();
    }

    /// Re-reads the configuration file and applies it (see [`apply`](Self::apply)).
    pub async fn reload(&self) -> Result<ReloadSummary, ReloadError> {
        self.reloader.reload().await
    }

    /// Applies a new configuration as one transaction (see [`Reloader::apply`]).
    pub async fn apply(&self, config: GatewayConfig) -> Result<ReloadSummary, ReloadError> {
        self.reloader.apply(config).await
    }

    /// Agent sessions per tenant.
    pub fn sessions(&self) -> std::collections::HashMap<String, usize> {
        self.tenants.load().iter().map(|t| (t.name.to_string(), t.registry.len())).collect()
    }
}

impl Gateway {
    /// Builds tenants and binds every listener; nothing is served until [`run`](Self::run).
    pub async fn bind(config: GatewayConfig, metrics: Option<PrometheusHandle>) -> Result<Self, SetupError> {
        Self::bind_with_path(config, None, metrics).await
    }

    /// Like [`bind`](Self::bind), remembering the file for reloads.
    pub async fn bind_with_path(
        config: GatewayConfig,
        config_path: Option<PathBuf>,
        metrics: Option<PrometheusHandle>,
    ) -> Result<Self, SetupError> {
        let tenants = Tenants::build(&config.tenants).await?;
        let certs = Arc::new(CertRegistry::default());
        let agents = bind_tcp(config.listen.agents)
            .await
            .map_err(|e| SetupError::listen("listen.agents", config.listen.agents, e))?;
        let admin = bind_tcp(config.listen.admin)
            .await
            .map_err(|e| SetupError::listen("listen.admin", config.listen.admin, e))?;
        let agent_tls = match &config.tls {
            Some(files) => Some(acceptor(&certs, "tls", &files.cert_file, &files.key_file, None, &[ALPN_HTTP11])?),
            None => None,
        };
        let mut bound_frontends = Vec::new();
        for tenant in tenants.iter() {
            bound_frontends.push((tenant.clone(), frontend::bind(&tenant.config(), &certs, &[]).await?));
        }
        let shared_frontend = match &config.shared_frontend {
            Some(sf) => {
                let listener = bind_tcp(sf.listen)
                    .await
                    .map_err(|e| SetupError::listen("shared_frontend.listen", sf.listen, e))?;
                let tls = acceptor(
                    &certs,
                    "shared_frontend.tls",
                    &sf.tls.cert_file,
                    &sf.tls.key_file,
                    Some(&sf.client_ca_file),
                    // HTTP/1.1 first: a CONNECT client offering both keeps HTTP/1.1; gRPC
                    // clients offer only h2 (see frontend::shared).
                    &[b"http/1.1", b"h2"],
                )?;
                Some((listener, tls))
            }
            None => None,
        };
        let server_id = config.server_id();
        let (peers, peer_endpoint) = match &config.peers {
            Some(p) => {
                let listener = bind_tcp(p.listen).await.map_err(|e| SetupError::listen("peers.listen", p.listen, e))?;
                let tls = acceptor(
                    &certs,
                    "peers.tls",
                    &p.tls.cert_file,
                    &p.tls.key_file,
                    Some(&p.tls.ca_file),
                    &[ALPN_HTTP11],
                )?;
                let set =
                    PeerSet::new(p.clone(), server_id.clone()).map_err(|e| SetupError::invalid("peers.tls", e))?;
                (Some(Arc::new(set)), Some((listener, tls)))
            }
            None => (None, None),
        };
        let lifecycle = Arc::new(Lifecycle::new());
        let tenants = Arc::new(TenantSet::new(tenants));
        let dialer = Dialer::new(peers.clone());
        let frontend_context = Arc::new(FrontendContext {
            dialer: dialer.clone(),
            server_id: config.server_id(),
            lifecycle: lifecycle.clone(),
            settings: FrontendSettings::from_config(&config),
        });
        let sessions = Arc::new(Sessions::new(
            SessionSettings::from_config(&config),
            lifecycle.clone(),
            config.limits.max_agent_sessions,
            peers.as_ref().map(|p| p.watch_count()),
        ));
        let frontends = Arc::new(FrontendSet::default());
        let reloader = Arc::new(Reloader::new(
            config_path,
            config.clone(),
            tenants.clone(),
            frontends.clone(),
            frontend_context.clone(),
            certs,
            peers.clone(),
            lifecycle.clone(),
        ));
        Ok(Self {
            config,
            lifecycle,
            tenants,
            frontends,
            bound_frontends,
            frontend_context,
            sessions,
            peers,
            dialer,
            reloader,
            agents,
            admin,
            agent_tls,
            shared_frontend,
            peer_endpoint,
            metrics,
            stop: CancellationToken::new(),
        })
    }

    /// The agent endpoint's address.
    pub fn agent_addr(&self) -> SocketAddr {
        self.agents.local_addr().unwrap_or(self.config.listen.agents)
    }

    /// The admin endpoint's address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.local_addr().unwrap_or(self.config.listen.admin)
    }

    /// The TCP frontend address of a tenant, if it has one.
    pub fn frontend_addr(&self, tenant: &str) -> Option<SocketAddr> {
        self.bound_frontends
            .iter()
            .filter(|(t, _)| &*t.name == tenant)
            .flat_map(|(_, frontends)| frontends.iter())
            .find_map(Frontend::tcp_addr)
            .or_else(|| self.frontends.tcp_addr(tenant))
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
        GatewayHandle { reloader: self.reloader.clone(), tenants: self.tenants.clone(), stop: self.stop.clone() }
    }

    /// Serves until `shutdown` resolves or the handle asks to stop, then drains: listeners
    /// close, agents get Drain, open connections and sessions get the grace period, then
    /// everything closes.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), SetupError> {
        let Self {
            config,
            lifecycle,
            tenants,
            frontends,
            bound_frontends,
            frontend_context,
            sessions,
            peers,
            dialer,
            reloader,
            agents,
            admin,
            agent_tls,
            shared_frontend,
            peer_endpoint,
            metrics,
            stop,
        } = self;
        crate::metrics::describe();
        if let (Some((listener, acceptor)), Some(peers)) = (peer_endpoint, peers.clone()) {
            let endpoint = Arc::new(PeerEndpoint {
                tenants: tenants.clone(),
                dialer,
                peers,
                lifecycle: lifecycle.clone(),
                handshake_timeout: config.limits.handshake_timeout.0,
            });
            tokio::spawn(peer_endpoint::serve(listener, acceptor, endpoint));
        }
        if let Some(peers) = &peers {
            // Learn the other replicas before the first agent is welcomed, so its Welcome
            // carries the real replica count (an agent is ready only with a session to each).
            peers.refresh().await;
            tokio::spawn(peers.clone().run(lifecycle.hard_stop().clone()));
            let mut count = peers.watch_count();
            tokio::spawn(async move {
                loop {
                    metrics::gauge!(REPLICAS).set(f64::from(*count.borrow_and_update()));
                    if count.changed().await.is_err() {
                        return;
                    }
                }
            });
        } else {
            metrics::gauge!(REPLICAS).set(1.0);
        }
        let endpoint = Arc::new(AgentEndpoint { tenants: tenants.clone(), sessions, listen: config.listen.clone() });
        let admission = Arc::new(Admission::new(config.limits.max_handshakes, config.limits.handshakes_per_source));
        let session_threads = start_session_threads();
        let agent_listener = tokio::spawn(serve_agents(
            agents,
            agent_tls,
            endpoint,
            admission,
            config.limits.handshake_timeout.0,
            session_threads.clone(),
        ));
        for (tenant, bound) in bound_frontends {
            frontends.replace(&tenant, bound, &frontend_context).await;
        }
        let shared_listener = shared_frontend.map(|(listener, acceptor)| {
            tokio::spawn(frontend::shared::serve(listener, acceptor, tenants.clone(), frontend_context.clone()))
        });
        for tenant in tenants.load().iter() {
            tokio::spawn(tenant.clone().refresh_keys_periodically(lifecycle.hard_stop().clone()));
        }
        if reloader.config_path.is_some() && !config.reload_check_interval.0.is_zero() {
            tokio::spawn(watch_config(reloader.clone(), config.reload_check_interval.0, lifecycle.clone()));
        }
        let admin_router =
            admin::router(AdminState { lifecycle: lifecycle.clone(), tenants: tenants.clone(), peers, metrics });
        let admin_stop = lifecycle.hard_stop().clone();
        let admin_task = tokio::spawn(async move {
            let served = axum::serve(admin, admin_router).with_graceful_shutdown(admin_stop.cancelled_owned());
            if let Err(e) = served.await {
                tracing::error!(error = %e, "admin endpoint failed");
            }
        });
        lifecycle.set_serving();
        tracing::info!(server_id = %config.server_id(), tenants = tenants.load().iter().count(), "gateway serving");

        tokio::select! {
            () = shutdown => {}
            () = stop.cancelled() => {}
        }

        let grace = config.drain_grace_period.0;
        lifecycle.set_unready();
        metrics::gauge!(DRAINING).set(1.0);
        let delay = config.drain_delay.0;
        if !delay.is_zero() {
            tracing::info!(
                delay_ms = delay.as_millis() as u64,
                "not ready; still accepting while load balancers notice"
            );
            tokio::time::sleep(delay).await;
        }
        tracing::info!(grace_period_s = grace.as_secs(), "draining: no new agents or connections; agents told to move");
        lifecycle.begin_drain();
        let _ = agent_listener.await;
        if let Some(listener) = shared_listener {
            let _ = listener.await;
        }
        frontends.stop_all().await;
        let (connections, agent_sessions) = lifecycle.finish_drain(grace).await;
        if connections + agent_sessions > 0 {
            tracing::warn!(connections, agent_sessions, "grace period over; closed what was still open");
        }
        let _ = admin_task.await;
        tracing::info!("gateway stopped");
        Ok(())
    }
}

/// A TLS acceptor from certificate files registered for reloads; `client_ca` requires client
/// certificates signed by it.
fn acceptor(
    certs: &CertRegistry,
    key: &str,
    cert_file: &std::path::Path,
    key_file: &std::path::Path,
    client_ca: Option<&std::path::Path>,
    alpn: &[&[u8]],
) -> Result<TlsAcceptor, SetupError> {
    let cert = ReloadableCert::load(cert_file, key_file).map_err(|e| SetupError::tls(key, e))?;
    certs.register(&cert);
    let server = tls::server_config(cert, client_ca, alpn).map_err(|e| SetupError::tls(key, e))?;
    Ok(TlsAcceptor::from(Arc::new(server)))
}

/// Reloads when the configuration file or a certificate or key file changes (a Kubernetes
/// ConfigMap or Secret update swaps a symlink; a cert-manager renewal is picked up without a
/// SIGHUP). Only file metadata is read each round, off the runtime's threads.
async fn watch_config(reloader: Arc<Reloader>, interval: Duration, lifecycle: Arc<Lifecycle>) {
    let Some(path) = reloader.config_path.clone() else { return };
    let fingerprint = |reloader: Arc<Reloader>, path: PathBuf| async move {
        let mut files = vec![path];
        files.extend(reloader.certs.files());
        tokio::task::spawn_blocking(move || Fingerprint::of(&files)).await.ok()
    };
    let mut last = fingerprint(reloader.clone(), path.clone()).await;
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = lifecycle.drain_started().cancelled() => return,
        }
        let now = fingerprint(reloader.clone(), path.clone()).await;
        if now.as_ref().is_some_and(Fingerprint::first_exists) && now != last {
            tracing::info!(file = %path.display(), "configuration or certificate files changed; reloading");
            let _ = reloader.reload().await;
            last = fingerprint(reloader.clone(), path.clone()).await;
        }
    }
}

/// Accepts agent connections: TLS if configured, then HTTP/1.1 with upgrades.
async fn serve_agents(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    endpoint: Arc<AgentEndpoint>,
    admission: Arc<Admission>,
    handshake_timeout: Duration,
    threads: Option<Arc<SessionThreads>>,
) {
    let lifecycle = endpoint.sessions.lifecycle.clone();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = lifecycle.drain_started().cancelled() => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "agent endpoint accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Before any work: a connection over the handshake limit is closed at once.
        let Ok(slot) = admission.handshake_slot() else {
            tracing::debug!(%peer, "agent connection closed: too many handshakes in progress (limits.max_handshakes)");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (tls, endpoint, admission) = (tls.clone(), endpoint.clone(), admission.clone());
        let connection = move |mut stream: TcpStream, load: Option<ThreadLoad>| async move {
            let mut peer = peer;
            let listen = &endpoint.listen;
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
            if admission.check_source(peer.ip()).is_err() {
                tracing::debug!(%peer, "agent connection closed: its address opens connections too fast (limits.handshakes_per_source)");
                return;
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
            let conn = ConnInfo { peer, sni, load };
            let service = service_fn(move |req| agent_endpoint::handle(req, conn.clone(), endpoint.clone()));
            let served = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(handshake_timeout)
                .max_buf_size(64 * 1024)
                .serve_connection(TokioIo::new(transport), service)
                .with_upgrades();
            // The slot is held until the connection is upgraded (hyper hands it over and this
            // future ends) or closed.
            let served = served.await;
            drop(slot);
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "agent HTTP connection ended with an error");
            }
        };
        match &threads {
            Some(threads) => threads.serve(stream, peer, move |stream, load| connection(stream, Some(load))),
            None => {
                tokio::spawn(connection(stream, None));
            }
        }
    }
}

/// One session thread per worker of the current runtime, unless it has a single worker (then
/// connections stay where they are: there is nowhere for them to move to).
fn start_session_threads() -> Option<Arc<SessionThreads>> {
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    if workers < 2 {
        return None;
    }
    SessionThreads::start_shared(workers)
}

/// Binds a TCP listener with a deep backlog.
pub async fn bind_tcp(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    // A deep backlog absorbs reconnect storms instead of dropping SYNs.
    socket.listen(4096)
}

/// Binds a Unix socket. A socket file left by a previous run is replaced; one that a live
/// process still listens on is not (that is "address in use").
pub fn bind_unix(path: &std::path::Path) -> std::io::Result<UnixListener> {
    use std::io::{Error, ErrorKind};
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                "exists and is not a socket; remove it or choose another path",
            ));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(Error::new(ErrorKind::AddrInUse, "another listener is serving this socket"));
        }
        std::fs::remove_file(path)?;
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    UnixListener::bind(path)
}
