//! The peer endpoint: other replicas (and only they: mutual TLS) fetch this replica's inventory
//! and send it dials for agents it holds. A forwarded dial uses only the strategy the sender
//! names and never goes further: one hop at most.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tether_tunnel::splice::splice;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::Inventory;
use super::client::{DIAL_ERROR_HEADER, STRATEGY_HEADER, TENANT_HEADER};
use crate::config::RoutingStrategy;
use crate::dial::dial_local;
use crate::metrics::PEER_DIALS;
use crate::server::Shared;
use crate::target::DialTarget;

type HttpResponse = Response<Full<Bytes>>;

/// Serves peers until the gateway stops (it keeps serving through the drain, so peers can still
/// reach agents that have not moved yet).
pub async fn serve(listener: TcpListener, acceptor: TlsAcceptor, shared: Arc<Shared>) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shared.hard_stop.cancelled() => break,
        };
        let Ok((stream, peer)) = accepted else {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (acceptor, shared) = (acceptor.clone(), shared.clone());
        tokio::spawn(async move {
            let timeout = shared.config.limits.handshake_timeout.0;
            let tls = match tokio::time::timeout(timeout, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::warn!(%peer, error = %e, "peer endpoint: TLS handshake failed (not a replica?)");
                    return;
                }
                Err(_) => return,
            };
            let service = service_fn(move |req| handle(req, shared.clone()));
            let _ = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(timeout)
                .serve_connection(TokioIo::new(tls), service)
                .with_upgrades()
                .await;
        });
    }
}

async fn handle(req: Request<Incoming>, shared: Arc<Shared>) -> Result<HttpResponse, Infallible> {
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET, "/v1/peer/inventory") => {
            let limit = shared.config.peers.as_ref().map(|p| p.max_inventory_entries).unwrap_or(100_000);
            let body = serde_json::to_vec(&Inventory::local(&shared, limit)).unwrap_or_default();
            let mut response = Response::new(Full::new(Bytes::from(body)));
            response
                .headers_mut()
                .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
            response
        }
        (&Method::CONNECT, _) => forwarded_dial(req, shared).await,
        _ => text(StatusCode::NOT_FOUND, "not a peer endpoint path"),
    })
}

async fn forwarded_dial(req: Request<Incoming>, shared: Arc<Shared>) -> HttpResponse {
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let Some(tenant) = header(TENANT_HEADER).and_then(|name| shared.tenants.load().by_name(&name)) else {
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
    let dialed = dial_local(&tenant, &target, &[strategy]).await;
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
    let hard_stop = shared.hard_stop.clone();
    shared.conn_tasks.spawn(async move {
        let Ok(upgraded) = hyper::upgrade::on(req).await else { return };
        let mut upgraded = TokioIo::new(upgraded);
        tokio::select! {
            _ = splice(&mut upgraded, &mut dialed.stream, |_, _| {}) => {}
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
