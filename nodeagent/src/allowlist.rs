//! What the gateway may dial through this agent: networks and ports. Nothing is allowed unless a
//! rule lists it; host names are checked by the addresses they resolve to.

use std::net::IpAddr;
use std::ops::RangeInclusive;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::config::AllowRule;

/// A port or a port range as written in the configuration: `10250` or `"30000-32767"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PortSpec {
    /// One port.
    One(u16),
    /// A range `"low-high"` (or a single port as a string).
    Range(String),
}

impl PortSpec {
    /// The ports this spec covers.
    pub fn range(&self) -> Result<RangeInclusive<u16>, String> {
        let range = match self {
            Self::One(port) => *port..=*port,
            Self::Range(text) => {
                let parse = |s: &str| {
                    s.trim().parse::<u16>().map_err(|_| format!("{text:?} is not a port or range like 30000-32767"))
                };
                match text.split_once('-') {
                    Some((low, high)) => parse(low)?..=parse(high)?,
                    None => {
                        let port = parse(text)?;
                        port..=port
                    }
                }
            }
        };
        if *range.start() == 0 || range.start() > range.end() {
            return Err(format!("{self:?} is not a valid port range (1-65535, low before high)"));
        }
        Ok(range)
    }
}

/// The compiled allow list.
#[derive(Debug, Clone, Default)]
pub struct AllowList {
    rules: Vec<(IpNet, Vec<RangeInclusive<u16>>)>,
}

impl AllowList {
    /// Compiles validated rules (invalid port specs are skipped; validation reports them);
    /// `own_addresses` rules expand to each of `own` as a host network.
    pub fn new(rules: &[AllowRule], own: &[IpAddr]) -> Self {
        let mut compiled = Vec::new();
        for rule in rules {
            let ports: Vec<RangeInclusive<u16>> = rule.ports.iter().filter_map(|p| p.range().ok()).collect();
            if let Some(cidr) = rule.cidr {
                compiled.push((cidr.trunc(), ports.clone()));
            }
            if rule.own_addresses {
                compiled.extend(own.iter().map(|ip| (IpNet::from(canonical(*ip)), ports.clone())));
            }
        }
        Self { rules: compiled }
    }

    /// Whether `ip:port` may be dialed.
    pub fn allows(&self, ip: IpAddr, port: u16) -> bool {
        let ip = canonical(ip);
        self.rules.iter().any(|(net, ports)| net.contains(&ip) && ports.iter().any(|r| r.contains(&port)))
    }

    /// Whether any rule allows `port` at all (a cheap check before resolving a name).
    pub fn allows_port(&self, port: u16) -> bool {
        self.rules.iter().any(|(_, ports)| ports.iter().any(|r| r.contains(&port)))
    }

    /// Whether nothing at all is allowed.
    pub fn is_empty(&self) -> bool {
        self.rules.iter().all(|(_, ports)| ports.is_empty())
    }
}

/// IPv4-mapped IPv6 addresses are checked as the IPv4 address they are.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(rules: &[(&str, &[PortSpec])]) -> AllowList {
        AllowList::new(
            &rules
                .iter()
                .map(|(cidr, ports)| AllowRule {
                    cidr: Some(cidr.parse().unwrap()),
                    own_addresses: false,
                    ports: ports.to_vec(),
                })
                .collect::<Vec<_>>(),
            &[],
        )
    }

    #[test]
    fn allows_only_listed_networks_and_ports() {
        let allow = list(&[
            ("10.0.0.5/32", &[PortSpec::One(10250)]),
            ("10.1.0.0/16", &[PortSpec::Range("30000-32767".into()), PortSpec::One(443)]),
            ("fd00::/64", &[PortSpec::Range("22".into())]),
        ]);
        assert!(allow.allows("10.0.0.5".parse().unwrap(), 10250));
        assert!(!allow.allows("10.0.0.5".parse().unwrap(), 22));
        assert!(!allow.allows("10.0.0.6".parse().unwrap(), 10250));
        assert!(allow.allows("10.1.200.3".parse().unwrap(), 31000));
        assert!(allow.allows("10.1.200.3".parse().unwrap(), 443));
        assert!(!allow.allows("10.1.200.3".parse().unwrap(), 29999));
        assert!(allow.allows("fd00::9".parse().unwrap(), 22));
        assert!(allow.allows("::ffff:10.0.0.5".parse().unwrap(), 10250), "mapped IPv4 is checked as IPv4");
        assert!(allow.allows_port(31000) && !allow.allows_port(80));
    }

    #[test]
    fn own_addresses_expand_to_the_declared_addresses() {
        let rule = AllowRule { cidr: None, own_addresses: true, ports: vec![PortSpec::One(10250)] };
        let allow = AllowList::new(&[rule], &["10.0.0.5".parse().unwrap(), "fd00::5".parse().unwrap()]);
        assert!(allow.allows("10.0.0.5".parse().unwrap(), 10250));
        assert!(allow.allows("fd00::5".parse().unwrap(), 10250));
        assert!(!allow.allows("10.0.0.6".parse().unwrap(), 10250));
        assert!(!allow.allows("10.0.0.5".parse().unwrap(), 22));
    }

    #[test]
    fn an_empty_list_allows_nothing() {
        let allow = AllowList::default();
        assert!(allow.is_empty());
        assert!(!allow.allows("127.0.0.1".parse().unwrap(), 80));
    }

    #[test]
    fn bad_port_specs_are_reported() {
        assert!(PortSpec::Range("0-10".into()).range().is_err());
        assert!(PortSpec::Range("20-10".into()).range().is_err());
        assert!(PortSpec::Range("http".into()).range().is_err());
        assert!(PortSpec::One(0).range().is_err());
        assert_eq!(PortSpec::Range("1-3".into()).range(), Ok(1..=3));
    }
}
