//! Records a real agent session and writes fuzz seeds from it (`fuzz/seeds/`).
//!
//! A gateway and an agent (in this process, over plain `ws://` so the bytes can be read) talk
//! through a recording relay while the session does what sessions do: the agent's hello, CONNECT
//! dials (one refused by the agent's allow list), node -> control-plane forwards, a token refresh
//! and the agent leaving. The WebSocket frames of each direction are unmasked into the
//! multiplexer's byte stream (seeds of `mux_frames`), and the tunnel frames at the start of every
//! stream (stream-open frames, results, control messages) become seeds of `tunnel_protocol`.
//!
//!     cargo run --release -p tether-loadtest --example capture_session -- fuzz/seeds

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::Context as _;
use bytes::BytesMut;
use tether_agent::config::ListenerConfig;
use tether_gateway::config::{ForwardTarget, NodeToControlPlane};
use tether_loadtest::local::{AgentSpec, LocalDeployment, LocalOptions, allow};
use tether_tunnel::mux::frame::{FrameReader, Kind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type Recording = Arc<Mutex<Vec<u8>>>;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let out = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "fuzz/seeds".into()));
    tether_tunnel::tls::install_default_provider();

    let echo_listener = TcpListener::bind("127.0.0.1:0").await?;
    let echo = echo_listener.local_addr()?;
    let _echo = tether_loadtest::backends::spawn_echo(echo_listener);
    let controlplane_listener = TcpListener::bind("127.0.0.1:0").await?;
    let controlplane = controlplane_listener.local_addr()?;
    let _controlplane = tether_loadtest::backends::spawn_echo(controlplane_listener);
    let forward_listen = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), free_port()?);

    // The relay between agent and gateway; it learns the gateway's address once that is bound.
    let relay = TcpListener::bind("127.0.0.1:0").await?;
    let relay_addr = relay.local_addr()?;
    let upstream: Arc<OnceLock<SocketAddr>> = Arc::new(OnceLock::new());
    let (to_gateway, to_agent): (Recording, Recording) = Default::default();
    let relay_task = tokio::spawn(run_relay(relay, upstream.clone(), to_gateway.clone(), to_agent.clone()));

    let mut deployment = LocalDeployment::start(LocalOptions {
        tls: false,
        ping_interval: Duration::from_secs(1),
        tweak_gateway: Some(Box::new(move |config| {
            for tenant in &mut config.tenants {
                tenant.node_to_controlplane = Some(NodeToControlPlane {
                    targets: vec![ForwardTarget {
                        name: "kube-apiserver".into(),
                        address: controlplane.to_string(),
                        allowed_networks: vec![],
                    }],
                });
            }
        })),
        tweak_agent: Some(Arc::new(move |_, config| {
            config.gateway.url = format!("ws://{relay_addr}/v1/tunnel");
            config.listeners = vec![ListenerConfig::new(forward_listen, "kube-apiserver")];
        })),
        ..LocalOptions::default()
    })
    .await?;
    upstream.set(deployment.agent_addr).map_err(|_| anyhow::anyhow!("relay upstream set twice"))?;
    deployment
        .add_agent(AgentSpec {
            id: "node-1".into(),
            addresses: vec![echo.ip()],
            allow: vec![allow(echo.ip(), &[echo.port()])],
            default_route: false,
        })
        .await?;
    deployment.wait_connected(Duration::from_secs(15)).await?;

    for i in 0..3 {
        let stream = tether_loadtest::connect_client::connect_tcp(deployment.frontend_addr, &echo.to_string())
            .await?
            .map_err(|refused| anyhow::anyhow!("dial refused: {}", refused.reason))?;
        echo_round_trip(stream, format!("dial {i}: GET /containerLogs/kube-system/pod HTTP/1.1\r\n\r\n")).await?;
    }
    let not_allowed = SocketAddr::new(echo.ip(), 9);
    let refused =
        tether_loadtest::connect_client::connect_tcp(deployment.frontend_addr, &not_allowed.to_string()).await?;
    anyhow::ensure!(refused.is_err(), "a dial to a port off the allow list went through");
    for i in 0..2 {
        let stream = TcpStream::connect(forward_listen).await?;
        echo_round_trip(stream, format!("forward {i}: GET /api/v1/nodes?watch=1 HTTP/1.1\r\n\r\n")).await?;
    }
    // A token refresh on the live session (the agent re-reads its token file every second here).
    let agent = deployment.agents.first().context("no agent")?;
    let token = deployment.issuer.service_account_token(
        "kube-system",
        "tether-agent",
        tether_loadtest::local::AUDIENCE,
        Duration::from_secs(3600),
        Some("node-1"),
    )?;
    tether_loadtest::devpki::write_private(&agent.token_file, token.as_bytes())?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    deployment.shutdown().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    relay_task.abort();

    let lock = |r: &Recording| r.lock().map(|v| v.clone()).unwrap_or_default();
    let mut written = 0;
    for (direction, bytes, masked) in
        [("agent-to-gateway", lock(&to_gateway), true), ("gateway-to-agent", lock(&to_agent), false)]
    {
        let mux = websocket_payloads(&bytes, masked).with_context(|| format!("{direction}: not a WebSocket"))?;
        // mux_frames: the first input byte is the number of chunk-size bytes that follow (none).
        let mut seed = vec![0u8];
        seed.extend_from_slice(&mux);
        write_seed(&out.join("mux_frames"), &format!("session-{direction}"), &seed)?;
        written += 1;
        for (name, frame) in tunnel_frames(&mux)? {
            write_seed(&out.join("tunnel_protocol"), &format!("{direction}-{name}"), &frame)?;
            written += 1;
        }
    }
    println!("wrote {written} seeds under {}", out.display());
    Ok(())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

async fn echo_round_trip(mut stream: TcpStream, message: String) -> anyhow::Result<()> {
    stream.write_all(message.as_bytes()).await?;
    let mut answer = vec![0u8; message.len()];
    stream.read_exact(&mut answer).await?;
    anyhow::ensure!(answer == message.as_bytes(), "the echo differs");
    Ok(())
}

/// Accepts agent connections and relays each to the gateway, appending what passes each way.
async fn run_relay(
    listener: TcpListener,
    upstream: Arc<OnceLock<SocketAddr>>,
    to_gateway: Recording,
    to_agent: Recording,
) -> anyhow::Result<()> {
    let mut first = true;
    loop {
        let (agent, _) = listener.accept().await?;
        let Some(gateway) = upstream.get().copied() else {
            continue;
        };
        let gateway = TcpStream::connect(gateway).await?;
        // Only the first session is recorded: one byte stream per direction.
        let record = std::mem::take(&mut first);
        let (agent_read, agent_write) = agent.into_split();
        let (gateway_read, gateway_write) = gateway.into_split();
        tokio::spawn(pump(agent_read, gateway_write, record.then(|| to_gateway.clone())));
        tokio::spawn(pump(gateway_read, agent_write, record.then(|| to_agent.clone())));
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    record: Option<Recording>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(record) = &record
            && let Ok(mut bytes) = record.lock()
        {
            bytes.extend_from_slice(&buf[..n]);
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// The payloads of the binary and continuation frames after the HTTP upgrade head, unmasked.
fn websocket_payloads(bytes: &[u8], masked: bool) -> anyhow::Result<Vec<u8>> {
    let head_end = bytes.windows(4).position(|w| w == b"\r\n\r\n").context("no HTTP head")? + 4;
    let mut rest = &bytes[head_end..];
    let mut out = Vec::new();
    while rest.len() >= 2 {
        let opcode = rest[0] & 0x0f;
        let has_mask = rest[1] & 0x80 != 0;
        anyhow::ensure!(has_mask == masked, "frame masking does not match the direction");
        let (len, mut at) = match rest[1] & 0x7f {
            126 if rest.len() >= 4 => (usize::from(u16::from_be_bytes([rest[2], rest[3]])), 4),
            127 if rest.len() >= 10 => {
                let mut be = [0u8; 8];
                be.copy_from_slice(&rest[2..10]);
                (usize::try_from(u64::from_be_bytes(be))?, 10)
            }
            126 | 127 => break,
            n => (usize::from(n), 2),
        };
        let mut key = [0u8; 4];
        if has_mask {
            let Some(k) = rest.get(at..at + 4) else { break };
            key.copy_from_slice(k);
            at += 4;
        }
        let Some(payload) = rest.get(at..at + len) else { break };
        if opcode == 0x2 || opcode == 0x0 {
            out.extend(payload.iter().enumerate().map(|(i, b)| if has_mask { b ^ key[i % 4] } else { *b }));
        }
        rest = &rest[at + len..];
    }
    Ok(out)
}

/// The tunnel frames (length prefix + JSON) at the start of each stream's data, named by stream.
fn tunnel_frames(mux: &[u8]) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let mut reader = FrameReader::new();
    reader.push(BytesMut::from(mux));
    let mut streams: std::collections::BTreeMap<u32, Vec<u8>> = Default::default();
    while let Ok(Some(frame)) = reader.next_frame() {
        if frame.header.kind == Kind::Data {
            streams.entry(frame.header.stream_id).or_default().extend_from_slice(&frame.body);
        }
    }
    let mut frames = Vec::new();
    for (id, data) in streams {
        let mut rest = data.as_slice();
        let mut n = 0;
        while let Ok(Some((_, used))) =
            tether_tunnel::protocol::decode::<serde_json::Value>(rest, tether_tunnel::protocol::MAX_CONTROL_FRAME)
        {
            frames.push((format!("stream{id}-{n}"), rest[..used].to_vec()));
            rest = &rest[used..];
            n += 1;
        }
    }
    Ok(frames)
}

fn write_seed(dir: &Path, name: &str, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(name), bytes)?;
    Ok(())
}
