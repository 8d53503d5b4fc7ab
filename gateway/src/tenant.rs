//! A tenant at run time: its configuration, token verifier, agent registry and limits.

use std::collections::HashMap;
use std::sync::Arc;

use jsonwebtoken::Algorithm;
use tokio::sync::Semaphore;

use crate::auth::keys::KeySet;
use crate::auth::token::{TokenVerifier, VerifierSettings};
use crate::config::TenantConfig;
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
    /// Builds the run-time tenant, loading its keys.
    pub fn from_config(config: TenantConfig) -> anyhow::Result<Self> {
        let keys = KeySet::from_file(&config.auth.jwks_file)
            .map_err(|e| anyhow::anyhow!("tenant {}: auth.jwks_file: {e}", config.name))?;
        if keys.is_empty() {
            tracing::warn!(tenant = %config.name, "the JWKS file holds no usable keys; every agent will be refused");
        }
        let algorithms = config
            .auth
            .algorithms
            .iter()
            .map(|a| a.parse::<Algorithm>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("tenant {}: auth.algorithms: {e}", config.name))?;
        let verifier = TokenVerifier::new(
            VerifierSettings {
                issuer: config.auth.issuer.clone(),
                audiences: config.auth.audiences.clone(),
                algorithms,
                allowed_subjects: config.auth.allowed_subjects.iter().cloned().collect(),
                leeway: config.auth.leeway.0,
            },
            keys,
        );
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
}

/// All tenants, found by name or by the host name their agents connect to.
#[derive(Default)]
pub struct Tenants {
    list: Vec<Arc<Tenant>>,
    by_host: HashMap<String, Arc<Tenant>>,
}

impl Tenants {
    /// Builds every tenant; fails on the first that cannot be set up.
    pub fn build(configs: &[TenantConfig]) -> anyhow::Result<Self> {
        let mut tenants = Self::default();
        for config in configs {
            let tenant = Arc::new(Tenant::from_config(config.clone())?);
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
