//! The HTTP CONNECT exchange, byte-compatible with kube-apiserver's egress selector in
//! `HTTPConnect` mode (the same as Konnectivity's http-connect frontend).
//!
//! kube-apiserver writes `CONNECT host:port HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n` and requires a 200
//! with nothing after the response head, so the head is read exactly and the answer is one fixed
//! line. The Host header is ignored: the target is the request line's authority.

use std::io;
use tether_tunnel::untrusted::printable;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

/// Largest request head accepted.
pub const MAX_HEAD: usize = 8 * 1024;

/// The answer that opens the tunnel.
pub const ESTABLISHED: &[u8] = b"HTTP/1.1 200 Connection Established\r\n\r\n";

/// A parsed CONNECT request.
#[derive(Debug)]
pub struct ConnectRequest {
    /// `host:port` from the request line.
    pub target: String,
    /// Bytes the client sent after the head (already tunnel payload).
    pub early_data: Bytes,
}

/// Why a request head was not a usable CONNECT.
#[derive(Debug, thiserror::Error)]
pub enum HeadError {
    /// Reading failed or the client went away.
    #[error("client connection failed: {0}")]
    Io(#[from] io::Error),
    /// The client closed before sending a full head.
    #[error("client closed before sending a request")]
    Closed,
    /// Over [`MAX_HEAD`] bytes.
    #[error("request head larger than {MAX_HEAD} bytes")]
    TooLarge,
    /// Not HTTP.
    #[error("malformed HTTP request: {0}")]
    Malformed(String),
    /// Not a CONNECT.
    #[error("method {0} not allowed; only CONNECT is supported")]
    NotConnect(String),
}

impl HeadError {
    /// The status to answer with, if the client is still there to read it.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Io(_) | Self::Closed => None,
            Self::TooLarge => Some(431),
            Self::Malformed(_) => Some(400),
            Self::NotConnect(_) => Some(405),
        }
    }
}

/// Reads and parses one request head, leaving any following bytes in `early_data`.
pub async fn read_request<R: AsyncRead + Unpin>(reader: &mut R) -> Result<ConnectRequest, HeadError> {
    let mut buf = BytesMut::with_capacity(512);
    loop {
        if buf.len() >= MAX_HEAD {
            return Err(HeadError::TooLarge);
        }
        let n = reader.read_buf(&mut buf).await?;
        if n == 0 {
            return Err(HeadError::Closed);
        }
        if let Some((target, head_len)) = parse(&buf)? {
            let early_data = buf.split_off(head_len).freeze();
            return Ok(ConnectRequest { target, early_data });
        }
    }
}

/// Parses a complete head: `Ok(None)` while incomplete.
fn parse(buf: &[u8]) -> Result<Option<(String, usize)>, HeadError> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut request = httparse::Request::new(&mut headers);
    let head_len = match request.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            // A non-CONNECT method is refused as soon as the request line is readable.
            if let Some(method) = request.method
                && method != "CONNECT"
                && buf.contains(&b'\n')
            {
                return Err(HeadError::NotConnect(printable(method, 32)));
            }
            return Ok(None);
        }
        Err(e) => return Err(HeadError::Malformed(e.to_string())),
    };
    let method = request.method.unwrap_or_default();
    if method != "CONNECT" {
        return Err(HeadError::NotConnect(printable(method, 32)));
    }
    let target = request.path.unwrap_or_default();
    if target.is_empty() {
        return Err(HeadError::Malformed("CONNECT without a target".into()));
    }
    Ok(Some((target.to_owned(), head_len)))
}

/// An error answer with a short plain-text reason; the connection is closed after it.
pub fn error_response(status: u16, reason: &str) -> Vec<u8> {
    let phrase = match status {
        400 => "Bad Request",
        403 => "Forbidden",
        405 => "Method Not Allowed",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Error",
    };
    let body = format!("{}\n", reason.replace(['\r', '\n'], " "));
    let mut head = format!(
        "HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if status == 405 {
        head.push_str("Allow: CONNECT\r\n");
    }
    if matches!(status, 429 | 503) {
        head.push_str("Retry-After: 1\r\n");
    }
    head.push_str("\r\n");
    head.push_str(&body);
    head.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    async fn parse_bytes(chunks: &[&[u8]]) -> Result<ConnectRequest, HeadError> {
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        for chunk in chunks {
            client.write_all(chunk).await.unwrap();
        }
        drop(client);
        read_request(&mut server).await
    }

    #[tokio::test]
    async fn parses_the_exact_kube_apiserver_request() {
        let req = parse_bytes(&[b"CONNECT 10.0.0.5:10250 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"]).await.unwrap();
        assert_eq!(req.target, "10.0.0.5:10250");
        assert!(req.early_data.is_empty());
    }

    #[tokio::test]
    async fn parses_heads_split_across_reads_and_keeps_early_data() {
        let req =
            parse_bytes(&[b"CONNECT node-1:22 HT", b"TP/1.1\r\nHost: x\r\nUser-Agent: curl\r\n", b"\r\nSSH-2.0-early"])
                .await
                .unwrap();
        assert_eq!(req.target, "node-1:22");
        assert_eq!(&req.early_data[..], b"SSH-2.0-early");
    }

    #[tokio::test]
    async fn refuses_other_methods_and_garbage() {
        let err = parse_bytes(&[b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"]).await.unwrap_err();
        assert_eq!(err.status(), Some(405));
        let err = parse_bytes(&[b"\x16\x03\x01\x02\x00garbage\r\n\r\n"]).await.unwrap_err();
        assert_eq!(err.status(), Some(400));
        let err = parse_bytes(&[b"CONNECT a:1 HTTP/1.1\r\n", &vec![b'x'; MAX_HEAD]]).await.unwrap_err();
        assert_eq!(err.status(), Some(431));
        let err = parse_bytes(&[b"CONNECT a:1 HTTP/1.1\r\n"]).await.unwrap_err();
        assert!(matches!(err, HeadError::Closed));
    }

    #[test]
    fn error_responses_are_complete_http() {
        let r = String::from_utf8(error_response(503, "no agent\r\navailable")).unwrap();
        assert!(r.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
        assert!(r.contains("Retry-After: 1\r\n"));
        assert!(r.ends_with("\r\n\r\nno agent  available\n"));
        let r = String::from_utf8(error_response(405, "only CONNECT")).unwrap();
        assert!(r.contains("Allow: CONNECT\r\n"));
    }
}
