//! Dial targets as clients write them: `host:port`, `1.2.3.4:port` or `[v6]:port`.

use std::fmt;
use std::net::IpAddr;

/// The host part of a target.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum TargetHost {
    /// An IP literal.
    Ip(IpAddr),
    /// A host name, lowercased.
    Name(String),
}

/// A parsed `host:port`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DialTarget {
    /// Host.
    pub host: TargetHost,
    /// Port.
    pub port: u16,
}

/// Why a target is not `host:port`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    /// Not `host:port` with a DNS name or address and a port from 1 to 65535.
    #[error("{0:?} is not host:port")]
    NotHostPort(String),
    /// An IPv6 address without brackets.
    #[error("{0:?}: IPv6 addresses must be in brackets, e.g. [fd00::1]:10250")]
    UnbracketedIpv6(String),
}

impl DialTarget {
    /// Parses `host:port`; host names must be valid DNS names, ports non-zero.
    pub fn parse(text: &str) -> Result<Self, TargetError> {
        let bad = || TargetError::NotHostPort(text.chars().take(300).collect::<String>());
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            let (v6, port) = rest.split_once("]:").ok_or_else(bad)?;
            let ip: IpAddr = v6.parse().map_err(|_| bad())?;
            (TargetHost::Ip(ip), port)
        } else {
            let (host, port) = text.rsplit_once(':').ok_or_else(bad)?;
            if host.contains(':') {
                return Err(TargetError::UnbracketedIpv6(text.chars().take(300).collect()));
            }
            let host = match host.parse::<IpAddr>() {
                Ok(ip) => TargetHost::Ip(ip),
                Err(_) if valid_dns_name(host) => TargetHost::Name(host.to_ascii_lowercase()),
                Err(_) => return Err(bad()),
            };
            (host, port)
        };
        let port: u16 = port.parse().map_err(|_| bad())?;
        if port == 0 {
            return Err(bad());
        }
        Ok(Self { host, port })
    }
}

impl fmt::Display for DialTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            TargetHost::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]:{}", self.port),
            TargetHost::Ip(ip) => write!(f, "{ip}:{}", self.port),
            TargetHost::Name(name) => write!(f, "{name}:{}", self.port),
        }
    }
}

fn valid_dns_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_kube_apiserver_sends() {
        let t = DialTarget::parse("10.0.0.5:10250").unwrap();
        assert_eq!(t.host, TargetHost::Ip("10.0.0.5".parse().unwrap()));
        assert_eq!(t.port, 10250);
        let t = DialTarget::parse("[fd00::5]:10250").unwrap();
        assert_eq!(t.to_string(), "[fd00::5]:10250");
        let t = DialTarget::parse("Node-1.Example.com:443").unwrap();
        assert_eq!(t.host, TargetHost::Name("node-1.example.com".into()));
    }

    #[test]
    fn refuses_what_is_not_host_port() {
        for bad in [
            "",
            "host",
            "host:",
            ":80",
            "host:0",
            "host:70000",
            "fd00::1:80",
            "[fd00::1]80",
            "a b:1",
            "x..y:1",
            "[nothex]:1",
        ] {
            assert!(DialTarget::parse(bad).is_err(), "{bad:?}");
        }
    }
}
