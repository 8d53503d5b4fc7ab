//! Checking tokens by asking the tenant's kube-apiserver: `POST /apis/authentication.k8s.io/v1/tokenreviews`.
//! An alternative to local JWKS validation for issuers whose keys the gateway cannot fetch. Results
//! are cached briefly (by the token's SHA-256, never the token) so reconnect storms do not become
//! TokenReview storms.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use tokio::sync::Semaphore;

use super::token::{AuthError, Identity, valid_until};
use crate::https_client::HttpsClient;
use tether_tunnel::jwt::{now_unix, unverified_expiry};

/// Cached reviews kept at most.
const CACHE_LIMIT: usize = 10_000;

/// How long a rejection is remembered (at most the cache TTL): a token the API refused is not
/// sent again by every reconnect.
const REJECTION_TTL: Duration = Duration::from_secs(10);

/// Asks one kube-apiserver about tokens.
pub struct TokenReviewer {
    url: String,
    client: HttpsClient,
    audiences: Vec<String>,
    ttl: Duration,
    cache: std::sync::Mutex<HashMap<[u8; 32], (Identity, Instant)>>,
    rejected: std::sync::Mutex<HashMap<[u8; 32], Instant>>,
    /// One call per token at a time: concurrent checks of one token wait for its answer.
    in_flight: std::sync::Mutex<HashMap<[u8; 32], Arc<tokio::sync::Mutex<()>>>>,
    /// Calls to the API at once.
    calls: Arc<Semaphore>,
    /// Longest wait for a call slot.
    wait: Duration,
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
    /// Reviews against `server` (e.g. `https://10.0.0.1:6443`) for `audiences`, caching for `ttl`,
    /// with at most `max_concurrent` calls at once (waiting up to `wait` for one).
    pub fn new(
        server: &str,
        client: HttpsClient,
        audiences: Vec<String>,
        ttl: Duration,
        max_concurrent: usize,
        wait: Duration,
    ) -> Self {
        Self {
            url: format!("{}/apis/authentication.k8s.io/v1/tokenreviews", server.trim_end_matches('/')),
            client,
            audiences,
            ttl,
            cache: std::sync::Mutex::new(HashMap::new()),
            rejected: std::sync::Mutex::new(HashMap::new()),
            in_flight: std::sync::Mutex::new(HashMap::new()),
            calls: Arc::new(Semaphore::new(max_concurrent.max(1))),
            wait,
        }
    }

    /// Authenticates `token`, from the cache when a fresh answer is there. The identity is valid
    /// until the token's `exp` plus `leeway`; a cached answer never outlives that.
    pub async fn review(&self, token: &str, leeway: Duration) -> Result<Identity, AuthError> {
        let Some(key) = digest(token) else { return Err(AuthError::Unavailable) };
        if let Some(answer) = self.cached(&key) {
            return answer;
        }
        // Single flight: the first check of a token calls the API, the others wait for its answer.
        let flight = self.in_flight.lock().ok().map(|mut m| m.entry(key).or_default().clone());
        let Some(flight) = flight else { return Err(AuthError::Unavailable) };
        let answer = {
            let _turn = flight.lock().await;
            match self.cached(&key) {
                Some(answer) => answer,
                None => self.call(token, key, leeway).await,
            }
        };
        if let Ok(mut in_flight) = self.in_flight.lock()
            && in_flight.get(&key).is_some_and(|f| Arc::ptr_eq(f, &flight))
            && Arc::strong_count(&flight) <= 2
        {
            in_flight.remove(&key);
        }
        answer
    }

    /// One TokenReview call, within the concurrency limit.
    async fn call(&self, token: &str, key: [u8; 32], leeway: Duration) -> Result<Identity, AuthError> {
        let Ok(Ok(_slot)) = tokio::time::timeout(self.wait, self.calls.clone().acquire_owned()).await else {
            tracing::warn!("TokenReview calls at their limit (token_review.max_concurrent) for too long");
            return Err(AuthError::Unavailable);
        };
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
            self.remember_rejection(key);
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
        self.remember(key, identity.clone());
        Ok(identity)
    }

    /// A fresh cached answer: the identity (or `Expired` once the token's acceptance ended), or a
    /// recent rejection.
    fn cached(&self, key: &[u8; 32]) -> Option<Result<Identity, AuthError>> {
        let rejection_ttl = REJECTION_TTL.min(self.ttl);
        if self.rejected.lock().ok()?.get(key).is_some_and(|at| at.elapsed() < rejection_ttl) {
            return Some(Err(AuthError::ReviewRejected));
        }
        let cache = self.cache.lock().ok()?;
        let (identity, at) = cache.get(key)?;
        if at.elapsed() >= self.ttl {
            return None;
        }
        if identity.valid_until <= now_unix() {
            return Some(Err(AuthError::Expired));
        }
        Some(Ok(identity.clone()))
    }

    fn remember_rejection(&self, key: [u8; 32]) {
        let Ok(mut rejected) = self.rejected.lock() else { return };
        if rejected.len() >= CACHE_LIMIT {
            rejected.retain(|_, at| at.elapsed() < REJECTION_TTL);
            if rejected.len() >= CACHE_LIMIT {
                rejected.clear();
            }
        }
        rejected.insert(key, Instant::now());
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
        let reviewer = TokenReviewer::new(
            "https://127.0.0.1:1",
            client,
            vec![],
            Duration::from_secs(600),
            4,
            Duration::from_secs(1),
        );
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
