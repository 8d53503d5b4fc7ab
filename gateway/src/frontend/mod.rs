//! The frontends a tenant's kube-apiserver connects to: a Unix socket and/or a TCP port (plain,
//! TLS, or mutual TLS), each speaking HTTP CONNECT and each bound to exactly one tenant, so a
//! frontend can only ever reach its own tenant's agents.

pub mod connect;
pub mod shared;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tether_tunnel::tls::{self, ReloadableCert};
use tokio_util::sync::CancellationToken;

use tether_tunnel::splice::{Direction, splice};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio_rustls::TlsAcceptor;

use crate::dial::dial;
use crate::metrics::BYTES;
use crate::server::{CertRegistry, Shared};
use crate::target::DialTarget;
use crate::tenant::Tenant;
use connect::{ESTABLISHED, error_response, read_request};

/// A bound frontend listener of one tenant.
pub enum FrontendListener {
    /// A Unix socket and its path.
    Unix(UnixListener, PathBuf),
    /// A TCP listener, with TLS (and maybe client certificates) or plain.
    Tcp(TcpListener, Option<TlsAcceptor>),
}

impl FrontendListener {
    /// The TCP address, for TCP listeners.
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        match self {
            Self::Tcp(listener, _) => listener.local_addr().ok(),
            Self::Unix(..) => None,
        }
    }
}

/// Binds every frontend of a tenant's current configuration. Certificates loaded here are
/// registered in `certs` so a reload re-reads them.
pub async fn bind(tenant: &Tenant, certs: &CertRegistry) -> anyhow::Result<Vec<FrontendListener>> {
    let config = tenant.config();
    let key = |field: &str| format!("tenants[{}].frontend.{field}", tenant.name);
    let mut listeners = Vec::new();
    if let Some(path) = &config.frontend.uds {
        let listener = crate::server::bind_unix(path).with_context(|| key("uds"))?;
        if let Some(bits) = config.frontend.uds_permissions() {
            use std::os::unix::fs::PermissionsExt;
            let bits = bits.map_err(anyhow::Error::msg).with_context(|| key("uds_mode"))?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(bits)).with_context(|| key("uds_mode"))?;
        }
        listeners.push(FrontendListener::Unix(listener, path.clone()));
    }
    if let Some(tcp) = &config.frontend.tcp {
        let listener = crate::server::bind_tcp(tcp.listen).await.with_context(|| key("tcp.listen"))?;
        let acceptor = match &tcp.tls {
            Some(files) => {
                let cert = ReloadableCert::load(&files.cert_file, &files.key_file).with_context(|| key("tcp.tls"))?;
                certs.register(&cert);
                let server = tls::server_config(cert, tcp.client_ca_file.as_deref(), &[])
                    .with_context(|| key("tcp.client_ca_file"))?;
                Some(TlsAcceptor::from(Arc::new(server)))
            }
            None => None,
        };
        listeners.push(FrontendListener::Tcp(listener, acceptor));
    }
    Ok(listeners)
}

/// Serves bound listeners until the gateway drains or `stop` is cancelled; Unix socket files are
/// removed when their listener stops.
pub fn spawn(
    listeners: Vec<FrontendListener>,
    tenant: &Arc<Tenant>,
    shared: &Arc<Shared>,
    stop: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    listeners
        .into_iter()
        .map(|listener| {
            let (tenant, shared, stop) = (tenant.clone(), shared.clone(), stop.clone());
            tokio::spawn(async move {
                match listener {
                    FrontendListener::Unix(l, path) => {
                        serve_uds(l, tenant, shared, stop).await;
                        let _ = std::fs::remove_file(&path);
                    }
                    FrontendListener::Tcp(l, tls) => serve_tcp(l, tls, tenant, shared, stop).await,
                }
            })
        })
        .collect()
}

/// Serves CONNECT requests on a Unix socket until the gateway drains or `stop` is cancelled.
pub async fn serve_uds(listener: UnixListener, tenant: Arc<Tenant>, shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shared.drain_started.cancelled() => break,
            () = stop.cancelled() => break,
        };
        match accepted {
            Ok((stream, _)) => {
                let (tenant, shared2) = (tenant.clone(), shared.clone());
                shared.conn_tasks.spawn(async move { serve_connection(stream, tenant, shared2, "unix socket").await });
            }
            Err(e) => accept_failed(&tenant, &e).await,
        }
    }
}

/// Serves CONNECT requests on TCP, with TLS when `tls` is set, until the gateway drains or
/// `stop` is cancelled.
pub async fn serve_tcp(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    tenant: Arc<Tenant>,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shared.drain_started.cancelled() => break,
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
        let (tenant, shared2, tls) = (tenant.clone(), shared.clone(), tls.clone());
        shared.conn_tasks.spawn(async move {
            let peer = peer.to_string();
            // Each branch is boxed: a task lives as long as its tunnelled connection, and an
            // unboxed future would reserve room for the TLS handshake and every branch.
            match tls {
                None => Box::pin(serve_connection(stream, tenant, shared2, &peer)).await,
                Some(acceptor) => {
                    let timeout = shared2.config.limits.handshake_timeout.0;
                    let accepted = Box::pin(tokio::time::timeout(timeout, acceptor.accept(stream))).await;
                    match accepted {
                        Ok(Ok(tls_stream)) => Box::pin(serve_connection(tls_stream, tenant, shared2, &peer)).await,
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

/// One CONNECT exchange and, when it succeeds, the tunnelled connection.
pub async fn serve_connection<S>(mut client: S, tenant: Arc<Tenant>, shared: Arc<Shared>, peer: &str)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let request_timeout = shared.config.limits.connect_request_timeout.0;
    let request = match Box::pin(tokio::time::timeout(request_timeout, read_request(&mut client))).await {
        Err(_) => {
            let _ = client.write_all(&error_response(400, "timed out waiting for the CONNECT request")).await;
            return;
        }
        Ok(Err(e)) => {
            tracing::debug!(tenant = %tenant.name, %peer, error = %e, "bad CONNECT request");
            if let Some(status) = e.status() {
                let _ = client.write_all(&error_response(status, &e.to_string())).await;
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
            let _ = client.write_all(&error_response(400, &reason)).await;
            return;
        }
    };
    // Boxed so the connection's long-lived future does not keep room for the dial's states.
    let mut dialed = match Box::pin(dial(&shared, &tenant, &target)).await {
        Ok(dialed) => dialed,
        Err(e) => {
            tracing::info!(tenant = %tenant.name, %peer, %target, status = e.status(), error = %e, "dial failed");
            let _ = client.write_all(&error_response(e.status(), &e.to_string())).await;
            return;
        }
    };
    if client.write_all(ESTABLISHED).await.is_err() {
        return;
    }
    if !request.early_data.is_empty() && dialed.stream.write_all(&request.early_data).await.is_err() {
        return;
    }
    let to_agent = metrics::counter!(BYTES, "tenant" => tenant.name.to_string(), "direction" => "to_agent");
    let from_agent = metrics::counter!(BYTES, "tenant" => tenant.name.to_string(), "direction" => "from_agent");
    to_agent.increment(request.early_data.len() as u64);
    let copy = splice(&mut client, &mut dialed.stream, |direction, n| match direction {
        Direction::AToB => to_agent.increment(n as u64),
        Direction::BToA => from_agent.increment(n as u64),
    });
    tokio::select! {
        result = copy => {
            if let Err(e) = result {
                tracing::debug!(tenant = %tenant.name, %peer, %target, agent = %dialed.carrier, error = %e, "tunnelled connection ended with an error");
            }
        }
        () = shared.hard_stop.cancelled() => {
            tracing::info!(tenant = %tenant.name, %peer, %target, "closing tunnelled connection: drain grace period over");
        }
    }
}
