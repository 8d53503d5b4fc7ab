//! High availability: gateway replicas (the real binary) behind haproxy, agents keeping a session
//! to every replica, peer forwarding, rolling restarts without failed dials, and scaling.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tether_e2e::bins::{Process, eventually, free_port, http_get, metric_sum, start_gateway};
use tether_e2e::daemons::{self, Daemon};
use tether_e2e::nginx::wait_listening;
use tether_loadtest::connect_client::connect_tcp;
use tether_loadtest::devpki::{DevCa, DevIssuer, IssuerKey, PemPair, write_private};
use tether_loadtest::local::{AUDIENCE, ScratchDir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::echo_server;
use crate::tenancy::RunningAgent;

const PEER_NAME: &str = "tether-gateway-peer";

/// One replica's addresses.
#[derive(Clone, Copy)]
struct Replica {
    agents: SocketAddr,
    admin: SocketAddr,
    frontend: SocketAddr,
    peer: SocketAddr,
}

/// Replicas (some maybe stopped), haproxy in front of them, credentials.
struct Cluster {
    dir: ScratchDir,
    ca: DevCa,
    cert: PemPair,
    peer_cert: PemPair,
    issuer: DevIssuer,
    replicas: Vec<Replica>,
    running: Vec<Option<Process>>,
    /// How often replicas refresh each other's inventories.
    refresh_interval: &'static str,
    /// The tenant's `limits`.
    tenant_limits: serde_json::Value,
    /// Agents connect here (TLS passed through, round robin).
    agent_lb: SocketAddr,
    /// CONNECT dials go here (round robin, only to ready replicas).
    connect_lb: SocketAddr,
    _haproxy: Daemon,
}

impl Cluster {
    /// Prepares `total` replicas, starts the first `running`, and haproxy in front of all.
    async fn start(total: usize, running: usize) -> Self {
        Self::start_with(total, running, "300ms").await
    }

    /// Like [`start`](Self::start), with peers refreshing inventories every `refresh_interval`.
    async fn start_with(total: usize, running: usize, refresh_interval: &'static str) -> Self {
        Self::start_limited(total, running, refresh_interval, serde_json::json!({})).await
    }

    /// Like [`start_with`](Self::start_with), with the tenant's `limits`.
    async fn start_limited(
        total: usize,
        running: usize,
        refresh_interval: &'static str,
        tenant_limits: serde_json::Value,
    ) -> Self {
        let dir = ScratchDir::new("tether-ha").unwrap();
        let ca = DevCa::create(dir.path(), "ha").unwrap();
        let cert = ca.server("gateway", &["ha.tether.local"]).unwrap();
        let peer_cert = ca.peer("peer", &[PEER_NAME]).unwrap();
        let issuer = DevIssuer::create(dir.path(), "ha", "https://ha.issuer", IssuerKey::Es256).unwrap();
        let replicas: Vec<Replica> =
            (0..total).map(|_| Replica { agents: lo(), admin: lo(), frontend: lo(), peer: lo() }).collect();
        let (agent_lb, connect_lb) = (lo(), lo());
        let mut config = format!(
            "frontend agents\n  bind {agent_lb}\n  default_backend gateways\n\nbackend gateways\n  balance roundrobin\n"
        );
        for (i, r) in replicas.iter().enumerate() {
            config.push_str(&format!(
                "  server gw{i} {} check port {} inter 200ms fall 1 rise 1\n",
                r.agents,
                r.admin.port()
            ));
        }
        config.push_str(&format!(
            // Dials go only to replicas that can serve the tenant (locally or through a peer).
            "  option httpchk GET /readyz\n\nfrontend dials\n  bind {connect_lb}\n  default_backend frontends\n\nbackend frontends\n  balance roundrobin\n  retries 3\n  option redispatch 1\n  option httpchk GET /readyz/tenant/ha\n"
        ));
        for (i, r) in replicas.iter().enumerate() {
            config.push_str(&format!(
                "  server fe{i} {} check port {} inter 200ms fall 1 rise 1\n",
                r.frontend,
                r.admin.port()
            ));
        }
        let haproxy = daemons::haproxy(&dir.path().join("haproxy"), &config);
        assert!(wait_listening(agent_lb, Duration::from_secs(10)).await, "haproxy did not start");
        let mut cluster = Self {
            dir,
            ca,
            cert,
            peer_cert,
            issuer,
            replicas,
            running: (0..total).map(|_| None).collect(),
            refresh_interval,
            tenant_limits,
            agent_lb,
            connect_lb,
            _haproxy: haproxy,
        };
        for i in 0..running {
            cluster.start_replica(i).await;
        }
        cluster
    }

    fn config(&self, i: usize) -> serde_json::Value {
        let r = self.replicas[i];
        serde_json::json!({
            "server_id": format!("gw-{i}"),
            "listen": { "agents": r.agents.to_string(), "admin": r.admin.to_string() },
            "tls": { "cert_file": self.cert.cert, "key_file": self.cert.key },
            "keepalive": { "ping_interval": "1s", "ping_timeout": "2s" },
            "drain_grace_period": "3s",
            // haproxy checks every 200 ms and takes a replica out after one failed check.
            "drain_delay": "600ms",
            "peers": {
                "listen": r.peer.to_string(),
                "tls": { "cert_file": self.peer_cert.cert, "key_file": self.peer_cert.key, "ca_file": self.ca.ca_cert, "server_name": PEER_NAME },
                "addresses": self.replicas.iter().map(|r| r.peer.to_string()).collect::<Vec<_>>(),
                "refresh_interval": self.refresh_interval,
            },
            "tenants": [{
                "name": "ha",
                "hosts": ["ha.tether.local"],
                "auth": { "issuer": self.issuer.issuer, "audiences": [AUDIENCE], "jwks_file": self.issuer.jwks_file },
                "frontend": { "tcp": { "listen": r.frontend.to_string() } },
                "limits": self.tenant_limits,
            }],
        })
    }

    async fn start_replica(&mut self, i: usize) {
        let process = start_gateway(self.dir.path(), &format!("gw-{i}"), &self.config(i), self.replicas[i].admin).await;
        self.running[i] = Some(process);
    }

    /// SIGTERM, and wait for the drain to finish.
    async fn stop_replica(&mut self, i: usize) {
        if let Some(mut process) = self.running[i].take() {
            process.terminate();
            let status = process.wait(Duration::from_secs(20)).await;
            assert!(
                status.is_some_and(|s| s.success()),
                "gw-{i} did not drain and exit cleanly:\n{}",
                process.log_text()
            );
        }
    }

    /// An in-process agent for node `node` serving `target`, pooling per `mode`.
    async fn agent(&self, node: &str, target: SocketAddr, mode: &str) -> RunningAgent {
        self.agent_with(node, target, serde_json::json!({ "mode": mode, "duplicate_retry_max": "200ms" })).await
    }

    /// An agent with the given `gateway.pool` settings.
    async fn agent_with(&self, node: &str, target: SocketAddr, pool: serde_json::Value) -> RunningAgent {
        let token = self
            .issuer
            .service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(3600), Some(node))
            .unwrap();
        let token_file = self.dir.path().join(format!("{node}.token"));
        write_private(&token_file, token.as_bytes()).unwrap();
        let config = serde_json::from_value(serde_json::json!({
            "agent_id": node,
            "gateway": {
                "url": format!("wss://{}/v1/tunnel", self.agent_lb),
                "server_name": "ha.tether.local",
                "token_file": token_file,
                "ca_file": self.ca.ca_cert,
                "reconnect_initial": "100ms",
                "reconnect_max": "1s",
                "ping_interval": "1s",
                "ping_timeout": "2s",
                "pool": pool,
            },
            "admin_listen": "127.0.0.1:0",
            "shutdown_grace_period": "1s",
            "identifiers": { "addresses": [target.ip().to_string()] },
            "allow": [{ "cidr": format!("{}/32", target.ip()), "ports": [target.port()] }],
        }))
        .unwrap();
        RunningAgent::start(config).await
    }

    /// haproxy's and the replicas' logs, for failure messages.
    fn diagnostics(&self) -> String {
        let mut text = std::fs::read_to_string(self.dir.path().join("haproxy/haproxy.cfg")).unwrap_or_default();
        text.push_str(&std::fs::read_to_string(self.dir.path().join("haproxy/haproxy.out")).unwrap_or_default());
        for process in self.running.iter().flatten() {
            text.push_str(&process.log_text());
        }
        text
    }

    fn running_replicas(&self) -> Vec<Replica> {
        self.replicas.iter().zip(&self.running).filter(|(_, p)| p.is_some()).map(|(r, _)| *r).collect()
    }
}

fn lo() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

async fn echo_via(frontend: SocketAddr, target: SocketAddr) -> Result<(), String> {
    let mut tunnel = connect_tcp(frontend, &target.to_string())
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("{}: {}", e.status, e.reason))?;
    tunnel.write_all(b"ha!").await.map_err(|e| e.to_string())?;
    let mut got = [0u8; 3];
    tunnel.read_exact(&mut got).await.map_err(|e| e.to_string())?;
    if &got == b"ha!" { Ok(()) } else { Err("wrong bytes".into()) }
}

/// Starts `count` agents, each in front of its own echo server.
async fn fleet(cluster: &Cluster, count: usize, mode: &str) -> Vec<(RunningAgent, SocketAddr)> {
    let mut agents = Vec::new();
    for i in 0..count {
        let target = echo_server().await;
        agents.push((cluster.agent(&format!("node-{i}"), target, mode).await, target));
    }
    agents
}

async fn all_hold(agents: &[(RunningAgent, SocketAddr)], sessions: usize, timeout: Duration) -> bool {
    let held = eventually(timeout, async || agents.iter().all(|(a, _)| a.state.server_ids().len() == sessions)).await;
    if !held {
        for (agent, _) in agents.iter().filter(|(a, _)| a.state.server_ids().len() != sessions).take(3) {
            eprintln!(
                "agent holds {:?} (count {}), last error {:?}",
                agent.state.server_ids(),
                agent.state.server_count(),
                agent.state.last_error()
            );
        }
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_agent_reaches_every_replica_and_dials_via_any_replica_reach_any_node() {
    let cluster = Cluster::start(3, 3).await;
    let agents = fleet(&cluster, 50, "all").await;
    assert!(
        all_hold(&agents, 3, Duration::from_secs(60)).await,
        "every agent must hold a session to all three replicas"
    );
    for (agent, _) in &agents {
        assert!(agent.state.is_ready());
    }
    for replica in cluster.running_replicas() {
        for (_, target) in &agents {
            echo_via(replica.frontend, *target).await.unwrap();
        }
        let (_, body) = http_get(replica.admin, "/readyz/tenant/ha").await.unwrap();
        assert!(body.contains("50 local agent sessions"), "{body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_one_session_per_agent_dials_succeed_through_peer_forwarding() {
    let cluster = Cluster::start(3, 3).await;
    let agents = fleet(&cluster, 12, "one").await;
    assert!(all_hold(&agents, 1, Duration::from_secs(30)).await, "{}", cluster.diagnostics());
    // Every replica holds only some agents, yet reaches all of them, through a peer if needed.
    tokio::time::sleep(Duration::from_secs(1)).await; // peers refresh inventories every 300 ms
    for replica in cluster.running_replicas() {
        for (_, target) in &agents {
            echo_via(replica.frontend, *target).await.unwrap_or_else(|e| panic!("via {}: {e}", replica.frontend));
        }
    }
    let mut forwarded = 0.0;
    for replica in cluster.running_replicas() {
        let (_, metrics) = http_get(replica.admin, "/metrics").await.unwrap();
        forwarded += metric_sum(&metrics, "tether_gateway_peer_dials_total", "result=\"ok\"");
        // A replica without local agents is still ready for the tenant, through its peers.
        let (status, _) = http_get(replica.admin, "/readyz/tenant/ha").await.unwrap();
        assert_eq!(status, 200);
    }
    assert!(forwarded >= 12.0, "most dials were forwarded to the replica holding the agent ({forwarded})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_every_replica_fails_no_new_dial() {
    let mut cluster = Cluster::start(3, 3).await;
    let agents = fleet(&cluster, 10, "all").await;
    assert!(all_hold(&agents, 3, Duration::from_secs(60)).await);
    let targets: Vec<SocketAddr> = agents.iter().map(|(_, t)| *t).collect();
    let (ok, failed, running) =
        (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(true)));
    let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut load = Vec::new();
    for worker in 0..4 {
        let (ok, failed, running, failures, targets, lb) =
            (ok.clone(), failed.clone(), running.clone(), failures.clone(), targets.clone(), cluster.connect_lb);
        load.push(tokio::spawn(async move {
            let mut i = worker;
            while running.load(Ordering::Relaxed) {
                i += 1;
                match echo_via(lb, targets[i % targets.len()]).await {
                    Ok(()) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        failures.lock().unwrap().push(e);
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        }));
    }
    for i in 0..3 {
        cluster.stop_replica(i).await;
        cluster.start_replica(i).await;
        assert!(all_hold(&agents, 3, Duration::from_secs(60)).await, "agents must return to gw-{i}");
    }
    running.store(false, Ordering::Relaxed);
    for worker in load {
        worker.await.unwrap();
    }
    let done = ok.load(Ordering::Relaxed);
    assert!(done > 100, "the load kept flowing ({done} dials)");
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "failed dials during the rolling restart: {:?}\n{}",
        failures.lock().unwrap(),
        cluster.diagnostics()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_follow_a_scale_out_and_a_scale_in() {
    let mut cluster = Cluster::start(4, 2).await;
    let agents = fleet(&cluster, 10, "all").await;
    assert!(all_hold(&agents, 2, Duration::from_secs(30)).await);
    cluster.start_replica(2).await;
    cluster.start_replica(3).await;
    assert!(all_hold(&agents, 4, Duration::from_secs(30)).await, "agents must cover the new replicas");
    cluster.stop_replica(3).await;
    cluster.stop_replica(2).await;
    assert!(all_hold(&agents, 2, Duration::from_secs(30)).await, "agents must settle on the remaining replicas");
    for replica in cluster.running_replicas() {
        for (_, target) in &agents {
            echo_via(replica.frontend, *target).await.unwrap();
        }
    }
}

/// Benchmark, not a test: time for agents to cover a new replica, dial latency through a peer
/// versus local, and failed dials during a rolling restart. Run with
/// `cargo test --release -p tether-e2e --test suite bench_ha -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "benchmark; run explicitly"]
async fn bench_ha() {
    // Coverage of a new replica by 50 agents.
    let mut cluster = Cluster::start(3, 2).await;
    let agents = fleet(&cluster, 50, "all").await;
    assert!(all_hold(&agents, 2, Duration::from_secs(60)).await);
    let started = std::time::Instant::now();
    cluster.start_replica(2).await;
    assert!(all_hold(&agents, 3, Duration::from_secs(120)).await);
    let cover = started.elapsed();
    drop(agents);

    // Dial latency: local agent vs forwarded to the peer holding it (one session per agent).
    let cluster2 = Cluster::start(2, 2).await;
    let single = fleet(&cluster2, 1, "one").await;
    assert!(all_hold(&single, 1, Duration::from_secs(30)).await);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let target = single[0].1;
    let held_by = single[0].0.state.server_ids()[0].clone();
    let replicas = cluster2.running_replicas();
    let (local, remote) = if held_by == "gw-0" { (replicas[0], replicas[1]) } else { (replicas[1], replicas[0]) };
    let measure = async |frontend: SocketAddr| {
        let mut samples = Vec::new();
        for _ in 0..500 {
            let t = std::time::Instant::now();
            echo_via(frontend, target).await.unwrap();
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
        samples.sort_by(f64::total_cmp);
        (samples[250], samples[495])
    };
    let (local_p50, local_p99) = measure(local.frontend).await;
    let (peer_p50, peer_p99) = measure(remote.frontend).await;

    // Failed dials during a rolling restart of three replicas under load.
    let restart = Cluster::start(3, 3).await;
    let mut restart = restart;
    let agents = fleet(&restart, 20, "all").await;
    assert!(all_hold(&agents, 3, Duration::from_secs(60)).await);
    let targets: Vec<SocketAddr> = agents.iter().map(|(_, t)| *t).collect();
    let (ok, failed, running) =
        (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(true)));
    let mut load = Vec::new();
    for worker in 0..4 {
        let (ok, failed, running, targets, lb) =
            (ok.clone(), failed.clone(), running.clone(), targets.clone(), restart.connect_lb);
        load.push(tokio::spawn(async move {
            let mut i = worker;
            while running.load(Ordering::Relaxed) {
                i += 1;
                if echo_via(lb, targets[i % targets.len()]).await.is_ok() {
                    ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let rolling = std::time::Instant::now();
    for i in 0..3 {
        restart.stop_replica(i).await;
        restart.start_replica(i).await;
        assert!(all_hold(&agents, 3, Duration::from_secs(60)).await);
    }
    let rolling = rolling.elapsed();
    running.store(false, Ordering::Relaxed);
    for worker in load {
        worker.await.unwrap();
    }
    println!("\nHA figures");
    println!("  50 agents cover a new replica in      {:.2} s", cover.as_secs_f64());
    println!("  dial + echo, local agent              p50 {local_p50:.0} us, p99 {local_p99:.0} us");
    println!("  dial + echo, through a peer replica   p50 {peer_p50:.0} us, p99 {peer_p99:.0} us");
    println!(
        "  rolling restart of 3 replicas ({:.1} s): {} dials ok, {} failed",
        rolling.as_secs_f64(),
        ok.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed)
    );
    let json = serde_json::json!({
        "agents": 50, "cover_new_replica_s": cover.as_secs_f64(),
        "local_dial_p50_us": local_p50, "local_dial_p99_us": local_p99,
        "peer_dial_p50_us": peer_p50, "peer_dial_p99_us": peer_p99,
        "rolling_restart_s": rolling.as_secs_f64(), "rolling_ok": ok.load(Ordering::Relaxed), "rolling_failed": failed.load(Ordering::Relaxed),
    });
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-ha.json");
    std::fs::write(out, serde_json::to_string_pretty(&json).unwrap()).unwrap();
}

/// An interrupted download through a replica that forwards the dial to the replica holding the
/// agent frees the stream on every replica and on the agent, and closes the node-side connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_download_forwarded_through_a_peer_replica_frees_everything() {
    let cluster = Cluster::start(2, 2).await;
    let (firehose, open) = crate::support::firehose().await;
    let agent = cluster.agent("node-0", firehose, "one").await;
    assert!(eventually(Duration::from_secs(30), async || agent.state.server_ids().len() == 1).await);
    let holder = agent.state.server_ids()[0].clone();
    let other = if holder == "gw-0" { 1 } else { 0 };
    let via = cluster.replicas[other];
    // The other replica learns from its peer's inventory (refreshed every 300 ms).
    assert!(
        eventually(Duration::from_secs(10), async || {
            matches!(http_get(via.admin, "/readyz/tenant/ha").await, Ok((200, _)))
        })
        .await
    );
    for _ in 0..10 {
        let tunnel = connect_tcp(via.frontend, &firehose.to_string()).await.unwrap().unwrap();
        crate::support::read_a_little_then_abort(tunnel).await;
    }
    let replicas = cluster.running_replicas();
    let agent_admin = agent.admin.unwrap();
    let freed = eventually(Duration::from_secs(5), async || {
        let mut streams = 0.0;
        for replica in &replicas {
            let metrics = http_get(replica.admin, "/metrics").await.map(|(_, m)| m).unwrap_or_default();
            streams += metric_sum(&metrics, "tether_gateway_streams_open", "");
        }
        let agent_metrics = http_get(agent_admin, "/metrics").await.map(|(_, m)| m).unwrap_or_default();
        streams == 0.0
            && metric_sum(&agent_metrics, "tether_agent_streams_open", "") == 0.0
            && open.load(Ordering::SeqCst) == 0
            && crate::support::sockets_on_port(firehose.port()).is_empty()
    })
    .await;
    assert!(
        freed,
        "node-side connections {}, sockets {:?}\n{}",
        open.load(Ordering::SeqCst),
        crate::support::sockets_on_port(firehose.port()),
        cluster.diagnostics()
    );
    let (_, metrics) = http_get(cluster.replicas[other ^ 1].admin, "/metrics").await.unwrap();
    assert_eq!(
        metric_sum(&metrics, "tether_gateway_peer_dials_total", "result=\"ok\""),
        10.0,
        "the dials were forwarded"
    );
}

/// A tenant's `max_agents` counts agents on each replica. An agent that holds a session on one
/// replica says so when it dials for another; where the tenant is full the replica refuses it at
/// its Hello (after the upgrade, where the agent's id is known), and the agent waits as after a
/// 503 - seconds, not its reconnect backoff - while its other session carries its traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_refused_at_its_hello_for_a_full_tenant_waits_and_keeps_its_other_session() {
    let mut cluster = Cluster::start_limited(2, 1, "300ms", serde_json::json!({ "max_agents": 1 })).await;
    let (x, y) = (echo_server().await, echo_server().await);
    // node-a takes gw-0's only agent slot (the only replica up), with a single session in all.
    let a = cluster.agent("node-a", x, "one").await;
    assert!(eventually(Duration::from_secs(10), async || a.state.server_ids() == ["gw-0"]).await);
    cluster.start_replica(1).await;
    // node-b wants a session to each replica; it gets gw-1's slot, never gw-0's.
    let b = cluster.agent("node-b", y, "all").await;
    assert!(
        eventually(Duration::from_secs(20), async || b.state.server_ids() == ["gw-1"]).await,
        "{}",
        cluster.diagnostics()
    );
    let gw0 = cluster.replicas[0].admin;
    let hello_refusals = || cluster.running[0].as_ref().map(|p| p.log_text().matches("refused at its Hello").count());
    assert!(
        eventually(Duration::from_secs(10), async || hello_refusals() >= Some(1)).await,
        "gw-0 refuses node-b at its Hello: {}",
        cluster.diagnostics()
    );
    // Paced: at most one more refusal in 4 s (the agent waits 5-6 s; its backoff is 100 ms-1 s).
    let before = hello_refusals();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = hello_refusals();
    assert!(after <= before.map(|n| n + 1), "refusals {before:?} -> {after:?}");
    let (_, metrics) = http_get(gw0, "/metrics").await.unwrap();
    assert!(metric_sum(&metrics, "tether_gateway_agent_connects_total", "result=\"limit\"") >= 1.0, "{metrics}");
    assert_eq!(b.state.server_ids(), ["gw-1"], "node-b kept its session to gw-1");
    // Both nodes are reached through either replica (a peer's inventory within its refresh).
    for replica in cluster.running_replicas() {
        for target in [x, y] {
            let echoed = eventually(Duration::from_secs(5), async || {
                let Ok(Ok(mut tunnel)) = connect_tcp(replica.frontend, &target.to_string()).await else { return false };
                let mut got = [0u8; 2];
                tunnel.write_all(b"hi").await.is_ok() && tunnel.read_exact(&mut got).await.is_ok() && &got == b"hi"
            })
            .await;
            assert!(echoed, "{target} through {}: {}", replica.frontend, cluster.diagnostics());
        }
    }
    a.stop().await;
    b.stop().await;
}

/// A node whose agent keeps a single session (`pool.mode: one`) moves to another replica in a
/// rolling restart. Dials for its address must reach it - never another node's agent through the
/// fallback strategies - even while the replicas' inventories are still stale (the documented
/// default routing, and the documented default 2 s refresh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dials_for_a_node_that_moved_replicas_reach_it_and_never_another_node() {
    let mut cluster = Cluster::start_with(3, 3, "2s").await;
    let mut agents = fleet(&cluster, 2, "all").await;
    let single_target = echo_server().await;
    let single = cluster.agent("node-c", single_target, "one").await;
    assert!(all_hold(&agents, 3, Duration::from_secs(60)).await);
    assert!(eventually(Duration::from_secs(30), async || single.state.server_ids().len() == 1).await);
    tokio::time::sleep(Duration::from_secs(3)).await; // one refresh everywhere
    let (ok, running) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(true)));
    let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut load = Vec::new();
    for _ in 0..3 {
        let (ok, running, failures, lb) = (ok.clone(), running.clone(), failures.clone(), cluster.connect_lb);
        load.push(tokio::spawn(async move {
            while running.load(Ordering::Relaxed) {
                match echo_via(lb, single_target).await {
                    Ok(()) => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => failures.lock().unwrap().push(e),
                }
            }
        }));
    }
    for i in 0..3 {
        cluster.stop_replica(i).await;
        cluster.start_replica(i).await;
        assert!(all_hold(&agents, 3, Duration::from_secs(60)).await, "agents must return to gw-{i}");
        assert!(eventually(Duration::from_secs(30), async || single.state.server_ids().len() == 1).await);
    }
    running.store(false, Ordering::Relaxed);
    for worker in load {
        worker.await.unwrap();
    }
    let done = ok.load(Ordering::Relaxed);
    assert!(done > 50, "the load kept flowing ({done} dials)");
    let failures = failures.lock().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {} dials failed: {:?}",
        failures.len(),
        done + failures.len(),
        &failures[..failures.len().min(10)]
    );
    agents.clear();
}

/// Replicas find each other before they welcome agents, so an agent is never ready while it
/// holds fewer sessions than there are replicas (it would be told the wrong count).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_is_ready_only_with_a_session_to_every_replica() {
    let cluster = Cluster::start(3, 3).await;
    let agents = fleet(&cluster, 10, "all").await;
    let mut watchers = Vec::new();
    for (agent, _) in &agents {
        let (admin, state) = (agent.admin.unwrap(), agent.state.clone());
        watchers.push(tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            while tokio::time::Instant::now() < deadline {
                if let Ok((200, body)) = http_get(admin, "/readyz").await {
                    return (state.server_ids().len(), body);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (0, "never ready".to_owned())
        }));
    }
    for watcher in watchers {
        let (sessions, body) = watcher.await.unwrap();
        assert_eq!(sessions, 3, "ready with {sessions} of 3 sessions: {body}");
    }
}

/// A replica stopped with nothing open keeps its agents' sessions until they have moved: every
/// agent receives the drain and counts it, none sees its session lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_agent_of_a_draining_replica_is_told_to_move() {
    let mut cluster = Cluster::start(2, 2).await;
    let agents = fleet(&cluster, 20, "all").await;
    assert!(all_hold(&agents, 2, Duration::from_secs(60)).await);
    cluster.stop_replica(0).await;
    // One process: any agent's admin endpoint renders every agent's metrics.
    let (_, metrics) = http_get(agents[0].0.admin.unwrap(), "/metrics").await.unwrap();
    assert_eq!(metric_sum(&metrics, "tether_agent_drains_total", ""), 20.0, "{metrics}");
    for (agent, _) in &agents {
        assert_eq!(agent.state.last_error(), None, "an agent saw its session lost instead of a drain");
    }
}

/// After a replica's drain message, its agents do not all redial in the same instant: each waits
/// a random pause within `pool.drain_reconnect_window` (here 2 s), so their first dials after the
/// drain spread over most of the window (at once, they would all fall within a few ms).
///
/// The draining replica's inventory says so at once, and the other replica tells its agents the
/// replica count fell to 1 within its next refresh (300 ms). On a loaded machine that can reach an
/// agent before the drain message does; such an agent already holds all the sessions it wants and
/// rightly never redials. Every agent must redial, or have learned that count and hold every
/// session it wants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_replicas_agents_spread_their_redials() {
    let mut cluster = Cluster::start(2, 2).await;
    let mut agents = Vec::new();
    for i in 0..20 {
        let target = echo_server().await;
        let pool = serde_json::json!({ "mode": "all", "duplicate_retry_max": "200ms", "drain_reconnect_window": "2s" });
        agents.push((cluster.agent_with(&format!("node-{i}"), target, pool).await, target));
    }
    assert!(all_hold(&agents, 2, Duration::from_secs(60)).await);
    let states: Vec<_> = agents.iter().map(|(a, _)| a.state.clone()).collect();
    let before: Vec<u64> = states.iter().map(|s| s.dials()).collect();
    let watcher = tokio::spawn(async move {
        // When each agent first dials after the drain.
        let mut first: Vec<Option<tokio::time::Instant>> = vec![None; states.len()];
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while first.iter().any(Option::is_none) && tokio::time::Instant::now() < deadline {
            for (i, state) in states.iter().enumerate() {
                if first[i].is_none() && state.dials() > before[i] {
                    first[i] = Some(tokio::time::Instant::now());
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        first
    });
    cluster.stop_replica(0).await;
    let first = watcher.await.unwrap();
    for ((agent, _), dialed) in agents.iter().zip(&first) {
        let (count, live, wanted) =
            (agent.state.server_count(), agent.state.live_sessions(), agent.state.wanted_sessions());
        assert!(
            dialed.is_some() || (count == 1 && live >= wanted),
            "an agent did not dial again after the drain, and holds {live} of the {wanted} sessions it wants (replica count {count})"
        );
    }
    let first: Vec<_> = first.into_iter().flatten().collect();
    assert!(first.len() >= 15, "only {} of 20 agents dialed again after the drain", first.len());
    let (earliest, latest) = (first.iter().min().unwrap(), first.iter().max().unwrap());
    let spread = latest.duration_since(*earliest);
    assert!(spread >= Duration::from_millis(800), "redials fell within {spread:?} of each other");
}

/// `pool.sessions_per_replica: 2`: each agent holds two sessions to each replica; the gateways
/// count it as one agent (readiness, the agents gauge) and spread its dials over both sessions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_with_several_sessions_per_replica_is_one_agent_and_its_dials_spread_over_them() {
    let cluster = Cluster::start(2, 2).await;
    let pool = serde_json::json!({ "mode": "all", "sessions_per_replica": 2, "duplicate_retry_max": "200ms" });
    let mut agents = Vec::new();
    for i in 0..3 {
        let target = echo_server().await;
        agents.push((cluster.agent_with(&format!("node-{i}"), target, pool.clone()).await, target));
    }
    assert!(all_hold(&agents, 4, Duration::from_secs(60)).await, "{}", cluster.diagnostics());
    for (agent, _) in &agents {
        let mut servers = agent.state.server_ids();
        servers.sort();
        servers.dedup();
        assert_eq!(servers.len(), 2, "two sessions to each of the two replicas");
        assert!(agent.state.is_ready());
    }
    for replica in cluster.running_replicas() {
        let (_, body) = http_get(replica.admin, "/readyz/tenant/ha").await.unwrap();
        assert!(body.contains("6 local agent sessions, 3 agents"), "{body}");
        let (_, metrics) = http_get(replica.admin, "/metrics").await.unwrap();
        assert_eq!(metric_sum(&metrics, "tether_gateway_agents", "tenant=\"ha\""), 3.0, "{metrics}");
        assert_eq!(metric_sum(&metrics, "tether_gateway_agent_sessions", "tenant=\"ha\""), 6.0);
    }
    // Four tunnels held open to one node through one replica: two on each of its sessions there
    // (each session also carries its control stream).
    let (agent, target) = &agents[0];
    let replica = cluster.running_replicas()[0];
    let mut tunnels = Vec::new();
    for _ in 0..4 {
        let mut tunnel = connect_tcp(replica.frontend, &target.to_string()).await.unwrap().unwrap();
        tunnel.write_all(b"ha!").await.unwrap();
        let mut got = [0u8; 3];
        tunnel.read_exact(&mut got).await.unwrap();
        tunnels.push(tunnel);
    }
    let mut loads = agent.state.session_streams();
    loads.sort_unstable();
    assert_eq!(loads, vec![1, 1, 3, 3], "dials spread over the sessions to the replica that made them");
}
