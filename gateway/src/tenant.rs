//! A tenant at run time: its configuration, token verifier, agent registry and limits.

use std::collections::HashMap;
use std::sync::Arc;

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use jsonwebtoken::Algorithm;
use tether_tunnel::tls::{self, ClientRoots};
use tokio::sync::Semaphore;

use crate::auth::key_store::{KeySource, KeyStore};
use crate::auth::keys::KeySet;
use crate::auth::token::{TokenVerifier, VerifierSettings};
use crate::auth::token_review::TokenReviewer;
use crate::config::TenantConfig;
use crate::https_client::HttpsClient;
use crate::registry::AgentRegistry;

/// One tenant cluster being served.
pub struct Tenant {
    /// The tenant's name (metric label).
    pub name: Arc<str>,
    /// Its configuration.
    pub config: TenantConfig,
    /// Checks its agents' tokens.
    pub verifier: TokenVerifier,
    /// Its connected agents.
    pub registry: AgentRegistry,
    /// Dials waiting for an agent's answer.
    pub pending_dials: Arc<Semaphore>,
    /// Tunnelled streams open.
    pub streams: Arc<Semaphore>,
    /// Agent sessions connected.
    pub agent_slots: Arc<Semaphore>,
}

impl Tenant {
    /// Builds the run-time tenant. Keys from a file must load; keys fetched over HTTPS may fail
    /// (the issuer may be down at start-up): the tenant then starts without keys and the periodic
    /// refresh, or the first unknown key id, fetches them.
    pub async fn build(config: TenantConfig) -> anyhow::Result<Self> {
        let verifier = verifier(&config).await?;
        Ok(Self {
            name: config.name.as_str().into(),
            pending_dials: Arc::new(Semaphore::new(config.limits.max_pending_dials)),
            streams: Arc::new(Semaphore::new(config.limits.max_streams)),
            agent_slots: Arc::new(Semaphore::new(config.limits.max_agents)),
            verifier,
            registry: AgentRegistry::default(),
            config,
        })
    }

    /// Re-fetches signing keys every `auth.fetch.refresh_interval` until `stop` is cancelled.
    pub async fn refresh_keys_periodically(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        let interval = self.config.auth.fetch.refresh_interval.0;
        loop {
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = stop.cancelled() => return,
            }
            if let Err(e) = self.verifier.key_store().refresh().await {
                tracing::warn!(tenant = %self.name, error = %e, "periodic key refresh failed; keeping the cached keys");
            }
        }
    }
}

async fn verifier(config: &TenantConfig) -> anyhow::Result<TokenVerifier> {
    let auth = &config.auth;
    let context = |field: &str| format!("tenant {}: auth.{field}", config.name);
    let algorithms = auth
        .algorithms
        .iter()
        .map(|a| a.parse::<Algorithm>())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| context("algorithms"))?;
    let settings = VerifierSettings {
        issuer: auth.issuer.clone(),
        audiences: auth.audiences.clone(),
        algorithms,
        allowed_subjects: auth.allowed_subjects.iter().cloned().collect(),
        leeway: auth.leeway.0,
    };
    if let Some(review) = &auth.token_review {
        let client = https_client(review.ca_file.as_deref(), Some(&review.bearer_token_file), review.timeout.0)
            .with_context(|| context("token_review"))?;
        let reviewer = TokenReviewer::new(&review.server, client, auth.audiences.clone(), review.cache_ttl.0);
        return Ok(TokenVerifier::with_token_review(settings, reviewer));
    }
    let min_refresh = auth.fetch.min_refresh_interval.0;
    let store = if let Some(file) = &auth.hmac_secret_file {
        let secret = std::fs::read(file).with_context(|| context("hmac_secret_file"))?;
        let trimmed = String::from_utf8_lossy(&secret).trim().as_bytes().to_vec();
        let keys = KeySet::from_hmac_secret(&trimmed)
            .map_err(anyhow::Error::msg)
            .with_context(|| context("hmac_secret_file"))?;
        KeyStore::new(KeySource::Fixed, keys, min_refresh)
    } else if let Some(file) = &auth.jwks_file {
        let keys = KeySet::from_file(file).map_err(anyhow::Error::msg).with_context(|| context("jwks_file"))?;
        KeyStore::new(KeySource::File(file.clone()), keys, min_refresh)
    } else {
        let client =
            https_client(auth.fetch.ca_file.as_deref(), auth.fetch.bearer_token_file.as_deref(), auth.fetch.timeout.0)
                .with_context(|| context("fetch"))?;
        let source = match &auth.jwks_url {
            Some(url) => KeySource::Url { url: url.clone(), client },
            None => KeySource::Discovery { issuer: auth.issuer.clone(), client },
        };
        let store = KeyStore::new(source, KeySet::default(), min_refresh);
        match store.refresh().await {
            Ok(count) => tracing::info!(tenant = %config.name, keys = count, "signing keys fetched"),
            Err(e) => {
                tracing::error!(tenant = %config.name, error = %e, "cannot fetch signing keys yet; agents are refused until they load")
            }
        }
        store
    };
    if store.current().is_empty() && auth.token_review.is_none() {
        tracing::warn!(tenant = %config.name, "no usable signing keys; every agent will be refused until keys load");
    }
    Ok(TokenVerifier::new(settings, Arc::new(store)))
}

fn https_client(ca_file: Option<&Path>, bearer_file: Option<&Path>, timeout: Duration) -> anyhow::Result<HttpsClient> {
    let roots = ClientRoots { ca_file: ca_file.map(Path::to_owned), system_roots: ca_file.is_none() };
    let tls = tls::client_config(&roots, None, &[tls::ALPN_HTTP11])?;
    let bearer = match bearer_file {
        Some(path) => Some(
            std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?.trim().to_owned(),
        ),
        None => None,
    };
    Ok(HttpsClient::new(Arc::new(tls), bearer, timeout))
}

/// All tenants, found by name or by the host name their agents connect to.
#[derive(Default)]
pub struct Tenants {
    list: Vec<Arc<Tenant>>,
    by_host: HashMap<String, Arc<Tenant>>,
}

impl Tenants {
    /// Builds every tenant; fails on the first that cannot be set up.
    pub async fn build(configs: &[TenantConfig]) -> anyhow::Result<Self> {
        let mut tenants = Self::default();
        for config in configs {
            let tenant = Arc::new(Tenant::build(config.clone()).await?);
            for host in &config.hosts {
                tenants.by_host.insert(host.to_ascii_lowercase(), tenant.clone());
            }
            tenants.list.push(tenant);
        }
        Ok(tenants)
    }

    /// The tenant serving `host` (port and trailing dot ignored, case-insensitive).
    pub fn for_host(&self, host: &str) -> Option<Arc<Tenant>> {
        let host = strip_port(host).trim_end_matches('.').to_ascii_lowercase();
        self.by_host.get(&host).cloned()
    }

    /// The tenant called `name`.
    pub fn by_name(&self, name: &str) -> Option<Arc<Tenant>> {
        self.list.iter().find(|t| &*t.name == name).cloned()
    }

    /// All tenants.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Tenant>> {
        self.list.iter()
    }
}

/// `host:port` -> `host`; IPv6 literals keep their brackets off.
pub fn strip_port(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) && !name.contains(':') => name,
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::strip_port;

    #[test]
    fn ports_are_stripped_from_hosts() {
        assert_eq!(strip_port("acme.example.com:443"), "acme.example.com");
        assert_eq!(strip_port("acme.example.com"), "acme.example.com");
        assert_eq!(strip_port("[::1]:8443"), "::1");
        assert_eq!(strip_port("::1"), "::1");
    }
}
