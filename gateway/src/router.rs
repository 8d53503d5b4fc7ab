//! Where a dial goes - the one place that decides. [`Router::route`] walks the tenant's routing
//! chain once and yields [`Route`]s, best first: an agent session of this replica, or a peer
//! replica that holds a suitable agent (one hop). [`crate::dial`] opens each route it is given
//! and comes back for the next only when the failure is retryable.
//!
//! Per strategy, this replica's own agents come first, then peers whose inventory matches. For
//! `dest_host`, a target that some agent claims - here or in a peer's inventory, now or within
//! [`crate::registry::CLAIM_MEMORY`] - never falls through to `default_route` or `least_loaded`, which would
//! send another node's traffic to an agent that does not serve it: when the claimed agent is not
//! reachable, the inventories are refreshed and the dial waits (until its deadline) for the agent
//! to turn up again, as it does within moments when it moves between replicas. A target no agent
//! claims goes on to the next strategy at once.

use std::collections::{HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::RoutingStrategy;
use crate::peers::PeerSet;
use crate::registry::AgentSession;
use crate::target::DialTarget;
use crate::tenant::Tenant;

/// One way to reach a dial's target.
#[derive(Clone)]
pub enum Route {
    /// A session of this replica's agent.
    Local(Arc<AgentSession>),
    /// A peer replica, asked to dial with exactly this strategy.
    Peer {
        /// Its peer endpoint.
        addr: SocketAddr,
        /// Its id.
        server_id: String,
        /// The one strategy it may use.
        strategy: RoutingStrategy,
    },
}

impl Route {
    /// The agent a local route uses, and the replica a peer route goes through.
    pub fn parties(&self) -> (Option<String>, Option<String>) {
        match self {
            Self::Local(session) => (Some(session.agent_id.clone()), None),
            Self::Peer { server_id, .. } => (None, Some(server_id.clone())),
        }
    }

    /// Who carries the dial: an agent id, or `via <replica>`.
    pub fn carrier(&self) -> String {
        match self {
            Self::Local(session) => session.agent_id.clone(),
            Self::Peer { server_id, .. } => format!("via {server_id}"),
        }
    }

    fn key(&self) -> RouteKey {
        match self {
            Self::Local(session) => RouteKey::Local(session.conn_id),
            Self::Peer { server_id, strategy, .. } => RouteKey::Peer(server_id.clone(), *strategy),
        }
    }
}

#[derive(Clone, PartialEq, Eq, Hash)]
enum RouteKey {
    Local(u64),
    Peer(String, RoutingStrategy),
}

/// Where routes may come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The whole routing chain, here and on peers (a dial from a kube-apiserver).
    Everywhere,
    /// Only this replica's agents, with only this strategy (a dial a peer forwarded: one hop).
    LocalOnly(RoutingStrategy),
}

/// Decides routes for dials.
#[derive(Clone, Default)]
pub struct Router {
    peers: Option<Arc<PeerSet>>,
}

/// How often a dial waiting for a claimed agent looks again.
const WAIT_STEP: Duration = Duration::from_millis(200);
/// Inventories younger than this are fresh enough for a dial that found nothing.
const FRESH_INVENTORY: Duration = Duration::from_millis(100);
/// Peers asked per strategy (each may fail over to the next).
const PEERS_PER_STRATEGY: usize = 2;

impl Router {
    /// A router over this replica's agents and, when configured, its peers.
    pub fn new(peers: Option<Arc<PeerSet>>) -> Self {
        Self { peers }
    }

    /// The routes for a dial to `target`; waiting for a claimed agent ends at `deadline`.
    pub fn route<'a>(
        &'a self,
        tenant: &'a Tenant,
        target: &'a DialTarget,
        scope: Scope,
        deadline: Instant,
    ) -> Routes<'a> {
        let chain = match scope {
            Scope::Everywhere => tenant.config().routing.clone(),
            Scope::LocalOnly(strategy) => vec![strategy],
        };
        let peers = if scope == Scope::Everywhere { self.peers.as_deref() } else { None };
        Routes {
            tenant,
            target,
            peers,
            chain,
            index: 0,
            step: Step::Current,
            queue: VecDeque::new(),
            tried: HashSet::new(),
            may_wait: scope == Scope::Everywhere,
            claimed: None,
            deadline,
            rewalked: false,
        }
    }
}

/// Where a claimed `dest_host` target is in its search; other strategies use only `Current`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Candidates from what is known now.
    Current,
    /// Candidates after refreshing the peers' inventories.
    Refreshed,
    /// Waiting for a claimed agent to turn up, until the deadline.
    Waiting,
}

/// The routes of one dial, produced lazily (see the module documentation).
pub struct Routes<'a> {
    tenant: &'a Tenant,
    target: &'a DialTarget,
    peers: Option<&'a PeerSet>,
    chain: Vec<RoutingStrategy>,
    index: usize,
    step: Step,
    queue: VecDeque<Route>,
    tried: HashSet<RouteKey>,
    /// Whether a claimed target may wait for its agent (not for a dial a peer forwarded: the
    /// replica that forwarded it waits).
    may_wait: bool,
    /// Whether some agent claims the target (decided once per walk, at `dest_host`).
    claimed: Option<bool>,
    deadline: Instant,
    /// Whether the whole chain was walked a second time after a refresh.
    rewalked: bool,
}

impl Routes<'_> {
    /// The next route to try, or `None` when there is none (the dial fails).
    pub async fn next(&mut self) -> Option<Route> {
        loop {
            while let Some(route) = self.queue.pop_front() {
                if self.tried.insert(route.key()) {
                    return Some(route);
                }
            }
            let Some(&strategy) = self.chain.get(self.index) else {
                // Nothing left: inventories may be stale (this replica just started, or agents
                // just moved). Look again once before giving up.
                if self.rewalked || self.peers.is_none() {
                    return None;
                }
                self.rewalked = true;
                self.refresh().await;
                self.index = 0;
                self.step = Step::Current;
                self.claimed = None;
                continue;
            };
            let dest_host = strategy == RoutingStrategy::DestHost && self.may_wait;
            if dest_host && self.claimed.is_none() {
                self.claimed = Some(self.is_claimed());
            }
            let claimed_here = dest_host && self.claimed == Some(true);
            match self.step {
                Step::Current => {
                    self.fill(strategy);
                    if claimed_here {
                        self.step = Step::Refreshed;
                    } else {
                        self.index += 1;
                    }
                }
                Step::Refreshed => {
                    self.refresh().await;
                    self.fill(strategy);
                    self.step = Step::Waiting;
                }
                Step::Waiting => {
                    // The target belongs to an agent that is not reachable right now (it is moving
                    // between replicas): wait for it rather than give its traffic to another node.
                    let left = self.deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    let _ = tokio::time::timeout(WAIT_STEP.min(left), self.tenant.registry.session_added()).await;
                    if let Some(peers) = self.peers {
                        peers.refresh_if_older_than(WAIT_STEP).await;
                    }
                    self.fill(strategy);
                }
            }
        }
    }

    /// Whether some agent claims the target: here or in a peer's inventory, now or recently.
    fn is_claimed(&self) -> bool {
        self.tenant.registry.claims(self.target) || self.peers.is_some_and(|p| p.claims(&self.tenant.name, self.target))
    }

    /// Queues `strategy`'s candidates not tried yet: local sessions first, then peers.
    fn fill(&mut self, strategy: RoutingStrategy) {
        for session in self.tenant.registry.candidates(strategy, self.target) {
            self.queue.push_back(Route::Local(session));
        }
        if let Some(peers) = self.peers {
            for (addr, server_id) in
                peers.candidates(&self.tenant.name, strategy, self.target).into_iter().take(PEERS_PER_STRATEGY)
            {
                self.queue.push_back(Route::Peer { addr, server_id, strategy });
            }
        }
    }

    async fn refresh(&self) {
        if let Some(peers) = self.peers {
            peers.refresh_if_older_than(FRESH_INVENTORY).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::test_session;
    use crate::tenant::test_tenant;
    use tether_tunnel::protocol::Identifiers;

    /// Registers an agent session (a real multiplexer session over an in-memory pipe) claiming
    /// `addresses`; `default_route` as declared.
    fn agent(
        tenant: &Tenant,
        conn_id: u64,
        id: &str,
        addresses: &[&str],
        default_route: bool,
    ) -> (Arc<AgentSession>, impl Sized + use<>) {
        let declared = Identifiers {
            hosts: vec![],
            addresses: addresses.iter().map(|a| a.parse().unwrap()).collect(),
            cidrs: vec![],
            default_route,
        };
        let (entry, agent_end) = test_session(conn_id, id, false, &declared);
        tenant.registry.register(entry.clone(), &tenant.claims());
        (entry, agent_end)
    }

    fn target(text: &str) -> DialTarget {
        DialTarget::parse(text).unwrap()
    }

    async fn agents_in_order(routes: &mut Routes<'_>) -> Vec<String> {
        let mut seen = Vec::new();
        while let Some(route) = routes.next().await {
            seen.push(route.carrier());
        }
        seen
    }

    const CHAIN: [RoutingStrategy; 3] =
        [RoutingStrategy::DestHost, RoutingStrategy::DefaultRoute, RoutingStrategy::LeastLoaded];

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(600)
    }

    #[tokio::test]
    async fn a_claimed_target_goes_to_its_agent_and_an_unclaimed_one_falls_through() {
        let tenant = test_tenant("route-basic", &CHAIN).await;
        let _a = agent(&tenant, 1, "node-a", &["10.0.0.1"], false);
        let _b = agent(&tenant, 2, "gateway-node", &["10.0.0.2"], true);
        let router = Router::new(None);
        let t = target("10.0.0.1:10250");
        let mut routes = router.route(&tenant, &t, Scope::Everywhere, soon());
        assert_eq!(routes.next().await.map(|r| r.carrier()).as_deref(), Some("node-a"));
        // A pod IP nobody claims: the default route, then anyone.
        let pod = target("10.244.1.7:8443");
        let mut routes = router.route(&tenant, &pod, Scope::Everywhere, soon());
        let seen = agents_in_order(&mut routes).await;
        assert_eq!(seen.first().map(String::as_str), Some("gateway-node"), "{seen:?}");
        assert!(seen.contains(&"node-a".to_owned()), "least_loaded offers the others: {seen:?}");
    }

    #[tokio::test]
    async fn a_target_whose_agent_just_left_is_never_given_to_another_node() {
        let tenant = test_tenant("route-left", &CHAIN).await;
        let _b = agent(&tenant, 1, "node-b", &["10.0.0.2"], true);
        let (moving, _c) = agent(&tenant, 2, "node-c", &["10.0.0.3"], false);
        tenant.registry.deregister(&moving);
        let router = Router::new(None);
        let t = target("10.0.0.3:10250");
        let started = Instant::now();
        let mut routes = router.route(&tenant, &t, Scope::Everywhere, started + Duration::from_millis(500));
        assert!(routes.next().await.is_none(), "node-b does not serve node-c's address");
        assert!(started.elapsed() >= Duration::from_millis(500), "the dial waited for node-c to return");
    }

    #[tokio::test]
    async fn a_dial_waiting_for_a_moving_agent_takes_its_new_session() {
        let tenant = test_tenant("route-wait", &CHAIN).await;
        let _b = agent(&tenant, 1, "node-b", &["10.0.0.2"], true);
        // node-c's session is draining (its agent is moving): it still claims its address.
        let (old, _c) = agent(&tenant, 2, "node-c", &["10.0.0.3"], false);
        old.set_draining();
        let router = Router::new(None);
        let t = target("10.0.0.3:10250");
        let registering = {
            let tenant = tenant.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(150)).await;
                agent(&tenant, 3, "node-c", &["10.0.0.3"], false)
            })
        };
        let mut routes = router.route(&tenant, &t, Scope::Everywhere, Instant::now() + Duration::from_secs(5));
        let route = routes.next().await.expect("the new session");
        assert!(matches!(&route, Route::Local(s) if s.conn_id == 3), "{}", route.carrier());
        let _new = registering.await.unwrap();
    }

    #[tokio::test]
    async fn a_dial_a_peer_forwarded_uses_only_its_strategy_and_never_waits() {
        let tenant = test_tenant("route-peer", &CHAIN).await;
        let _b = agent(&tenant, 1, "node-b", &["10.0.0.2"], true);
        let (old, _c) = agent(&tenant, 2, "node-c", &["10.0.0.3"], false);
        old.set_draining();
        let router = Router::new(None);
        let t = target("10.0.0.3:10250");
        let started = Instant::now();
        let mut routes =
            router.route(&tenant, &t, Scope::LocalOnly(RoutingStrategy::DestHost), started + Duration::from_secs(5));
        assert!(routes.next().await.is_none());
        assert!(started.elapsed() < Duration::from_millis(100), "the forwarding replica does the waiting");
        let mut routes = router.route(
            &tenant,
            &t,
            Scope::LocalOnly(RoutingStrategy::DefaultRoute),
            started + Duration::from_secs(5),
        );
        assert_eq!(routes.next().await.map(|r| r.carrier()).as_deref(), Some("node-b"));
    }
}
