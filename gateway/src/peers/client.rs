//! Calling other replicas over mutual TLS: fetching inventories and forwarding dials.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tether_tunnel::protocol::ErrorCode;
use tether_tunnel::tls::{self, ClientRoots};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use super::Inventory;
use crate::config::{PeerTls, RoutingStrategy};
use crate::dial::DialError;
use crate::target::DialTarget;

/// Header naming the tenant of a forwarded dial.
pub const TENANT_HEADER: &str = "tether-tenant";
/// Header naming the one routing strategy the peer may use (no fallback, no further hop).
pub const STRATEGY_HEADER: &str = "tether-strategy";
/// On a failed forwarded dial: the failure's metric label (`tunnel_error`, `no_agent`, ...), so the
/// forwarding replica can tell a broken session on the peer (try elsewhere) from the agent's own
/// refusal (final), which share the status 502.
pub const DIAL_ERROR_HEADER: &str = "tether-dial-error";

/// Largest inventory accepted from a peer.
const MAX_INVENTORY: usize = 32 * 1024 * 1024;
/// Limit for reaching a peer and its answer.
const PEER_TIMEOUT: Duration = Duration::from_secs(5);

/// A TLS client that presents this replica's peer certificate.
pub struct PeerClient {
    connector: TlsConnector,
    server_name: ServerName<'static>,
}

impl PeerClient {
    /// Builds the client from the peer TLS settings.
    pub fn new(config: &PeerTls) -> anyhow::Result<Self> {
        let roots = ClientRoots { ca_file: Some(config.ca_file.clone()), system_roots: false };
        let tls = tls::client_config(&roots, Some((&config.cert_file, &config.key_file)), &[tls::ALPN_HTTP11])?;
        let server_name = ServerName::try_from(config.server_name.clone())
            .map_err(|e| anyhow::anyhow!("peers.tls.server_name {:?}: {e}", config.server_name))?;
        Ok(Self { connector: TlsConnector::from(Arc::new(tls)), server_name })
    }

    async fn connect(&self, addr: SocketAddr) -> Result<TlsStream<TcpStream>, String> {
        let tcp = tokio::time::timeout(PEER_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| "connect timed out".to_owned())?
            .map_err(|e| e.to_string())?;
        let _ = tcp.set_nodelay(true);
        tokio::time::timeout(PEER_TIMEOUT, self.connector.connect(self.server_name.clone(), tcp))
            .await
            .map_err(|_| "TLS handshake timed out".to_owned())?
            .map_err(|e| format!("TLS: {e}"))
    }

    /// Fetches a peer's inventory.
    pub async fn inventory(&self, addr: SocketAddr, limit: usize) -> Result<Inventory, String> {
        let fetch = async {
            let mut stream = self.connect(addr).await?;
            let request =
                format!("GET /v1/peer/inventory?limit={limit} HTTP/1.1\r\nHost: peer\r\nConnection: close\r\n\r\n");
            stream.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
            let mut response = Vec::new();
            (&mut stream).take(MAX_INVENTORY as u64).read_to_end(&mut response).await.map_err(|e| e.to_string())?;
            let split = response.windows(4).position(|w| w == b"\r\n\r\n").ok_or("no response head")?;
            let head = String::from_utf8_lossy(&response[..split]);
            if !head.starts_with("HTTP/1.1 200") {
                return Err(format!("answered {}", head.lines().next().unwrap_or_default()));
            }
            serde_json::from_slice(&response[split + 4..]).map_err(|e| format!("bad inventory: {e}"))
        };
        tokio::time::timeout(PEER_TIMEOUT * 2, fetch).await.map_err(|_| "inventory timed out".to_owned())?
    }

    /// Asks the peer at `addr` to dial `target` for `tenant` with exactly `strategy`; returns the
    /// open tunnel, or the peer's refusal mapped back to a dial error.
    pub async fn forward(
        &self,
        addr: SocketAddr,
        tenant: &str,
        strategy: RoutingStrategy,
        target: &DialTarget,
        timeout: Duration,
    ) -> Result<TlsStream<TcpStream>, DialError> {
        let attempt = async {
            let mut stream = self.connect(addr).await.map_err(DialError::Tunnel)?;
            let strategy =
                serde_json::to_value(strategy).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
            let request = format!(
                "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{TENANT_HEADER}: {tenant}\r\n{STRATEGY_HEADER}: {strategy}\r\n\r\n"
            );
            stream.write_all(request.as_bytes()).await.map_err(|e| DialError::Tunnel(e.to_string()))?;
            let mut head = Vec::with_capacity(128);
            while !head.ends_with(b"\r\n\r\n") {
                if head.len() > 16 * 1024 {
                    return Err(DialError::Tunnel("peer answer too large".into()));
                }
                let mut byte = [0u8; 1];
                if stream.read(&mut byte).await.map_err(|e| DialError::Tunnel(e.to_string()))? == 0 {
                    return Err(DialError::Tunnel("peer closed the connection".into()));
                }
                head.push(byte[0]);
            }
            let text = String::from_utf8_lossy(&head);
            let status: u16 = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
            if status == 200 {
                return Ok(stream);
            }
            let label = text.lines().find_map(|line| {
                let (name, value) = line.split_once(':')?;
                name.trim().eq_ignore_ascii_case(DIAL_ERROR_HEADER).then(|| value.trim().to_owned())
            });
            let mut body = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(2), (&mut stream).take(4096).read_to_end(&mut body)).await;
            let message = String::from_utf8_lossy(&body).trim().to_owned();
            Err(answer_error(status, label.as_deref(), message, target, timeout))
        };
        tokio::time::timeout(timeout + PEER_TIMEOUT, attempt).await.map_err(|_| DialError::Timeout(timeout))?
    }
}

/// The error a peer's refusal stands for, from its status and `Tether-Dial-Error` label.
fn answer_error(
    status: u16,
    label: Option<&str>,
    message: String,
    target: &DialTarget,
    timeout: Duration,
) -> DialError {
    match (status, label) {
        // The peer's session to the agent broke before the agent answered: nothing reached the
        // target, so another replica may serve the dial.
        (_, Some("tunnel_error")) => DialError::Tunnel(format!("peer: {message}")),
        (403, _) => DialError::Refused { code: ErrorCode::NotAllowed, message, agent: "peer".into() },
        (502, _) => DialError::Refused { code: ErrorCode::DialFailed, message, agent: "peer".into() },
        (504, _) => DialError::Timeout(timeout),
        (429, _) => DialError::TooManyPending(0),
        (503, _) => DialError::NoAgent(target.to_string()),
        (other, _) => DialError::Tunnel(format!("peer answered {other}: {message}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_session_on_the_peer_is_retryable_and_a_refusal_is_final() {
        let target = DialTarget::parse("10.0.0.5:10250").unwrap();
        let timeout = Duration::from_secs(5);
        let err = |status, label| answer_error(status, label, "why".into(), &target, timeout);
        // Both 502: only the label tells them apart.
        assert!(matches!(err(502, Some("tunnel_error")), DialError::Tunnel(_)));
        assert!(matches!(err(502, Some("dial_failed")), DialError::Refused { code: ErrorCode::DialFailed, .. }));
        // An older peer without the header: the status alone decides, as before.
        assert!(matches!(err(502, None), DialError::Refused { .. }));
        assert!(matches!(err(503, Some("no_agent")), DialError::NoAgent(_)));
        assert!(matches!(err(403, None), DialError::Refused { code: ErrorCode::NotAllowed, .. }));
        assert!(matches!(err(504, None), DialError::Timeout(_)));
        assert!(matches!(err(418, None), DialError::Tunnel(_)));
    }
}
