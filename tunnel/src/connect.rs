//! Connecting to a target that a policy must allow: resolve the name (an IP literal is used as
//! it is), keep only the addresses the policy allows, and connect to them in turn, all within
//! one deadline. The policy - the agent's allow list, the gateway's node -> control-plane list -
//! stays with the caller; a name is judged by what it resolves to, so DNS cannot smuggle in an
//! address the policy refuses.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::net::TcpStream;

/// Why no connection was made.
#[derive(Debug, thiserror::Error)]
pub enum AllowedConnectError {
    /// The name did not resolve.
    #[error("cannot resolve {host}: {reason}")]
    Resolve {
        /// The name.
        host: String,
        /// Why.
        reason: String,
    },
    /// The policy allows none of the addresses (the first few are listed).
    #[error("none of {} is allowed", shown(.resolved))]
    NotAllowed {
        /// What the target resolved to.
        resolved: Vec<IpAddr>,
    },
    /// The deadline passed.
    #[error("timed out after {} ms", .0.as_millis())]
    TimedOut(Duration),
    /// Every allowed address refused or failed.
    #[error("{0}")]
    Failed(String),
}

impl AllowedConnectError {
    /// The resolved addresses, for a refusal's message ("nothing" when there were none).
    pub fn shown_addresses(&self) -> String {
        match self {
            Self::NotAllowed { resolved } => shown(resolved),
            _ => String::new(),
        }
    }
}

fn shown(addresses: &[IpAddr]) -> String {
    if addresses.is_empty() {
        return "nothing".into();
    }
    addresses.iter().take(4).map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// Connects to `host:port` through an address `allowed` accepts, within `timeout`. TCP_NODELAY
/// is set on the connection.
pub async fn connect_allowed(
    host: &str,
    port: u16,
    timeout: Duration,
    allowed: impl Fn(IpAddr) -> bool,
) -> Result<TcpStream, AllowedConnectError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let candidates: Vec<SocketAddr> = match host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => tokio::time::timeout_at(deadline, tokio::net::lookup_host((host, port)))
            .await
            .map_err(|_| AllowedConnectError::TimedOut(timeout))?
            .map_err(|e| AllowedConnectError::Resolve { host: host.to_owned(), reason: e.to_string() })?
            .collect(),
    };
    let permitted: Vec<SocketAddr> = candidates.iter().copied().filter(|a| allowed(a.ip())).collect();
    if permitted.is_empty() {
        return Err(AllowedConnectError::NotAllowed { resolved: candidates.iter().map(SocketAddr::ip).collect() });
    }
    let mut last_error = String::new();
    for addr in permitted {
        match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
            Err(_) => return Err(AllowedConnectError::TimedOut(timeout)),
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                return Ok(stream);
            }
            Ok(Err(e)) => last_error = format!("{addr}: {e}"),
        }
    }
    Err(AllowedConnectError::Failed(last_error))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_allowed_addresses_are_connected_to() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let timeout = Duration::from_secs(5);
        assert!(connect_allowed("127.0.0.1", port, timeout, |ip| ip.is_loopback()).await.is_ok());
        // A name is judged by the addresses it resolves to.
        let refused = connect_allowed("localhost", port, timeout, |_| false).await.unwrap_err();
        assert!(matches!(&refused, AllowedConnectError::NotAllowed { resolved } if !resolved.is_empty()));
        assert!(refused.shown_addresses().contains("127.0.0.1") || refused.shown_addresses().contains("::1"));
        drop(listener);
        let failed = connect_allowed("127.0.0.1", port, timeout, |_| true).await.unwrap_err();
        assert!(matches!(failed, AllowedConnectError::Failed(_)), "{failed}");
        let unresolvable = connect_allowed("no-such-host.invalid", port, timeout, |_| true).await.unwrap_err();
        assert!(matches!(unresolvable, AllowedConnectError::Resolve { .. } | AllowedConnectError::TimedOut(_)));
    }
}
