//! A tenant at run time: its configuration, token verifier, agent registry and limits, and the
//! set of tenants in force.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use jsonwebtoken::Algorithm;
use tether_tunnel::tls::{self, ClientRoots};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::auth::key_store::{KeySource, KeyStore};
use crate::auth::keys::KeySet;
use crate::auth::token::{TokenVerifier, VerifierSettings};
use crate::auth::token_review::TokenReviewer;
use crate::claims::ClaimPolicy;
use crate::config::TenantConfig;
use crate::error::SetupError;
use crate::https_client::HttpsClient;
use crate::registry::AgentRegistry;

/// One tenant cluster being served. Its configuration, verifier and limits can change at run
/// time (hot reload) while its registry, and so its connected agents, stay.
pub struct Tenant {
    /// The tenant's name (metric label).
    pub name: Arc<str>,
    config: ArcSwap<TenantConfig>,
    claims: ArcSwap<ClaimPolicy>,
    verifier: ArcSwap<TokenVerifier>,
    /// Its connected agents.
    pub registry: AgentRegistry,
    /// Dials waiting for an agent's answer.
    pub pending_dials: Limit,
    /// Tunnelled streams open.
    pub streams: Limit,
    /// Agents connected (`limits.max_agents`): one slot per agent, shared by its sessions.
    pub agent_slots: AgentSlots,
    /// New dials per second.
    pub dial_rate: RateLimit,
    /// Cancelled when the tenant is removed from the configuration.
    pub removed: CancellationToken,
}

/// A changed configuration for a tenant, with everything that can fail already built; applying
/// it ([`Tenant::commit`]) cannot fail.
pub struct TenantUpdate {
    config: TenantConfig,
    verifier: Option<TokenVerifier>,
}

impl Tenant {
    /// Builds the run-time tenant. Keys from a file must load; keys fetched over HTTPS may fail
    /// (the issuer may be down at start-up): the tenant then starts without keys and the periodic
    /// refresh, or the first unknown key id, fetches them.
    pub async fn build(config: TenantConfig) -> Result<Self, SetupError> {
        let verifier = verifier(&config).await?;
        let limits = &config.limits;
        Ok(Self {
            name: config.name.as_str().into(),
            pending_dials: Limit::new(limits.max_pending_dials),
            streams: Limit::new(limits.max_streams),
            agent_slots: AgentSlots::new(limits.max_agents),
            dial_rate: RateLimit::new(limits.dials_per_second, limits.dial_burst),
            verifier: ArcSwap::from_pointee(verifier),
            claims: ArcSwap::from_pointee(ClaimPolicy::new(&config.claims)),
            registry: AgentRegistry::default(),
            removed: CancellationToken::new(),
            config: ArcSwap::from_pointee(config),
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<TenantConfig> {
        self.config.load_full()
    }

    /// The claims rules in force.
    pub fn claims(&self) -> Arc<ClaimPolicy> {
        self.claims.load_full()
    }

    /// The token verifier in force.
    pub fn verifier(&self) -> Arc<TokenVerifier> {
        self.verifier.load_full()
    }

    /// Builds what a changed configuration needs (a new verifier when `auth` changed); nothing
    /// changes until [`commit`](Self::commit).
    pub async fn prepare(&self, config: TenantConfig) -> Result<TenantUpdate, SetupError> {
        let auth_changed = serde_json::to_value(&self.config().auth).ok() != serde_json::to_value(&config.auth).ok();
        let verifier = if auth_changed { Some(verifier(&config).await?) } else { None };
        Ok(TenantUpdate { config, verifier })
    }

    /// Applies a prepared update in place; connected agents stay.
    pub fn commit(&self, update: TenantUpdate) {
        let TenantUpdate { config, verifier } = update;
        if let Some(verifier) = verifier {
            self.verifier.store(Arc::new(verifier));
        }
        self.pending_dials.resize(config.limits.max_pending_dials);
        self.streams.resize(config.limits.max_streams);
        self.agent_slots.resize(config.limits.max_agents);
        self.dial_rate.resize(config.limits.dials_per_second, config.limits.dial_burst);
        self.claims.store(Arc::new(ClaimPolicy::new(&config.claims)));
        self.config.store(Arc::new(config));
    }

    /// Re-fetches signing keys every `auth.fetch.refresh_interval` until the tenant is removed
    /// or `stop` is cancelled.
    pub async fn refresh_keys_periodically(self: Arc<Self>, stop: CancellationToken) {
        loop {
            // Without keys every agent is refused (and the gateway is unready): retry soon.
            let fetch = &self.config().auth.fetch;
            let interval =
                if self.verifier().has_keys() { fetch.refresh_interval.0 } else { fetch.min_refresh_interval.0 };
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = stop.cancelled() => return,
                () = self.removed.cancelled() => return,
            }
            if let Err(e) = self.verifier().key_store().refresh().await {
                tracing::warn!(tenant = %self.name, error = %e, "periodic key refresh failed; keeping the cached keys");
            }
        }
    }
}

/// Most sessions one agent holds on one replica under its single agent slot: its held and busy
/// sessions (the agent allows at most 16 of each per replica) and one that lands on a replica it
/// already holds, before the agent closes it.
pub const MAX_SESSIONS_PER_AGENT: usize = 32;

type HeldSlots = Arc<Mutex<HashMap<String, Weak<AgentSlot>>>>;

/// The tenant's agent limit (`limits.max_agents`), counted in agents: an agent's first session on
/// this replica takes a slot, its further sessions (several per replica, busy sessions) share it,
/// and the slot comes back when the last of them has ended.
pub struct AgentSlots {
    limit: Limit,
    held: HeldSlots,
}

/// One agent's place under its tenant's agent limit, shared by its sessions on this replica.
pub struct AgentSlot {
    agent_id: String,
    held: HeldSlots,
    _permit: OwnedSemaphorePermit,
}

impl Drop for AgentSlot {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        // A new session of the agent may already have put a slot of its own in this one's place.
        if held.get(&self.agent_id).is_some_and(|slot| slot.strong_count() == 0) {
            held.remove(&self.agent_id);
        }
    }
}

/// Why an agent's session gets no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SlotRefused {
    /// The tenant has `limits.max_agents` agents connected, this one not among them.
    #[error("this cluster has reached its agent limit (limits.max_agents)")]
    Agents,
    /// The agent holds [`MAX_SESSIONS_PER_AGENT`] sessions here already.
    #[error("this agent holds as many sessions as one agent may on this gateway replica")]
    AgentSessions,
}

impl AgentSlots {
    /// Room for `max` agents.
    pub fn new(max: usize) -> Self {
        Self { limit: Limit::new(max), held: HeldSlots::default() }
    }

    /// Changes the maximum; agents over a lowered one stay until they leave.
    pub fn resize(&self, max: usize) {
        self.limit.resize(max);
    }

    /// Agents holding a slot now.
    #[cfg(test)]
    fn agents(&self) -> usize {
        self.held.lock().unwrap_or_else(PoisonError::into_inner).values().filter(|s| s.strong_count() > 0).count()
    }

    /// A free slot, taken before the agent has said who it is (before the upgrade, so that a full
    /// tenant refuses a new agent with 503). [`claim`](Self::claim) hands it to the agent, or
    /// gives it back when the agent holds a slot already.
    pub fn reserve(&self) -> Option<OwnedSemaphorePermit> {
        self.limit.try_acquire()
    }

    /// The slot of `agent_id` for one more of its sessions: the one it holds when it has a
    /// session here already (`reserved` then goes back), else `reserved` or a free one.
    pub fn claim(&self, agent_id: &str, reserved: Option<OwnedSemaphorePermit>) -> Result<Arc<AgentSlot>, SlotRefused> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = held.get(agent_id).and_then(Weak::upgrade) {
            // `slot` is one of the references counted; every session holds one.
            if Arc::strong_count(&slot) > MAX_SESSIONS_PER_AGENT {
                // Not dropped under the lock: were it the last reference, its drop would lock.
                drop(held);
                drop(slot);
                return Err(SlotRefused::AgentSessions);
            }
            return Ok(slot);
        }
        let permit = reserved.or_else(|| self.limit.try_acquire()).ok_or(SlotRefused::Agents)?;
        let slot = Arc::new(AgentSlot { agent_id: agent_id.to_owned(), held: self.held.clone(), _permit: permit });
        held.insert(agent_id.to_owned(), Arc::downgrade(&slot));
        Ok(slot)
    }
}

/// A concurrency limit that can be resized while permits are held.
pub struct Limit {
    semaphore: Arc<Semaphore>,
    max: AtomicUsize,
}

impl Limit {
    /// A limit of `max` concurrent holders.
    pub fn new(max: usize) -> Self {
        Self { semaphore: Arc::new(Semaphore::new(max)), max: AtomicUsize::new(max) }
    }

    /// The configured maximum.
    pub fn max(&self) -> usize {
        self.max.load(Ordering::Relaxed)
    }

    /// Takes a permit for as long as the returned guard lives, if one is free.
    pub fn try_acquire(&self) -> Option<OwnedSemaphorePermit> {
        self.semaphore.clone().try_acquire_owned().ok()
    }

    /// Changes the maximum. Shrinking takes effect as holders release their permits.
    pub fn resize(&self, max: usize) {
        let old = self.max.swap(max, Ordering::Relaxed);
        if max > old {
            self.semaphore.add_permits(max - old);
        } else if old > max {
            let surplus = old - max;
            let forgotten = self.semaphore.forget_permits(surplus);
            let still = surplus - forgotten;
            if still > 0 {
                let semaphore = self.semaphore.clone();
                let count = u32::try_from(still).unwrap_or(u32::MAX);
                tokio::spawn(async move {
                    if let Ok(permits) = semaphore.acquire_many_owned(count).await {
                        permits.forget();
                    }
                });
            }
        }
    }
}

/// A token bucket: `rate` takes per second sustained, up to `burst` at once; rate 0: no limit.
pub struct RateLimit {
    bucket: Mutex<Bucket>,
}

struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl RateLimit {
    /// A full bucket.
    pub fn new(rate: u32, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        Self { bucket: Mutex::new(Bucket { rate: f64::from(rate), burst, tokens: burst, last: Instant::now() }) }
    }

    /// Takes one if the bucket holds one.
    pub fn try_take(&self) -> bool {
        let Ok(mut bucket) = self.bucket.lock() else { return true };
        if bucket.rate == 0.0 {
            return true;
        }
        let now = Instant::now();
        let refill = now.duration_since(bucket.last).as_secs_f64() * bucket.rate;
        bucket.tokens = (bucket.tokens + refill).min(bucket.burst);
        bucket.last = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// The sustained rate (0: no limit).
    pub fn rate(&self) -> u32 {
        self.bucket.lock().map(|b| b.rate as u32).unwrap_or_default()
    }

    /// Changes rate and burst, keeping what the bucket holds (up to the new burst).
    pub fn resize(&self, rate: u32, burst: u32) {
        if let Ok(mut bucket) = self.bucket.lock() {
            bucket.rate = f64::from(rate);
            bucket.burst = f64::from(burst.max(1));
            bucket.tokens = bucket.tokens.min(bucket.burst);
        }
    }
}

async fn verifier(config: &TenantConfig) -> Result<TokenVerifier, SetupError> {
    let auth = &config.auth;
    let key = |field: &str| format!("tenants[{}].auth.{field}", config.name);
    let algorithms = auth
        .algorithms
        .iter()
        .map(|a| a.parse::<Algorithm>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| SetupError::invalid(key("algorithms"), e))?;
    let settings = VerifierSettings {
        issuer: auth.issuer.clone(),
        audiences: auth.audiences.clone(),
        algorithms,
        allowed_subjects: auth.allowed_subjects.iter().cloned().collect(),
        leeway: auth.leeway.0,
    };
    if let Some(review) = &auth.token_review {
        let client = https_client(
            &key("token_review"),
            review.ca_file.as_deref(),
            Some(&review.bearer_token_file),
            review.timeout.0,
        )
        .await?;
        let reviewer = TokenReviewer::new(
            &review.server,
            client,
            auth.audiences.clone(),
            review.cache_ttl.0,
            review.max_concurrent,
            review.timeout.0,
        );
        return Ok(TokenVerifier::with_token_review(settings, reviewer));
    }
    let min_refresh = auth.fetch.min_refresh_interval.0;
    let store = if let Some(file) = &auth.hmac_secret_file {
        let secret = tokio::fs::read(file).await.map_err(|e| SetupError::file(key("hmac_secret_file"), e))?;
        let trimmed = String::from_utf8_lossy(&secret).trim().as_bytes().to_vec();
        let keys = KeySet::from_hmac_secret(&trimmed).map_err(|e| SetupError::file(key("hmac_secret_file"), e))?;
        KeyStore::new(KeySource::Fixed, keys, min_refresh)
    } else if let Some(file) = &auth.jwks_file {
        let path = file.clone();
        let keys = tokio::task::spawn_blocking(move || KeySet::from_file(&path))
            .await
            .map_err(|e| SetupError::file(key("jwks_file"), e))?
            .map_err(|e| SetupError::file(key("jwks_file"), e))?;
        KeyStore::new(KeySource::File(file.clone()), keys, min_refresh)
    } else {
        let client = https_client(
            &key("fetch"),
            auth.fetch.ca_file.as_deref(),
            auth.fetch.bearer_token_file.as_deref(),
            auth.fetch.timeout.0,
        )
        .await?;
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

async fn https_client(
    key: &str,
    ca_file: Option<&Path>,
    bearer_file: Option<&Path>,
    timeout: Duration,
) -> Result<HttpsClient, SetupError> {
    let roots = ClientRoots { ca_file: ca_file.map(Path::to_owned), system_roots: ca_file.is_none() };
    let tls = tls::client_config(&roots, None, &[tls::ALPN_HTTP11]).map_err(|e| SetupError::tls(key, e))?;
    let bearer = match bearer_file {
        Some(path) => Some(
            tokio::fs::read_to_string(path)
                .await
                .map_err(|e| {
                    SetupError::file(format!("{key}.bearer_token_file"), format!("cannot read {}: {e}", path.display()))
                })?
                .trim()
                .to_owned(),
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
    by_client_name: HashMap<String, Arc<Tenant>>,
}

impl Tenants {
    /// Builds every tenant; fails on the first that cannot be set up.
    pub async fn build(configs: &[TenantConfig]) -> Result<Self, SetupError> {
        let mut list = Vec::new();
        for config in configs {
            list.push(Arc::new(Tenant::build(config.clone()).await?));
        }
        Ok(Self::from_list(list))
    }

    /// Indexes existing tenants by their current host names.
    pub fn from_list(list: Vec<Arc<Tenant>>) -> Self {
        let mut by_host = HashMap::new();
        let mut by_client_name = HashMap::new();
        for tenant in &list {
            let config = tenant.config();
            for host in &config.hosts {
                by_host.insert(host.to_ascii_lowercase(), tenant.clone());
            }
            for name in &config.frontend.client_names {
                by_client_name.insert(name.to_ascii_lowercase(), tenant.clone());
            }
        }
        Self { list, by_host, by_client_name }
    }

    /// The tenant whose kube-apiserver client certificates carry `name` (shared frontend).
    pub fn for_client_name(&self, name: &str) -> Option<Arc<Tenant>> {
        self.by_client_name.get(&name.to_ascii_lowercase()).cloned()
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

/// The tenants in force; replaced as a whole, in one step, on reload.
#[derive(Default)]
pub struct TenantSet {
    current: ArcSwap<Tenants>,
}

impl TenantSet {
    /// Puts `tenants` in force.
    pub fn new(tenants: Tenants) -> Self {
        Self { current: ArcSwap::from_pointee(tenants) }
    }

    /// The tenants in force now.
    pub fn load(&self) -> Arc<Tenants> {
        self.current.load_full()
    }

    /// Replaces the tenants in force.
    pub fn replace(&self, tenants: Tenants) {
        self.current.store(Arc::new(tenants));
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

/// Test support: a tenant built from a real configuration (a shared-secret issuer written to a
/// temporary file), with `routing` as its chain.
#[cfg(test)]
pub(crate) async fn test_tenant(name: &str, routing: &[crate::config::RoutingStrategy]) -> Arc<Tenant> {
    let dir = std::env::temp_dir().join(format!("tether-tenant-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_default();
    let secret = dir.join("secret");
    std::fs::write(&secret, "a test secret that is long enough for HS256").unwrap_or_default();
    let config: TenantConfig = serde_json::from_value(serde_json::json!({
        "name": name,
        "hosts": [format!("{name}.test")],
        "auth": { "issuer": "https://issuer.test", "audiences": ["tether"], "algorithms": ["HS256"], "hmac_secret_file": secret },
        "routing": routing,
        "limits": { "dial_timeout": "1s" },
    }))
    .unwrap_or_else(|e| panic!("test tenant config: {e}"));
    let tenant = Tenant::build(config).await;
    // The secret is read once, at build: the directory need not outlive it.
    std::fs::remove_dir_all(&dir).unwrap_or_default();
    Arc::new(tenant.unwrap_or_else(|e| panic!("test tenant: {e}")))
}

#[cfg(test)]
mod tests {
    use super::strip_port;

    #[tokio::test]
    async fn the_dial_rate_allows_its_burst_then_refills_at_its_rate() {
        let limit = super::RateLimit::new(10, 3);
        assert_eq!((0..5).filter(|_| limit.try_take()).count(), 3, "the burst, then nothing");
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        let refilled = (0..5).filter(|_| limit.try_take()).count();
        assert!((2..=3).contains(&refilled), "about 2.5 refilled at 10/s in 250 ms: {refilled}");
        limit.resize(0, 1);
        assert!((0..100).all(|_| limit.try_take()), "rate 0 is no limit");
    }

    #[test]
    fn an_agents_sessions_share_one_slot_which_comes_back_after_the_last() {
        use super::{AgentSlots, MAX_SESSIONS_PER_AGENT, SlotRefused};
        let slots = AgentSlots::new(1);
        let reserved = slots.reserve().expect("a free slot");
        assert!(slots.reserve().is_none(), "the only slot is reserved");
        let first = slots.claim("node-a", Some(reserved)).expect("the reserved slot");
        // Further sessions of node-a share it, reserved or not; another agent finds none.
        let second = slots.claim("node-a", None).expect("node-a's own slot");
        assert_eq!(slots.claim("node-b", None).err(), Some(SlotRefused::Agents));
        assert_eq!(slots.agents(), 1);
        drop(first);
        assert!(slots.claim("node-b", None).is_err(), "node-a still has a session");
        drop(second);
        assert_eq!(slots.agents(), 0);
        let b = slots.claim("node-b", None).expect("node-a's slot came back");
        // A slot reserved for a session that turns out to be node-b's goes back.
        slots.resize(2);
        let reserved = slots.reserve().expect("the second slot");
        let b2 = slots.claim("node-b", Some(reserved)).expect("node-b's own");
        assert!(slots.reserve().is_some(), "the reserved slot went back");
        drop((b, b2));
        // One agent holds at most MAX_SESSIONS_PER_AGENT sessions under its slot.
        let many: Vec<_> = (0..MAX_SESSIONS_PER_AGENT).map(|_| slots.claim("node-c", None).expect("room")).collect();
        assert_eq!(slots.claim("node-c", None).err(), Some(SlotRefused::AgentSessions));
        drop(many);
        assert_eq!(slots.agents(), 0);
    }

    #[test]
    fn ports_are_stripped_from_hosts() {
        assert_eq!(strip_port("acme.example.com:443"), "acme.example.com");
        assert_eq!(strip_port("acme.example.com"), "acme.example.com");
        assert_eq!(strip_port("[::1]:8443"), "::1");
        assert_eq!(strip_port("::1"), "::1");
    }
}
