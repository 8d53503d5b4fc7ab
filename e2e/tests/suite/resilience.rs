//! The gateway and agent survive restarts and bad input.

use std::time::Duration;

use tether_loadtest::connect_client::connect_tcp;
use tether_loadtest::local::AUDIENCE;
use tether_tunnel::client;
use tether_tunnel::framed::{read_frame, write_frame};
use tether_tunnel::mux;
use tether_tunnel::protocol::{
    ControlMessage, ErrorCode, ForwardRequest, MAX_CONTROL_FRAME, MAX_STREAM_FRAME, StreamOpen, StreamResult,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::one_agent_echo;

async fn echo_roundtrip(frontend: std::net::SocketAddr, echo: std::net::SocketAddr) -> Result<(), String> {
    let mut tunnel =
        connect_tcp(frontend, &echo.to_string()).await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    tunnel.write_all(b"ping").await.map_err(|e| e.to_string())?;
    let mut got = [0u8; 4];
    tunnel.read_exact(&mut got).await.map_err(|e| e.to_string())?;
    if &got == b"ping" { Ok(()) } else { Err(format!("got {got:?}")) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_reconnect_after_a_gateway_restart_and_dials_work_again() {
    let (mut deployment, echo) = one_agent_echo().await;
    echo_roundtrip(deployment.frontend_addr, echo).await.unwrap();
    deployment.stop_gateway().await;
    // While the gateway is down the agent is not ready and keeps retrying with backoff.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(deployment.agents[0].state.live_sessions(), 0);
    deployment.start_gateway_again().await.unwrap();
    deployment.wait_connected(Duration::from_secs(15)).await.unwrap();
    echo_roundtrip(deployment.frontend_addr, echo).await.unwrap();
    deployment.shutdown().await;
}

/// Speaks the protocol like an agent, up to the Welcome.
async fn raw_agent(
    deployment: &tether_loadtest::local::LocalDeployment,
) -> (mux::Session, mux::Incoming, tether_tunnel::mux::MuxStream) {
    let settings = deployment.client_settings().unwrap();
    let token = deployment
        .issuer
        .service_account_token("kube-system", "raw", AUDIENCE, Duration::from_secs(600), None)
        .unwrap();
    let ws = client::connect(&settings, Some(&token)).await.unwrap();
    let (session, incoming, mut control, result) = crate::support::hello_as(ws, "raw").await;
    assert!(result.ok);
    let welcome: ControlMessage = read_frame(&mut control, MAX_CONTROL_FRAME).await.unwrap();
    assert!(matches!(welcome, ControlMessage::Welcome(_)));
    (session, incoming, control)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_stream_header_resets_one_stream_and_the_session_lives() {
    let (deployment, echo) = one_agent_echo().await;
    let (session, _incoming, _control) = raw_agent(&deployment).await;

    let mut bad = session.open().await.unwrap();
    // Only the length prefix is sent: the gateway must refuse before any body arrives.
    bad.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
    let mut rest = Vec::new();
    let outcome = tokio::time::timeout(Duration::from_secs(10), bad.read_to_end(&mut rest)).await.unwrap();
    assert!(outcome.is_err() || rest.is_empty(), "the oversized stream gets no answer, only a reset");

    // The same session still answers a well-formed stream: forwarding is denied by default.
    let mut good = session.open().await.unwrap();
    write_frame(&mut good, &StreamOpen::Forward(ForwardRequest { target: "kube-apiserver".into() }), MAX_STREAM_FRAME)
        .await
        .unwrap();
    let answer: StreamResult = read_frame(&mut good, MAX_STREAM_FRAME).await.unwrap();
    assert_eq!(answer.code, Some(ErrorCode::NotAllowed));
    assert!(!session.is_closed());
    echo_roundtrip(deployment.frontend_addr, echo).await.unwrap();
    deployment.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_closes_one_session_never_the_process() {
    let (deployment, echo) = one_agent_echo().await;
    let settings = deployment.client_settings().unwrap();
    let token = deployment
        .issuer
        .service_account_token("kube-system", "raw", AUDIENCE, Duration::from_secs(600), None)
        .unwrap();

    // Not a multiplexer frame at all: the gateway closes this session.
    let mut ws = client::connect(&settings, Some(&token)).await.unwrap();
    let garbage: Vec<u8> = (0..4096).map(|_| fastrand::u8(..)).collect();
    {
        use tether_tunnel::mux::Link;
        futures::future::poll_fn(|cx| ws.poll_ready(cx)).await.unwrap();
        ws.start_send(bytes::BytesMut::from(&garbage[..]).into()).unwrap();
        futures::future::poll_fn(|cx| ws.poll_flush(cx)).await.unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(Ok(_)) = futures::future::poll_fn(|cx| ws.poll_recv(cx)).await {}
        })
        .await;
        assert!(ended.is_ok(), "the gateway must close a session that sends garbage");
    }

    // Garbage on the agent port outside any WebSocket.
    let mut raw = tokio::net::TcpStream::connect(deployment.agent_addr).await.unwrap();
    raw.write_all(b"\x00\x01\x02 this is not TLS\r\n\r\n").await.unwrap();
    let mut sink = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), raw.read_to_end(&mut sink)).await.unwrap();

    // Garbage on the CONNECT frontend.
    let mut raw = tokio::net::TcpStream::connect(deployment.frontend_addr).await.unwrap();
    raw.write_all(b"\x16\x03\x01garbage\r\n\r\n").await.unwrap();
    let mut answer = String::new();
    let _ = raw.read_to_string(&mut answer).await;
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer:?}");

    // Everyone else is unaffected.
    echo_roundtrip(deployment.frontend_addr, echo).await.unwrap();
    deployment.shutdown().await;
}

/// The gateway restarts while dials and transfers run: every in-flight dial ends cleanly (an
/// HTTP error or a closed connection, never a hang or wrong bytes), all agents come back, and new
/// dials succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_restart_under_load_fails_in_flight_dials_cleanly() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use tether_loadtest::local::{LocalDeployment, LocalOptions};

    let echo = crate::support::echo_server().await;
    let agents = (0..10).map(|i| crate::support::agent_for(&format!("node-{i}"), echo)).collect();
    let mut deployment = LocalDeployment::start(LocalOptions { agents, ..LocalOptions::default() }).await.unwrap();
    deployment.wait_connected(Duration::from_secs(15)).await.unwrap();
    let frontend = deployment.frontend_addr;
    let (ok, clean_failures, running) =
        (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(true)));
    let mut workers = Vec::new();
    for worker in 0..8 {
        let (ok, clean_failures, running) = (ok.clone(), clean_failures.clone(), running.clone());
        workers.push(tokio::spawn(async move {
            let mut i = 0u64;
            while running.load(Ordering::Relaxed) {
                i += 1;
                let payload = format!("worker {worker} dial {i} ").repeat(200);
                let attempt = tokio::time::timeout(Duration::from_secs(20), async {
                    let mut tunnel = match connect_tcp(frontend, &echo.to_string()).await {
                        Ok(Ok(tunnel)) => tunnel,
                        Ok(Err(refused)) => {
                            assert!(
                                matches!(refused.status, 502 | 503),
                                "unexpected status {}: {}",
                                refused.status,
                                refused.reason
                            );
                            return false;
                        }
                        Err(_) => return false, // the frontend is down: connection refused
                    };
                    if tunnel.write_all(payload.as_bytes()).await.is_err() {
                        return false;
                    }
                    let mut got = vec![0u8; payload.len()];
                    match tunnel.read_exact(&mut got).await {
                        Ok(_) => {
                            assert_eq!(got, payload.as_bytes(), "a tunnel must never deliver wrong bytes");
                            true
                        }
                        Err(_) => false, // cut by the restart
                    }
                })
                .await
                .expect("a dial hung across the restart");
                if attempt {
                    ok.fetch_add(1, Ordering::Relaxed)
                } else {
                    clean_failures.fetch_add(1, Ordering::Relaxed)
                };
                if !attempt {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = ok.load(Ordering::Relaxed);
    assert!(before > 0);
    deployment.restart_gateway().await.unwrap();
    deployment.wait_connected(Duration::from_secs(20)).await.unwrap();
    let after_restart = ok.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    running.store(false, Ordering::Relaxed);
    for worker in workers {
        worker.await.unwrap();
    }
    assert!(ok.load(Ordering::Relaxed) > after_restart, "new dials succeed once the agents are back");
    echo_roundtrip(frontend, echo).await.unwrap();
    deployment.shutdown().await;
}

/// An agent refused with 503 and `Retry-After` (here: the tenant's `max_agents` is reached) waits
/// at least that long before dialing again, instead of its own backoff (100 ms, then up to 2 s):
/// over 3.5 s it dials once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_refused_with_retry_after_waits_that_long() {
    use tether_loadtest::local::{LocalDeployment, LocalOptions};
    let first = crate::support::echo_server().await;
    let mut d = LocalDeployment::start(LocalOptions {
        agents: vec![crate::support::agent_for("node-1", first)],
        tweak_gateway: Some(Box::new(|config| config.tenants[0].limits.max_agents = 1)),
        ..LocalOptions::default()
    })
    .await
    .unwrap();
    d.wait_connected(Duration::from_secs(10)).await.unwrap();
    let second = crate::support::echo_server().await;
    d.add_agent(crate::support::agent_for("node-2", second)).await.unwrap();
    let refused = &d.agents[1];
    assert!(
        tether_e2e::bins::eventually(Duration::from_secs(5), async || refused.state.dials() >= 1).await,
        "the second agent never dialed"
    );
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(refused.state.dials(), 1, "dialed again before the gateway's Retry-After: 5");
    assert!(refused.state.last_error().is_some_and(|e| e.contains("503")), "{:?}", refused.state.last_error());
    d.shutdown().await;
}
