//! Applying a new configuration while serving, as one transaction: first everything that can fail
//! is built - every new or changed tenant's verifier and limits, every new frontend socket (a
//! frontend whose address or socket path stays keeps its socket) - and only when all of it
//! succeeded is it put in force, in one step. A failure changes nothing, and the log says so.
//! Connected agents of changed tenants stay; removed tenants' agents are drained.

use std::path::PathBuf;
use std::sync::Arc;

use tether_tunnel::settings::SettingsError;

use crate::certs::CertRegistry;
use crate::config::{ConfigError, GatewayConfig};
use crate::error::SetupError;
use crate::frontend::{self, Frontend, FrontendContext, FrontendSet};
use crate::lifecycle::Lifecycle;
use crate::metrics::{CONFIG_LAST_RELOAD_OK, CONFIG_RELOADS};
use crate::peers::PeerSet;
use crate::tenant::{Tenant, TenantSet, TenantUpdate, Tenants};

/// What a reload changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReloadSummary {
    /// Tenants added.
    pub added: Vec<String>,
    /// Tenants whose configuration changed.
    pub changed: Vec<String>,
    /// Tenants removed (their agents are drained).
    pub removed: Vec<String>,
    /// Settings that changed but need a restart.
    pub needs_restart: Vec<String>,
}

/// Why a reload changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The file could not be read or parsed.
    #[error(transparent)]
    Load(#[from] SettingsError),
    /// The configuration is not valid.
    #[error("invalid configuration; keeping the one in force:\n{}", .0.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<ConfigError>),
    /// Part of it could not be put into service.
    #[error("{0}; keeping the configuration in force")]
    Setup(#[from] SetupError),
}

/// Applies configurations to a running gateway, one at a time.
pub struct Reloader {
    /// The file the configuration comes from.
    pub config_path: Option<PathBuf>,
    /// The configuration the process started with (process-wide settings need a restart).
    pub started: GatewayConfig,
    /// The tenants in force.
    pub tenants: Arc<TenantSet>,
    /// The tenants' serving frontends.
    pub frontends: Arc<FrontendSet>,
    /// What the frontends serve with.
    pub frontend_context: Arc<FrontendContext>,
    /// Certificates to re-read.
    pub certs: Arc<CertRegistry>,
    /// The other replicas, when configured.
    pub peers: Option<Arc<PeerSet>>,
    /// For the key-refresh tasks of added tenants.
    pub lifecycle: Arc<Lifecycle>,
    one_at_a_time: tokio::sync::Mutex<()>,
}

/// A tenant's part of a reload, everything fallible already done.
enum Planned {
    Added(Arc<Tenant>, Vec<Frontend>),
    Changed(Arc<Tenant>, Box<TenantUpdate>, Option<Vec<Frontend>>),
    Unchanged(Arc<Tenant>),
}

impl Reloader {
    /// A reloader for a gateway serving `tenants` on `frontends`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config_path: Option<PathBuf>,
        started: GatewayConfig,
        tenants: Arc<TenantSet>,
        frontends: Arc<FrontendSet>,
        frontend_context: Arc<FrontendContext>,
        certs: Arc<CertRegistry>,
        peers: Option<Arc<PeerSet>>,
        lifecycle: Arc<Lifecycle>,
    ) -> Self {
        Self {
            config_path,
            started,
            tenants,
            frontends,
            frontend_context,
            certs,
            peers,
            lifecycle,
            one_at_a_time: tokio::sync::Mutex::new(()),
        }
    }

    /// Re-reads the configuration file and applies it; the outcome is logged and counted.
    pub async fn reload(&self) -> Result<ReloadSummary, ReloadError> {
        let path = self.config_path.clone();
        // Validation follows in `apply_inner`, with the problems listed one by one.
        let loaded =
            tokio::task::spawn_blocking(move || tether_tunnel::settings::load::<GatewayConfig>(path.as_deref())).await;
        let result = match loaded {
            Ok(Ok(config)) => self.apply_inner(config).await,
            Ok(Err(e)) => Err(ReloadError::Load(e)),
            Err(e) => Err(ReloadError::Setup(SetupError::file("configuration", e))),
        };
        record(&result);
        result
    }

    /// Applies `config`: tenants are added, changed in place or removed (their agents drained),
    /// certificates re-read. Other tenants' connections are untouched. If anything in the new
    /// configuration is invalid or cannot be set up, nothing changes. Listener addresses and
    /// process-wide settings need a restart; changes to them are reported and ignored.
    pub async fn apply(&self, config: GatewayConfig) -> Result<ReloadSummary, ReloadError> {
        let result = self.apply_inner(config).await;
        record(&result);
        result
    }

    async fn apply_inner(&self, config: GatewayConfig) -> Result<ReloadSummary, ReloadError> {
        let _one_at_a_time = self.one_at_a_time.lock().await;
        let check_files = true;
        let config_for_check = config.clone();
        let problems = tokio::task::spawn_blocking(move || config_for_check.validate_with(check_files))
            .await
            .map_err(|e| ReloadError::Setup(SetupError::file("configuration", e)))?;
        if !problems.is_empty() {
            return Err(ReloadError::Invalid(problems));
        }
        let mut summary = ReloadSummary { needs_restart: self.needs_restart(&config), ..ReloadSummary::default() };
        let current = self.tenants.load();

        // Everything that can fail, with no effect on what is in force.
        let mut plan = Vec::new();
        for tenant_config in &config.tenants {
            let planned = match current.by_name(&tenant_config.name) {
                None => {
                    let tenant = Arc::new(Tenant::build(tenant_config.clone()).await?);
                    let frontends = frontend::bind(tenant_config, &self.certs, &[]).await?;
                    Planned::Added(tenant, frontends)
                }
                Some(tenant) if json(&*tenant.config()) != json(tenant_config) => {
                    let frontends_changed = json(&tenant.config().frontend) != json(&tenant_config.frontend);
                    let update = tenant.prepare(tenant_config.clone()).await?;
                    let frontends = if frontends_changed {
                        let existing = self.frontends.sockets(&tenant.name);
                        Some(frontend::bind(tenant_config, &self.certs, &existing).await?)
                    } else {
                        None
                    };
                    Planned::Changed(tenant, Box::new(update), frontends)
                }
                Some(tenant) => Planned::Unchanged(tenant),
            };
            plan.push(planned);
        }

        // Put it in force; nothing below fails.
        let mut in_force = Vec::new();
        for planned in plan {
            match planned {
                Planned::Added(tenant, frontends) => {
                    self.frontends.replace(&tenant, frontends, &self.frontend_context).await;
                    tokio::spawn(tenant.clone().refresh_keys_periodically(self.lifecycle.hard_stop().clone()));
                    summary.added.push(tenant.name.to_string());
                    in_force.push(tenant);
                }
                Planned::Changed(tenant, update, frontends) => {
                    tenant.commit(*update);
                    if let Some(frontends) = frontends {
                        self.frontends.replace(&tenant, frontends, &self.frontend_context).await;
                    }
                    summary.changed.push(tenant.name.to_string());
                    in_force.push(tenant);
                }
                Planned::Unchanged(tenant) => in_force.push(tenant),
            }
        }
        for tenant in current.iter() {
            if !config.tenants.iter().any(|t| t.name == *tenant.name) {
                tenant.removed.cancel();
                self.frontends.remove(&tenant.name).await;
                summary.removed.push(tenant.name.to_string());
            }
        }
        self.tenants.replace(Tenants::from_list(in_force));
        if let (Some(peers), Some(peer_config)) = (&self.peers, &config.peers) {
            peers.reconfigure(peer_config.clone());
            peers.refresh().await;
        }
        let certs = self.certs.clone();
        let failures = tokio::task::spawn_blocking(move || certs.reload_all()).await.unwrap_or_default();
        for error in failures {
            tracing::error!(%error, "certificate reload failed; keeping the old certificate");
        }
        tracing::info!(
            added = ?summary.added,
            changed = ?summary.changed,
            removed = ?summary.removed,
            needs_restart = ?summary.needs_restart,
            "configuration reloaded"
        );
        Ok(summary)
    }

    /// Process-wide settings that differ from the ones the process started with.
    fn needs_restart(&self, config: &GatewayConfig) -> Vec<String> {
        let started = &self.started;
        [
            ("listen", json(&started.listen) == json(&config.listen)),
            ("tls", json(&started.tls) == json(&config.tls)),
            ("keepalive", json(&started.keepalive) == json(&config.keepalive)),
            ("limits", json(&started.limits) == json(&config.limits)),
            ("shared_frontend", json(&started.shared_frontend) == json(&config.shared_frontend)),
            (
                "peers.listen/peers.tls",
                json(&started.peers.as_ref().map(|p| (&p.listen, &p.tls)))
                    == json(&config.peers.as_ref().map(|p| (&p.listen, &p.tls))),
            ),
            ("server_id", started.server_id == config.server_id),
        ]
        .into_iter()
        .filter(|(_, same)| !same)
        .map(|(setting, _)| setting.to_owned())
        .collect()
    }
}

fn json<T: serde::Serialize>(value: &T) -> Option<serde_json::Value> {
    serde_json::to_value(value).ok()
}

fn record(result: &Result<ReloadSummary, ReloadError>) {
    let label = if result.is_ok() { "ok" } else { "error" };
    metrics::counter!(CONFIG_RELOADS, "result" => label).increment(1);
    metrics::gauge!(CONFIG_LAST_RELOAD_OK).set(if result.is_ok() { 1.0 } else { 0.0 });
    if let Err(e) = result {
        tracing::error!(error = %e, "configuration reload failed; the previous configuration stays in force");
    }
}
