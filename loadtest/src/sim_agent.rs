//! Simulated agents: the agent's side of the protocol without the agent's policy, cheap enough to
//! run thousands in one process. Each binds its own source address (several 127.x addresses keep
//! clear of ephemeral-port exhaustion), does TLS and the WebSocket upgrade with its own token,
//! says Hello, and then holds the session; optionally it serves dial streams to one allowed target.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use http::HeaderValue;
use http::header::{AUTHORIZATION, HOST, SEC_WEBSOCKET_PROTOCOL, USER_AGENT};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tether_tunnel::backoff::Backoff;
use tether_tunnel::framed::{read_frame, write_frame};
use tether_tunnel::mux::{self, Incoming, MuxSettings, MuxStream, Role, Session};
use tether_tunnel::protocol::{
    ControlMessage, ControlOpen, ErrorCode, Hello, Identifiers, MAX_CONTROL_FRAME, MAX_STREAM_FRAME, PROTOCOL_VERSION,
    SUBPROTOCOL, StreamOpen, StreamResult, Welcome,
};
use tether_tunnel::transport::Transport;
use tether_tunnel::ws::WsSettings;
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsConnector;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_util::sync::CancellationToken;

use crate::devpki::DevIssuer;
use crate::local::AUDIENCE;

/// An external gateway for the agent scenarios.
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayArgs {
    /// Agent endpoint of an external gateway, wss://IP:PORT/v1/tunnel. Without it a gateway
    /// process is started here.
    #[arg(long)]
    pub gateway_url: Option<String>,
    /// CA bundle that signed the external gateway's certificate.
    #[arg(long)]
    pub ca_file: Option<PathBuf>,
    /// SNI and Host for the external gateway (the tenant's host name).
    #[arg(long)]
    pub server_name: Option<String>,
    /// One token for every simulated agent (they all register under the token's identity).
    #[arg(long, conflicts_with = "signing_key")]
    pub token_file: Option<PathBuf>,
    /// PEM private key to mint one token per simulated agent (bound to node sim-N).
    #[arg(long)]
    pub signing_key: Option<PathBuf>,
    /// Algorithm of --signing-key: ES256 or RS256.
    #[arg(long, default_value = "ES256")]
    pub signing_alg: String,
    /// `kid` header of minted tokens (must match the tenant's JWKS).
    #[arg(long)]
    pub kid: Option<String>,
    /// `iss` of minted tokens.
    #[arg(long)]
    pub issuer: Option<String>,
    /// `aud` of minted tokens.
    #[arg(long, default_value = AUDIENCE)]
    pub audience: String,
    /// Process id of the external gateway, to read its memory (same machine only).
    #[arg(long)]
    pub gateway_pid: Option<u32>,
    /// The tether-gateway binary to start (default: next to this executable).
    #[arg(long)]
    pub gateway_bin: Option<PathBuf>,
}

/// Where simulated agents connect and how.
pub struct GatewayTarget {
    /// The agent endpoint.
    pub addr: SocketAddr,
    /// SNI and Host.
    pub server_name: String,
    /// TLS client configuration (trusting the gateway's CA).
    pub tls: Arc<ClientConfig>,
    /// WebSocket settings (the real agent's defaults).
    pub ws: WsSettings,
    /// Multiplexer settings (the real agent's defaults).
    pub mux: MuxSettings,
    /// Limit for TCP + TLS + upgrade + Hello/Welcome.
    pub timeout: Duration,
}

impl GatewayTarget {
    /// A target trusting `ca_file`.
    pub fn new(addr: SocketAddr, server_name: &str, ca_file: PathBuf) -> anyhow::Result<Self> {
        let roots = tether_tunnel::tls::ClientRoots { ca_file: Some(ca_file), system_roots: false };
        let tls = tether_tunnel::tls::client_config(&roots, None, &[tether_tunnel::tls::ALPN_HTTP11])?;
        Ok(Self {
            addr,
            server_name: server_name.to_owned(),
            tls: Arc::new(tls),
            ws: WsSettings::default(),
            mux: MuxSettings::default(),
            timeout: Duration::from_secs(30),
        })
    }

    /// The external gateway described by `args`.
    pub fn external(args: &GatewayArgs) -> anyhow::Result<Option<Self>> {
        let Some(url) = &args.gateway_url else { return Ok(None) };
        let uri: http::Uri = url.parse().with_context(|| format!("--gateway-url {url:?}"))?;
        let (host, port, tls) = tether_tunnel::client::target(&uri)?;
        anyhow::ensure!(tls, "--gateway-url must be wss://");
        let addr: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(&(host.trim_matches(['[', ']']), port))?
            .next()
            .with_context(|| format!("{host} does not resolve"))?;
        let ca = args.ca_file.clone().context("--gateway-url needs --ca-file")?;
        let name = args.server_name.clone().unwrap_or(host);
        Self::new(addr, &name, ca).map(Some)
    }
}

/// Where each simulated agent's token comes from.
pub enum TokenSource {
    /// A dev issuer of our own (the gateway we started trusts it).
    Issuer(Arc<DevIssuer>),
    /// A signing key given on the command line.
    Key {
        /// The key.
        key: EncodingKey,
        /// Its algorithm.
        algorithm: Algorithm,
        /// Its `kid`.
        kid: Option<String>,
        /// `iss`.
        issuer: String,
        /// `aud`.
        audience: String,
    },
    /// The same token for everyone.
    Fixed(String),
}

impl TokenSource {
    /// The token source `args` describe, if any.
    pub fn external(args: &GatewayArgs) -> anyhow::Result<Option<Self>> {
        if let Some(file) = &args.token_file {
            let token = std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
            return Ok(Some(Self::Fixed(token.trim().to_owned())));
        }
        let Some(key_file) = &args.signing_key else { return Ok(None) };
        let pem = std::fs::read(key_file).with_context(|| format!("cannot read {}", key_file.display()))?;
        let (key, algorithm) = match args.signing_alg.as_str() {
            "ES256" => (EncodingKey::from_ec_pem(&pem)?, Algorithm::ES256),
            "RS256" => (EncodingKey::from_rsa_pem(&pem)?, Algorithm::RS256),
            other => anyhow::bail!("--signing-alg {other}: use ES256 or RS256"),
        };
        let issuer = args.issuer.clone().context("--signing-key needs --issuer")?;
        Ok(Some(Self::Key { key, algorithm, kid: args.kid.clone(), issuer, audience: args.audience.clone() }))
    }

    /// A token for the agent on `node`.
    pub fn token_for(&self, node: &str) -> anyhow::Result<String> {
        match self {
            Self::Issuer(issuer) => issuer.service_account_token(
                "kube-system",
                "tether-agent",
                AUDIENCE,
                Duration::from_secs(86400),
                Some(node),
            ),
            Self::Key { key, algorithm, kid, issuer, audience } => {
                let now = crate::devpki::now();
                let claims = crate::devpki::TokenClaims {
                    iss: issuer.clone(),
                    sub: "system:serviceaccount:kube-system:tether-agent".into(),
                    aud: vec![audience.clone()],
                    exp: now + 86400,
                    iat: now,
                    nbf: now.saturating_sub(1),
                    kubernetes: Some(serde_json::json!({
                        "namespace": "kube-system",
                        "serviceaccount": { "name": "tether-agent", "uid": "00000000-0000-0000-0000-000000000001" },
                        "node": { "name": node, "uid": "00000000-0000-0000-0000-000000000002" },
                    })),
                };
                let mut header = Header::new(*algorithm);
                header.kid = kid.clone();
                Ok(jsonwebtoken::encode(&header, &claims, key)?)
            }
            Self::Fixed(token) => Ok(token.clone()),
        }
    }
}

/// `count` source addresses 127.0.1.1, 127.0.1.2, ... (all of 127/8 is local on Linux).
pub fn source_addresses(count: usize) -> Vec<IpAddr> {
    (0..count.max(1)).map(|i| IpAddr::from([127, 0, 1 + (i / 250) as u8, 1 + (i % 250) as u8])).collect()
}

/// A connected simulated agent.
pub struct SimAgent {
    /// The session.
    pub session: Session,
    /// Streams the gateway opens.
    pub incoming: Incoming,
    /// The control stream (dropping it would end the session at the gateway).
    pub control: MuxStream,
    /// The gateway's Welcome.
    pub welcome: Welcome,
}

/// Connects one simulated agent from `source`, through TLS, upgrade and Hello/Welcome.
pub async fn connect(
    target: &GatewayTarget,
    source: Option<IpAddr>,
    token: &str,
    agent_id: &str,
) -> anyhow::Result<SimAgent> {
    tokio::time::timeout(target.timeout, connect_inner(target, source, token, agent_id))
        .await
        .map_err(|_| anyhow::anyhow!("connecting took longer than {:?}", target.timeout))?
}

async fn connect_inner(
    target: &GatewayTarget,
    source: Option<IpAddr>,
    token: &str,
    agent_id: &str,
) -> anyhow::Result<SimAgent> {
    let tcp = dial_from(source, target.addr).await?;
    let name = ServerName::try_from(target.server_name.clone()).context("bad TLS server name")?;
    let tls = TlsConnector::from(target.tls.clone()).connect(name, tcp).await.context("TLS handshake")?;
    let mut request = format!("wss://{}:{}/v1/tunnel", target.server_name, target.addr.port())
        .into_client_request()
        .context("upgrade request")?;
    let headers = request.headers_mut();
    headers.insert(SEC_WEBSOCKET_PROTOCOL, HeaderValue::from_static(SUBPROTOCOL));
    headers.insert(USER_AGENT, HeaderValue::from_static("tether-loadtest"));
    headers.insert(HOST, HeaderValue::from_str(&target.server_name)?);
    let mut bearer = HeaderValue::from_str(&format!("Bearer {token}")).context("token is not a valid header")?;
    bearer.set_sensitive(true);
    headers.insert(AUTHORIZATION, bearer);
    let link = tether_tunnel::client::upgrade_over(Transport::ClientTls(Box::new(tls)), &request, &target.ws)
        .await
        .map_err(|e| anyhow::anyhow!("WebSocket upgrade failed: {e}"))?;
    let (session, incoming, driver) = mux::start(link, Role::Client, &target.mux);
    tokio::spawn(driver);
    let handshake = async {
        let mut control = session.open().await?;
        write_frame(&mut control, &StreamOpen::Control(ControlOpen { version: PROTOCOL_VERSION }), MAX_STREAM_FRAME)
            .await?;
        let hello = ControlMessage::Hello(Hello {
            agent_id: agent_id.to_owned(),
            version: env!("CARGO_PKG_VERSION").into(),
            identifiers: Identifiers { hosts: vec![agent_id.to_owned()], ..Identifiers::default() },
            capabilities: vec![],
        });
        write_frame(&mut control, &hello, MAX_CONTROL_FRAME).await?;
        let result: StreamResult = read_frame(&mut control, MAX_STREAM_FRAME).await?;
        anyhow::ensure!(result.ok, "gateway refused the Hello: {}", result.message.unwrap_or_default());
        match read_frame::<ControlMessage, _>(&mut control, MAX_CONTROL_FRAME).await? {
            ControlMessage::Welcome(welcome) => Ok((control, welcome)),
            other => anyhow::bail!("expected Welcome, got {other:?}"),
        }
    };
    match handshake.await {
        Ok((control, welcome)) => Ok(SimAgent { session, incoming, control, welcome }),
        Err(e) => {
            session.close();
            Err(e)
        }
    }
}

/// A TCP connection to `addr` from `source` (any port).
pub async fn dial_from(source: Option<IpAddr>, addr: SocketAddr) -> anyhow::Result<TcpStream> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    if let Some(ip) = source {
        socket.bind(SocketAddr::new(ip, 0)).with_context(|| format!("cannot bind source address {ip}"))?;
    }
    let stream = socket.connect(addr).await.with_context(|| format!("cannot connect to {addr}"))?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// Serves the gateway's dial streams: only `allowed` may be dialed; bytes are spliced.
pub async fn serve_dials(mut incoming: Incoming, allowed: SocketAddr) {
    while let Some(stream) = incoming.accept().await {
        tokio::spawn(serve_dial(stream, allowed));
    }
}

async fn serve_dial(mut stream: MuxStream, allowed: SocketAddr) {
    let Ok(open) = read_frame::<StreamOpen, _>(&mut stream, MAX_STREAM_FRAME).await else { return };
    let target = match open {
        StreamOpen::Dial(request) if request.target.parse::<SocketAddr>().ok() == Some(allowed) => allowed,
        _ => {
            let refusal = StreamResult::refused(ErrorCode::NotAllowed, "simulated agent serves one target");
            let _ = write_frame(&mut stream, &refusal, MAX_STREAM_FRAME).await;
            return;
        }
    };
    let mut tcp = match TcpStream::connect(target).await {
        Ok(tcp) => tcp,
        Err(e) => {
            let _ = write_frame(
                &mut stream,
                &StreamResult::refused(ErrorCode::DialFailed, e.to_string()),
                MAX_STREAM_FRAME,
            )
            .await;
            return;
        }
    };
    let _ = tcp.set_nodelay(true);
    if write_frame(&mut stream, &StreamResult::ok(), MAX_STREAM_FRAME).await.is_err() {
        return;
    }
    let _ = tether_tunnel::splice::splice_mux(&mut tcp, &mut stream, |_, _| {}).await;
}

/// What happened to a reconnecting simulated agent.
#[derive(Debug, Clone, Copy)]
pub enum AgentEvent {
    /// Agent `index` got its Welcome.
    Connected(usize, Instant),
    /// Agent `index` lost its session.
    Lost(usize, Instant),
}

/// A simulated agent that keeps a session like the real agent: reconnect with exponential
/// backoff and full jitter, serve dials to `allowed`.
pub struct ReconnectingAgent {
    /// Index (agent id `sim-<index>`).
    pub index: usize,
    /// Source address.
    pub source: Option<IpAddr>,
    /// Token.
    pub token: String,
    /// Backoff bounds (initial, max).
    pub backoff: (Duration, Duration),
    /// The one target it dials.
    pub allowed: SocketAddr,
}

impl ReconnectingAgent {
    /// Runs until `stop`; `live` counts agents with a session.
    pub async fn run(
        self,
        target: Arc<GatewayTarget>,
        live: Arc<AtomicUsize>,
        events: mpsc::UnboundedSender<AgentEvent>,
        stop: CancellationToken,
    ) {
        let id = format!("sim-{}", self.index);
        let mut backoff = Backoff::new(self.backoff.0, self.backoff.1);
        loop {
            let delay = match connect(&target, self.source, &self.token, &id).await {
                Ok(agent) => {
                    backoff.reset();
                    live.fetch_add(1, Ordering::Relaxed);
                    let _ = events.send(AgentEvent::Connected(self.index, Instant::now()));
                    let SimAgent { session, incoming, control, .. } = agent;
                    let server = tokio::spawn(serve_dials(incoming, self.allowed));
                    tokio::select! {
                        () = session.closed() => {}
                        () = stop.cancelled() => {}
                    }
                    drop(control);
                    session.close();
                    server.abort();
                    live.fetch_sub(1, Ordering::Relaxed);
                    let _ = events.send(AgentEvent::Lost(self.index, Instant::now()));
                    if stop.is_cancelled() {
                        return;
                    }
                    backoff.next_delay()
                }
                Err(_) => backoff.next_delay(),
            };
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = stop.cancelled() => return,
            }
        }
    }
}
