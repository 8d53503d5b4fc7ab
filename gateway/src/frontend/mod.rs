//! The frontends a tenant's kube-apiserver connects to: a Unix socket and/or a TCP port (plain,
//! TLS, or mutual TLS), each speaking HTTP CONNECT or Konnectivity's gRPC protocol (the tenant's
//! `frontend.protocol`) and each bound to exactly one tenant, so a frontend can only ever reach its
//! own tenant's agents.
//!
//! A bound socket outlives the configuration it was bound for: a reload that keeps a frontend's
//! address (or socket path) hands the same socket to the new serving task, so the address is never
//! released (no "address in use", no connection refused) and a Unix socket file is removed only
//! when no configuration uses its path any more.

pub mod connect;
pub mod grpc;
pub mod shared;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tether_tunnel::splice::{Direction, splice, splice_mux};
use tether_tunnel::tls::{self, ReloadableCert};
use tether_tunnel::transport::send_all;
use tether_tunnel::untrusted::printable;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::audit;
use crate::certs::CertRegistry;
use crate::config::{FrontendProtocol, TenantConfig};
use crate::dial::{Dialed, DialedStream, Dialer};
use crate::error::SetupError;
use crate::lifecycle::Lifecycle;
use crate::metrics::BYTES;
use crate::settings::FrontendSettings;
use crate::target::DialTarget;
use crate::tenant::Tenant;
use connect::{ESTABLISHED, error_response, read_request};

/// What serving a CONNECT needs.
pub struct FrontendContext {
    /// Opens the dials.
    pub dialer: Dialer,
    /// This replica's id (audit log).
    pub server_id: String,
    /// Drain and stop.
    pub lifecycle: Arc<Lifecycle>,
    /// Timeouts.
    pub settings: FrontendSettings,
}

/// A bound Unix socket; its file is removed when the last user lets go of it.
pub struct UnixSocket {
    listener: UnixListener,
    path: PathBuf,
}

impl Drop for UnixSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A bound TCP socket and the address it was configured with (which may say port 0).
pub struct TcpSocket {
    listener: TcpListener,
    configured: SocketAddr,
}

/// A bound frontend socket, shared by the serving tasks of successive configurations.
#[derive(Clone)]
pub enum Socket {
    /// A Unix socket.
    Unix(Arc<UnixSocket>),
    /// A TCP socket.
    Tcp(Arc<TcpSocket>),
}

/// One frontend of a tenant, ready to serve: its socket and, for TCP, its TLS.
pub struct Frontend {
    socket: Socket,
    tls: Option<TlsAcceptor>,
    protocol: FrontendProtocol,
}

impl Frontend {
    /// The TCP address, for TCP frontends.
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        match &self.socket {
            Socket::Tcp(tcp) => tcp.listener.local_addr().ok(),
            Socket::Unix(_) => None,
        }
    }
}

/// Binds the frontends of `config`, reusing `existing` sockets whose address or path is the same.
/// Certificates loaded here are registered in `certs` so a reload re-reads them.
pub async fn bind(
    config: &TenantConfig,
    certs: &CertRegistry,
    existing: &[Socket],
) -> Result<Vec<Frontend>, SetupError> {
    let key = |field: &str| format!("tenants[{}].frontend.{field}", config.name);
    let protocol = config.frontend.protocol;
    let mut frontends = Vec::new();
    if let Some(path) = &config.frontend.uds {
        let reused = existing.iter().find_map(|s| match s {
            Socket::Unix(unix) if unix.path == *path => Some(unix.clone()),
            _ => None,
        });
        let socket = match reused {
            Some(socket) => socket,
            None => {
                let listener =
                    crate::server::bind_unix(path).map_err(|e| SetupError::listen(key("uds"), path.display(), e))?;
                Arc::new(UnixSocket { listener, path: path.clone() })
            }
        };
        if let Some(bits) = config.frontend.uds_permissions() {
            use std::os::unix::fs::PermissionsExt;
            let bits = bits.map_err(|e| SetupError::invalid(key("uds_mode"), e))?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(bits))
                .map_err(|e| SetupError::file(key("uds_mode"), e))?;
        }
        frontends.push(Frontend { socket: Socket::Unix(socket), tls: None, protocol });
    }
    if let Some(tcp) = &config.frontend.tcp {
        let reused = existing.iter().find_map(|s| match s {
            Socket::Tcp(socket) if socket.configured == tcp.listen => Some(socket.clone()),
            _ => None,
        });
        let socket = match reused {
            Some(socket) => socket,
            None => {
                let listener = crate::server::bind_tcp(tcp.listen)
                    .await
                    .map_err(|e| SetupError::listen(key("tcp.listen"), tcp.listen, e))?;
                Arc::new(TcpSocket { listener, configured: tcp.listen })
            }
        };
        let protocol = tcp.protocol.unwrap_or(protocol);
        let tls = match &tcp.tls {
            Some(files) => {
                let cert = ReloadableCert::load(&files.cert_file, &files.key_file)
                    .map_err(|e| SetupError::tls(key("tcp.tls"), e))?;
                certs.register(&cert);
                // gRPC clients require HTTP/2 negotiated by ALPN; CONNECT clients need none.
                let alpn: &[&[u8]] = match protocol {
                    FrontendProtocol::Grpc => &[b"h2"],
                    FrontendProtocol::HttpConnect => &[],
                };
                let server = tls::server_config(cert, tcp.client_ca_file.as_deref(), alpn)
                    .map_err(|e| SetupError::tls(key("tcp.client_ca_file"), e))?;
                Some(TlsAcceptor::from(Arc::new(server)))
            }
            None => None,
        };
        frontends.push(Frontend { socket: Socket::Tcp(socket), tls, protocol });
    }
    Ok(frontends)
}

/// The serving frontends of one tenant.
struct Serving {
    frontends: Vec<Frontend>,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Serving {
    /// Stops accepting and waits until every accept loop has ended (connections already
    /// accepted go on).
    async fn stop(self) -> Vec<Frontend> {
        self.stop.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
        self.frontends
    }
}

/// Every tenant's serving frontends.
#[derive(Default)]
pub struct FrontendSet {
    by_tenant: Mutex<HashMap<String, Serving>>,
}

impl FrontendSet {
    /// The sockets `tenant` serves on now (a new configuration may reuse them).
    pub fn sockets(&self, tenant: &str) -> Vec<Socket> {
        self.by_tenant
            .lock()
            .map(|map| {
                map.get(tenant).map(|s| s.frontends.iter().map(|f| f.socket.clone()).collect()).unwrap_or_default()
            })
            .unwrap_or_default()
    }

    /// The TCP address `tenant` serves CONNECT on, if it has one.
    pub fn tcp_addr(&self, tenant: &str) -> Option<SocketAddr> {
        let map = self.by_tenant.lock().ok()?;
        map.get(tenant)?.frontends.iter().find_map(Frontend::tcp_addr)
    }

    /// Serves `frontends` for `tenant`, after the tenant's previous frontends (if any) have
    /// stopped accepting; sockets the new ones do not reuse are closed.
    pub async fn replace(&self, tenant: &Arc<Tenant>, frontends: Vec<Frontend>, context: &Arc<FrontendContext>) {
        let previous = self.by_tenant.lock().ok().and_then(|mut map| map.remove(&*tenant.name));
        if let Some(previous) = previous {
            drop(previous.stop().await);
        }
        let stop = CancellationToken::new();
        let tasks = frontends.iter().map(|f| spawn(f, tenant, context, &stop)).collect();
        if let Ok(mut map) = self.by_tenant.lock() {
            map.insert(tenant.name.to_string(), Serving { frontends, stop, tasks });
        }
    }

    /// Stops serving `tenant` and closes its sockets.
    pub async fn remove(&self, tenant: &str) {
        let previous = self.by_tenant.lock().ok().and_then(|mut map| map.remove(tenant));
        if let Some(previous) = previous {
            drop(previous.stop().await);
        }
    }

    /// Stops every frontend (the drain) and closes the sockets; Unix socket files are removed.
    pub async fn stop_all(&self) {
        let all: Vec<Serving> =
            self.by_tenant.lock().map(|mut map| map.drain().map(|(_, s)| s).collect()).unwrap_or_default();
        for serving in all {
            drop(serving.stop().await);
        }
    }
}

fn spawn(
    frontend: &Frontend,
    tenant: &Arc<Tenant>,
    context: &Arc<FrontendContext>,
    stop: &CancellationToken,
) -> JoinHandle<()> {
    let (tenant, context, stop) = (tenant.clone(), context.clone(), stop.clone());
    match &frontend.socket {
        Socket::Unix(socket) => tokio::spawn(serve_uds(socket.clone(), frontend.protocol, tenant, context, stop)),
        Socket::Tcp(socket) => {
            tokio::spawn(serve_tcp(socket.clone(), frontend.tls.clone(), frontend.protocol, tenant, context, stop))
        }
    }
}

/// Serves a Unix socket until the gateway drains or `stop` is cancelled.
async fn serve_uds(
    socket: Arc<UnixSocket>,
    protocol: FrontendProtocol,
    tenant: Arc<Tenant>,
    context: Arc<FrontendContext>,
    stop: CancellationToken,
) {
    let lifecycle = context.lifecycle.clone();
    loop {
        let accepted = tokio::select! {
            accepted = socket.listener.accept() => accepted,
            () = lifecycle.drain_started().cancelled() => break,
            () = stop.cancelled() => break,
        };
        match accepted {
            Ok((stream, _)) => {
                let (tenant, context) = (tenant.clone(), context.clone());
                let client = Client { frontend: "unix", peer: String::new(), name: None };
                lifecycle.spawn_connection(serve_client(stream, protocol, tenant, context, client));
            }
            Err(e) => accept_failed(&tenant, &e).await,
        }
    }
}

/// Serves TCP, with TLS when `tls` is set, until the gateway drains or `stop` is cancelled.
async fn serve_tcp(
    socket: Arc<TcpSocket>,
    tls: Option<TlsAcceptor>,
    protocol: FrontendProtocol,
    tenant: Arc<Tenant>,
    context: Arc<FrontendContext>,
    stop: CancellationToken,
) {
    let lifecycle = context.lifecycle.clone();
    loop {
        let accepted = tokio::select! {
            accepted = socket.listener.accept() => accepted,
            () = lifecycle.drain_started().cancelled() => break,
            () = stop.cancelled() => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                accept_failed(&tenant, &e).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (tenant, context, tls) = (tenant.clone(), context.clone(), tls.clone());
        lifecycle.spawn_connection(async move {
            let peer = peer.to_string();
            // Each branch is boxed: a task lives as long as its tunnelled connection, and an
            // unboxed future would reserve room for the TLS handshake and every branch.
            match tls {
                None => {
                    let client = Client { frontend: "tcp", peer, name: None };
                    Box::pin(serve_client(stream, protocol, tenant, context, client)).await;
                }
                Some(acceptor) => {
                    let timeout = context.settings.handshake_timeout;
                    let accepted = Box::pin(tokio::time::timeout(timeout, acceptor.accept(stream))).await;
                    match accepted {
                        Ok(Ok(tls_stream)) => {
                            let name = client_cert_names(tls_stream.get_ref().1).into_iter().next();
                            let frontend = if tls_stream.get_ref().1.peer_certificates().is_some() {
                                "tcp+mtls"
                            } else {
                                "tcp+tls"
                            };
                            let client = Client { frontend, peer, name };
                            Box::pin(serve_client(tls_stream, protocol, tenant, context, client)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::info!(tenant = %tenant.name, %peer, error = %e, "frontend TLS handshake failed");
                        }
                        Err(_) => tracing::info!(tenant = %tenant.name, %peer, "frontend TLS handshake timed out"),
                    }
                }
            }
        });
    }
}

async fn accept_failed(tenant: &Tenant, e: &std::io::Error) {
    // Out of file descriptors and similar: back off instead of spinning.
    tracing::warn!(tenant = %tenant.name, error = %e, "frontend accept failed");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Who is on the other end of a frontend connection (for logs and the audit log).
pub struct Client {
    /// Which frontend: `unix`, `tcp`, `tcp+tls`, `tcp+mtls`, `shared`.
    pub frontend: &'static str,
    /// The client's address (empty on a Unix socket).
    pub peer: String,
    /// The first DNS name of its verified client certificate.
    pub name: Option<String>,
}

/// The DNS names of a TLS connection's verified client certificate.
pub fn client_cert_names(connection: &rustls::ServerConnection) -> Vec<String> {
    connection
        .peer_certificates()
        .and_then(|c| c.first())
        .and_then(|cert| webpki::EndEntityCert::try_from(cert).ok())
        .map(|cert| cert.valid_dns_names().map(str::to_ascii_lowercase).collect())
        .unwrap_or_default()
}

/// Serves one client connection in the frontend's protocol.
pub async fn serve_client<S>(
    stream: S,
    protocol: FrontendProtocol,
    tenant: Arc<Tenant>,
    context: Arc<FrontendContext>,
    who: Client,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    match protocol {
        FrontendProtocol::HttpConnect => serve_connection(stream, tenant, context, who).await,
        FrontendProtocol::Grpc => grpc::serve_connection(stream, tenant, context, who).await,
    }
}

/// One CONNECT exchange and, when it succeeds, the tunnelled connection; one audit line for it.
///
/// A connection carried by one of this replica's agent sessions is tunnelled on that session's
/// own task ([`tether_tunnel::mux::Session::spawn_local`]): its bytes then pass between the
/// client's socket and the agent's link without a hand-over between tasks (and worker threads).
pub async fn serve_connection<S>(mut client: S, tenant: Arc<Tenant>, context: Arc<FrontendContext>, who: Client)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let log = DialLog { tenant, context, who, started: Instant::now() };
    let (tenant, context, peer) = (&log.tenant, &log.context, log.who.peer.as_str());
    let request_timeout = context.settings.connect_request_timeout;
    let request = match Box::pin(tokio::time::timeout(request_timeout, read_request(&mut client))).await {
        Err(_) => {
            let _ = send_all(&mut client, &error_response(400, "timed out waiting for the CONNECT request")).await;
            return;
        }
        Ok(Err(e)) => {
            tracing::debug!(tenant = %tenant.name, %peer, error = %e, "bad CONNECT request");
            if let Some(status) = e.status() {
                let _ = send_all(&mut client, &error_response(status, &e.to_string())).await;
            }
            return;
        }
        Ok(Ok(request)) => request,
    };
    // A connection accepted before the drain began is still served (within the grace period):
    // with peers, its dial goes to another replica's agents.
    let target = match DialTarget::parse(&request.target) {
        Ok(target) => target,
        Err(reason) => {
            log.write(&printable(&request.target, 256), "bad_request", 400, None, (0, 0));
            let _ = send_all(&mut client, &error_response(400, &reason.to_string())).await;
            return;
        }
    };
    // Boxed so the connection's long-lived future does not keep room for the dial's states.
    let dialed = match Box::pin(context.dialer.dial(tenant, &target, "http-connect")).await {
        Ok(dialed) => dialed,
        Err(e) => {
            tracing::info!(tenant = %tenant.name, %peer, %target, status = e.status(), error = %e, "dial failed");
            log.write(&target.to_string(), e.label(), e.status(), None, (0, 0));
            let _ = send_all(&mut client, &error_response(e.status(), &e.to_string())).await;
            return;
        }
    };
    let session = match &dialed.stream {
        DialedStream::Local(stream) => Some(stream.session()),
        DialedStream::Peer(_) => None,
    };
    let lifecycle = context.lifecycle.clone();
    let tunnelled = tunnel(client, request.early_data, dialed, target, log);
    match session {
        Some(session) => session.spawn_local(lifecycle.track_connection(tunnelled)),
        None => tunnelled.await,
    }
}

/// The audit line of one CONNECT: who asked, where, and since when.
struct DialLog {
    tenant: Arc<Tenant>,
    context: Arc<FrontendContext>,
    who: Client,
    started: Instant,
}

impl DialLog {
    fn write(&self, target: &str, result: &str, status: u16, dialed: Option<&Dialed>, bytes: (u64, u64)) {
        let outcome = DialOutcome {
            target,
            result,
            status,
            agent: dialed.and_then(|d| d.agent.as_deref()),
            via_replica: dialed.and_then(|d| d.via_replica.as_deref()),
            bytes,
        };
        self.who.audit_dial(&self.tenant, &self.context, "http-connect", self.started, &outcome);
    }
}

/// How one dial went, for its audit line.
pub(crate) struct DialOutcome<'a> {
    pub target: &'a str,
    pub result: &'a str,
    pub status: u16,
    pub agent: Option<&'a str>,
    pub via_replica: Option<&'a str>,
    /// Bytes to the node, bytes from the node.
    pub bytes: (u64, u64),
}

impl Client {
    /// Writes the audit line of one dial this client made through `protocol` (`http-connect` or
    /// `grpc`), started at `started`.
    pub(crate) fn audit_dial(
        &self,
        tenant: &Tenant,
        context: &FrontendContext,
        protocol: &'static str,
        started: Instant,
        outcome: &DialOutcome<'_>,
    ) {
        audit::dial(&audit::Dial {
            tenant: &tenant.name,
            frontend: self.frontend,
            protocol,
            peer: &self.peer,
            client_name: self.name.as_deref(),
            target: outcome.target,
            replica: &context.server_id,
            agent: outcome.agent,
            via_replica: outcome.via_replica,
            result: outcome.result,
            status: outcome.status,
            bytes_to_node: outcome.bytes.0,
            bytes_from_node: outcome.bytes.1,
            started,
        });
    }
}

/// The tunnelled connection after a successful dial, until either side closes or the drain's
/// grace period ends; then its audit line.
async fn tunnel<S>(mut client: S, early_data: bytes::Bytes, mut dialed: Dialed, target: DialTarget, log: DialLog)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (tenant, context, peer) = (&log.tenant, &log.context, log.who.peer.as_str());
    let (sent, received) = (audit::ByteCount::default(), audit::ByteCount::default());
    let tunnelled = async {
        if send_all(&mut client, ESTABLISHED).await.is_err() {
            return;
        }
        if !early_data.is_empty() && send_all(&mut dialed.stream, &early_data).await.is_err() {
            return;
        }
        let to_agent = metrics::counter!(BYTES, "tenant" => tenant.name.to_string(), "direction" => "to_agent");
        let from_agent = metrics::counter!(BYTES, "tenant" => tenant.name.to_string(), "direction" => "from_agent");
        to_agent.increment(early_data.len() as u64);
        sent.add(early_data.len());
        let count = |direction, n: usize| match direction {
            Direction::AToB => {
                to_agent.increment(n as u64);
                sent.add(n);
            }
            Direction::BToA => {
                from_agent.increment(n as u64);
                received.add(n);
            }
        };
        let copy = async {
            match &mut dialed.stream {
                DialedStream::Local(stream) => splice_mux(&mut client, stream, count).await,
                peer => splice(&mut client, peer, count).await,
            }
        };
        tokio::select! {
            result = copy => {
                if let Err(e) = result {
                    tracing::debug!(tenant = %tenant.name, %peer, %target, agent = %dialed.carrier, error = %e, "tunnelled connection ended with an error");
                }
            }
            () = context.lifecycle.hard_stop().cancelled() => {
                tracing::info!(tenant = %tenant.name, %peer, %target, "closing tunnelled connection: drain grace period over");
            }
        }
    };
    tunnelled.await;
    log.write(&target.to_string(), "ok", 200, Some(&dialed), (sent.get(), received.get()));
}
