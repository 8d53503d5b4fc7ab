//! The data path in one process: CONNECT through the frontends, through the gateway, the WSS
//! tunnel and the agent, to node-side servers.

use std::time::Duration;

use tether_e2e::checksum::Checksum;
use tether_e2e::proc::open_fds;
use tether_loadtest::backends;
use tether_loadtest::connect_client::{connect_tcp, connect_uds};
use tether_loadtest::local::{LocalDeployment, LocalOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{agent_for, echo_server, node_listener, one_agent_echo};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_through_tcp_and_unix_frontends_reaches_the_node() {
    let (deployment, echo) = one_agent_echo().await;
    let mut over_tcp = connect_tcp(deployment.frontend_addr, &echo.to_string()).await.unwrap().unwrap();
    over_tcp.write_all(b"hello over tcp").await.unwrap();
    let mut got = [0u8; 14];
    over_tcp.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"hello over tcp");
    drop(over_tcp);

    let mut over_uds = connect_uds(&deployment.frontend_uds, &echo.to_string()).await.unwrap().unwrap();
    over_uds.write_all(b"hello over uds").await.unwrap();
    over_uds.shutdown().await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), over_uds.read_to_end(&mut got)).await.unwrap().unwrap();
    assert_eq!(got, b"hello over uds");
    deployment.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_still_delivers_the_whole_response() {
    let (listener, bulk) = node_listener().await;
    backends::spawn_bulk(listener);
    let deployment =
        LocalDeployment::start(LocalOptions { agents: vec![agent_for("node-1", bulk)], ..LocalOptions::default() })
            .await
            .unwrap();
    deployment.wait_connected(Duration::from_secs(10)).await.unwrap();

    // Upload, shut down writing, then read the server's answer, which it sends only after EOF.
    let mut tunnel = connect_tcp(deployment.frontend_addr, &bulk.to_string()).await.unwrap().unwrap();
    let payload = vec![7u8; 3 * 1024 * 1024 + 17];
    tunnel.write_all(b"U").await.unwrap();
    tunnel.write_all(&payload).await.unwrap();
    tunnel.shutdown().await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), tunnel.read_to_end(&mut answer)).await.unwrap().unwrap();
    assert_eq!(answer, (payload.len() as u64).to_be_bytes(), "the count arrives after our write shutdown");
    deployment.shutdown().await;
}

/// 1,000 concurrent streams through one agent, random payloads both ways, every byte verified;
/// afterwards open file descriptors and tasks are back to their baseline, with the busy session
/// the traffic brought retired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_streams_carry_every_byte_and_leave_no_leaks() {
    let (deployment, echo) = one_agent_echo().await;
    let metrics = tokio::runtime::Handle::current().metrics();
    // Warm up lazily created pools and the session, then take the baseline.
    run_streams(&deployment, echo, 4, 1024).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let fds_before = open_fds("self");
    let tasks_before = metrics.num_alive_tasks();

    let results = run_streams(&deployment, echo, 1000, 64 * 1024).await;
    assert_eq!(results, 1000);

    let settled = wait_for(Duration::from_secs(20), || {
        open_fds("self") <= fds_before && metrics.num_alive_tasks() <= tasks_before
    })
    .await;
    assert!(
        settled,
        "resources did not return to baseline: fds {} -> {}, tasks {} -> {}",
        fds_before,
        open_fds("self"),
        tasks_before,
        metrics.num_alive_tasks()
    );
    let admin = deployment.agents[0].admin.unwrap();
    let (_, agent_metrics) = tether_e2e::bins::http_get(admin, "/metrics").await.unwrap();
    let connects = tether_e2e::bins::metric_sum(&agent_metrics, "tether_agent_connects_total", "result=\"ok\"");
    assert_eq!(connects, 2.0, "the held session and one busy session: {agent_metrics}");
    assert_eq!(deployment.agents[0].state.live_sessions(), 1);
    deployment.shutdown().await;
}

/// Opens `count` tunnels at once; each sends a random payload of up to `max_len` bytes while
/// reading the echo concurrently, and checks the echo's checksum. Returns how many verified.
async fn run_streams(deployment: &LocalDeployment, echo: std::net::SocketAddr, count: usize, max_len: usize) -> usize {
    let frontend = deployment.frontend_addr;
    let mut tasks = Vec::with_capacity(count);
    for i in 0..count {
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(i as u64);
            let len = rng.usize(1..=max_len);
            let payload: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
            let expected = Checksum::of(&payload);
            let tunnel = connect_tcp(frontend, &echo.to_string()).await.unwrap().unwrap();
            let (mut read, mut write) = tunnel.into_split();
            let writer = tokio::spawn(async move {
                for chunk in payload.chunks(7919) {
                    write.write_all(chunk).await.unwrap();
                }
                write.shutdown().await.unwrap();
            });
            let mut sum = Checksum::default();
            let mut total = 0;
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = read.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                sum.update(&buf[..n]);
                total += n;
            }
            writer.await.unwrap();
            assert_eq!(total, len, "stream {i} length");
            assert_eq!(sum.value(), expected, "stream {i} checksum");
        }));
    }
    let mut ok = 0;
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(120), task).await.expect("stream timed out").unwrap();
        ok += 1;
    }
    ok
}

/// One tunnelled download whose client never reads must not slow the others: its yamux window
/// fills and only that stream waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_reader_does_not_block_other_streams() {
    let (listener, bulk) = node_listener().await;
    backends::spawn_bulk(listener);
    let deployment =
        LocalDeployment::start(LocalOptions { agents: vec![agent_for("node-1", bulk)], ..LocalOptions::default() })
            .await
            .unwrap();
    deployment.wait_connected(Duration::from_secs(10)).await.unwrap();

    // The stalled stream asks for 1 GiB and never reads a byte.
    let mut stalled = connect_tcp(deployment.frontend_addr, &bulk.to_string()).await.unwrap().unwrap();
    stalled.write_all(b"D").await.unwrap();
    stalled.write_all(&(1u64 << 30).to_be_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Meanwhile eight other downloads of 16 MiB each complete.
    let mut downloads = Vec::new();
    for _ in 0..8 {
        let frontend = deployment.frontend_addr;
        downloads.push(tokio::spawn(async move {
            let mut tunnel = connect_tcp(frontend, &bulk.to_string()).await.unwrap().unwrap();
            tunnel.write_all(b"D").await.unwrap();
            tunnel.write_all(&(16u64 << 20).to_be_bytes()).await.unwrap();
            let mut got = Vec::with_capacity(16 << 20);
            tunnel.read_to_end(&mut got).await.unwrap();
            assert_eq!(got, backends::pattern(256 * 1024).repeat(64));
        }));
    }
    for download in downloads {
        tokio::time::timeout(Duration::from_secs(60), download)
            .await
            .expect("a download stalled behind the stalled stream")
            .unwrap();
    }
    // The stalled stream is still open and still has data waiting: it was throttled, not failed.
    let mut first = [0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), stalled.read(&mut first)).await.unwrap().unwrap();
    assert!(n > 0);
    deployment.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dials_route_to_the_agent_that_serves_the_target() {
    let first = echo_server().await;
    let (listener, second) = node_listener().await;
    backends::spawn_http(listener, "node-2".into());
    let deployment = LocalDeployment::start(LocalOptions {
        agents: vec![agent_for("node-1", first), agent_for("node-2", second)],
        ..LocalOptions::default()
    })
    .await
    .unwrap();
    deployment.wait_connected(Duration::from_secs(10)).await.unwrap();
    for _ in 0..5 {
        let mut tunnel = connect_tcp(deployment.frontend_addr, &second.to_string()).await.unwrap().unwrap();
        tunnel.write_all(b"GET /route HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let mut response = String::new();
        tunnel.read_to_string(&mut response).await.unwrap();
        assert!(response.contains("hello from node-2"), "{response}");
    }
    // node-1 does not allow node-2's server, so a wrong route would be refused, not answered.
    let refused = connect_tcp(deployment.frontend_addr, "127.0.0.1:1").await.unwrap().unwrap_err();
    assert_eq!(refused.status, 403, "{}", refused.reason);
    assert!(refused.reason.contains("allow list"), "{}", refused.reason);
    deployment.shutdown().await;
}

/// Polls `check` every 100 ms until it holds or `timeout` passes.
pub async fn wait_for(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    check()
}

/// Over a link with a 25 ms one-way delay, a stream's receive window grows past yamux's initial
/// 256 KiB: the sender gets further ahead of the reader than 256 KiB. With no room to grow (the
/// control), it never does, so a stream would move at most 256 KiB per round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streams_window_grows_to_fill_a_long_link() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tether_loadtest::delay::pipe;
    use tether_tunnel::mux::{self, MuxSettings, Role};

    async fn furthest_ahead(settings: MuxSettings) -> u64 {
        let delay = Duration::from_millis(25);
        let (client_io, near) = tokio::io::duplex(256 * 1024);
        let (far, server_io) = tokio::io::duplex(256 * 1024);
        let (near_read, near_write) = tokio::io::split(near);
        let (far_read, far_write) = tokio::io::split(far);
        tokio::spawn(pipe(near_read, far_write, delay));
        tokio::spawn(pipe(far_read, near_write, delay));
        let (client, _client_in, client_driver) = mux::start(mux::ByteLink::new(client_io), Role::Client, &settings);
        let (_server, mut server_in, server_driver) =
            mux::start(mux::ByteLink::new(server_io), Role::Server, &settings);
        tokio::spawn(client_driver);
        tokio::spawn(server_driver);

        let total: u64 = 6 << 20;
        let read = Arc::new(AtomicU64::new(0));
        let mut sender = client.open().await.unwrap();
        let reader = {
            let read = read.clone();
            tokio::spawn(async move {
                let mut stream = server_in.accept().await.unwrap();
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = stream.read(&mut buf).await.unwrap();
                    if n == 0 {
                        break;
                    }
                    read.fetch_add(n as u64, Ordering::SeqCst);
                }
            })
        };
        let chunk = vec![7u8; 16 * 1024];
        let (mut written, mut ahead) = (0u64, 0u64);
        while written < total {
            sender.write_all(&chunk).await.unwrap();
            written += chunk.len() as u64;
            ahead = ahead.max(written.saturating_sub(read.load(Ordering::SeqCst)));
        }
        sender.shutdown().await.unwrap();
        tokio::time::timeout(Duration::from_secs(30), reader).await.unwrap().unwrap();
        assert_eq!(read.load(Ordering::SeqCst), total);
        ahead
    }

    let pinned = furthest_ahead(MuxSettings { window_growth: 0, ..MuxSettings::default() }).await;
    assert!(pinned <= 256 * 1024, "without room to grow, a stream's window is 256 KiB: {pinned} bytes ahead");
    let grown = furthest_ahead(MuxSettings::default()).await;
    println!("furthest ahead: {pinned} bytes pinned, {grown} bytes with room to grow");
    assert!(grown > 512 * 1024, "the window grew on a 50 ms round trip: only {grown} bytes ahead");
}
