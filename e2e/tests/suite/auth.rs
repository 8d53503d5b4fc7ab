//! Agent authentication at the gateway: a bad token gets 401 before any upgrade.

use std::time::Duration;

use tether_loadtest::devpki::{DevIssuer, IssuerKey, now};
use tether_loadtest::local::{AUDIENCE, LocalDeployment, LocalOptions};
use tether_tunnel::client::{self, ConnectError};

async fn deployment() -> LocalDeployment {
    LocalDeployment::start(LocalOptions::default()).await.unwrap()
}

async fn status_for(deployment: &LocalDeployment, token: Option<&str>) -> Result<(), (u16, String)> {
    let settings = deployment.client_settings().unwrap();
    match client::connect(&settings, token).await {
        Ok(_) => Ok(()),
        Err(ConnectError::Rejected { status, reason, .. }) => Err((status, reason)),
        Err(other) => panic!("expected an HTTP answer, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_token_is_upgraded() {
    let d = deployment().await;
    let token = d
        .issuer
        .service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600), None)
        .unwrap();
    assert_eq!(status_for(&d, Some(&token)).await, Ok(()));
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tokens_get_401_and_no_upgrade() {
    let d = deployment().await;
    let issuer = &d.issuer;
    let mut expired = issuer.claims("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600));
    expired.exp = now() - 3600;
    expired.iat = now() - 7200;
    expired.nbf = now() - 7200;
    let mut wrong_audience = issuer.claims("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600));
    wrong_audience.aud = vec!["kubernetes".into()];
    let mut wrong_issuer = issuer.claims("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600));
    wrong_issuer.iss = "https://evil.example.com".into();
    let stranger = DevIssuer::create(d.dir.path(), "stranger", &issuer.issuer, IssuerKey::Es256).unwrap();
    let mut forged = stranger.claims("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600));
    forged.iss = issuer.issuer.clone();
    let good =
        issuer.service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600), None).unwrap();
    let mut tampered = good.clone();
    tampered.replace_range(tampered.len() - 4.., "AAAA");

    let cases: Vec<(&str, Option<String>, &str)> = vec![
        ("missing", None, "no bearer token"),
        ("garbage", Some("not-a-jwt".into()), "malformed"),
        ("expired", Some(issuer.sign(&expired).unwrap()), "expired"),
        ("wrong audience", Some(issuer.sign(&wrong_audience).unwrap()), "audience"),
        ("wrong issuer", Some(issuer.sign(&wrong_issuer).unwrap()), "issuer"),
        // Signed by another key under our issuer's name (and a kid the gateway does not know).
        ("wrongly signed", Some(stranger.sign(&forged).unwrap()), "unknown signing key"),
        ("tampered signature", Some(tampered), "signature"),
        ("oversized", Some("a".repeat(20_000)), "too large"),
    ];
    for (name, token, expected) in cases {
        let (status, reason) = status_for(&d, token.as_deref()).await.expect_err(name);
        assert_eq!(status, 401, "{name}: {reason}");
        assert!(reason.contains(expected), "{name}: reason {reason:?} should mention {expected:?}");
        if let Some(token) = &token {
            assert!(!reason.contains(token.as_str()), "{name}: the answer must not echo the token");
        }
    }
    d.shutdown().await;
}

/// A node-bound agent that declares another node's address (node-a's agent claiming node-b's
/// InternalIP, as `identifiers.addresses` lets anyone declare anything) gets none of that node's
/// dials: the gateway refuses the claim, names both nodes and counts it. The spoofer cannot reach
/// node-b's server (its allow list has only its own), so any dial handed to it would fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spoofing_agent_gets_none_of_another_nodes_dials() {
    use tether_loadtest::connect_client::connect_tcp;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let node_b = crate::support::echo_server().await;
    let mut d = LocalDeployment::start(LocalOptions {
        agents: vec![crate::support::agent_for("node-b", node_b)],
        ..LocalOptions::default()
    })
    .await
    .unwrap();
    d.wait_connected(Duration::from_secs(10)).await.unwrap();
    let node_a = crate::support::echo_server().await;
    let mut spoofer = crate::support::agent_for("node-a", node_a);
    spoofer.addresses.push(node_b.ip());
    spoofer.default_route = true;
    d.add_agent(spoofer).await.unwrap();
    d.wait_connected(Duration::from_secs(10)).await.unwrap();

    let mut failed = 0;
    for i in 0..100u32 {
        let target = if i % 10 == 9 { node_a } else { node_b };
        let Ok(Ok(mut tunnel)) = connect_tcp(d.frontend_addr, &target.to_string()).await else {
            failed += 1;
            continue;
        };
        let message = format!("dial {i}");
        tunnel.write_all(message.as_bytes()).await.unwrap();
        let mut echoed = vec![0; message.len()];
        tunnel.read_exact(&mut echoed).await.unwrap();
        assert_eq!(echoed, message.as_bytes());
    }
    assert_eq!(failed, 0, "dials for node-b's address were handed to the spoofing agent");
    let (_, metrics) = tether_loadtest::procs::http_get(d.admin_addr, "/metrics").await.unwrap();
    for reason in ["held_by_another_node", "default_route_not_allowed"] {
        let line = format!("tether_gateway_claims_refused_total{{tenant=\"demo\",reason=\"{reason}\"}} 1");
        assert!(metrics.contains(&line), "no {line:?} in\n{metrics}");
    }
    d.shutdown().await;
}

/// Opens a TCP connection from `source` that never starts its TLS handshake; answers whether the
/// gateway closed it at once (instead of waiting for the handshake).
async fn closed_at_once(source: std::net::IpAddr, to: std::net::SocketAddr) -> (bool, tokio::net::TcpStream) {
    use tokio::io::AsyncReadExt;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(std::net::SocketAddr::new(source, 0)).unwrap();
    let mut stream = socket.connect(to).await.unwrap();
    let mut byte = [0u8; 1];
    let closed =
        matches!(tokio::time::timeout(Duration::from_millis(300), stream.read(&mut byte)).await, Ok(Ok(0) | Err(_)));
    (closed, stream)
}

/// Connections stuck before their TLS handshake (a slowloris flood) fill `limits.max_handshakes`;
/// further ones are closed at once and counted, and once the stuck ones go, agents connect again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_flood_is_capped_before_any_token_is_checked() {
    let d = LocalDeployment::start(LocalOptions {
        tweak_gateway: Some(Box::new(|config| config.limits.max_handshakes = 3)),
        ..LocalOptions::default()
    })
    .await
    .unwrap();
    let local: std::net::IpAddr = [127, 0, 0, 1].into();
    let mut stuck = Vec::new();
    for _ in 0..3 {
        let (closed, stream) = closed_at_once(local, d.agent_addr).await;
        assert!(!closed, "within the limit, a connection waits for its handshake");
        stuck.push(stream);
    }
    let (closed, _) = closed_at_once(local, d.agent_addr).await;
    assert!(closed, "over the limit, a connection is closed at once");
    let token = d
        .issuer
        .service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600), None)
        .unwrap();
    let settings = d.client_settings().unwrap();
    assert!(client::connect(&settings, Some(&token)).await.is_err(), "no slot for a real agent either");
    drop(stuck);
    let connected = tether_e2e::bins::eventually(Duration::from_secs(5), async || {
        client::connect(&settings, Some(&token)).await.is_ok()
    })
    .await;
    assert!(connected, "freed slots admit agents again");
    let (_, metrics) = tether_loadtest::procs::http_get(d.admin_addr, "/metrics").await.unwrap();
    assert!(
        tether_e2e::bins::metric_sum(
            &metrics,
            "tether_gateway_connections_refused_total",
            "reason=\"too_many_handshakes\""
        ) >= 2.0,
        "{metrics}"
    );
    d.shutdown().await;
}

/// `limits.handshakes_per_source`: one address opening connections fast is cut off at its burst,
/// while another address is not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_source_opening_connections_fast_does_not_shut_out_others() {
    let d = LocalDeployment::start(LocalOptions {
        tweak_gateway: Some(Box::new(|config| config.limits.handshakes_per_source = 2)),
        ..LocalOptions::default()
    })
    .await
    .unwrap();
    let noisy: std::net::IpAddr = [127, 0, 0, 1].into();
    let quiet: std::net::IpAddr = [127, 0, fastrand::u8(1..250), fastrand::u8(2..250)].into();
    // Eight at once: a burst of 4 (twice the rate) is admitted, the rest closed.
    let results = futures::future::join_all((0..8).map(|_| closed_at_once(noisy, d.agent_addr))).await;
    let closed = results.iter().filter(|(was_closed, _)| *was_closed).count();
    assert!((3..=4).contains(&closed), "{closed} of 8 fast connections were refused");
    let (was_closed, _held) = closed_at_once(quiet, d.agent_addr).await;
    assert!(!was_closed, "another address must not be affected");
    let (_, metrics) = tether_loadtest::procs::http_get(d.admin_addr, "/metrics").await.unwrap();
    assert!(
        tether_e2e::bins::metric_sum(&metrics, "tether_gateway_connections_refused_total", "reason=\"source_rate\"")
            >= 2.0,
        "{metrics}"
    );
    d.shutdown().await;
}
