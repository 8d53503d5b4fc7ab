//! Shared set-up for the tests.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tether_loadtest::backends;
use tether_loadtest::local::{AgentSpec, LocalDeployment, LocalOptions, allow};
use tokio::net::TcpListener;

/// Binds a node-side server on a fresh loopback address of its own (127.0.x.y).
pub async fn node_listener() -> (TcpListener, SocketAddr) {
    loop {
        let ip = IpAddr::from([127, 0, fastrand::u8(1..250), fastrand::u8(1..250)]);
        if let Ok(listener) = TcpListener::bind((ip, 0)).await {
            let addr = listener.local_addr().unwrap();
            return (listener, addr);
        }
    }
}

/// A node-side echo server.
pub async fn echo_server() -> SocketAddr {
    let (listener, addr) = node_listener().await;
    backends::spawn_echo(listener);
    addr
}

/// An agent that serves `addr` (declared as its address and allowed).
pub fn agent_for(id: &str, addr: SocketAddr) -> AgentSpec {
    AgentSpec {
        id: id.into(),
        addresses: vec![addr.ip()],
        allow: vec![allow(addr.ip(), &[addr.port()])],
        default_route: false,
    }
}

/// A deployment with one agent in front of an echo server; returns it and the echo address.
pub async fn one_agent_echo() -> (LocalDeployment, SocketAddr) {
    let echo = echo_server().await;
    let deployment =
        LocalDeployment::start(LocalOptions { agents: vec![agent_for("node-1", echo)], ..LocalOptions::default() })
            .await
            .unwrap();
    deployment.wait_connected(Duration::from_secs(10)).await.unwrap();
    (deployment, echo)
}
