//! Node -> control-plane forwarding in one process: agent listeners, the gateway's allow list,
//! refusals, bulk integrity, many clients, and a gateway restart under a bound listener.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tether_agent::config::{ListenerConfig, PoolConfig};
use tether_e2e::bins::{http_get, metric_sum};
use tether_e2e::checksum::Checksum;
use tether_gateway::GatewayConfig;
use tether_gateway::config::{ForwardTarget, NodeToControlPlane};
use tether_loadtest::backends;
use tether_loadtest::local::{LocalDeployment, LocalOptions, loopback};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::{echo_server, node_listener};

/// A deployment whose single agent listens for `targets` (by name) and whose tenant allows `allowed`.
async fn deployment(tenant: &str, listeners: &[&str], allowed: Option<Vec<ForwardTarget>>) -> LocalDeployment {
    deployment_with(tenant, listeners, allowed, 4096, |_| {}, |_| {}).await
}

/// One listener for the `kube-apiserver` target at `control_plane`, allowed by the tenant, the
/// agent's session pool set by `pool`.
async fn kas_deployment(
    tenant: &str,
    control_plane: SocketAddr,
    pool: impl Fn(&mut PoolConfig) + Send + Sync + 'static,
) -> LocalDeployment {
    deployment_with(
        tenant,
        &["kube-apiserver"],
        Some(vec![target("kube-apiserver", control_plane)]),
        4096,
        pool,
        |_| {},
    )
    .await
}

/// Like [`deployment`], each listener taking at most `max_connections` at once, the agent's
/// session pool set by `pool`.
async fn deployment_with(
    tenant: &str,
    listeners: &[&str],
    allowed: Option<Vec<ForwardTarget>>,
    max_connections: usize,
    pool: impl Fn(&mut PoolConfig) + Send + Sync + 'static,
    gateway: impl FnOnce(&mut GatewayConfig) + Send + 'static,
) -> LocalDeployment {
    let names: Vec<String> = listeners.iter().map(|s| (*s).to_owned()).collect();
    let deployment = LocalDeployment::start(LocalOptions {
        tenant: tenant.into(),
        host: format!("{tenant}.tether.local"),
        agents: vec![tether_loadtest::local::AgentSpec {
            id: "node-1".into(),
            addresses: vec![],
            allow: vec![],
            default_route: false,
        }],
        tweak_gateway: Some(Box::new(move |config| {
            config.tenants[0].node_to_controlplane = allowed.map(|targets| NodeToControlPlane { targets });
            gateway(config);
        })),
        tweak_agent: Some(Arc::new(move |_, config| {
            config.forward_wait = Duration::from_secs(10).into();
            pool(&mut config.gateway.pool);
            config.listeners = names
                .iter()
                .map(|name| ListenerConfig { max_connections, ..ListenerConfig::new(loopback(0), name.clone()) })
                .collect();
        })),
        ..LocalOptions::default()
    })
    .await
    .unwrap();
    deployment.wait_connected(Duration::from_secs(10)).await.unwrap();
    deployment
}

fn target(name: &str, address: SocketAddr) -> ForwardTarget {
    ForwardTarget { name: name.into(), address: address.to_string(), allowed_networks: vec![] }
}

fn listener_for(deployment: &LocalDeployment, name: &str) -> SocketAddr {
    deployment.agents[0].forward_addrs.iter().find(|(_, t)| t == name).map(|(a, _)| *a).unwrap()
}

/// Opens `count` forwards through `listener` (to an echo), each checked with a round trip, and
/// holds them open.
async fn hold_forwards(listener: SocketAddr, count: usize) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(count);
    for _ in 0..count {
        let mut client = TcpStream::connect(listener).await.unwrap();
        round_trip(&mut client, b"held").await;
        held.push(client);
    }
    held
}

/// Open streams on each of the agent's live sessions, smallest first.
fn sorted_loads(agent: &tether_loadtest::local::LocalAgent) -> Vec<usize> {
    let mut loads = agent.state.session_streams();
    loads.sort_unstable();
    loads
}

/// Sends `message` on `client` (to an echo) and reads it back.
async fn round_trip(client: &mut TcpStream, message: &[u8]) {
    client.write_all(message).await.unwrap();
    let mut got = vec![0u8; message.len()];
    tokio::time::timeout(Duration::from_secs(10), client.read_exact(&mut got)).await.unwrap().unwrap();
    assert_eq!(got, message);
}

/// Sends `len` random bytes through an echo and checks what comes back.
async fn echo_checksummed(addr: SocketAddr, len: usize, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let payload: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
    let expected = Checksum::of(&payload);
    let (mut read, mut write) = TcpStream::connect(addr).await.unwrap().into_split();
    let writer = tokio::spawn(async move {
        write.write_all(&payload).await.unwrap();
        write.shutdown().await.unwrap();
    });
    let mut got = Vec::with_capacity(len);
    tokio::time::timeout(Duration::from_secs(60), read.read_to_end(&mut got)).await.unwrap().unwrap();
    writer.await.unwrap();
    assert_eq!(got.len(), len);
    assert_eq!(Checksum::of(&got), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_bytes_arrive_intact_both_ways_for_many_clients() {
    let control_plane = echo_server().await;
    let d = deployment("fwd-bulk", &["kube-apiserver"], Some(vec![target("kube-apiserver", control_plane)])).await;
    let listener = listener_for(&d, "kube-apiserver");
    // One large transfer, then 200 concurrent clients.
    echo_checksummed(listener, 32 << 20, 1).await;
    let clients: Vec<_> =
        (0..200).map(|i| tokio::spawn(echo_checksummed(listener, fastrand::usize(1..200_000), i))).collect();
    for client in clients {
        client.await.unwrap();
    }
    let (_, metrics) = http_get(d.admin_addr, "/metrics").await.unwrap();
    assert_eq!(
        metric_sum(
            &metrics,
            "tether_gateway_forwards_total",
            "tenant=\"fwd-bulk\",target=\"kube-apiserver\",result=\"ok\""
        ),
        201.0,
        "{metrics}"
    );
    d.shutdown().await;
}

/// `pool.sessions_per_replica: 2`: the agent runs each session on a thread of its own and moves
/// every node-side connection to its session's thread; the connections spread over both sessions
/// and their bytes arrive intact both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwards_over_two_sessions_on_threads_of_their_own_arrive_intact() {
    let control_plane = echo_server().await;
    let d = kas_deployment("fwd-two", control_plane, |p| {
        p.sessions_per_replica = 2;
    })
    .await;
    let agent = &d.agents[0];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while agent.state.live_sessions() < 2 {
        assert!(tokio::time::Instant::now() < deadline, "the agent never held two sessions");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let listener = listener_for(&d, "kube-apiserver");
    // Eight connections held open: four on each session (each also carries its control stream).
    let held = hold_forwards(listener, 8).await;
    assert_eq!(sorted_loads(agent), vec![5, 5], "forwards spread over both sessions");
    // Bulk and many clients at once, over both sessions.
    let mut clients = vec![tokio::spawn(echo_checksummed(listener, 16 << 20, 1))];
    clients.extend((0..100).map(|i| tokio::spawn(echo_checksummed(listener, fastrand::usize(1..200_000), i + 2))));
    for client in clients {
        client.await.unwrap();
    }
    drop(held);
    let (_, metrics) = http_get(d.admin_addr, "/metrics").await.unwrap();
    assert_eq!(
        metric_sum(
            &metrics,
            "tether_gateway_forwards_total",
            "tenant=\"fwd-two\",target=\"kube-apiserver\",result=\"ok\""
        ),
        109.0,
        "{metrics}"
    );
    d.shutdown().await;
}

/// Busy sessions: an agent whose traffic stays under `busy_mib_per_second` (small requests) holds
/// one session; bulk traffic makes it busy, a second session comes up and later forwards spread
/// over both; once the traffic has stayed under the rate for `busy_linger`, the second session
/// retires: the agent routes nothing new to it, the streams still on it keep working, and it
/// closes (at the gateway too) when they end. Bulk brings it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_traffic_brings_a_second_session_that_retires_when_the_agent_is_quiet() {
    let control_plane = echo_server().await;
    let d = kas_deployment("fwd-busy", control_plane, |p| {
        assert_eq!((p.sessions_per_replica, p.busy_sessions_per_replica), (1, 2), "the defaults");
        p.busy_mib_per_second = 2;
        p.busy_linger = Duration::from_millis(1500).into();
    })
    .await;
    let agent = &d.agents[0];
    let gateway_sessions = async || {
        let (_, metrics) = http_get(d.admin_addr, "/metrics").await.unwrap();
        metric_sum(&metrics, "tether_gateway_agent_sessions", "tenant=\"fwd-busy\"")
    };
    let listener = listener_for(&d, "kube-apiserver");

    // Small requests for a few samples: still one session.
    let mut small = TcpStream::connect(listener).await.unwrap();
    for _ in 0..20 {
        round_trip(&mut small, b"busy").await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!agent.state.is_busy());
    assert_eq!(agent.state.live_sessions(), 1);
    assert_eq!(gateway_sessions().await, 1.0);
    drop(small);

    // Bulk until the second session is up.
    let bulk = bulk_until(listener, || agent.state.live_sessions() == 2);
    assert!(tokio::time::timeout(Duration::from_secs(30), bulk).await.is_ok(), "bulk never brought a second session");
    assert!(agent.state.is_busy());
    let (_, agent_metrics) = http_get(agent.admin.unwrap(), "/metrics").await.unwrap();
    assert_eq!(metric_sum(&agent_metrics, "tether_agent_busy", ""), 1.0, "{agent_metrics}");
    // Forwards opened while busy go to the least-loaded session (once the bulk one has closed).
    assert!(
        crate::tunnel::wait_for(Duration::from_secs(10), || agent.state.session_streams().iter().sum::<usize>() == 2)
            .await
    );
    let mut held = hold_forwards(listener, 4).await;
    assert_eq!(
        sorted_loads(agent),
        vec![3, 3],
        "four forwards spread over both sessions (each also has its control stream)"
    );
    assert_eq!(gateway_sessions().await, 2.0);

    // Quiet (the held connections move almost nothing): the second session retires. Its streams
    // still work; it closes, at the gateway too, once they end.
    assert!(
        crate::tunnel::wait_for(Duration::from_secs(10), || agent.state.live_sessions() == 1).await,
        "the busy session never retired"
    );
    assert!(!agent.state.is_busy());
    for client in &mut held {
        round_trip(client, b"busy").await;
    }
    assert_eq!(gateway_sessions().await, 2.0, "a retiring session stays while it carries streams");
    drop(held);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while gateway_sessions().await != 1.0 {
        assert!(tokio::time::Instant::now() < deadline, "the gateway still holds the retired session");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, agent_metrics) = http_get(agent.admin.unwrap(), "/metrics").await.unwrap();
    assert_eq!(metric_sum(&agent_metrics, "tether_agent_busy", ""), 0.0, "{agent_metrics}");
    assert_eq!(metric_sum(&agent_metrics, "tether_agent_sessions", ""), 1.0, "{agent_metrics}");

    // Busy again: bulk brings the second session back.
    let bulk = bulk_until(listener, || agent.state.live_sessions() == 2);
    assert!(tokio::time::timeout(Duration::from_secs(30), bulk).await.is_ok(), "the second session never came back");
    d.shutdown().await;
}

/// A busy session the gateway refuses (it is at `limits.max_agent_sessions`, which counts
/// sessions; a tenant's `max_agents` counts agents and would admit it) is no outage: the agent
/// stays ready on its held session, reports no connection error, keeps carrying its traffic, and
/// the refusal is counted at the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_session_refused_at_the_session_limit_leaves_the_agent_ready() {
    let control_plane = echo_server().await;
    let deployment = deployment_with(
        "fwd-limit",
        &["kube-apiserver"],
        Some(vec![target("kube-apiserver", control_plane)]),
        4096,
        |p| p.busy_mib_per_second = 2,
        |config| config.limits.max_agent_sessions = 1,
    )
    .await;
    let agent = &deployment.agents[0];
    let listener = listener_for(&deployment, "kube-apiserver");
    let bulk = bulk_until(listener, || agent.state.is_busy());
    assert!(tokio::time::timeout(Duration::from_secs(30), bulk).await.is_ok(), "bulk never made the agent busy");
    let refused = async || {
        let (_, metrics) = http_get(deployment.admin_addr, "/metrics").await.unwrap();
        metric_sum(&metrics, "tether_gateway_agent_connects_total", "tenant=\"fwd-limit\",result=\"limit\"")
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while refused().await < 1.0 {
        assert!(tokio::time::Instant::now() < deadline, "the busy session was never refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(agent.state.live_sessions(), 1);
    assert!(agent.state.is_ready());
    assert_eq!(agent.state.last_error(), None, "a refused busy session is not the agent's connection error");
    let (status, body) = http_get(agent.admin.unwrap(), "/readyz").await.unwrap();
    assert_eq!(status, 200, "{body}");
    echo_checksummed(listener, 1 << 20, 9).await;
    deployment.shutdown().await;
}

/// Streams 1 MiB chunks through the echo at `addr`, reading them back, until `done`.
async fn bulk_until(addr: SocketAddr, done: impl Fn() -> bool) {
    let (mut read, mut write) = TcpStream::connect(addr).await.unwrap().into_split();
    let chunk = vec![0x5a_u8; 1 << 20];
    let mut got = vec![0u8; 1 << 20];
    while !done() {
        let (wrote, echoed) = tokio::join!(write.write_all(&chunk), read.read_exact(&mut got));
        wrote.unwrap();
        echoed.unwrap();
        assert!(got.iter().all(|b| *b == 0x5a));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unlisted_targets_and_tenants_without_a_list_are_refused() {
    let control_plane = echo_server().await;
    // localhost resolves to loopback, which this target's allowed networks exclude.
    let rebinding = ForwardTarget {
        name: "rebound".into(),
        address: format!("localhost:{}", control_plane.port()),
        allowed_networks: vec!["10.96.0.0/12".parse().unwrap()],
    };
    let d = deployment(
        "fwd-deny",
        &["kube-apiserver", "etcd", "rebound"],
        Some(vec![target("kube-apiserver", control_plane), rebinding]),
    )
    .await;
    for name in ["etcd", "rebound"] {
        let mut client = TcpStream::connect(listener_for(&d, name)).await.unwrap();
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(10), client.read(&mut buf)).await.unwrap().unwrap_or(0);
        assert_eq!(n, 0, "{name}: a refused forward closes the node-side connection");
    }
    // The agent keeps serving what is allowed.
    echo_checksummed(listener_for(&d, "kube-apiserver"), 100_000, 7).await;
    let (_, metrics) = http_get(d.admin_addr, "/metrics").await.unwrap();
    assert_eq!(
        metric_sum(
            &metrics,
            "tether_gateway_forwards_total",
            "tenant=\"fwd-deny\",target=\"unlisted\",result=\"not_allowed\""
        ),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        metric_sum(
            &metrics,
            "tether_gateway_forwards_total",
            "tenant=\"fwd-deny\",target=\"rebound\",result=\"not_allowed\""
        ),
        1.0
    );
    assert_eq!(metric_sum(&metrics, "tether_agent_forwards_total", "target=\"etcd\",result=\"not_allowed\""), 1.0);
    d.shutdown().await;

    // A tenant with no node_to_controlplane list refuses everything.
    let d = deployment("fwd-none", &["kube-apiserver"], None).await;
    let mut client = TcpStream::connect(listener_for(&d, "kube-apiserver")).await.unwrap();
    let mut buf = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_secs(10), client.read(&mut buf)).await.unwrap().unwrap_or(0);
    assert_eq!(n, 0);
    let (_, metrics) = http_get(d.admin_addr, "/metrics").await.unwrap();
    assert_eq!(
        metric_sum(
            &metrics,
            "tether_gateway_forwards_total",
            "tenant=\"fwd-none\",target=\"unlisted\",result=\"not_allowed\""
        ),
        1.0,
        "{metrics}"
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_stays_bound_across_a_gateway_restart() {
    let (listener, control_plane) = node_listener().await;
    backends::spawn_http(listener, "kube-apiserver".into());
    let mut d =
        deployment("fwd-restart", &["kube-apiserver"], Some(vec![target("kube-apiserver", control_plane)])).await;
    let node_side = listener_for(&d, "kube-apiserver");
    d.stop_gateway().await;
    // While the gateway is down the listener still accepts; the connection waits for a session.
    let mut client = TcpStream::connect(node_side).await.unwrap();
    client.write_all(b"GET /version HTTP/1.1\r\nHost: kubernetes\r\n\r\n").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    d.start_gateway_again().await.unwrap();
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(20), client.read_to_string(&mut response)).await.unwrap().unwrap();
    assert!(response.contains("hello from kube-apiserver: you asked for /version"), "{response}");
    d.shutdown().await;
}

/// A node-side client that goes away with data unread (an RST) frees the forward stream on both
/// sides and closes the control-plane connection, even while the control plane is writing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_forwarded_connection_frees_both_sides() {
    use std::sync::atomic::Ordering;
    let (control_plane, open) = crate::support::firehose().await;
    let d = deployment("fwd-abort", &["kube-apiserver"], Some(vec![target("kube-apiserver", control_plane)])).await;
    let listener = listener_for(&d, "kube-apiserver");
    let clients: Vec<_> = (0..20)
        .map(|_| {
            tokio::spawn(async move {
                crate::support::read_a_little_then_abort(TcpStream::connect(listener).await.unwrap()).await;
            })
        })
        .collect();
    for client in clients {
        client.await.unwrap();
    }
    let admin = d.admin_addr;
    let freed = tether_e2e::bins::eventually(Duration::from_secs(5), async || {
        // One process: the gateway's admin endpoint renders the agent's metrics too.
        let metrics = http_get(admin, "/metrics").await.map(|(_, m)| m).unwrap_or_default();
        metric_sum(&metrics, "tether_gateway_forwards_open", "") == 0.0
            && metric_sum(&metrics, "tether_agent_forwards_open", "") == 0.0
            && open.load(Ordering::SeqCst) == 0
            && crate::support::sockets_on_port(control_plane.port()).is_empty()
    })
    .await;
    let (_, metrics) = http_get(admin, "/metrics").await.unwrap();
    assert!(
        freed,
        "gateway forwards open {}, agent forwards open {}, control-plane connections {}, sockets {:?}",
        metric_sum(&metrics, "tether_gateway_forwards_open", ""),
        metric_sum(&metrics, "tether_agent_forwards_open", ""),
        open.load(Ordering::SeqCst),
        crate::support::sockets_on_port(control_plane.port())
    );
    assert_eq!(
        metric_sum(
            &metrics,
            "tether_gateway_forwards_total",
            "tenant=\"fwd-abort\",target=\"kube-apiserver\",result=\"ok\""
        ),
        20.0
    );
    d.shutdown().await;
}

/// `listeners[].max_connections`: past the cap, a node-side connection is closed at once (and
/// counted); a freed slot takes the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_takes_at_most_its_max_connections() {
    let control_plane = echo_server().await;
    let d = deployment_with(
        "fwd-cap",
        &["kube-apiserver"],
        Some(vec![target("kube-apiserver", control_plane)]),
        2,
        |_| {},
        |_| {},
    )
    .await;
    let listener = listener_for(&d, "kube-apiserver");
    let roundtrip = async |stream: &mut TcpStream| -> bool {
        let mut got = [0u8; 4];
        stream.write_all(b"ping").await.is_ok()
            && matches!(tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut got)).await, Ok(Ok(_)))
    };
    let mut open = Vec::new();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(listener).await.unwrap();
        assert!(roundtrip(&mut stream).await, "within the cap");
        open.push(stream);
    }
    let mut third = TcpStream::connect(listener).await.unwrap();
    assert!(!roundtrip(&mut third).await, "over the cap, the connection is closed");
    drop(open.pop());
    let freed = tether_e2e::bins::eventually(Duration::from_secs(5), async || {
        let Ok(mut stream) = TcpStream::connect(listener).await else { return false };
        roundtrip(&mut stream).await
    })
    .await;
    assert!(freed, "a freed slot takes the next connection");
    let (_, metrics) = http_get(d.agents[0].admin.unwrap(), "/metrics").await.unwrap();
    assert!(metric_sum(&metrics, "tether_agent_forwards_total", "result=\"too_many_connections\"") >= 1.0, "{metrics}");
    d.shutdown().await;
}
