//! Gateway replicas working as one: they find each other (a headless Service's DNS name or a
//! fixed list), fetch each other's inventory (which agents each holds, per tenant; bounded), tell
//! agents how many replicas there are, and forward a dial one hop to the replica that holds a
//! suitable agent. Replicas authenticate each other with mutual TLS.

pub mod client;
pub mod endpoint;

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::config::{PeersConfig, RoutingStrategy};
use crate::target::{DialTarget, TargetHost};
use client::PeerClient;

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

    fn serves(&self, strategy: RoutingStrategy, target: &DialTarget, truncated: bool) -> bool {
        match strategy {
            RoutingStrategy::DestHost => {
                let listed = match &target.host {
                    TargetHost::Name(name) => self.hosts.contains(name),
                    TargetHost::Ip(ip) => self.addresses.contains(ip) || self.cidrs.iter().any(|n| n.contains(ip)),
                };
                // A truncated inventory may not list the match: ask the peer.
                listed || (truncated && self.agents > 0)
            }
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
}

impl PeerSet {
    /// A peer set for this replica (`server_id`) with the given configuration.
    pub fn new(config: PeersConfig, server_id: String) -> anyhow::Result<Self> {
        let client = PeerClient::new(&config.tls)?;
        let (count, _) = watch::channel(1);
        Ok(Self {
            config: RwLock::new(config),
            server_id,
            client,
            peers: RwLock::new(Vec::new()),
            count,
            refreshing: tokio::sync::Mutex::new(None),
        })
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

    /// Whether some other replica holds agents of `tenant`.
    pub fn tenant_served_elsewhere(&self, tenant: &str) -> bool {
        self.peers
            .read()
            .map(|peers| peers.iter().any(|p| !p.draining && p.tenants.get(tenant).is_some_and(|t| t.agents > 0)))
            .unwrap_or(false)
    }

    /// Rediscovers peers and refreshes their inventories until `stop` is cancelled.
    pub async fn run(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        loop {
            self.refresh().await;
            let interval = self.config.read().map(|c| c.refresh_interval.0).unwrap_or(Duration::from_secs(2));
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = stop.cancelled() => return,
            }
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
            (*addr, self.client.inventory(*addr, limit).await, started.elapsed())
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
        if let Ok(mut peers) = self.peers.write() {
            *peers = fresh;
        }
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

impl Inventory {
    /// Builds this replica's inventory, keeping at most `limit` identifier entries.
    pub fn local(shared: &crate::server::Shared, limit: usize) -> Self {
        let mut inventory = Inventory {
            server_id: shared.server_id.clone(),
            draining: shared.drain_started.is_cancelled(),
            ..Inventory::default()
        };
        let mut budget = limit;
        for tenant in shared.tenants.load().iter() {
            let (summary, truncated) = tenant.registry.summary(&mut budget);
            inventory.truncated |= truncated;
            inventory.tenants.insert(tenant.name.to_string(), summary);
        }
        inventory
    }
}
