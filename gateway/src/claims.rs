//! Which of an agent's declared addresses, networks and default-route flag are admitted.
//!
//! A node-bound token proves an agent's node name, not its addresses. Without a rule, node-a's
//! agent could declare node-b's InternalIP and be handed part of node-b's kubelet traffic. When
//! claims are exclusive (`claims.mode`), an address, network or host name is held by one agent
//! only: the first to claim it on this replica, unless `claims.trusted` names its node, and
//! `default_route` only for the agents `claims.default_route` lists. Refused claims are dropped from
//! the session's identifiers, logged with both nodes and counted.

use std::collections::{HashMap, HashSet};

use ipnet::IpNet;

use crate::config::{ClaimMode, ClaimsConfig, parse_claim};
use crate::metrics::CLAIMS_REFUSED;

/// The claims rules of one tenant, ready for lookups.
#[derive(Debug, Default)]
pub struct ClaimPolicy {
    mode: ClaimMode,
    trusted: HashMap<String, Vec<IpNet>>,
    default_route_all: bool,
    default_route: HashSet<String>,
}

impl ClaimPolicy {
    /// The policy a (validated) configuration describes.
    pub fn new(config: &ClaimsConfig) -> Self {
        let trusted = config
            .trusted
            .iter()
            .map(|(node, claims)| (node.to_ascii_lowercase(), claims.iter().filter_map(|c| parse_claim(c)).collect()))
            .collect();
        Self {
            mode: config.mode,
            trusted,
            default_route_all: config.default_route.iter().any(|a| a == "*"),
            default_route: config.default_route.iter().map(|a| a.to_ascii_lowercase()).collect(),
        }
    }

    /// Whether the claims of an agent are exclusive (`node_bound`: its token proves its node).
    pub fn exclusive(&self, node_bound: bool) -> bool {
        match self.mode {
            ClaimMode::Auto => node_bound,
            ClaimMode::Exclusive => true,
            ClaimMode::AsDeclared => false,
        }
    }

    /// The trusted claims of `agent`, when the configuration lists its node.
    pub fn trusted(&self, agent: &str) -> Option<&[IpNet]> {
        self.trusted.get(&agent.to_ascii_lowercase()).map(Vec::as_slice)
    }

    /// Another node whose trusted claims overlap `net`.
    pub fn trusted_holder(&self, net: &IpNet, agent: &str) -> Option<&str> {
        let agent = agent.to_ascii_lowercase();
        self.trusted
            .iter()
            .find(|(node, nets)| **node != agent && nets.iter().any(|n| overlaps(n, net)))
            .map(|(node, _)| node.as_str())
    }

    /// Whether `agent` may be a default route when its claims are exclusive.
    pub fn may_default_route(&self, agent: &str) -> bool {
        self.default_route_all || self.default_route.contains(&agent.to_ascii_lowercase())
    }
}

/// Whether two networks share an address.
pub fn overlaps(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// Why a claim was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Another agent holds it (or the configuration gives it to another node).
    HeldBy(String),
    /// The configuration lists this node's claims, and this is not one of them.
    NotTrusted,
    /// `claims.default_route` does not list this agent.
    DefaultRouteNotAllowed,
}

impl Refusal {
    fn label(&self) -> &'static str {
        match self {
            Self::HeldBy(_) => "held_by_another_node",
            Self::NotTrusted => "not_trusted",
            Self::DefaultRouteNotAllowed => "default_route_not_allowed",
        }
    }
}

/// One refused claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedClaim {
    /// What was claimed: a host name, an address, a network, or `default_route`.
    pub claim: String,
    /// Why it was refused.
    pub refusal: Refusal,
}

/// Logs and counts refused claims.
pub fn report(tenant: &str, agent: &str, refused: &[RefusedClaim]) {
    for RefusedClaim { claim, refusal } in refused {
        metrics::counter!(CLAIMS_REFUSED, "tenant" => tenant.to_owned(), "reason" => refusal.label()).increment(1);
        match refusal {
            Refusal::HeldBy(holder) => tracing::warn!(
                tenant, agent, claim = %claim, held_by = %holder,
                "claim refused: another node holds it; dials for it keep going to that node"
            ),
            Refusal::NotTrusted => tracing::warn!(
                tenant, agent, claim = %claim,
                "claim refused: not among this node's addresses in claims.trusted"
            ),
            Refusal::DefaultRouteNotAllowed => {
                tracing::warn!(tenant, agent, "default_route refused: claims.default_route does not list this agent")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(yaml: &str) -> ClaimPolicy {
        let config: ClaimsConfig = serde_json::from_str(yaml).unwrap();
        ClaimPolicy::new(&config)
    }

    #[test]
    fn auto_is_exclusive_only_for_node_bound_agents() {
        let auto = policy("{}");
        assert!(auto.exclusive(true));
        assert!(!auto.exclusive(false));
        assert!(policy(r#"{"mode":"exclusive"}"#).exclusive(false));
        assert!(!policy(r#"{"mode":"as_declared"}"#).exclusive(true));
    }

    #[test]
    fn trusted_claims_belong_to_their_node_only() {
        let p = policy(r#"{"trusted":{"Node-B":["10.0.0.2","10.244.2.0/24"]}}"#);
        assert_eq!(p.trusted("node-b").map(<[IpNet]>::len), Some(2));
        assert!(p.trusted("node-a").is_none());
        let ip: IpNet = "10.0.0.2/32".parse().unwrap();
        assert_eq!(p.trusted_holder(&ip, "node-a"), Some("node-b"));
        assert_eq!(p.trusted_holder(&ip, "node-b"), None);
        let wide: IpNet = "10.244.0.0/16".parse().unwrap();
        assert_eq!(p.trusted_holder(&wide, "node-a"), Some("node-b"), "a wider network overlaps");
        let other: IpNet = "10.244.3.0/24".parse().unwrap();
        assert_eq!(p.trusted_holder(&other, "node-a"), None);
    }

    #[test]
    fn default_route_needs_listing() {
        assert!(!policy("{}").may_default_route("node-a"));
        assert!(policy(r#"{"default_route":["node-a"]}"#).may_default_route("NODE-A"));
        assert!(policy(r#"{"default_route":["*"]}"#).may_default_route("anyone"));
    }
}
