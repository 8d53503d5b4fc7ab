//! A small HTTPS client for the gateway's own calls: OIDC discovery, JWKS documents, TokenReview.
//! One request per connection (these calls are rare and cached), bounded in time and size.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// Largest response body accepted (JWKS documents and TokenReviews are small).
pub const MAX_BODY: usize = 1024 * 1024;

/// Why a call failed; never contains credentials.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FetchError {
    /// The URL cannot be used.
    #[error("bad URL {0}")]
    Url(String),
    /// Connecting, TLS or HTTP failed.
    #[error("{url}: {reason}")]
    Transport {
        /// The URL.
        url: String,
        /// What went wrong.
        reason: String,
    },
    /// The server answered with an error status.
    #[error("{url}: HTTP {status}")]
    Status {
        /// The URL.
        url: String,
        /// The status.
        status: u16,
    },
    /// No answer in time.
    #[error("{url}: timed out after {} ms", .after.as_millis())]
    Timeout {
        /// The URL.
        url: String,
        /// The limit.
        after: Duration,
    },
}

/// How to call one server.
#[derive(Clone)]
pub struct HttpsClient {
    tls: Arc<ClientConfig>,
    bearer: Option<Arc<str>>,
    timeout: Duration,
}

impl HttpsClient {
    /// A client trusting `tls`'s roots, optionally authenticating with a bearer token.
    pub fn new(tls: Arc<ClientConfig>, bearer: Option<String>, timeout: Duration) -> Self {
        Self { tls, bearer: bearer.map(Into::into), timeout }
    }

    /// `GET url`, returning the body of a 2xx answer.
    pub async fn get(&self, url: &str) -> Result<Bytes, FetchError> {
        self.call(Method::GET, url, None).await
    }

    /// `POST url` with a JSON body, returning the body of a 2xx answer.
    pub async fn post_json(&self, url: &str, body: Vec<u8>) -> Result<Bytes, FetchError> {
        self.call(Method::POST, url, Some(body)).await
    }

    async fn call(&self, method: Method, url: &str, body: Option<Vec<u8>>) -> Result<Bytes, FetchError> {
        tokio::time::timeout(self.timeout, self.call_inner(method, url, body))
            .await
            .map_err(|_| FetchError::Timeout { url: url.to_owned(), after: self.timeout })?
    }

    async fn call_inner(&self, method: Method, url: &str, body: Option<Vec<u8>>) -> Result<Bytes, FetchError> {
        let uri: Uri = url.parse().map_err(|_| FetchError::Url(url.to_owned()))?;
        if uri.scheme_str() != Some("https") {
            return Err(FetchError::Url(format!("{url} (only https:// is supported)")));
        }
        let host = uri.host().ok_or_else(|| FetchError::Url(url.to_owned()))?.to_owned();
        let bare = host.trim_start_matches('[').trim_end_matches(']').to_owned();
        let port = uri.port_u16().unwrap_or(443);
        let transport = |reason: String| FetchError::Transport { url: url.to_owned(), reason };
        let tcp = TcpStream::connect((bare.as_str(), port)).await.map_err(|e| transport(e.to_string()))?;
        let name = ServerName::try_from(bare).map_err(|e| transport(e.to_string()))?;
        let tls =
            TlsConnector::from(self.tls.clone()).connect(name, tcp).await.map_err(|e| transport(e.to_string()))?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.map_err(|e| transport(e.to_string()))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
        let authority = uri.authority().map(|a| a.as_str()).unwrap_or(&host);
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, authority)
            .header(http::header::ACCEPT, "application/json")
            .header(http::header::USER_AGENT, concat!("tether-gateway/", env!("CARGO_PKG_VERSION")));
        if body.is_some() {
            request = request.header(http::header::CONTENT_TYPE, "application/json");
        }
        if let Some(token) = &self.bearer {
            let mut value = HeaderValue::from_str(&format!("Bearer {token}"))
                .map_err(|_| transport("unusable bearer token".into()))?;
            value.set_sensitive(true);
            request = request.header(http::header::AUTHORIZATION, value);
        }
        let request =
            request.body(Full::new(Bytes::from(body.unwrap_or_default()))).map_err(|e| transport(e.to_string()))?;
        let response = sender.send_request(request).await.map_err(|e| transport(e.to_string()))?;
        let status = response.status();
        let collected = Limited::new(response.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| transport(format!("reading the body: {e}")))?;
        if !status.is_success() && status != StatusCode::CREATED {
            return Err(FetchError::Status { url: url.to_owned(), status: status.as_u16() });
        }
        Ok(collected.to_bytes())
    }
}
