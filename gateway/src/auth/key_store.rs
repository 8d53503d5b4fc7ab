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

use super::keys::{KeyError, KeySet};
use crate::https_client::{FetchError, HttpsClient};

/// Why the keys could not be refreshed (the cached keys stay in use).
#[derive(Debug, Clone, thiserror::Error)]
pub enum RefreshError {
    /// The issuer, the discovery document or the JWKS URL could not be fetched.
    #[error("{source_name}: {error}")]
    Fetch {
        /// Where the keys come from.
        source_name: String,
        /// Why.
        error: FetchError,
    },
    /// What came back is not a usable key set or discovery document.
    #[error("{source_name}: {reason}")]
    Invalid {
        /// Where the keys come from.
        source_name: String,
        /// Why.
        reason: String,
    },
}

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

    /// Fetches the keys now; on failure the cached keys stay.
    pub async fn refresh(&self) -> Result<usize, RefreshError> {
        let _one_at_a_time = self.refreshing.lock().await;
        self.refresh_locked().await
    }

    async fn refresh_locked(&self) -> Result<usize, RefreshError> {
        if let Ok(mut last) = self.last_attempt.lock() {
            *last = Some(Instant::now());
        }
        let source_name = self.source.describe();
        let keys = self.fetch().await.map_err(|e| match e {
            Fetched::Transport(error) => RefreshError::Fetch { source_name: source_name.clone(), error },
            Fetched::Invalid(reason) => RefreshError::Invalid { source_name: source_name.clone(), reason },
        })?;
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

    async fn fetch(&self) -> Result<KeySet, Fetched> {
        match &self.source {
            KeySource::Fixed => Ok(KeySet::default()),
            KeySource::File(path) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || KeySet::from_file(&path))
                    .await
                    .map_err(|e| Fetched::Invalid(e.to_string()))?
                    .map_err(Fetched::from)
            }
            KeySource::Url { url, client } => {
                let body = client.get(url).await.map_err(Fetched::Transport)?;
                Ok(KeySet::from_jwks(&body)?)
            }
            KeySource::Discovery { issuer, client } => {
                let cached = self.jwks_uri.lock().ok().and_then(|u| u.clone());
                let jwks_uri = match cached {
                    Some(uri) => uri,
                    None => {
                        let url = format!("{}/.well-known/openid-configuration", issuer.trim_end_matches('/'));
                        let body = client.get(&url).await.map_err(Fetched::Transport)?;
                        let discovery: Discovery = serde_json::from_slice(&body)
                            .map_err(|e| Fetched::Invalid(format!("{url}: not a discovery document: {e}")))?;
                        if let Ok(mut slot) = self.jwks_uri.lock() {
                            *slot = Some(discovery.jwks_uri.clone());
                        }
                        discovery.jwks_uri
                    }
                };
                match client.get(&jwks_uri).await {
                    Ok(body) => Ok(KeySet::from_jwks(&body)?),
                    Err(e) => {
                        // The issuer may have moved its JWKS; look it up again next time.
                        if let Ok(mut slot) = self.jwks_uri.lock() {
                            *slot = None;
                        }
                        Err(Fetched::Transport(e))
                    }
                }
            }
        }
    }
}

/// What went wrong fetching, before the source is named.
enum Fetched {
    Transport(FetchError),
    Invalid(String),
}

impl From<KeyError> for Fetched {
    fn from(e: KeyError) -> Self {
        Self::Invalid(e.to_string())
    }
}
