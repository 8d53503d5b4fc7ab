//! Reaching the gateway through a corporate HTTP proxy with `CONNECT`, optionally with Basic
//! credentials. The proxy's answer is read exactly (nothing past its head), and authentication
//! failures are reported as such, naming the proxy, never as a gateway failure. Credentials
//! never appear in errors or logs.

use std::fmt;
use std::time::Duration;

use http::{HeaderValue, Uri};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest proxy response head accepted.
const MAX_HEAD: usize = 16 * 1024;

/// An HTTP proxy to tunnel through.
#[derive(Clone)]
pub struct ProxySettings {
    /// `http://host:port` (credentials, if any, are in `authorization`, not here).
    pub url: Uri,
    /// A ready `Proxy-Authorization` value (e.g. `Basic ...`), marked sensitive.
    pub authorization: Option<HeaderValue>,
    /// Limit for connecting to the proxy and its answer to CONNECT.
    pub connect_timeout: Duration,
}

impl fmt::Debug for ProxySettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxySettings")
            .field("url", &self.display())
            .field("authorization", &self.authorization.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl ProxySettings {
    /// `host:port` of the proxy, for messages (never with credentials).
    pub fn display(&self) -> String {
        let host = self.url.host().unwrap_or("?");
        let port = self.url.port_u16().unwrap_or(default_port(&self.url));
        format!("{host}:{port}")
    }

    /// Basic credentials as a sensitive header value.
    pub fn basic_auth(user: &str, password: &str) -> Option<HeaderValue> {
        use base64::Engine;
        let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        let mut value = HeaderValue::from_str(&format!("Basic {encoded}")).ok()?;
        value.set_sensitive(true);
        Some(value)
    }
}

fn default_port(url: &Uri) -> u16 {
    if url.scheme_str() == Some("https") { 443 } else { 80 }
}

/// Why the proxy did not open a tunnel.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The proxy could not be reached.
    #[error("cannot reach proxy {proxy}: {reason}")]
    Unreachable {
        /// `host:port`.
        proxy: String,
        /// Why.
        reason: String,
    },
    /// The proxy refused our credentials (407, or 401 as tinyproxy answers).
    #[error("proxy {proxy} refused the credentials (HTTP {status}); check the proxy user and password")]
    Authentication {
        /// `host:port`.
        proxy: String,
        /// 407 or 401.
        status: u16,
    },
    /// The proxy refused the tunnel otherwise.
    #[error("proxy {proxy} refused CONNECT to {target} with HTTP {status} {reason}")]
    Refused {
        /// `host:port`.
        proxy: String,
        /// Where we wanted to go.
        target: String,
        /// The status.
        status: u16,
        /// The reason phrase.
        reason: String,
    },
    /// No answer in time.
    #[error("proxy {proxy} did not answer CONNECT within {} ms", .after.as_millis())]
    Timeout {
        /// `host:port`.
        proxy: String,
        /// The limit.
        after: Duration,
    },
    /// The answer was not HTTP, or too large.
    #[error("proxy {proxy} sent a malformed answer: {reason}")]
    Malformed {
        /// `host:port`.
        proxy: String,
        /// What was wrong.
        reason: String,
    },
}

/// Opens a TCP tunnel to `target_host:target_port` through the proxy.
pub async fn connect_through(
    proxy: &ProxySettings,
    target_host: &str,
    target_port: u16,
    user_agent: &str,
) -> Result<TcpStream, ProxyError> {
    let name = proxy.display();
    let attempt = async {
        let host = proxy.url.host().unwrap_or_default().trim_start_matches('[').trim_end_matches(']');
        let port = proxy.url.port_u16().unwrap_or(default_port(&proxy.url));
        let mut stream = TcpStream::connect((host, port))
            .await
            .map_err(|e| ProxyError::Unreachable { proxy: name.clone(), reason: e.to_string() })?;
        let _ = stream.set_nodelay(true);
        let target = if target_host.contains(':') && !target_host.starts_with('[') {
            format!("[{target_host}]:{target_port}")
        } else {
            format!("{target_host}:{target_port}")
        };
        let mut request = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nUser-Agent: {user_agent}\r\n");
        if let Some(auth) = &proxy.authorization {
            request.push_str("Proxy-Authorization: ");
            request.push_str(auth.to_str().unwrap_or_default());
            request.push_str("\r\n");
        }
        request.push_str("\r\n");
        let io_error = |e: std::io::Error| ProxyError::Unreachable { proxy: name.clone(), reason: e.to_string() };
        stream.write_all(request.as_bytes()).await.map_err(io_error)?;
        let head =
            read_head(&mut stream).await.map_err(|reason| ProxyError::Malformed { proxy: name.clone(), reason })?;
        let (status, reason) =
            parse_status(&head).map_err(|reason| ProxyError::Malformed { proxy: name.clone(), reason })?;
        match status {
            200..=299 => Ok(stream),
            401 | 407 => Err(ProxyError::Authentication { proxy: name.clone(), status }),
            _ => Err(ProxyError::Refused { proxy: name.clone(), target, status, reason }),
        }
    };
    tokio::time::timeout(proxy.connect_timeout, attempt)
        .await
        .map_err(|_| ProxyError::Timeout { proxy: name.clone(), after: proxy.connect_timeout })?
}

/// Reads up to and including the blank line that ends the head, one byte at a time so nothing
/// of the tunnel is consumed. (Fuzzed: fuzz/fuzz_targets/agent_upgrade.rs.)
pub async fn read_head<R: AsyncRead + Unpin>(stream: &mut R) -> Result<Vec<u8>, String> {
    let mut head = Vec::with_capacity(256);
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() >= MAX_HEAD {
            return Err(format!("response head larger than {MAX_HEAD} bytes"));
        }
        let mut byte = [0u8; 1];
        match stream.read(&mut byte).await {
            Ok(0) => return Err("connection closed before the answer was complete".into()),
            Ok(_) => head.push(byte[0]),
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(head)
}

/// The status code and reason phrase of a response head.
pub fn parse_status(head: &[u8]) -> Result<(u16, String), String> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut response = httparse::Response::new(&mut headers);
    match response.parse(head) {
        Ok(httparse::Status::Complete(_)) => {
            let status = response.code.ok_or("no status code")?;
            let reason: String = response.reason.unwrap_or_default().chars().take(100).collect();
            Ok((status, reason))
        }
        Ok(httparse::Status::Partial) => Err("incomplete response head".into()),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    async fn fake_proxy(answer: &'static [u8]) -> (Uri, tokio::task::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url: Uri = format!("http://{}", listener.local_addr().unwrap()).parse().unwrap();
        let task = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !request.ends_with(b"\r\n\r\n") {
                let n = stream.read(&mut buf).await.unwrap();
                request.extend_from_slice(&buf[..n]);
            }
            stream.write_all(answer).await.unwrap();
            stream.write_all(b"TUNNEL").await.unwrap();
            String::from_utf8(request).unwrap()
        });
        (url, task)
    }

    fn settings(url: Uri, auth: Option<HeaderValue>) -> ProxySettings {
        ProxySettings { url, authorization: auth, connect_timeout: Duration::from_secs(5) }
    }

    #[tokio::test]
    async fn sends_connect_with_credentials_and_leaves_the_tunnel_unread() {
        let (url, proxy) = fake_proxy(b"HTTP/1.1 200 Connection established\r\n\r\n").await;
        let auth = ProxySettings::basic_auth("alice", "s3cret");
        let mut stream = connect_through(&settings(url, auth), "gw.example.com", 443, "test").await.unwrap();
        let mut tunnel = [0u8; 6];
        stream.read_exact(&mut tunnel).await.unwrap();
        assert_eq!(&tunnel, b"TUNNEL");
        let request = proxy.await.unwrap();
        assert!(
            request.starts_with("CONNECT gw.example.com:443 HTTP/1.1\r\nHost: gw.example.com:443\r\n"),
            "{request}"
        );
        assert!(request.contains("Proxy-Authorization: Basic YWxpY2U6czNjcmV0\r\n"), "{request}");
    }

    #[tokio::test]
    async fn authentication_failures_name_the_proxy() {
        for answer in [
            &b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=x\r\n\r\n"[..],
            b"HTTP/1.1 401 Unauthorized\r\n\r\n",
        ] {
            let answer: &'static [u8] = Box::leak(answer.to_vec().into_boxed_slice());
            let (url, _proxy) = fake_proxy(answer).await;
            let proxy = settings(url, ProxySettings::basic_auth("alice", "wrong"));
            let err = connect_through(&proxy, "gw", 443, "t").await.unwrap_err();
            assert!(matches!(err, ProxyError::Authentication { .. }), "{err}");
            let text = err.to_string();
            assert!(text.contains(&proxy.display()) && !text.contains("wrong"), "{text}");
        }
    }

    #[tokio::test]
    async fn other_refusals_and_garbage_are_reported() {
        let (url, _p) = fake_proxy(b"HTTP/1.1 403 Forbidden\r\n\r\n").await;
        let err = connect_through(&settings(url, None), "gw", 443, "t").await.unwrap_err();
        assert!(matches!(err, ProxyError::Refused { status: 403, .. }), "{err}");
        let (url, _p) = fake_proxy(b"SSH-2.0-OpenSSH\r\n\r\n").await;
        let err = connect_through(&settings(url, None), "gw", 443, "t").await.unwrap_err();
        assert!(matches!(err, ProxyError::Malformed { .. }), "{err}");
    }

    #[test]
    fn debug_output_hides_credentials() {
        let proxy = settings("http://proxy:3128".parse().unwrap(), ProxySettings::basic_auth("alice", "s3cret"));
        let shown = format!("{proxy:?}");
        assert!(!shown.contains("YWxpY2U6czNjcmV0") && shown.contains("proxy:3128"), "{shown}");
    }
}
