//! The agents of one tenant and how a dial picks one of them.
//!
//! Each live session is an entry (an agent may hold several sessions, e.g. during a reconnect).
//! Lookups by host name and address are hash lookups; least-loaded picks the less busy of two
//! random sessions ("power of two choices"), so routing stays O(1) with tens of thousands of agents.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use ipnet::IpNet;
use tether_tunnel::mux;
use tether_tunnel::protocol::{ControlMessage, Identifiers};
use tokio::sync::mpsc;

use crate::config::RoutingStrategy;
use crate::target::{DialTarget, TargetHost};

/// What an agent can reach, parsed and normalised.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentIdentifiers {
    /// Lowercase host names.
    pub hosts: HashSet<String>,
    /// Addresses.
    pub addresses: HashSet<IpAddr>,
    /// Networks.
    pub cidrs: Vec<IpNet>,
    /// Whether unmatched dials may go to this agent.
    pub default_route: bool,
}

impl AgentIdentifiers {
    /// Parses what the agent declared. When its token proves a node (`node_name`), that name is
    /// a host identifier and the agent may declare no other node's name: declared host names must
    /// be the node name or start with `<node name>.` (its FQDNs); others are dropped.
    pub fn from_declared(declared: &Identifiers, node_name: Option<&str>) -> Result<Self, String> {
        let mut hosts: HashSet<String> = declared.hosts.iter().map(|h| h.to_ascii_lowercase()).collect();
        if let Some(node) = node_name {
            let node = node.to_ascii_lowercase();
            let prefix = format!("{node}.");
            hosts.retain(|h| {
                let own = *h == node || h.starts_with(&prefix);
                if !own {
                    tracing::warn!(node = %node, claimed = %h, "agent declared a host name of another node; ignored");
                }
                own
            });
            hosts.insert(node);
        }
        let cidrs = declared
            .cidrs
            .iter()
            .map(|c| c.parse::<IpNet>().map(|n| n.trunc()).map_err(|_| format!("{c:?} is not a CIDR")))
            .collect::<Result<Vec<_>, _>>()?;
        if hosts.len() + declared.addresses.len() + cidrs.len() > 4096 {
            return Err("too many identifiers (at most 4096)".into());
        }
        Ok(Self {
            hosts,
            addresses: declared.addresses.iter().copied().collect(),
            cidrs,
            default_route: declared.default_route,
        })
    }

    fn matches(&self, host: &TargetHost) -> bool {
        match host {
            TargetHost::Ip(ip) => self.addresses.contains(ip) || self.cidrs.iter().any(|n| n.contains(ip)),
            TargetHost::Name(name) => self.hosts.contains(name),
        }
    }
}

/// One live session of one agent.
pub struct AgentSession {
    /// Unique per session within this process.
    pub conn_id: u64,
    /// The agent's id (its node name when the token proves one).
    pub agent_id: String,
    /// Where the connection came from.
    pub remote: SocketAddr,
    /// When it connected.
    pub connected_at: Instant,
    /// The multiplexer session.
    pub session: mux::Session,
    identifiers: RwLock<AgentIdentifiers>,
    active_streams: AtomicUsize,
    draining: AtomicBool,
    control: mpsc::Sender<Box<ControlMessage>>,
}

impl AgentSession {
    /// A new session entry.
    pub fn new(
        conn_id: u64,
        agent_id: String,
        remote: SocketAddr,
        session: mux::Session,
        identifiers: AgentIdentifiers,
        control: mpsc::Sender<Box<ControlMessage>>,
    ) -> Self {
        Self {
            conn_id,
            agent_id,
            remote,
            connected_at: Instant::now(),
            session,
            identifiers: RwLock::new(identifiers),
            active_streams: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            control,
        }
    }

    /// Streams this gateway has open on the session (its load).
    pub fn load(&self) -> usize {
        self.active_streams.load(Ordering::Relaxed)
    }

    /// Counts a stream for as long as the guard lives.
    pub fn stream_guard(self: &Arc<Self>) -> StreamGuard {
        self.active_streams.fetch_add(1, Ordering::Relaxed);
        StreamGuard { session: self.clone() }
    }

    /// Whether the session takes new dials.
    pub fn is_usable(&self) -> bool {
        !self.draining.load(Ordering::Relaxed) && !self.session.is_closed()
    }

    /// Stops routing new dials here.
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Sends a control message to the agent (dropped if the session's queue is full or gone).
    pub fn send_control(&self, message: ControlMessage) -> bool {
        self.control.try_send(Box::new(message)).is_ok()
    }

    /// The agent's current identifiers.
    pub fn identifiers(&self) -> AgentIdentifiers {
        self.identifiers.read().map(|i| i.clone()).unwrap_or_default()
    }
}

/// Keeps a session's stream count up while a stream is open.
pub struct StreamGuard {
    session: Arc<AgentSession>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.session.active_streams.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A set with O(1) insert, remove and random access.
#[derive(Default)]
struct SessionSet {
    items: Vec<Arc<AgentSession>>,
    index: HashMap<u64, usize>,
}

impl SessionSet {
    fn insert(&mut self, session: Arc<AgentSession>) {
        if self.index.contains_key(&session.conn_id) {
            return;
        }
        self.index.insert(session.conn_id, self.items.len());
        self.items.push(session);
    }

    fn remove(&mut self, conn_id: u64) {
        let Some(at) = self.index.remove(&conn_id) else { return };
        self.items.swap_remove(at);
        if let Some(moved) = self.items.get(at) {
            self.index.insert(moved.conn_id, at);
        }
    }

    fn pick_least_loaded(&self) -> Option<Arc<AgentSession>> {
        pick_least_loaded(&self.items)
    }
}

/// The less loaded of two random usable sessions (all of them when there are few).
fn pick_least_loaded(items: &[Arc<AgentSession>]) -> Option<Arc<AgentSession>> {
    if items.len() <= 4 {
        return items.iter().filter(|s| s.is_usable()).min_by_key(|s| s.load()).cloned();
    }
    let mut best: Option<&Arc<AgentSession>> = None;
    // A few tries, in case some picks are draining.
    for _ in 0..8 {
        let candidate = &items[fastrand::usize(..items.len())];
        if !candidate.is_usable() {
            continue;
        }
        best = match best {
            Some(b) if b.load() <= candidate.load() => Some(b),
            _ => Some(candidate),
        };
        if best.is_some_and(|b| !Arc::ptr_eq(b, candidate)) {
            break;
        }
    }
    best.cloned().or_else(|| items.iter().filter(|s| s.is_usable()).min_by_key(|s| s.load()).cloned())
}

#[derive(Default)]
struct Inner {
    all: SessionSet,
    default_routes: SessionSet,
    by_host: HashMap<String, SessionSet>,
    by_address: HashMap<IpAddr, SessionSet>,
    with_cidrs: SessionSet,
}

/// The live agent sessions of one tenant.
#[derive(Default)]
pub struct AgentRegistry {
    inner: RwLock<Inner>,
}

impl AgentRegistry {
    /// Adds a session to routing.
    pub fn register(&self, session: Arc<AgentSession>) {
        let identifiers = session.identifiers();
        let Ok(mut inner) = self.inner.write() else { return };
        inner.index(&session, &identifiers);
        inner.all.insert(session);
    }

    /// Removes a session from routing.
    pub fn deregister(&self, session: &AgentSession) {
        let identifiers = session.identifiers();
        let Ok(mut inner) = self.inner.write() else { return };
        inner.unindex(session.conn_id, &identifiers);
        inner.all.remove(session.conn_id);
    }

    /// Replaces a session's identifiers (the agent sent an update).
    pub fn update_identifiers(&self, session: &Arc<AgentSession>, identifiers: AgentIdentifiers) {
        let Ok(mut inner) = self.inner.write() else { return };
        let old = session.identifiers();
        inner.unindex(session.conn_id, &old);
        if inner.all.index.contains_key(&session.conn_id) {
            inner.index(session, &identifiers);
        }
        if let Ok(mut current) = session.identifiers.write() {
            *current = identifiers;
        }
    }

    /// Number of registered sessions.
    pub fn len(&self) -> usize {
        self.inner.read().map(|i| i.all.items.len()).unwrap_or_default()
    }

    /// Whether no session is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All registered sessions.
    pub fn sessions(&self) -> Vec<Arc<AgentSession>> {
        self.inner.read().map(|i| i.all.items.clone()).unwrap_or_default()
    }

    /// What this registry holds, for peers: counts and identifiers, at most `budget` identifier
    /// entries (the budget is shared across tenants); the flag says whether some were left out.
    pub fn summary(&self, budget: &mut usize) -> (crate::peers::TenantInventory, bool) {
        let mut summary = crate::peers::TenantInventory::default();
        let Ok(inner) = self.inner.read() else { return (summary, false) };
        summary.agents = inner.all.items.iter().filter(|s| s.is_usable()).count();
        summary.default_routes = inner.default_routes.items.iter().filter(|s| s.is_usable()).count();
        let mut truncated = false;
        let mut take = |budget: &mut usize| {
            if *budget == 0 {
                truncated = true;
                false
            } else {
                *budget -= 1;
                true
            }
        };
        for (host, set) in &inner.by_host {
            if set.items.iter().any(|s| s.is_usable()) && take(budget) {
                summary.hosts.push(host.clone());
            }
        }
        for (address, set) in &inner.by_address {
            if set.items.iter().any(|s| s.is_usable()) && take(budget) {
                summary.addresses.push(*address);
            }
        }
        let mut cidrs = HashSet::new();
        for session in inner.with_cidrs.items.iter().filter(|s| s.is_usable()) {
            for net in session.identifiers().cidrs {
                if !cidrs.contains(&net) && take(budget) {
                    cidrs.insert(net);
                }
            }
        }
        summary.cidrs = cidrs.into_iter().collect();
        (summary, truncated)
    }

    /// The session a dial to `target` should use, trying the strategies in order.
    pub fn pick_for(&self, target: &DialTarget, chain: &[RoutingStrategy]) -> Option<Arc<AgentSession>> {
        let inner = self.inner.read().ok()?;
        for strategy in chain {
            let picked = match strategy {
                RoutingStrategy::DestHost => inner.pick_dest_host(&target.host),
                RoutingStrategy::DefaultRoute => inner.default_routes.pick_least_loaded(),
                RoutingStrategy::LeastLoaded => inner.all.pick_least_loaded(),
            };
            if picked.is_some() {
                return picked;
            }
        }
        None
    }
}

impl Inner {
    fn index(&mut self, session: &Arc<AgentSession>, ids: &AgentIdentifiers) {
        for host in &ids.hosts {
            self.by_host.entry(host.clone()).or_default().insert(session.clone());
        }
        for address in &ids.addresses {
            self.by_address.entry(*address).or_default().insert(session.clone());
        }
        if !ids.cidrs.is_empty() {
            self.with_cidrs.insert(session.clone());
        }
        if ids.default_route {
            self.default_routes.insert(session.clone());
        }
    }

    fn unindex(&mut self, conn_id: u64, ids: &AgentIdentifiers) {
        for host in &ids.hosts {
            if let Some(set) = self.by_host.get_mut(host) {
                set.remove(conn_id);
                if set.items.is_empty() {
                    self.by_host.remove(host);
                }
            }
        }
        for address in &ids.addresses {
            if let Some(set) = self.by_address.get_mut(address) {
                set.remove(conn_id);
                if set.items.is_empty() {
                    self.by_address.remove(address);
                }
            }
        }
        self.with_cidrs.remove(conn_id);
        self.default_routes.remove(conn_id);
    }

    fn pick_dest_host(&self, host: &TargetHost) -> Option<Arc<AgentSession>> {
        match host {
            TargetHost::Name(name) => self.by_host.get(name).and_then(SessionSet::pick_least_loaded),
            TargetHost::Ip(ip) => self.by_address.get(ip).and_then(SessionSet::pick_least_loaded).or_else(|| {
                // Most specific matching network wins; ties go to the least loaded.
                let matching: Vec<(u8, Arc<AgentSession>)> = self
                    .with_cidrs
                    .items
                    .iter()
                    .filter(|s| s.is_usable())
                    .filter_map(|s| {
                        let ids = s.identifiers.read().ok()?;
                        let best = ids.cidrs.iter().filter(|n| n.contains(ip)).map(IpNet::prefix_len).max()?;
                        Some((best, s.clone()))
                    })
                    .collect();
                let longest = matching.iter().map(|(len, _)| *len).max()?;
                let best: Vec<Arc<AgentSession>> =
                    matching.into_iter().filter(|(len, _)| *len == longest).map(|(_, s)| s).collect();
                pick_least_loaded(&best)
            }),
        }
    }
}

impl AgentIdentifiers {
    /// Whether this agent can serve the target (used in tests and diagnostics).
    pub fn can_reach(&self, target: &DialTarget) -> bool {
        self.matches(&target.host)
    }
}
