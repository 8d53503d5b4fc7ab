//! Dialing a gateway: TCP, TLS (with SNI = the gateway host), then the WebSocket upgrade on
//! `GET /v1/tunnel` with the bearer token and the `tether.v1` subprotocol.

use std::sync::Arc;
use std::time::Duration;

use http::header::{AUTHORIZATION, HeaderValue, SEC_WEBSOCKET_PROTOCOL, USER_AGENT};
use http::{Request, Uri};
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_tungstenite::tungstenite;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use crate::protocol::SUBPROTOCOL;
use crate::proxy::{self, ProxyError, ProxySettings};
use crate::transport::Transport;
use crate::ws::{WsByteStream, WsSettings};

/// How to reach a gateway.
#[derive(Clone, Default)]
pub struct ClientSettings {
    /// `wss://host[:port]/v1/tunnel` (or `ws://` behind nothing but loopback, for tests).
    pub url: Uri,
    /// TLS client configuration; required for `wss://`.
    pub tls: Option<Arc<ClientConfig>>,
    /// Server name for SNI and certificate checks, when it differs from the URL's host.
    pub tls_server_name: Option<String>,
    /// Limit for the TCP connect.
    pub connect_timeout: Duration,
    /// Limit for TLS plus the WebSocket upgrade.
    pub handshake_timeout: Duration,
    /// WebSocket tuning and keepalive.
    pub ws: WsSettings,
    /// Sent as `User-Agent`.
    pub user_agent: String,
    /// An HTTP proxy to reach the gateway through (`CONNECT`).
    pub proxy: Option<ProxySettings>,
}

/// Why a gateway could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL is unusable.
    #[error("invalid gateway URL: {0}")]
    InvalidUrl(String),
    /// TCP connect failed.
    #[error("cannot connect to {addr}: {source}")]
    Tcp {
        /// `host:port` tried.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// A stage took too long.
    #[error("{stage} with {addr} timed out after {} ms", after.as_millis())]
    Timeout {
        /// What was going on.
        stage: &'static str,
        /// `host:port`.
        addr: String,
        /// The limit.
        after: Duration,
    },
    /// The TLS handshake failed (untrusted certificate, name mismatch...).
    #[error("TLS handshake with {addr} failed: {source}")]
    Tls {
        /// `host:port`.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// The corporate proxy did not open a tunnel (authentication, refusal, timeout).
    #[error(transparent)]
    Proxy(#[from] ProxyError),
    /// The gateway answered the upgrade with an HTTP error.
    #[error("gateway refused the tunnel with HTTP {status}: {reason}")]
    Rejected {
        /// HTTP status.
        status: u16,
        /// The gateway's short reason.
        reason: String,
    },
    /// The WebSocket handshake failed otherwise.
    #[error("WebSocket handshake with {addr} failed: {reason}")]
    Handshake {
        /// `host:port`.
        addr: String,
        /// Why.
        reason: String,
    },
}

impl ConnectError {
    /// Whether the gateway refused our credentials (retrying with the same token will not help).
    pub fn is_unauthorized(&self) -> bool {
        matches!(self, Self::Rejected { status: 401 | 403, .. })
    }
}

/// Dials the gateway and returns the tunnel as a byte stream.
pub async fn connect(
    settings: &ClientSettings,
    bearer_token: Option<&str>,
) -> Result<WsByteStream<Transport>, ConnectError> {
    let (host, port, tls) = target(&settings.url)?;
    let addr = format!("{host}:{port}");
    let bare_host = host.trim_start_matches('[').trim_end_matches(']');
    let tcp = match &settings.proxy {
        Some(proxy) => proxy::connect_through(proxy, bare_host, port, &settings.user_agent).await?,
        None => tokio::time::timeout(settings.connect_timeout, TcpStream::connect((bare_host, port)))
            .await
            .map_err(|_| ConnectError::Timeout {
                stage: "TCP connect",
                addr: addr.clone(),
                after: settings.connect_timeout,
            })?
            .map_err(|source| ConnectError::Tcp { addr: addr.clone(), source })?,
    };
    let _ = tcp.set_nodelay(true);
    let handshake = async {
        let transport = if tls {
            let config = settings
                .tls
                .clone()
                .ok_or_else(|| ConnectError::InvalidUrl("wss:// needs a TLS configuration (CA bundle)".into()))?;
            let name = settings.tls_server_name.clone().unwrap_or_else(|| host.clone());
            let server_name = ServerName::try_from(name.trim_start_matches('[').trim_end_matches(']').to_owned())
                .map_err(|e| ConnectError::InvalidUrl(format!("bad TLS server name {name:?}: {e}")))?;
            let stream = TlsConnector::from(config)
                .connect(server_name, tcp)
                .await
                .map_err(|source| ConnectError::Tls { addr: addr.clone(), source })?;
            Transport::ClientTls(Box::new(stream))
        } else {
            Transport::Plain(tcp)
        };
        upgrade(settings, transport, bearer_token, &addr).await
    };
    tokio::time::timeout(settings.handshake_timeout, handshake).await.map_err(|_| ConnectError::Timeout {
        stage: "TLS and WebSocket handshake",
        addr: addr.clone(),
        after: settings.handshake_timeout,
    })?
}

async fn upgrade(
    settings: &ClientSettings,
    transport: Transport,
    bearer_token: Option<&str>,
    addr: &str,
) -> Result<WsByteStream<Transport>, ConnectError> {
    let mut request = upgrade_request(settings, bearer_token)?;
    if let Some(name) = &settings.tls_server_name
        && let Ok(value) = HeaderValue::from_str(name)
    {
        request.headers_mut().insert(http::header::HOST, value);
    }
    let config = settings.ws.tungstenite_config();
    match tokio_tungstenite::client_async_with_config(request, transport, Some(config)).await {
        Ok((ws, response)) => {
            let agreed = response.headers().get(SEC_WEBSOCKET_PROTOCOL).and_then(|v| v.to_str().ok());
            if agreed != Some(SUBPROTOCOL) {
                return Err(ConnectError::Handshake {
                    addr: addr.to_owned(),
                    reason: format!("gateway did not agree to subprotocol {SUBPROTOCOL} (got {agreed:?})"),
                });
            }
            Ok(WsByteStream::new(ws, &settings.ws))
        }
        Err(tungstenite::Error::Http(response)) => {
            let status = response.status().as_u16();
            let body = response.body().as_deref().unwrap_or_default();
            let reason: String = String::from_utf8_lossy(body).trim().chars().take(300).collect();
            Err(ConnectError::Rejected { status, reason })
        }
        Err(e) => Err(ConnectError::Handshake { addr: addr.to_owned(), reason: e.to_string() }),
    }
}

fn upgrade_request(settings: &ClientSettings, bearer_token: Option<&str>) -> Result<Request<()>, ConnectError> {
    // tungstenite expects ws/wss; the scheme does not go on the wire.
    let mut parts = settings.url.clone().into_parts();
    let scheme = parts.scheme.as_ref().map(|s| s.as_str().to_owned()).unwrap_or_default();
    parts.scheme = Some(
        if scheme == "wss" || scheme == "https" { "wss" } else { "ws" }
            .parse()
            .map_err(|e: http::uri::InvalidUri| ConnectError::InvalidUrl(e.to_string()))?,
    );
    let uri = Uri::from_parts(parts).map_err(|e| ConnectError::InvalidUrl(e.to_string()))?;
    let mut request = uri.into_client_request().map_err(|e| ConnectError::InvalidUrl(e.to_string()))?;
    let headers = request.headers_mut();
    headers.insert(SEC_WEBSOCKET_PROTOCOL, HeaderValue::from_static(SUBPROTOCOL));
    if let Ok(agent) = HeaderValue::from_str(&settings.user_agent) {
        headers.insert(USER_AGENT, agent);
    }
    if let Some(token) = bearer_token {
        let mut value = HeaderValue::from_str(&format!("Bearer {}", token.trim()))
            .map_err(|_| ConnectError::InvalidUrl("the token contains characters not allowed in a header".into()))?;
        value.set_sensitive(true);
        headers.insert(AUTHORIZATION, value);
    }
    Ok(request)
}

/// Host, port and whether TLS is used, from a `wss://`, `ws://`, `https://` or `http://` URL.
pub fn target(url: &Uri) -> Result<(String, u16, bool), ConnectError> {
    let tls = match url.scheme_str() {
        Some("wss" | "https") => true,
        Some("ws" | "http") => false,
        other => {
            return Err(ConnectError::InvalidUrl(format!(
                "scheme {other:?} is not supported; use wss:// (or ws:// for plain-text tests)"
            )));
        }
    };
    let host = url.host().ok_or_else(|| ConnectError::InvalidUrl(format!("{url} has no host")))?;
    let port = url.port_u16().unwrap_or(if tls { 443 } else { 80 });
    Ok((host.to_owned(), port, tls))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_from_urls() {
        let t = |s: &str| target(&s.parse().unwrap()).map_err(|e| e.to_string());
        assert_eq!(t("wss://gw.example.com/v1/tunnel"), Ok(("gw.example.com".into(), 443, true)));
        assert_eq!(t("ws://127.0.0.1:8080/v1/tunnel"), Ok(("127.0.0.1".into(), 8080, false)));
        assert_eq!(t("wss://[::1]:9443/v1/tunnel"), Ok(("[::1]".into(), 9443, true)));
        assert!(t("ftp://x/").unwrap_err().contains("not supported"));
    }
}
