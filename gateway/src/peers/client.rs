//! Calling other replicas over mutual TLS: fetching inventories and forwarding dials.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tether_tunnel::tls::{self, ClientRoots};
use tether_tunnel::transport::send_all;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use super::Inventory;
use crate::config::{PeerTls, RoutingStrategy};
use crate::target::DialTarget;

/// Header naming the tenant of a forwarded dial.
pub const TENANT_HEADER: &str = "tether-tenant";
/// Header naming the one routing strategy the peer may use (no fallback, no further hop).
pub const STRATEGY_HEADER: &str = "tether-strategy";
/// Header naming the replica that asks for an inventory (a replica it does not know yet makes the
/// answering replica look again at once: a new replica is known everywhere before it serves).
pub const REPLICA_HEADER: &str = "tether-replica";
/// On a failed forwarded dial: the failure's metric label (`tunnel_error`, `no_agent`, ...), so the
/// forwarding replica can tell a broken session on the peer (try elsewhere) from the agent's own
/// refusal (final), which share the status 502.
pub const DIAL_ERROR_HEADER: &str = "tether-dial-error";

/// Largest inventory accepted from a peer.
const MAX_INVENTORY: usize = 32 * 1024 * 1024;
/// Limit for reaching a peer and its answer.
const PEER_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the peer TLS client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum PeerTlsError {
    /// The certificate, key or CA did not load.
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    /// `server_name` is not a DNS name or address.
    #[error("peers.tls.server_name {0:?} is not a valid server name")]
    ServerName(String),
}

/// Why a forwarded dial did not open a tunnel.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForwardError {
    /// The peer could not be reached or broke the exchange (nothing reached the target).
    #[error("{0}")]
    Unreachable(String),
    /// The peer answered with an error status; `label` is its dial-error label, if it sent one.
    #[error("peer answered {status}: {message}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// The peer's `Tether-Dial-Error` label.
        label: Option<String>,
        /// The peer's reason.
        message: String,
    },
    /// No answer in time.
    #[error("no answer from the peer in time")]
    TimedOut,
}

/// Why a peer's inventory could not be fetched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InventoryError {
    /// Connecting, TLS or the exchange failed.
    #[error("{0}")]
    Unreachable(String),
    /// The peer answered with something other than 200.
    #[error("answered {0}")]
    Answered(String),
    /// The answer is not an inventory.
    #[error("bad inventory: {0}")]
    Invalid(String),
    /// No answer in time.
    #[error("inventory timed out")]
    TimedOut,
}

/// A TLS client that presents this replica's peer certificate.
pub struct PeerClient {
    connector: TlsConnector,
    server_name: ServerName<'static>,
}

impl PeerClient {
    /// Builds the client from the peer TLS settings.
    pub fn new(config: &PeerTls) -> Result<Self, PeerTlsError> {
        let roots = ClientRoots { ca_file: Some(config.ca_file.clone()), system_roots: false };
        let tls = tls::client_config(&roots, Some((&config.cert_file, &config.key_file)), &[tls::ALPN_HTTP11])?;
        let server_name = ServerName::try_from(config.server_name.clone())
            .map_err(|_| PeerTlsError::ServerName(config.server_name.clone()))?;
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
    pub async fn inventory(
        &self,
        addr: SocketAddr,
        limit: usize,
        requester: &str,
    ) -> Result<Inventory, InventoryError> {
        let fetch = async {
            let mut stream = self.connect(addr).await.map_err(InventoryError::Unreachable)?;
            let request = format!(
                "GET /v1/peer/inventory?limit={limit} HTTP/1.1\r\nHost: peer\r\n{REPLICA_HEADER}: {requester}\r\nConnection: close\r\n\r\n"
            );
            let unreachable = |e: std::io::Error| InventoryError::Unreachable(e.to_string());
            send_all(&mut stream, request.as_bytes()).await.map_err(unreachable)?;
            let mut response = Vec::new();
            (&mut stream).take(MAX_INVENTORY as u64).read_to_end(&mut response).await.map_err(unreachable)?;
            let split = response
                .windows(4)
                .position(|w| w == b"\r\n\r\n")
                .ok_or_else(|| InventoryError::Invalid("no response head".into()))?;
            let head = String::from_utf8_lossy(&response[..split]);
            if !head.starts_with("HTTP/1.1 200") {
                return Err(InventoryError::Answered(head.lines().next().unwrap_or_default().to_owned()));
            }
            serde_json::from_slice(&response[split + 4..]).map_err(|e| InventoryError::Invalid(e.to_string()))
        };
        tokio::time::timeout(PEER_TIMEOUT * 2, fetch).await.map_err(|_| InventoryError::TimedOut)?
    }

    /// Asks the peer at `addr` to dial `target` for `tenant` with exactly `strategy`; returns the
    /// open tunnel, or why not.
    pub async fn forward(
        &self,
        addr: SocketAddr,
        tenant: &str,
        strategy: RoutingStrategy,
        target: &DialTarget,
        timeout: Duration,
    ) -> Result<TlsStream<TcpStream>, ForwardError> {
        let attempt = async {
            let mut stream = self.connect(addr).await.map_err(ForwardError::Unreachable)?;
            let strategy =
                serde_json::to_value(strategy).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
            let request = format!(
                "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{TENANT_HEADER}: {tenant}\r\n{STRATEGY_HEADER}: {strategy}\r\n\r\n"
            );
            send_all(&mut stream, request.as_bytes()).await.map_err(|e| ForwardError::Unreachable(e.to_string()))?;
            let mut head = Vec::with_capacity(128);
            while !head.ends_with(b"\r\n\r\n") {
                if head.len() > 16 * 1024 {
                    return Err(ForwardError::Unreachable("peer answer too large".into()));
                }
                let mut byte = [0u8; 1];
                if stream.read(&mut byte).await.map_err(|e| ForwardError::Unreachable(e.to_string()))? == 0 {
                    return Err(ForwardError::Unreachable("peer closed the connection".into()));
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
            Err(ForwardError::Refused { status, label, message })
        };
        tokio::time::timeout(timeout + PEER_TIMEOUT, attempt).await.map_err(|_| ForwardError::TimedOut)?
    }
}
