//! Where a tenant's verification keys come from, and keeping them fresh: a JWKS file, a JWKS
//! URL, or OIDC discovery (`<issuer>/.well-known/openid-configuration` -> `jwks_uri`; kube-apiserver
//! serves `/openid/v1/jwks`).
//!
//! Keys are cached. A token with an unknown `kid` triggers a refresh, at most once per
//! `min_refresh_interval` and one at a time, so a flood of bad tokens or a reconnect storm cannot
//! hammer the issuer. When the issuer is down the cached keys keep working.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use serde::Deserialize;

use super::keys::KeySet;
use crate::https_client::HttpsClient;

/// Where keys are fetched from.
#[derive(Clone)]
pub enum KeySource {
    /// A JWKS file on disk (re-read on refresh).
    File(PathBuf),
    /// A JWKS document over HTTPS.
    Url {
        /// The JWKS URL.
        url: String,
        /// How to call it.
        client: HttpsClient,
    },
    /// OIDC discovery from the issuer.
    Discovery {
        /// The issuer URL (`iss`).
        issuer: String,
        /// How to call it.
        client: HttpsClient,
    },
    /// A fixed key set (a shared HMAC secret).
    Fixed,
}

impl KeySource {
    fn describe(&self) -> String {
        match self {
            Self::File(path) => path.display().to_string(),
            Self::Url { url, .. } => url.clone(),
            Self::Discovery { issuer, .. } => format!("{issuer} (OIDC discovery)"),
            Self::Fixed => "shared secret".into(),
        }
    }
}

#[derive(Deserialize)]
struct Discovery {
    jwks_uri: String,
}

/// The cached keys of one issuer and the means to refresh them.
pub struct KeyStore {
    source: KeySource,
    keys: ArcSwap<KeySet>,
    min_refresh_interval: Duration,
    last_attempt: std::sync::Mutex<Option<Instant>>,
    refreshing: tokio::sync::Mutex<()>,
    jwks_uri: std::sync::Mutex<Option<String>>,
}

impl KeyStore {
    /// A store with `initial` keys (possibly empty) from `source`.
    pub fn new(source: KeySource, initial: KeySet, min_refresh_interval: Duration) -> Self {
        Self {
            source,
            keys: ArcSwap::from_pointee(initial),
            min_refresh_interval,
            last_attempt: std::sync::Mutex::new(None),
            refreshing: tokio::sync::Mutex::new(()),
            jwks_uri: std::sync::Mutex::new(None),
        }
    }

    /// The keys in use.
    pub fn current(&self) -> Arc<KeySet> {
        self.keys.load_full()
    }

    /// Replaces the keys (tests, shared secrets).
    pub fn set(&self, keys: KeySet) {
        self.keys.store(Arc::new(keys));
    }

    /// Fetches the keys now; on failure the cached keys stay.
    pub async fn refresh(&self) -> Result<usize, String> {
        let _one_at_a_time = self.refreshing.lock().await;
        self.refresh_locked().await
    }

    async fn refresh_locked(&self) -> Result<usize, String> {
        if let Ok(mut last) = self.last_attempt.lock() {
            *last = Some(Instant::now());
        }
        let keys = self.fetch().await.map_err(|e| format!("{}: {e}", self.source.describe()))?;
        let count = keys.len();
        self.keys.store(Arc::new(keys));
        Ok(count)
    }

    /// Refreshes unless the last attempt was within `min_refresh_interval`; returns whether the
    /// keys may have changed. Concurrent callers wait for one refresh instead of starting many.
    pub async fn refresh_if_due(&self) -> bool {
        if matches!(self.source, KeySource::Fixed) {
            return false;
        }
        let before = self.keys.load_full();
        let _one_at_a_time = self.refreshing.lock().await;
        if !Arc::ptr_eq(&before, &self.keys.load_full()) {
            return true;
        }
        let due = self
            .last_attempt
            .lock()
            .map(|last| last.is_none_or(|at| at.elapsed() >= self.min_refresh_interval))
            .unwrap_or(false);
        if !due {
            return false;
        }
        match self.refresh_locked().await {
            Ok(count) => {
                tracing::info!(source = %self.source.describe(), keys = count, "signing keys refreshed");
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "signing key refresh failed; keeping the cached keys");
                false
            }
        }
    }

    async fn fetch(&self) -> Result<KeySet, String> {
        match &self.source {
            KeySource::Fixed => Ok(KeySet::default()),
            KeySource::File(path) => KeySet::from_file(path),
            KeySource::Url { url, client } => {
                let body = client.get(url).await.map_err(|e| e.to_string())?;
                KeySet::from_jwks(&body)
            }
            KeySource::Discovery { issuer, client } => {
                let cached = self.jwks_uri.lock().ok().and_then(|u| u.clone());
                let jwks_uri = match cached {
                    Some(uri) => uri,
                    None => {
                        let url = format!("{}/.well-known/openid-configuration", issuer.trim_end_matches('/'));
                        let body = client.get(&url).await.map_err(|e| e.to_string())?;
                        let discovery: Discovery = serde_json::from_slice(&body)
                            .map_err(|e| format!("{url}: not a discovery document: {e}"))?;
                        if let Ok(mut slot) = self.jwks_uri.lock() {
                            *slot = Some(discovery.jwks_uri.clone());
                        }
                        discovery.jwks_uri
                    }
                };
                match client.get(&jwks_uri).await {
                    Ok(body) => KeySet::from_jwks(&body),
                    Err(e) => {
                        // The issuer may have moved its JWKS; look it up again next time.
                        if let Ok(mut slot) = self.jwks_uri.lock() {
                            *slot = None;
                        }
                        Err(e.to_string())
                    }
                }
            }
        }
    }
}
