//! The peer endpoint: other replicas (and only they: mutual TLS) fetch this replica's inventory
//! and send it dials for agents it holds. A forwarded dial uses only the strategy the sender
//! names and never goes further: one hop at most.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tether_tunnel::splice::{splice, splice_mux};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::config::RoutingStrategy;
use crate::dial::{DialedStream, Dialer};
use crate::lifecycle::Lifecycle;
use crate::metrics::PEER_DIALS;
use crate::peers::client::{DIAL_ERROR_HEADER, REPLICA_HEADER, STRATEGY_HEADER, TENANT_HEADER};
use crate::peers::{Inventory, PeerSet};
use crate::router::Scope;
use crate::target::DialTarget;
use crate::tenant::TenantSet;
use tether_tunnel::untrusted::printable;

type HttpResponse = Response<Full<Bytes>>;

/// What the peer endpoint serves from.
pub struct PeerEndpoint {
    /// The tenants in force.
    pub tenants: Arc<TenantSet>,
    /// Dials forwarded dials through this replica's agents.
    pub dialer: Dialer,
    /// This replica's peer set (its id, the inventory limit).
    pub peers: Arc<PeerSet>,
    /// Drain and stop.
    pub lifecycle: Arc<Lifecycle>,
    /// Time for a peer's TLS handshake and request head.
    pub handshake_timeout: Duration,
}

/// Serves peers until the gateway stops (it keeps serving through the drain, so peers can still
/// reach agents that have not moved yet).
pub async fn serve(listener: TcpListener, acceptor: TlsAcceptor, endpoint: Arc<PeerEndpoint>) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = endpoint.lifecycle.hard_stop().cancelled() => break,
        };
        let Ok((stream, peer)) = accepted else {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (acceptor, endpoint) = (acceptor.clone(), endpoint.clone());
        tokio::spawn(async move {
            let timeout = endpoint.handshake_timeout;
            let tls = match tokio::time::timeout(timeout, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::warn!(%peer, error = %e, "peer endpoint: TLS handshake failed (not a replica?)");
                    return;
                }
                Err(_) => return,
            };
            let service = service_fn(move |req| handle(req, endpoint.clone()));
            let _ = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(timeout)
                .serve_connection(TokioIo::new(tls), service)
                .with_upgrades()
                .await;
        });
    }
}

async fn handle(req: Request<Incoming>, endpoint: Arc<PeerEndpoint>) -> Result<HttpResponse, Infallible> {
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET, "/v1/peer/inventory") => {
            let requester = req.headers().get(REPLICA_HEADER).and_then(|v| v.to_str().ok());
            if let Some(requester) = requester
                && !endpoint.peers.knows(requester)
            {
                // A replica this one does not know yet (it is starting): learn of it now rather
                // than at the next refresh, so agents are told the right replica count.
                tracing::info!(replica = %printable(requester, 64), "a new replica asked for this inventory; refreshing peers");
                let peers = endpoint.peers.clone();
                tokio::spawn(async move { peers.refresh_if_older_than(std::time::Duration::ZERO).await });
            }
            let body = serde_json::to_vec(&local_inventory(&endpoint)).unwrap_or_default();
            let mut response = Response::new(Full::new(Bytes::from(body)));
            response
                .headers_mut()
                .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
            response
        }
        (&Method::CONNECT, _) => forwarded_dial(req, &endpoint).await,
        _ => text(StatusCode::NOT_FOUND, "not a peer endpoint path"),
    })
}

/// This replica's inventory, at most `peers.max_inventory_entries` identifier entries in all.
fn local_inventory(endpoint: &PeerEndpoint) -> Inventory {
    let mut budget = endpoint.peers.inventory_limit();
    let tenants = endpoint.tenants.load();
    let summaries: Vec<_> = tenants
        .iter()
        .map(|tenant| {
            let (summary, truncated) = tenant.registry.summary(&mut budget);
            (tenant.name.to_string(), summary, truncated)
        })
        .collect();
    Inventory::new(endpoint.peers.server_id().to_owned(), endpoint.lifecycle.is_draining(), summaries)
}

async fn forwarded_dial(req: Request<Incoming>, endpoint: &PeerEndpoint) -> HttpResponse {
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let Some(tenant) = header(TENANT_HEADER).and_then(|name| endpoint.tenants.load().by_name(&name)) else {
        return text(StatusCode::SERVICE_UNAVAILABLE, "this replica does not serve that cluster");
    };
    let strategy: Option<RoutingStrategy> =
        header(STRATEGY_HEADER).and_then(|s| serde_json::from_value(serde_json::Value::String(s)).ok());
    let Some(strategy) = strategy else {
        return text(StatusCode::BAD_REQUEST, "missing or unknown routing strategy");
    };
    let Some(target) = req.uri().authority().and_then(|a| DialTarget::parse(a.as_str()).ok()) else {
        return text(StatusCode::BAD_REQUEST, "CONNECT needs host:port");
    };
    let dialed = endpoint.dialer.dial_scoped(&tenant, &target, Scope::LocalOnly(strategy)).await;
    let label = match &dialed {
        Ok(_) => "ok",
        Err(e) => e.label(),
    };
    metrics::counter!(PEER_DIALS, "tenant" => tenant.name.to_string(), "result" => label).increment(1);
    let mut dialed = match dialed {
        Ok(dialed) => dialed,
        Err(e) => {
            let mut response =
                text(StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_GATEWAY), &e.to_string());
            response.headers_mut().insert(DIAL_ERROR_HEADER, http::HeaderValue::from_static(e.label()));
            return response;
        }
    };
    let hard_stop = endpoint.lifecycle.hard_stop().clone();
    endpoint.lifecycle.spawn_connection(async move {
        let Ok(upgraded) = hyper::upgrade::on(req).await else { return };
        let mut upgraded = TokioIo::new(upgraded);
        tokio::select! {
            _ = async {
                match &mut dialed.stream {
                    DialedStream::Local(stream) => splice_mux(&mut upgraded, stream, |_, _| {}).await,
                    peer => splice(&mut upgraded, peer, |_, _| {}).await,
                }
            } => {}
            () = hard_stop.cancelled() => {}
        }
    });
    Response::new(Full::new(Bytes::new()))
}

fn text(status: StatusCode, body: &str) -> HttpResponse {
    let mut response = Response::new(Full::new(Bytes::from(format!("{body}\n"))));
    *response.status_mut() = status;
    response
}
