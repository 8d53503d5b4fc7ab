//! An HTTP CONNECT client, as kube-apiserver's egress selector speaks it.

use std::io;
use std::path::Path;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::{TcpStream, UnixStream};

/// The answer to a CONNECT that did not open a tunnel.
#[derive(Debug, thiserror::Error)]
#[error("CONNECT answered {status}: {reason}")]
pub struct ConnectRefused {
    /// HTTP status.
    pub status: u16,
    /// The body (the gateway's short reason).
    pub reason: String,
}

/// Sends `CONNECT target` exactly as kube-apiserver does and returns the open tunnel, or the
/// status and reason of a refusal.
pub async fn connect_via<S>(mut stream: S, target: &str) -> io::Result<Result<S, ConnectRefused>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    tether_tunnel::transport::send_all(
        &mut stream,
        format!("CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes(),
    )
    .await?;
    // Read the head byte by byte so no tunnel bytes are consumed (kube-apiserver requires that
    // nothing follows the head).
    let mut head = Vec::with_capacity(64);
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() > 16 * 1024 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "response head too large"));
        }
        let mut byte = [0u8; 1];
        if stream.read(&mut byte).await? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "proxy closed before answering"));
        }
        head.push(byte[0]);
    }
    let text = String::from_utf8_lossy(&head);
    let status: u16 = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    if status == 200 {
        return Ok(Ok(stream));
    }
    let mut body = Vec::new();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), stream.read_to_end(&mut body)).await;
    Ok(Err(ConnectRefused { status, reason: String::from_utf8_lossy(&body).trim().to_owned() }))
}

/// CONNECT through a TCP frontend.
pub async fn connect_tcp(proxy: std::net::SocketAddr, target: &str) -> io::Result<Result<TcpStream, ConnectRefused>> {
    let stream = TcpStream::connect(proxy).await?;
    let _ = stream.set_nodelay(true);
    connect_via(stream, target).await
}

/// CONNECT through a Unix-socket frontend.
pub async fn connect_uds(socket: &Path, target: &str) -> io::Result<Result<UnixStream, ConnectRefused>> {
    let stream = UnixStream::connect(socket).await?;
    connect_via(stream, target).await
}
