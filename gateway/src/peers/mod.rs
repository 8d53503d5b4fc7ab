//! Gateway replicas working as one: they find each other (a headless Service's DNS name or a
//! fixed list), fetch each other's inventory (which agents each holds, per tenant; bounded), and
//! tell agents how many replicas there are. The router asks which peers can serve a dial; the
//! peer endpoint (`crate::peer_endpoint`) serves other replicas. Replicas authenticate each other
//! with mutual TLS.

pub mod client;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::config::{PeersConfig, RoutingStrategy};
use crate::registry::{ClaimMemory, Summary};
use crate::target::{DialTarget, TargetHost};
use client::{PeerClient, PeerTlsError};

/// What one replica holds, as published to its peers.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Inventory {
    /// The replica's id.
    pub server_id: String,
    /// Whether it is shutting down (peers stop sending it work).
    #[serde(default)]
    pub draining: bool,
    /// Per tenant name.
    #[serde(default)]
    pub tenants: BTreeMap<String, TenantInventory>,
    /// Set when entries were left out to stay within the size limit.
    #[serde(default)]
    pub truncated: bool,
}

/// The agents one replica holds for one tenant.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TenantInventory {
    /// Agent sessions.
    pub agents: usize,
    /// Sessions flagged as default routes.
    pub default_routes: usize,
    /// Host names the agents serve.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Addresses the agents serve.
    #[serde(default)]
    pub addresses: Vec<IpAddr>,
    /// Networks the agents serve.
    #[serde(default)]
    pub cidrs: Vec<IpNet>,
}

impl From<Summary> for TenantInventory {
    fn from(summary: Summary) -> Self {
        Self {
            agents: summary.agents,
            default_routes: summary.default_routes,
            hosts: summary.hosts,
            addresses: summary.addresses,
            cidrs: summary.cidrs,
        }
    }
}

/// A peer's inventory indexed for routing.
#[derive(Debug, Default)]
struct TenantIndex {
    agents: usize,
    default_routes: usize,
    hosts: HashSet<String>,
    addresses: HashSet<IpAddr>,
    cidrs: Vec<IpNet>,
}

impl TenantIndex {
    fn from_inventory(inventory: &TenantInventory) -> Self {
        Self {
            agents: inventory.agents,
            default_routes: inventory.default_routes,
            hosts: inventory.hosts.iter().cloned().collect(),
            addresses: inventory.addresses.iter().copied().collect(),
            cidrs: inventory.cidrs.clone(),
        }
    }

    fn lists(&self, host: &TargetHost) -> bool {
        match host {
            TargetHost::Name(name) => self.hosts.contains(name),
            TargetHost::Ip(ip) => self.addresses.contains(ip) || self.cidrs.iter().any(|n| n.contains(ip)),
        }
    }

    fn serves(&self, strategy: RoutingStrategy, target: &DialTarget, truncated: bool) -> bool {
        match strategy {
            // A truncated inventory may not list the match: ask the peer.
            RoutingStrategy::DestHost => self.lists(&target.host) || (truncated && self.agents > 0),
            RoutingStrategy::DefaultRoute => self.default_routes > 0,
            RoutingStrategy::LeastLoaded => self.agents > 0,
        }
    }
}

/// One other replica as last seen.
struct Peer {
    addr: SocketAddr,
    server_id: String,
    draining: bool,
    truncated: bool,
    tenants: BTreeMap<String, TenantIndex>,
}

/// The replicas this gateway knows about.
pub struct PeerSet {
    config: RwLock<PeersConfig>,
    server_id: String,
    client: PeerClient,
    peers: RwLock<Vec<Arc<Peer>>>,
    count: watch::Sender<u32>,
    refreshing: tokio::sync::Mutex<Option<Instant>>,
    /// Per tenant: what peers listed before and no longer list (agents that moved or left).
    departed: Mutex<HashMap<String, ClaimMemory>>,
}

impl PeerSet {
    /// A peer set for this replica (`server_id`) with the given configuration.
    pub fn new(config: PeersConfig, server_id: String) -> Result<Self, PeerTlsError> {
        let client = PeerClient::new(&config.tls)?;
        let (count, _) = watch::channel(1);
        Ok(Self {
            config: RwLock::new(config),
            server_id,
            client,
            peers: RwLock::new(Vec::new()),
            count,
            refreshing: tokio::sync::Mutex::new(None),
            departed: Mutex::new(HashMap::new()),
        })
    }

    /// This replica's id.
    pub fn server_id(&self) -> &str {
        &self.server_id
    }

    /// The most identifier entries an inventory may hold (`peers.max_inventory_entries`).
    pub fn inventory_limit(&self) -> usize {
        self.config.read().map(|c| c.max_inventory_entries).unwrap_or(100_000)
    }

    /// The TLS client replicas use to reach each other.
    pub fn client(&self) -> &PeerClient {
        &self.client
    }

    /// Replaces discovery settings (hot reload); the endpoint and TLS need a restart.
    pub fn reconfigure(&self, config: PeersConfig) {
        if let Ok(mut current) = self.config.write() {
            *current = config;
        }
    }

    /// Replicas serving now, this one included.
    pub fn server_count(&self) -> u32 {
        *self.count.borrow()
    }

    /// Follows the replica count.
    pub fn watch_count(&self) -> watch::Receiver<u32> {
        self.count.subscribe()
    }

    /// Peers (not draining) whose agents can serve `target` under `strategy`, in random order.
    pub fn candidates(
        &self,
        tenant: &str,
        strategy: RoutingStrategy,
        target: &DialTarget,
    ) -> Vec<(SocketAddr, String)> {
        let Ok(peers) = self.peers.read() else { return Vec::new() };
        let mut found: Vec<(SocketAddr, String)> = peers
            .iter()
            .filter(|p| !p.draining)
            .filter(|p| p.tenants.get(tenant).is_some_and(|t| t.serves(strategy, target, p.truncated)))
            .map(|p| (p.addr, p.server_id.clone()))
            .collect();
        fastrand::shuffle(&mut found);
        found
    }

    /// Whether a peer lists an agent of `tenant` that claims `target` (its `dest_host`), or listed
    /// one within [`crate::registry::CLAIM_MEMORY`].
    pub fn claims(&self, tenant: &str, target: &DialTarget) -> bool {
        let listed = self
            .peers
            .read()
            .is_ok_and(|peers| peers.iter().any(|p| p.tenants.get(tenant).is_some_and(|t| t.lists(&target.host))));
        listed
            || self
                .departed
                .lock()
                .is_ok_and(|departed| departed.get(tenant).is_some_and(|memory| memory.contains(&target.host)))
    }

    /// Whether `server_id` is a replica this one knows (or is itself).
    pub fn knows(&self, server_id: &str) -> bool {
        server_id == self.server_id
            || self.peers.read().is_ok_and(|peers| peers.iter().any(|p| p.server_id == server_id))
    }

    /// Whether some other replica holds agents of `tenant`.
    pub fn tenant_served_elsewhere(&self, tenant: &str) -> bool {
        self.peers
            .read()
            .map(|peers| peers.iter().any(|p| !p.draining && p.tenants.get(tenant).is_some_and(|t| t.agents > 0)))
            .unwrap_or(false)
    }

    /// Rediscovers peers and refreshes their inventories every `refresh_interval` until `stop`
    /// is cancelled (the first round is the caller's, before serving).
    pub async fn run(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        loop {
            let interval = self.config.read().map(|c| c.refresh_interval.0).unwrap_or(Duration::from_secs(2));
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = stop.cancelled() => return,
            }
            self.refresh().await;
        }
    }

    /// Refreshes now unless a refresh finished within `min_age`; concurrent callers share one.
    /// Used when a dial finds no agent anywhere: the inventories may just be stale (a replica
    /// that has only just started, or agents that have only just moved).
    pub async fn refresh_if_older_than(&self, min_age: Duration) {
        let mut last = self.refreshing.lock().await;
        if last.is_some_and(|at| at.elapsed() < min_age) {
            return;
        }
        self.refresh_round().await;
        *last = Some(Instant::now());
    }

    /// One round: discover, fetch every inventory, update the count.
    pub async fn refresh(&self) {
        let mut last = self.refreshing.lock().await;
        self.refresh_round().await;
        *last = Some(Instant::now());
    }

    async fn refresh_round(&self) {
        let (addresses, limit) = match self.config.read() {
            Ok(c) => (c.addresses.clone(), c.max_inventory_entries),
            Err(_) => return,
        };
        let dns = self.config.read().ok().and_then(|c| c.dns.clone().map(|d| (d, c.listen.port())));
        let mut endpoints: Vec<SocketAddr> = addresses;
        if let Some((name, port)) = dns {
            match tokio::time::timeout(Duration::from_secs(5), tokio::net::lookup_host((name.as_str(), port))).await {
                Ok(Ok(found)) => endpoints.extend(found),
                Ok(Err(e)) => {
                    tracing::warn!(%name, error = %e, "peer discovery: DNS lookup failed; keeping the known peers")
                }
                Err(_) => tracing::warn!(%name, "peer discovery: DNS lookup timed out; keeping the known peers"),
            }
        }
        endpoints.sort();
        endpoints.dedup();
        let fetches = endpoints.iter().map(|addr| async move {
            let started = Instant::now();
            (*addr, self.client.inventory(*addr, limit, &self.server_id).await, started.elapsed())
        });
        let results = futures::future::join_all(fetches).await;
        let mut fresh = Vec::new();
        let mut seen = HashSet::new();
        for (addr, result, _took) in results {
            match result {
                Ok(inventory) if inventory.server_id == self.server_id => {}
                Ok(inventory) => {
                    if !seen.insert(inventory.server_id.clone()) {
                        continue;
                    }
                    fresh.push(Arc::new(Peer {
                        addr,
                        server_id: inventory.server_id.clone(),
                        draining: inventory.draining,
                        truncated: inventory.truncated,
                        tenants: inventory
                            .tenants
                            .iter()
                            .map(|(k, v)| (k.clone(), TenantIndex::from_inventory(v)))
                            .collect(),
                    }));
                }
                Err(e) => tracing::debug!(peer = %addr, error = %e, "peer did not answer"),
            }
        }
        let live = u32::try_from(fresh.iter().filter(|p| !p.draining).count() + 1).unwrap_or(u32::MAX);
        let previous = match self.peers.write() {
            Ok(mut peers) => std::mem::replace(&mut *peers, fresh.clone()),
            Err(_) => Vec::new(),
        };
        self.remember_departed(&previous, &fresh);
        self.count.send_if_modified(|count| {
            if *count != live {
                tracing::info!(from = *count, to = live, "gateway replica count changed");
                *count = live;
                true
            } else {
                false
            }
        });
    }
}

impl PeerSet {
    /// Remembers what the previous inventories listed that no peer lists any more, per tenant.
    fn remember_departed(&self, previous: &[Arc<Peer>], fresh: &[Arc<Peer>]) {
        let Ok(mut departed) = self.departed.lock() else { return };
        for old in previous {
            for (tenant, index) in &old.tenants {
                let still =
                    |host: &TargetHost| fresh.iter().any(|p| p.tenants.get(tenant).is_some_and(|t| t.lists(host)));
                let hosts: Vec<&String> =
                    index.hosts.iter().filter(|h| !still(&TargetHost::Name((*h).clone()))).collect();
                let addresses: Vec<&IpAddr> = index.addresses.iter().filter(|a| !still(&TargetHost::Ip(**a))).collect();
                let cidrs: Vec<&IpNet> = index
                    .cidrs
                    .iter()
                    .filter(|n| !fresh.iter().any(|p| p.tenants.get(tenant).is_some_and(|t| t.cidrs.contains(n))))
                    .collect();
                if hosts.is_empty() && addresses.is_empty() && cidrs.is_empty() {
                    continue;
                }
                departed.entry(tenant.clone()).or_default().remember(hosts, addresses, cidrs);
            }
        }
    }
}

impl Inventory {
    /// This replica's inventory from its tenants' registry summaries.
    pub fn new(server_id: String, draining: bool, tenants: impl IntoIterator<Item = (String, Summary, bool)>) -> Self {
        let mut inventory = Inventory { server_id, draining, ..Inventory::default() };
        for (name, summary, truncated) in tenants {
            inventory.truncated |= truncated;
            inventory.tenants.insert(name, summary.into());
        }
        inventory
    }
}
