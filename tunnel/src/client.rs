//! Dialing a gateway: TCP, TLS (with SNI = the gateway host), then the WebSocket upgrade on
//! `GET /v1/tunnel` with the bearer token and the `tether.v1` subprotocol.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use http::header::{
    AUTHORIZATION, HeaderValue, SEC_WEBSOCKET_ACCEPT, SEC_WEBSOCKET_KEY, SEC_WEBSOCKET_PROTOCOL, USER_AGENT,
};
use http::{Request, Uri};
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;

use crate::protocol::{ADDITIONAL_SESSION, SESSION_HEADER, SUBPROTOCOL};
use crate::proxy::{self, ProxyError, ProxySettings};
use crate::transport::Transport;
use crate::ws::WsSettings;
use crate::ws_link::{WsLink, WsRole};

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
        /// Its `Retry-After` (seconds), if it sent one.
        retry_after: Option<Duration>,
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

    /// How long the gateway asked us to wait before trying again (`Retry-After`, capped at
    /// [`MAX_RETRY_AFTER`]).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Rejected { retry_after, .. } => retry_after.map(|d| d.min(MAX_RETRY_AFTER)),
            _ => None,
        }
    }
}

/// The longest `Retry-After` honoured: a misconfigured or hostile answer cannot park an agent
/// for days.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);

/// Dials the gateway and returns the tunnel's WebSocket link.
pub async fn connect(settings: &ClientSettings, bearer_token: Option<&str>) -> Result<WsLink<Transport>, ConnectError> {
    connect_session(settings, bearer_token, false).await
}

/// Like [`connect`]; `additional` says that the agent holds a session already (the
/// `Tether-Session: additional` header), so that the gateway lets its sessions share one agent
/// slot under the tenant's limit.
pub async fn connect_session(
    settings: &ClientSettings,
    bearer_token: Option<&str>,
    additional: bool,
) -> Result<WsLink<Transport>, ConnectError> {
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
        upgrade(settings, transport, bearer_token, additional, &addr).await
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
    additional: bool,
    addr: &str,
) -> Result<WsLink<Transport>, ConnectError> {
    let mut request = upgrade_request(settings, bearer_token)?;
    if additional {
        request.headers_mut().insert(SESSION_HEADER, HeaderValue::from_static(ADDITIONAL_SESSION));
    }
    if let Some(name) = &settings.tls_server_name
        && let Ok(value) = HeaderValue::from_str(name)
    {
        request.headers_mut().insert(http::header::HOST, value);
    }
    upgrade_over(transport, &request, &settings.ws).await.map_err(|e| match e {
        UpgradeError::Rejected { status, reason, retry_after } => {
            ConnectError::Rejected { status, reason, retry_after }
        }
        other => ConnectError::Handshake { addr: addr.to_owned(), reason: other.to_string() },
    })
}

/// Why a WebSocket upgrade did not complete.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    /// The server answered with an HTTP error.
    #[error("refused with HTTP {status}: {reason}")]
    Rejected {
        /// HTTP status.
        status: u16,
        /// The body (the gateway's short reason).
        reason: String,
        /// `Retry-After` in seconds (the HTTP-date form is not used by the gateway and ignored).
        retry_after: Option<Duration>,
    },
    /// The answer was not a valid upgrade to `tether.v1`.
    #[error("{0}")]
    Invalid(String),
    /// The connection failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Largest upgrade response head accepted.
const MAX_RESPONSE_HEAD: usize = 16 * 1024;

/// Sends the upgrade `request` over `io` and checks the answer (101, the accept key, our
/// subprotocol); returns the data path, with any bytes the server sent after the head kept.
pub async fn upgrade_over<S>(mut io: S, request: &Request<()>, ws: &WsSettings) -> Result<WsLink<S>, UpgradeError>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let key = request
        .headers()
        .get(SEC_WEBSOCKET_KEY)
        .and_then(|k| k.to_str().ok())
        .ok_or_else(|| UpgradeError::Invalid("the request has no Sec-WebSocket-Key".into()))?
        .to_owned();
    let path = request.uri().path_and_query().map_or("/", |p| p.as_str());
    let mut head = format!("GET {path} HTTP/1.1\r\n");
    for (name, value) in request.headers() {
        head.push_str(name.as_str());
        head.push_str(": ");
        head.push_str(&String::from_utf8_lossy(value.as_bytes()));
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    io.write_all(head.as_bytes()).await?;
    io.flush().await?;

    let mut buf = BytesMut::with_capacity(1024);
    let head_len = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        if buf.len() > MAX_RESPONSE_HEAD {
            return Err(UpgradeError::Invalid("the upgrade response head is too large".into()));
        }
        if io.read_buf(&mut buf).await? == 0 {
            return Err(UpgradeError::Invalid("the server closed the connection before answering".into()));
        }
    };
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut response = httparse::Response::new(&mut headers);
    response.parse(&buf[..head_len]).map_err(|e| UpgradeError::Invalid(format!("bad upgrade response: {e}")))?;
    let status = response.code.unwrap_or(0);
    let header = |name: &http::header::HeaderName| {
        response
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name.as_str()))
            .map(|h| String::from_utf8_lossy(h.value).trim().to_owned())
    };
    if status != 101 {
        let length: usize = header(&http::header::CONTENT_LENGTH).and_then(|l| l.parse().ok()).unwrap_or(0).min(4096);
        let retry_after =
            header(&http::header::RETRY_AFTER).and_then(|v| v.parse::<u64>().ok()).map(Duration::from_secs);
        let mut body = buf.split_off(head_len);
        let rest = async {
            while body.len() < length {
                if io.read_buf(&mut body).await.unwrap_or(0) == 0 {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(2), rest).await;
        body.truncate(length);
        let reason: String = String::from_utf8_lossy(&body).trim().chars().take(300).collect();
        return Err(UpgradeError::Rejected { status, reason, retry_after });
    }
    if header(&SEC_WEBSOCKET_ACCEPT).as_deref() != Some(derive_accept_key(key.as_bytes()).as_str()) {
        return Err(UpgradeError::Invalid("the server's Sec-WebSocket-Accept does not match our key".into()));
    }
    let agreed = header(&SEC_WEBSOCKET_PROTOCOL);
    if agreed.as_deref() != Some(SUBPROTOCOL) {
        return Err(UpgradeError::Invalid(format!(
            "gateway did not agree to subprotocol {SUBPROTOCOL} (got {agreed:?})"
        )));
    }
    let read_ahead = buf.split_off(head_len);
    Ok(WsLink::new(io, WsRole::Client, ws.link_settings(), read_ahead))
}

/// The upgrade request for `settings`' URL, with our subprotocol, user agent and token.
pub fn upgrade_request(settings: &ClientSettings, bearer_token: Option<&str>) -> Result<Request<()>, ConnectError> {
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
