//! Shared set-up for the tests.

use std::net::{IpAddr, SocketAddr};
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tether_loadtest::backends;
use tether_loadtest::local::{AgentSpec, LocalDeployment, LocalOptions, allow};
use tokio::net::TcpListener;

/// Starts a session like an agent on `link`: opens the control stream and sends a Hello as
/// `agent_id`; returns the session, its inbound streams, the control stream and the gateway's
/// answer to the Hello (a Welcome follows on the control stream when it is ok).
pub async fn hello_as(
    link: tether_tunnel::ws_link::WsLink<tether_tunnel::transport::Transport>,
    agent_id: &str,
) -> (
    tether_tunnel::mux::Session,
    tether_tunnel::mux::Incoming,
    tether_tunnel::mux::MuxStream,
    tether_tunnel::protocol::StreamResult,
) {
    use tether_tunnel::framed::{read_frame, write_frame};
    use tether_tunnel::mux::{self, MuxSettings, Role};
    use tether_tunnel::protocol::{
        ControlMessage, ControlOpen, Hello, Identifiers, MAX_CONTROL_FRAME, MAX_STREAM_FRAME, StreamOpen,
    };
    let (session, incoming, driver) = mux::start(link, Role::Client, &MuxSettings::default());
    tokio::spawn(driver);
    let mut control = session.open().await.unwrap();
    write_frame(&mut control, &StreamOpen::Control(ControlOpen { version: 1 }), MAX_STREAM_FRAME).await.unwrap();
    let hello = ControlMessage::Hello(Hello {
        agent_id: agent_id.into(),
        version: "test".into(),
        identifiers: Identifiers::default(),
        capabilities: vec![],
    });
    write_frame(&mut control, &hello, MAX_CONTROL_FRAME).await.unwrap();
    let result = read_frame(&mut control, MAX_STREAM_FRAME).await.unwrap();
    (session, incoming, control, result)
}

/// Binds a node-side server on a loopback address of its own (127.0.x.y), distinct from every
/// other one this test process handed out: agents claim their node's address exclusively, so two
/// nodes drawn onto one address would route one node's dials to the other.
pub async fn node_listener() -> (TcpListener, SocketAddr) {
    loop {
        if let Ok(listener) = TcpListener::bind((node_ip(), 0)).await {
            let addr = listener.local_addr().unwrap();
            return (listener, addr);
        }
    }
}

/// The next node address of this process: 127.0.x.y with x and y in 1..250, walked from a random
/// start so that concurrent test processes mostly use different ones.
fn node_ip() -> IpAddr {
    const SPAN: u32 = 249;
    static NEXT: LazyLock<AtomicU32> = LazyLock::new(|| AtomicU32::new(fastrand::u32(..SPAN * SPAN)));
    let n = NEXT.fetch_add(1, Ordering::Relaxed) % (SPAN * SPAN);
    IpAddr::from([127, 0, (1 + n / SPAN) as u8, (1 + n % SPAN) as u8])
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
    let deployment = LocalDeployment::start(LocalOptions {
        agents: vec![agent_for("node-1", echo)],
        // Busy from 4 MiB/s, and a busy session retires a second after the traffic (not a
        // minute): tests that compare resources with a baseline see it come and go, and what it
        // leaves behind.
        tweak_agent: Some(std::sync::Arc::new(|_, config| {
            config.gateway.pool.busy_mib_per_second = 4;
            config.gateway.pool.busy_linger = Duration::from_secs(1).into();
        })),
        ..LocalOptions::default()
    })
    .await
    .unwrap();
    deployment.wait_connected(Duration::from_secs(10)).await.unwrap();
    (deployment, echo)
}

/// A node-side server that answers every connection with an endless stream (like `logs -f`):
/// it reads whatever the client sends first, then writes until a write fails. Returns its address
/// and the number of connections it holds open right now.
pub async fn firehose() -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (listener, addr) = node_listener().await;
    let open = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = open.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let counter = counter.clone();
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut request = [0u8; 256];
                if stream.read(&mut request).await.is_ok() {
                    let chunk = tether_loadtest::backends::pattern(64 * 1024);
                    while stream.write_all(&chunk).await.is_ok() {}
                }
                counter.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    (addr, open)
}

/// TCP sockets with local port `port` in any state but LISTEN and TIME-WAIT, as `ss` sees them
/// (CLOSE-WAIT and FIN-WAIT-2 included): connections some process still holds.
pub fn sockets_on_port(port: u16) -> Vec<String> {
    // A listener is not a connection, and a TIME-WAIT entry is a connection both ends have closed
    // (the kernel keeps it for a while, no process holds it): neither is a leak.
    let output = std::process::Command::new("ss")
        .args([
            "-Htan",
            "state",
            "all",
            "exclude",
            "listening",
            "exclude",
            "time-wait",
            &format!("( sport = :{port} )"),
        ])
        .output()
        .expect("ss (iproute2)");
    String::from_utf8_lossy(&output.stdout).lines().map(str::to_owned).collect()
}

/// Reads some of an endless answer through `stream`, then goes away without reading the rest,
/// as an interrupted `kubectl logs -f` does (an RST, since unread data is left behind).
pub async fn read_a_little_then_abort<S>(mut stream: S)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::AsyncReadExt;
    tether_tunnel::transport::send_all(
        &mut stream,
        b"GET /containerLogs/default/app/app?follow=true HTTP/1.1\r\nHost: node\r\n\r\n",
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 16 * 1024];
    let mut got = 0;
    while got < 100 * 1024 {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await.unwrap().unwrap();
        assert!(n > 0, "the endless answer ended");
        got += n;
    }
    drop(stream);
}
