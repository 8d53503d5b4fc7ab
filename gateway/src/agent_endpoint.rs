//! The agent endpoint: `GET /v1/tunnel`. Everything is checked before the WebSocket upgrade
//! (tenant from Host/SNI, draining, upgrade headers, subprotocol, token, limits), so a refused
//! agent gets a plain HTTP error with a short reason and never a 101.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use tether_tunnel::untrusted::printable;

use bytes::{Bytes, BytesMut};
use http::header::{
    AUTHORIZATION, CONNECTION, HOST, RETRY_AFTER, SEC_WEBSOCKET_ACCEPT, SEC_WEBSOCKET_KEY, SEC_WEBSOCKET_PROTOCOL,
    SEC_WEBSOCKET_VERSION, UPGRADE, WWW_AUTHENTICATE,
};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tether_tunnel::protocol::{ADDITIONAL_SESSION, SESSION_HEADER, SUBPROTOCOL, TUNNEL_PATH};
use tether_tunnel::session_threads::ThreadLoad;
use tether_tunnel::ws_link::{WsLink, WsRole};
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;

use crate::agent_session::{self, SessionSlots, Sessions};
use crate::auth::token::AuthError;
use crate::config::ListenConfig;
use crate::metrics::AGENT_CONNECTS;
use crate::tenant::{Tenant, TenantSet};

/// What the agent endpoint serves from.
pub struct AgentEndpoint {
    /// The tenants in force (the tenant comes from SNI / Host).
    pub tenants: Arc<TenantSet>,
    /// Agent sessions: settings, limits, drain.
    pub sessions: Arc<Sessions>,
    /// Trusted proxies (for `X-Forwarded-For`).
    pub listen: ListenConfig,
}

/// What the gateway knows about the connection a request arrived on.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    /// The client's address.
    pub peer: SocketAddr,
    /// The TLS server name the client asked for, when the gateway terminated TLS.
    pub sni: Option<String>,
    /// The connection's place in its session thread's count, held by the session it becomes.
    pub load: Option<ThreadLoad>,
}

type HttpResponse = Response<Full<Bytes>>;

/// Routes a request on the agent port.
pub async fn handle(
    req: Request<Incoming>,
    conn: ConnInfo,
    endpoint: Arc<AgentEndpoint>,
) -> Result<HttpResponse, Infallible> {
    Ok(match req.uri().path() {
        TUNNEL_PATH => tunnel(req, &conn, &endpoint).await,
        "/healthz" => text(StatusCode::OK, "ok"),
        _ => text(StatusCode::NOT_FOUND, "not found; agents connect to /v1/tunnel"),
    })
}

async fn tunnel(req: Request<Incoming>, conn: &ConnInfo, endpoint: &AgentEndpoint) -> HttpResponse {
    if req.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "the tunnel endpoint takes GET with a WebSocket upgrade");
    }
    let tenant = match tenant_of(req.headers(), conn, &endpoint.tenants) {
        Ok(tenant) => tenant,
        Err(response) => return *response,
    };
    let sessions = &endpoint.sessions;
    if sessions.lifecycle.is_draining() {
        return retry_later("gateway is shutting down; connect to another replica", 1);
    }
    let key = match check_upgrade(req.headers()) {
        Ok(key) => key,
        Err(response) => return *response,
    };
    let verified = match bearer_token(req.headers()) {
        Ok(token) => tenant.verifier().verify(token).await,
        Err(e) => Err(e),
    };
    let identity = match verified {
        Ok(identity) => identity,
        Err(e) if e.status() == 503 => {
            metrics::counter!(AGENT_CONNECTS, "tenant" => tenant.name.to_string(), "result" => e.label()).increment(1);
            tracing::warn!(tenant = %tenant.name, peer = %conn.peer, reason = %e, "agent refused: cannot check its token now");
            return retry_later("cannot check the token right now; retry shortly", 5);
        }
        Err(e) => {
            metrics::counter!(AGENT_CONNECTS, "tenant" => tenant.name.to_string(), "result" => e.label()).increment(1);
            tracing::info!(tenant = %tenant.name, peer = %conn.peer, reason = %e, "agent refused: bad token");
            let mut response = text(StatusCode::UNAUTHORIZED, &format!("unauthorized: {e}"));
            response.headers_mut().insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer error=\"invalid_token\""));
            return response;
        }
    };
    // A session beyond the agent's first shares its agent's slot, checked at the Hello.
    let additional = req.headers().get(SESSION_HEADER).is_some_and(|v| v.as_bytes() == ADDITIONAL_SESSION.as_bytes());
    let slots = match SessionSlots::reserve(sessions, &tenant, additional) {
        Ok(slots) => slots,
        Err(reason) => {
            metrics::counter!(AGENT_CONNECTS, "tenant" => tenant.name.to_string(), "result" => "limit").increment(1);
            tracing::warn!(tenant = %tenant.name, peer = %conn.peer, reason, "agent refused: limit reached");
            return retry_later(reason, 5);
        }
    };

    let peer = client_address(req.headers(), conn.peer, &endpoint.listen);
    let for_task = sessions.clone();
    let load = conn.load.clone();
    sessions.lifecycle.spawn_session(async move {
        // The session counts on its thread for as long as it runs, not only while its HTTP
        // connection did.
        let _load = load;
        let upgraded = match Box::pin(hyper::upgrade::on(req)).await {
            Ok(upgraded) => upgraded,
            Err(e) => {
                tracing::info!(tenant = %tenant.name, %peer, error = %e, "WebSocket upgrade did not complete");
                return;
            }
        };
        let sessions = for_task;
        // hyper keeps any bytes it read past the request inside `upgraded`.
        let link =
            WsLink::new(TokioIo::new(upgraded), WsRole::Server, sessions.settings.ws.link_settings(), BytesMut::new());
        agent_session::run(sessions, tenant, identity, link, peer, slots).await;
    });

    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let headers = response.headers_mut();
    headers.insert(UPGRADE, HeaderValue::from_static("websocket"));
    headers.insert(CONNECTION, HeaderValue::from_static("Upgrade"));
    headers.insert(SEC_WEBSOCKET_PROTOCOL, HeaderValue::from_static(SUBPROTOCOL));
    if let Ok(accept) = HeaderValue::from_str(&derive_accept_key(key.as_bytes())) {
        headers.insert(SEC_WEBSOCKET_ACCEPT, accept);
    }
    response
}

/// The tenant named by SNI and/or Host; when both are present they must agree.
fn tenant_of(headers: &HeaderMap, conn: &ConnInfo, tenants: &TenantSet) -> Result<Arc<Tenant>, Box<HttpResponse>> {
    let host = headers.get(HOST).and_then(|h| h.to_str().ok());
    let tenants = tenants.load();
    let by_host = host.map(|h| (h, tenants.for_host(h)));
    let by_sni = conn.sni.as_deref().map(|s| (s, tenants.for_host(s)));
    match (by_sni, by_host) {
        (Some((sni, Some(a))), Some((host, Some(b)))) => {
            if Arc::ptr_eq(&a, &b) {
                Ok(a)
            } else {
                Err(Box::new(text(
                    StatusCode::MISDIRECTED_REQUEST,
                    &format!("TLS server name {sni} and Host {host} belong to different clusters"),
                )))
            }
        }
        (Some((_, Some(tenant))), None) | (None, Some((_, Some(tenant)))) => Ok(tenant),
        (Some((sni, Some(_))), Some((host, None))) => Err(Box::new(text(
            StatusCode::MISDIRECTED_REQUEST,
            &format!("Host {} does not match TLS server name {sni}", printable(host, 128)),
        ))),
        (Some((sni, None)), _) => {
            Err(Box::new(text(StatusCode::NOT_FOUND, &format!("no cluster is served at {}", printable(sni, 128)))))
        }
        (None, Some((host, None))) => {
            Err(Box::new(text(StatusCode::NOT_FOUND, &format!("no cluster is served at {}", printable(host, 128)))))
        }
        (None, None) => Err(Box::new(text(StatusCode::BAD_REQUEST, "missing Host header"))),
    }
}

/// Checks the WebSocket upgrade headers and our subprotocol; returns the client's key.
fn check_upgrade(headers: &HeaderMap) -> Result<String, Box<HttpResponse>> {
    let has_token = |name, token: &str| {
        headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    };
    if !has_token(UPGRADE, "websocket") || !has_token(CONNECTION, "upgrade") {
        let mut response = text(StatusCode::UPGRADE_REQUIRED, "the tunnel endpoint needs a WebSocket upgrade");
        response.headers_mut().insert(UPGRADE, HeaderValue::from_static("websocket"));
        return Err(Box::new(response));
    }
    if headers.get(SEC_WEBSOCKET_VERSION).and_then(|v| v.to_str().ok()) != Some("13") {
        let mut response = text(StatusCode::UPGRADE_REQUIRED, "WebSocket version 13 is required");
        response.headers_mut().insert(SEC_WEBSOCKET_VERSION, HeaderValue::from_static("13"));
        return Err(Box::new(response));
    }
    if !has_token(SEC_WEBSOCKET_PROTOCOL, SUBPROTOCOL) {
        return Err(Box::new(text(
            StatusCode::BAD_REQUEST,
            &format!("unsupported tunnel protocol: this gateway speaks {SUBPROTOCOL}; upgrade or downgrade the agent"),
        )));
    }
    headers
        .get(SEC_WEBSOCKET_KEY)
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty() && k.len() < 64)
        .map(str::to_owned)
        .ok_or_else(|| Box::new(text(StatusCode::BAD_REQUEST, "missing Sec-WebSocket-Key")))
}

/// The agent's address: the TCP peer, or, when the peer is a trusted ingress, the nearest
/// untrusted address in `X-Forwarded-For` (walking from the right, as each proxy appends).
fn client_address(headers: &HeaderMap, peer: SocketAddr, listen: &ListenConfig) -> SocketAddr {
    if !listen.is_trusted_proxy(peer.ip()) {
        return peer;
    }
    let forwarded: Vec<std::net::IpAddr> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    forwarded
        .iter()
        .rev()
        .find(|ip| !listen.is_trusted_proxy(**ip))
        .or(forwarded.first())
        .map(|ip| SocketAddr::new(*ip, 0))
        .unwrap_or(peer)
}

fn bearer_token(headers: &HeaderMap) -> Result<&str, AuthError> {
    let value = headers.get(AUTHORIZATION).ok_or(AuthError::Missing)?;
    let value = value.to_str().map_err(|_| AuthError::Malformed)?;
    let (scheme, token) = value.split_once(' ').ok_or(AuthError::Malformed)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(AuthError::Missing);
    }
    Ok(token.trim())
}

/// 503 with `Retry-After: seconds` (agents wait at least that long, plus jitter).
fn retry_later(reason: &str, seconds: u32) -> HttpResponse {
    let mut response = text(StatusCode::SERVICE_UNAVAILABLE, reason);
    response.headers_mut().insert(RETRY_AFTER, HeaderValue::from(seconds));
    response
}

fn text(status: StatusCode, body: &str) -> HttpResponse {
    let mut response = Response::new(Full::new(Bytes::from(format!("{body}\n"))));
    *response.status_mut() = status;
    response.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    response
}
