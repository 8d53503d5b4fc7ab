//! The agents of one tenant on this replica: their sessions, what each can reach, and the
//! candidates a routing strategy finds among them.
//!
//! Each live session is an entry (an agent may hold several sessions, e.g. during a reconnect).
//! Lookups by host name and address are hash lookups; least-loaded picks the less busy of two
//! random sessions ("power of two choices"), so routing stays O(1) with tens of thousands of agents.
//! The registry also remembers, for a while, what sessions that left could reach: a dial for a
//! node whose agent just moved to another replica is then known to belong to that node.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use tether_tunnel::mux;
use tether_tunnel::protocol::{ControlMessage, Identifiers};
use tether_tunnel::untrusted::printable;
use tokio::sync::{Notify, mpsc};

use crate::claims::{ClaimPolicy, Refusal, RefusedClaim, overlaps};
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

/// Why an agent's declared identifiers were refused (the reason goes back to the agent).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentifiersError {
    /// A CIDR that does not parse.
    #[error("{0:?} is not a CIDR")]
    NotCidr(String),
    /// More than [`MAX_IDENTIFIERS`].
    #[error("too many identifiers (at most {MAX_IDENTIFIERS})")]
    TooMany,
}

/// Most identifiers one agent may declare.
pub const MAX_IDENTIFIERS: usize = 4096;

impl AgentIdentifiers {
    /// Parses what the agent declared. When its token proves a node (`node_name`), that name is
    /// a host identifier and the agent may declare no other node's name: declared host names must
    /// be the node name or start with `<node name>.` (its FQDNs); others are dropped.
    pub fn from_declared(declared: &Identifiers, node_name: Option<&str>) -> Result<Self, IdentifiersError> {
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
            .map(|c| c.parse::<IpNet>().map(|n| n.trunc()).map_err(|_| IdentifiersError::NotCidr(printable(c, 64))))
            .collect::<Result<Vec<_>, _>>()?;
        if hosts.len() + declared.addresses.len() + cidrs.len() > MAX_IDENTIFIERS {
            return Err(IdentifiersError::TooMany);
        }
        Ok(Self {
            hosts,
            addresses: declared.addresses.iter().copied().collect(),
            cidrs,
            default_route: declared.default_route,
        })
    }

    /// Whether these identifiers claim the target's host (the `dest_host` match).
    pub fn matches(&self, host: &TargetHost) -> bool {
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
    /// Whether its token proves its node (the id is then the node name).
    pub node_bound: bool,
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
        node_bound: bool,
        remote: SocketAddr,
        session: mux::Session,
        identifiers: AgentIdentifiers,
        control: mpsc::Sender<Box<ControlMessage>>,
    ) -> Self {
        Self {
            conn_id,
            agent_id,
            node_bound,
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

    fn two_choices(&self) -> Vec<Arc<AgentSession>> {
        two_choices(&self.items)
    }
}

/// Two random usable sessions ("power of two choices"; all of them when there are few): the
/// caller takes the less loaded first and keeps the other in reserve.
fn two_choices(items: &[Arc<AgentSession>]) -> Vec<Arc<AgentSession>> {
    if items.len() <= MAX_CANDIDATES {
        return items.iter().filter(|s| s.is_usable()).cloned().collect();
    }
    let mut picked: Vec<Arc<AgentSession>> = Vec::with_capacity(2);
    // A few tries, in case some picks are draining.
    for _ in 0..8 {
        let candidate = &items[fastrand::usize(..items.len())];
        if candidate.is_usable() && !picked.iter().any(|p| Arc::ptr_eq(p, candidate)) {
            picked.push(candidate.clone());
            if picked.len() == 2 {
                return picked;
            }
        }
    }
    if picked.is_empty() {
        // Mostly draining: look at all of them.
        picked.extend(items.iter().filter(|s| s.is_usable()).take(2).cloned());
    }
    picked
}

#[derive(Default)]
struct Inner {
    all: SessionSet,
    /// Sessions per agent id: an agent may hold several (`pool.sessions_per_replica`).
    agents: HashMap<String, usize>,
    default_routes: SessionSet,
    by_host: HashMap<String, SessionSet>,
    by_address: HashMap<IpAddr, SessionSet>,
    with_cidrs: SessionSet,
}

/// The live agent sessions of one tenant.
#[derive(Default)]
pub struct AgentRegistry {
    inner: RwLock<Inner>,
    /// What sessions that left could reach.
    departed: Mutex<ClaimMemory>,
    added: Notify,
}

impl AgentRegistry {
    /// Adds a session to routing with the claims `policy` admits of the identifiers it declared
    /// (the refused ones are dropped from the session's identifiers and returned).
    pub fn register(&self, session: Arc<AgentSession>, policy: &ClaimPolicy) -> Registered {
        let declared = session.identifiers();
        let Ok(mut inner) = self.inner.write() else { return Registered::default() };
        let (identifiers, refused) = inner.admit(&session, declared, policy);
        inner.index(&session, &identifiers);
        if let Ok(mut current) = session.identifiers.write() {
            *current = identifiers;
        }
        let sessions = inner.agents.entry(session.agent_id.clone()).or_default();
        *sessions += 1;
        let first = *sessions == 1;
        inner.all.insert(session);
        drop(inner);
        self.added.notify_waiters();
        Registered { first, refused }
    }

    /// Removes a session from routing; answers whether it was its agent's last here.
    pub fn deregister(&self, session: &AgentSession) -> bool {
        let identifiers = session.identifiers();
        let mut last = false;
        if let Ok(mut inner) = self.inner.write() {
            inner.unindex(session.conn_id, &identifiers);
            if inner.all.index.contains_key(&session.conn_id) {
                inner.all.remove(session.conn_id);
                if let Some(sessions) = inner.agents.get_mut(&session.agent_id) {
                    *sessions -= 1;
                    if *sessions == 0 {
                        inner.agents.remove(&session.agent_id);
                        last = true;
                    }
                }
            }
        }
        if let Ok(mut departed) = self.departed.lock() {
            departed.remember(&identifiers.hosts, &identifiers.addresses, &identifiers.cidrs);
        }
        last
    }

    /// Number of agents with a session here (an agent with several sessions counts once).
    pub fn agents(&self) -> usize {
        self.inner.read().map(|i| i.agents.len()).unwrap_or_default()
    }

    /// Replaces a session's identifiers (the agent sent an update) with what `policy` admits of
    /// them; answers the refused claims.
    pub fn update_identifiers(
        &self,
        session: &Arc<AgentSession>,
        declared: AgentIdentifiers,
        policy: &ClaimPolicy,
    ) -> Vec<RefusedClaim> {
        let Ok(mut inner) = self.inner.write() else { return Vec::new() };
        let old = session.identifiers();
        inner.unindex(session.conn_id, &old);
        let (identifiers, refused) = inner.admit(session, declared, policy);
        if inner.all.index.contains_key(&session.conn_id) {
            inner.index(session, &identifiers);
        }
        if let Ok(mut current) = session.identifiers.write() {
            *current = identifiers;
        }
        refused
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
    pub fn summary(&self, budget: &mut usize) -> (Summary, bool) {
        let mut summary = Summary::default();
        let Ok(inner) = self.inner.read() else { return (summary, false) };
        // Agents, not sessions: an agent with several sessions is one agent to route to.
        let distinct = |items: &[Arc<AgentSession>]| {
            items.iter().filter(|s| s.is_usable()).map(|s| s.agent_id.as_str()).collect::<HashSet<_>>().len()
        };
        summary.agents = distinct(&inner.all.items);
        summary.default_routes = distinct(&inner.default_routes.items);
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

    /// The usable sessions `strategy` finds for `target`, best first (at most a few): the
    /// target's own agents for `dest_host`, the less loaded of two random picks otherwise.
    pub fn candidates(&self, strategy: RoutingStrategy, target: &DialTarget) -> Vec<Arc<AgentSession>> {
        let Ok(inner) = self.inner.read() else { return Vec::new() };
        let mut found = match strategy {
            RoutingStrategy::DestHost => inner.dest_host(&target.host),
            RoutingStrategy::DefaultRoute => inner.default_routes.two_choices(),
            RoutingStrategy::LeastLoaded => inner.all.two_choices(),
        };
        found.sort_by_key(|s| s.load());
        found.truncate(MAX_CANDIDATES);
        found
    }

    /// Whether an agent of this replica claims `target` (its identifiers match, usable or
    /// draining), or claimed it until it left, within [`CLAIM_MEMORY`].
    pub fn claims(&self, target: &DialTarget) -> bool {
        // The indexes hold draining sessions too (they leave them at deregistration).
        let live = self.inner.read().is_ok_and(|inner| match &target.host {
            TargetHost::Name(name) => inner.by_host.contains_key(name),
            TargetHost::Ip(ip) => {
                inner.by_address.contains_key(ip)
                    || inner
                        .with_cidrs
                        .items
                        .iter()
                        .any(|s| s.identifiers.read().is_ok_and(|ids| ids.cidrs.iter().any(|n| n.contains(ip))))
            }
        });
        live || self.departed.lock().is_ok_and(|memory| memory.contains(&target.host))
    }

    /// Resolves when a session registers (a dial waiting for a moving agent looks again).
    pub async fn session_added(&self) {
        self.added.notified().await;
    }
}

/// What [`AgentRegistry::register`] did.
#[derive(Debug, Default)]
pub struct Registered {
    /// Whether this is its agent's first session here.
    pub first: bool,
    /// Claims the policy refused.
    pub refused: Vec<RefusedClaim>,
}

/// Most sessions one strategy offers a dial.
const MAX_CANDIDATES: usize = 4;

/// How long what a departed agent could reach is still known to be its (and so not given to the
/// fallback strategies): long enough for an agent to reconnect elsewhere and for every replica's
/// inventories to catch up.
pub const CLAIM_MEMORY: Duration = Duration::from_secs(30);

/// What a registry holds, as published to peer replicas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// Agents with a usable session.
    pub agents: usize,
    /// Agents with a usable session flagged as a default route.
    pub default_routes: usize,
    /// Host names the usable sessions serve.
    pub hosts: Vec<String>,
    /// Addresses the usable sessions serve.
    pub addresses: Vec<IpAddr>,
    /// Networks the usable sessions serve.
    pub cidrs: Vec<IpNet>,
}

/// Host names, addresses and networks that were claimed recently, each with when it was last
/// seen; bounded.
#[derive(Debug, Default)]
pub struct ClaimMemory {
    hosts: HashMap<String, Instant>,
    addresses: HashMap<IpAddr, Instant>,
    cidrs: HashMap<IpNet, Instant>,
}

/// Entries a [`ClaimMemory`] keeps at most.
const CLAIM_MEMORY_ENTRIES: usize = 100_000;

impl ClaimMemory {
    /// Remembers identifiers as claimed now.
    pub fn remember<'a>(
        &mut self,
        hosts: impl IntoIterator<Item = &'a String>,
        addresses: impl IntoIterator<Item = &'a IpAddr>,
        cidrs: impl IntoIterator<Item = &'a IpNet>,
    ) {
        let now = Instant::now();
        for host in hosts {
            self.hosts.insert(host.clone(), now);
        }
        for address in addresses {
            self.addresses.insert(*address, now);
        }
        for net in cidrs {
            self.cidrs.insert(*net, now);
        }
        if self.len() > CLAIM_MEMORY_ENTRIES {
            self.forget_older_than(CLAIM_MEMORY);
        }
        if self.len() > CLAIM_MEMORY_ENTRIES {
            // Still over after expiry: a flood of claims; start over rather than grow.
            *self = Self::default();
        }
    }

    /// Whether `host` was claimed within [`CLAIM_MEMORY`].
    pub fn contains(&self, host: &TargetHost) -> bool {
        let fresh = |at: &Instant| at.elapsed() < CLAIM_MEMORY;
        match host {
            TargetHost::Name(name) => self.hosts.get(name).is_some_and(fresh),
            TargetHost::Ip(ip) => {
                self.addresses.get(ip).is_some_and(fresh)
                    || self.cidrs.iter().any(|(net, at)| net.contains(ip) && fresh(at))
            }
        }
    }

    fn len(&self) -> usize {
        self.hosts.len() + self.addresses.len() + self.cidrs.len()
    }

    fn forget_older_than(&mut self, age: Duration) {
        self.hosts.retain(|_, at| at.elapsed() < age);
        self.addresses.retain(|_, at| at.elapsed() < age);
        self.cidrs.retain(|_, at| at.elapsed() < age);
    }
}

impl Inner {
    /// What `policy` admits of `declared` for `session`, and what it refuses. Exclusive claims
    /// are held by one agent (all of its sessions): a claim overlapping another agent's (any of
    /// its sessions here, draining ones included) or another node's trusted claims is refused.
    fn admit(
        &self,
        session: &AgentSession,
        declared: AgentIdentifiers,
        policy: &ClaimPolicy,
    ) -> (AgentIdentifiers, Vec<RefusedClaim>) {
        if !policy.exclusive(session.node_bound) {
            return (declared, Vec::new());
        }
        let me = session.agent_id.as_str();
        let mut refused = Vec::new();
        let mut admitted = AgentIdentifiers::default();
        let mut refuse = |claim: String, refusal: Refusal| refused.push(RefusedClaim { claim, refusal });
        for host in declared.hosts {
            // A node-bound agent's own name is proven by its token.
            let own = session.node_bound && host.eq_ignore_ascii_case(me);
            match self.host_holder(&host, me).filter(|_| !own) {
                Some(holder) => refuse(host, Refusal::HeldBy(holder)),
                None => {
                    admitted.hosts.insert(host);
                }
            }
        }
        let trusted = policy.trusted(me);
        let nets = declared.addresses.iter().map(|ip| IpNet::from(*ip)).chain(declared.cidrs.iter().copied());
        let mut claimed: Vec<IpNet> = Vec::new();
        for net in nets {
            let claim =
                || if net.prefix_len() == net.max_prefix_len() { net.addr().to_string() } else { net.to_string() };
            if let Some(trusted) = trusted {
                if !trusted.iter().any(|t| t.contains(&net)) {
                    refuse(claim(), Refusal::NotTrusted);
                }
                continue;
            }
            match policy.trusted_holder(&net, me).map(str::to_owned).or_else(|| self.net_holder(&net, me)) {
                Some(holder) => refuse(claim(), Refusal::HeldBy(holder)),
                None => claimed.push(net),
            }
        }
        // A node the configuration lists claims exactly its trusted addresses and networks.
        claimed.extend(trusted.into_iter().flatten().copied());
        for net in claimed {
            if net.prefix_len() == net.max_prefix_len() {
                admitted.addresses.insert(net.addr());
            } else if !admitted.cidrs.contains(&net) {
                admitted.cidrs.push(net);
            }
        }
        if declared.default_route {
            if policy.may_default_route(me) {
                admitted.default_route = true;
            } else {
                refuse("default_route".into(), Refusal::DefaultRouteNotAllowed);
            }
        }
        (admitted, refused)
    }

    /// Another agent with a session indexed under `host`.
    fn host_holder(&self, host: &str, me: &str) -> Option<String> {
        let set = self.by_host.get(host)?;
        set.items.iter().find(|s| s.agent_id != me).map(|s| s.agent_id.clone())
    }

    /// Another agent whose addresses or networks overlap `net`.
    fn net_holder(&self, net: &IpNet, me: &str) -> Option<String> {
        let other = |set: &SessionSet| set.items.iter().find(|s| s.agent_id != me).map(|s| s.agent_id.clone());
        let by_address = if net.prefix_len() == net.max_prefix_len() {
            self.by_address.get(&net.addr()).and_then(other)
        } else {
            self.by_address.iter().filter(|(ip, _)| net.contains(*ip)).find_map(|(_, set)| other(set))
        };
        by_address.or_else(|| {
            self.with_cidrs
                .items
                .iter()
                .filter(|s| s.agent_id != me)
                .find(|s| s.identifiers.read().is_ok_and(|ids| ids.cidrs.iter().any(|n| overlaps(n, net))))
                .map(|s| s.agent_id.clone())
        })
    }

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

    /// The usable sessions whose identifiers match `host`: by name, by address, else the most
    /// specific matching network.
    fn dest_host(&self, host: &TargetHost) -> Vec<Arc<AgentSession>> {
        let usable = |set: &SessionSet| set.items.iter().filter(|s| s.is_usable()).cloned().collect::<Vec<_>>();
        match host {
            TargetHost::Name(name) => self.by_host.get(name).map(usable).unwrap_or_default(),
            TargetHost::Ip(ip) => {
                let exact = self.by_address.get(ip).map(usable).unwrap_or_default();
                if !exact.is_empty() {
                    return exact;
                }
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
                let Some(longest) = matching.iter().map(|(len, _)| *len).max() else { return Vec::new() };
                matching.into_iter().filter(|(len, _)| *len == longest).map(|(_, s)| s).collect()
            }
        }
    }
}

/// Test support: a session over a real multiplexer on an in-memory pipe, and the agent's end,
/// which has to stay alive for the session to live.
#[cfg(test)]
pub(crate) fn test_session(
    conn_id: u64,
    agent_id: &str,
    node_bound: bool,
    declared: &Identifiers,
) -> (Arc<AgentSession>, impl Sized + use<>) {
    use tether_tunnel::mux::{ByteLink, MuxSettings, Role};
    let (a, b) = tokio::io::duplex(64 * 1024);
    let (session, _incoming, driver) = mux::start(ByteLink::new(a), Role::Server, &MuxSettings::default());
    tokio::spawn(driver);
    let (peer, peer_incoming, peer_driver) = mux::start(ByteLink::new(b), Role::Client, &MuxSettings::default());
    tokio::spawn(peer_driver);
    let node = node_bound.then_some(agent_id);
    let ids = AgentIdentifiers::from_declared(declared, node).unwrap_or_default();
    let (control, _) = mpsc::channel(1);
    let remote = SocketAddr::from(([127, 0, 0, 1], 1));
    let entry = Arc::new(AgentSession::new(conn_id, agent_id.into(), node_bound, remote, session, ids, control));
    (entry, (peer, peer_incoming))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ClaimsConfig;

    fn declared(addresses: &[&str], cidrs: &[&str], default_route: bool) -> Identifiers {
        Identifiers {
            hosts: vec![],
            addresses: addresses.iter().map(|a| a.parse().unwrap()).collect(),
            cidrs: cidrs.iter().map(|c| (*c).to_owned()).collect(),
            default_route,
        }
    }

    fn policy(json: serde_json::Value) -> ClaimPolicy {
        ClaimPolicy::new(&serde_json::from_value::<ClaimsConfig>(json).unwrap())
    }

    fn claims(session: &AgentSession) -> (Vec<IpAddr>, Vec<IpNet>, bool) {
        let ids = session.identifiers();
        let mut addresses: Vec<_> = ids.addresses.into_iter().collect();
        addresses.sort();
        (addresses, ids.cidrs, ids.default_route)
    }

    #[tokio::test]
    async fn a_node_bound_agent_cannot_claim_what_another_node_holds() {
        let registry = AgentRegistry::default();
        let policy = policy(serde_json::json!({}));
        let (b, _b) = test_session(1, "node-b", true, &declared(&["10.0.0.2"], &["10.244.2.0/24"], false));
        assert!(registry.register(b.clone(), &policy).refused.is_empty());
        let spoof = declared(&["10.0.0.1", "10.0.0.2", "10.244.2.7"], &["10.244.0.0/16", "10.244.1.0/24"], true);
        let (a, _a) = test_session(2, "node-a", true, &spoof);
        let refused = registry.register(a.clone(), &policy).refused;
        let mut refused: Vec<(String, Refusal)> = refused.into_iter().map(|r| (r.claim, r.refusal)).collect();
        refused.sort_by(|x, y| x.0.cmp(&y.0));
        let held = Refusal::HeldBy("node-b".into());
        assert_eq!(
            refused,
            vec![
                ("10.0.0.2".into(), held.clone()),
                ("10.244.0.0/16".into(), held.clone()),
                ("10.244.2.7".into(), held),
                ("default_route".into(), Refusal::DefaultRouteNotAllowed),
            ]
        );
        let (addresses, cidrs, default_route) = claims(&a);
        assert_eq!(addresses, vec!["10.0.0.1".parse::<IpAddr>().unwrap()]);
        assert_eq!(cidrs, vec!["10.244.1.0/24".parse::<IpNet>().unwrap()]);
        assert!(!default_route);
        let to_b = DialTarget::parse("10.0.0.2:10250").unwrap();
        let found = registry.candidates(RoutingStrategy::DestHost, &to_b);
        assert_eq!(found.iter().map(|s| s.agent_id.as_str()).collect::<Vec<_>>(), vec!["node-b"]);
        let pod_of_b = DialTarget::parse("10.244.2.7:8080").unwrap();
        let found = registry.candidates(RoutingStrategy::DestHost, &pod_of_b);
        assert_eq!(found.iter().map(|s| s.agent_id.as_str()).collect::<Vec<_>>(), vec!["node-b"]);
    }

    #[tokio::test]
    async fn sessions_of_one_agent_share_its_claims_and_a_released_claim_is_free() {
        let registry = AgentRegistry::default();
        let policy = policy(serde_json::json!({}));
        let ids = declared(&["10.0.0.2"], &[], false);
        let (b1, _b1) = test_session(1, "node-b", true, &ids);
        let (b2, _b2) = test_session(2, "node-b", true, &ids);
        assert!(registry.register(b1.clone(), &policy).refused.is_empty());
        assert!(registry.register(b2.clone(), &policy).refused.is_empty());
        let (a, _a) = test_session(3, "node-a", true, &declared(&[], &[], false));
        registry.register(a.clone(), &policy);
        let wants = AgentIdentifiers::from_declared(&ids, Some("node-a")).unwrap();
        assert_eq!(registry.update_identifiers(&a, wants.clone(), &policy).len(), 1);
        // node-b lets go of the address (both sessions): then node-a may claim it.
        let none = AgentIdentifiers::from_declared(&declared(&[], &[], false), Some("node-b")).unwrap();
        registry.update_identifiers(&b1, none.clone(), &policy);
        assert_eq!(registry.update_identifiers(&a, wants.clone(), &policy).len(), 1, "node-b's other session holds it");
        registry.update_identifiers(&b2, none, &policy);
        assert!(registry.update_identifiers(&a, wants, &policy).is_empty());
    }

    #[tokio::test]
    async fn trusted_claims_win_over_whoever_came_first() {
        let registry = AgentRegistry::default();
        let policy = policy(serde_json::json!({"trusted": {"node-b": ["10.0.0.2", "10.244.2.0/24"]}}));
        // The spoofer connects first, claiming node-b's address: refused all the same.
        let (a, _a) = test_session(1, "node-a", true, &declared(&["10.0.0.2", "10.0.0.1"], &[], false));
        let refused = registry.register(a.clone(), &policy).refused;
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].refusal, Refusal::HeldBy("node-b".into()));
        // node-b's claims are its trusted ones, whatever it declares.
        let (b, _b) = test_session(2, "node-b", true, &declared(&["10.0.0.9"], &[], false));
        let refused = registry.register(b.clone(), &policy).refused;
        assert_eq!(refused.iter().map(|r| r.refusal.clone()).collect::<Vec<_>>(), vec![Refusal::NotTrusted]);
        let (addresses, cidrs, _) = claims(&b);
        assert_eq!(addresses, vec!["10.0.0.2".parse::<IpAddr>().unwrap()]);
        assert_eq!(cidrs, vec!["10.244.2.0/24".parse::<IpNet>().unwrap()]);
    }

    #[tokio::test]
    async fn as_declared_and_unbound_tokens_keep_the_old_behaviour() {
        let registry = AgentRegistry::default();
        let auto = policy(serde_json::json!({}));
        let ids = declared(&["10.0.0.2"], &[], true);
        let (x, _x) = test_session(1, "x", false, &ids);
        let (y, _y) = test_session(2, "y", false, &ids);
        assert!(registry.register(x, &auto).refused.is_empty());
        assert!(registry.register(y.clone(), &auto).refused.is_empty());
        assert!(claims(&y).2, "unbound agents may be default routes in auto mode");
        let exclusive = policy(serde_json::json!({"mode": "exclusive", "default_route": ["z"]}));
        let (z, _z) = test_session(3, "z", false, &ids);
        let refused = registry.register(z.clone(), &exclusive).refused;
        assert_eq!(refused.len(), 1, "exclusive mode applies to unbound agents too");
        assert!(claims(&z).2);
    }
}
