//! Checking tokens by asking the tenant's kube-apiserver: `POST /apis/authentication.k8s.io/v1/tokenreviews`.
//! An alternative to local JWKS validation for issuers whose keys the gateway cannot fetch. Results
//! are cached briefly (by the token's SHA-256, never the token) so reconnect storms do not become
//! TokenReview storms.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::token::{AuthError, Identity, valid_until};
use crate::https_client::HttpsClient;
use tether_tunnel::jwt::{now_unix, unverified_expiry};

/// Cached reviews kept at most.
const CACHE_LIMIT: usize = 10_000;

/// Asks one kube-apiserver about tokens.
pub struct TokenReviewer {
    url: String,
    client: HttpsClient,
    audiences: Vec<String>,
    ttl: Duration,
    cache: std::sync::Mutex<HashMap<[u8; 32], (Identity, Instant)>>,
}

#[derive(Deserialize)]
struct Review {
    #[serde(default)]
    status: ReviewStatus,
}

#[derive(Deserialize, Default)]
struct ReviewStatus {
    #[serde(default)]
    authenticated: bool,
    #[serde(default)]
    user: ReviewUser,
    #[serde(default)]
    error: String,
}

#[derive(Deserialize, Default)]
struct ReviewUser {
    #[serde(default)]
    username: String,
    #[serde(default)]
    extra: HashMap<String, Vec<String>>,
}

impl TokenReviewer {
    /// Reviews against `server` (e.g. `https://10.0.0.1:6443`) for `audiences`, caching for `ttl`.
    pub fn new(server: &str, client: HttpsClient, audiences: Vec<String>, ttl: Duration) -> Self {
        Self {
            url: format!("{}/apis/authentication.k8s.io/v1/tokenreviews", server.trim_end_matches('/')),
            client,
            audiences,
            ttl,
            cache: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// Authenticates `token`, from the cache when a fresh answer is there. The identity is valid
    /// until the token's `exp` plus `leeway`; a cached answer never outlives that.
    pub async fn review(&self, token: &str, leeway: Duration) -> Result<Identity, AuthError> {
        let key = digest(token);
        if let Some(identity) = key.as_ref().and_then(|k| self.cached(k)) {
            if identity.valid_until <= now_unix() {
                return Err(AuthError::Expired);
            }
            return Ok(identity);
        }
        let body = serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": { "token": token, "audiences": self.audiences },
        });
        let body = serde_json::to_vec(&body).map_err(|_| AuthError::Unavailable)?;
        let answer = self.client.post_json(&self.url, body).await.map_err(|e| {
            tracing::warn!(error = %e, "TokenReview call failed");
            AuthError::Unavailable
        })?;
        let review: Review = serde_json::from_slice(&answer).map_err(|e| {
            tracing::warn!(error = %e, "TokenReview answer unreadable");
            AuthError::Unavailable
        })?;
        if !review.status.authenticated {
            tracing::debug!(reason = %review.status.error, "TokenReview did not authenticate the token");
            return Err(AuthError::ReviewRejected);
        }
        let now = now_unix();
        let expires_at = unverified_expiry(token).unwrap_or(now + self.ttl.as_secs());
        let valid_until = valid_until(expires_at, leeway);
        if valid_until <= now {
            return Err(AuthError::Expired);
        }
        let node_name = review
            .status
            .user
            .extra
            .get("authentication.kubernetes.io/node-name")
            .and_then(|names| names.first().cloned())
            .filter(|n| !n.is_empty());
        let identity = Identity { subject: review.status.user.username, expires_at, valid_until, node_name };
        if let Some(key) = key {
            self.remember(key, identity.clone());
        }
        Ok(identity)
    }

    fn cached(&self, key: &[u8; 32]) -> Option<Identity> {
        let cache = self.cache.lock().ok()?;
        let (identity, at) = cache.get(key)?;
        (at.elapsed() < self.ttl).then(|| identity.clone())
    }

    fn remember(&self, key: [u8; 32], identity: Identity) {
        let Ok(mut cache) = self.cache.lock() else { return };
        if cache.len() >= CACHE_LIMIT {
            let ttl = self.ttl;
            cache.retain(|_, (_, at)| at.elapsed() < ttl);
            if cache.len() >= CACHE_LIMIT {
                cache.clear();
            }
        }
        cache.insert(key, (identity, Instant::now()));
    }
}

/// SHA-256 of the token (through rustls's aws-lc-rs provider, to avoid another crypto crate).
fn digest(token: &str) -> Option<[u8; 32]> {
    let suite = rustls::crypto::aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256.tls13()?;
    let hash = suite.common.hash_provider.hash(token.as_bytes());
    hash.as_ref().try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_cached_answer_never_outlives_the_token() {
        tether_tunnel::tls::install_default_provider();
        let tls = rustls::ClientConfig::builder()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        // Nothing listens there: every answer below must come from the cache.
        let client = HttpsClient::new(std::sync::Arc::new(tls), None, Duration::from_millis(200));
        let reviewer = TokenReviewer::new("https://127.0.0.1:1", client, vec![], Duration::from_secs(600));
        let now = now_unix();
        let identity =
            |valid_until| Identity { subject: "s".into(), expires_at: valid_until, valid_until, node_name: None };
        let (live, stale) = ("live.token.sig", "stale.token.sig");
        reviewer.remember(digest(live).unwrap(), identity(now + 60));
        reviewer.remember(digest(stale).unwrap(), identity(now - 1));
        assert_eq!(reviewer.review(live, Duration::ZERO).await.map(|i| i.valid_until), Ok(now + 60));
        assert_eq!(reviewer.review(stale, Duration::ZERO).await, Err(AuthError::Expired));
    }
}
