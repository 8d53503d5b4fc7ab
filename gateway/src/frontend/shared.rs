//! The shared frontend: one TCP port for several tenants, mutual TLS required. The tenant is taken
//! from the client certificate (its DNS names, mapped by `frontend.client_names`), never from SNI,
//! which the client chooses freely; the tenant's `frontend.protocol` says whether its
//! kube-apiserver speaks HTTP CONNECT or gRPC. The port offers both `http/1.1` and `h2` by ALPN, in
//! that order, so a client offering both gets HTTP/1.1 and a gRPC client (offering only `h2`)
//! gets HTTP/2.

use std::sync::Arc;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::connect::error_response;
use super::{Client, FrontendContext, client_cert_names, serve_client};
use crate::tenant::{Tenant, TenantSet};

/// Serves the shared frontend until the gateway drains.
pub async fn serve(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    tenants: Arc<TenantSet>,
    context: Arc<FrontendContext>,
) {
    let lifecycle = context.lifecycle.clone();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = lifecycle.drain_started().cancelled() => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "shared frontend accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (acceptor, tenants, context) = (acceptor.clone(), tenants.clone(), context.clone());
        lifecycle.spawn_connection(async move {
            let timeout = context.settings.handshake_timeout;
            let mut tls = match tokio::time::timeout(timeout, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::info!(%peer, error = %e, "shared frontend TLS handshake failed");
                    return;
                }
                Err(_) => return,
            };
            let names = client_cert_names(tls.get_ref().1);
            match tenant_for(&tenants, &names) {
                Ok(tenant) => {
                    let client = Client { frontend: "shared", peer: peer.to_string(), name: names.first().cloned() };
                    let protocol = tenant.config().frontend.protocol;
                    serve_client(tls, protocol, tenant, context, client).await;
                }
                Err(reason) => {
                    tracing::warn!(%peer, names = ?names, %reason, "shared frontend client refused");
                    let _ = tls.write_all(&error_response(403, &reason.to_string())).await;
                    let _ = tls.shutdown().await;
                }
            }
        });
    }
}

/// Why a client certificate maps to no tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
enum ClientNameError {
    #[error("the client certificate names more than one cluster")]
    SeveralClusters,
    #[error("the client certificate is not mapped to any cluster on this frontend")]
    NoCluster,
}

/// Exactly one tenant must claim the certificate's names.
fn tenant_for(tenants: &TenantSet, names: &[String]) -> Result<Arc<Tenant>, ClientNameError> {
    let tenants = tenants.load();
    let mut found: Option<Arc<Tenant>> = None;
    for name in names {
        if let Some(tenant) = tenants.for_client_name(name) {
            match &found {
                Some(other) if !Arc::ptr_eq(other, &tenant) => {
                    return Err(ClientNameError::SeveralClusters);
                }
                _ => found = Some(tenant),
            }
        }
    }
    found.ok_or(ClientNameError::NoCluster)
}
