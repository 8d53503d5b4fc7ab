//! What the data-path scenarios (throughput, rps, latency, dial-rate) measure against: an
//! in-process deployment (default) or an external gateway's CONNECT frontend, plus the node-side
//! servers this process runs, and the routes to them (direct TCP or through a CONNECT frontend).

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::task::JoinHandle;

use crate::backends;
use crate::delay::{DelayedLink, spawn_relay};
use crate::local::{AgentSpec, LocalDeployment, LocalOptions, allow};
use tether_agent::config::AgentConfig;
use tether_tunnel::tls;

/// A frontend: CONNECT at `tcp://host:port` or `unix:///path`, or Konnectivity's gRPC protocol
/// at `grpc+tcp://host:port` or `grpc+unix:///path`.
#[derive(Debug, Clone)]
pub enum Frontend {
    /// CONNECT over plain TCP.
    Tcp(SocketAddr),
    /// CONNECT over a Unix socket.
    Unix(PathBuf),
    /// gRPC over plain TCP (HTTP/2 without TLS).
    GrpcTcp(SocketAddr),
    /// gRPC over a Unix socket.
    GrpcUnix(PathBuf),
}

impl FromStr for Frontend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let addr =
            |a: &str| a.parse::<SocketAddr>().map_err(|e| format!("{a:?} is not host:port with a numeric IP: {e}"));
        if let Some(a) = s.strip_prefix("tcp://") {
            addr(a).map(Self::Tcp)
        } else if let Some(path) = s.strip_prefix("unix://") {
            Ok(Self::Unix(PathBuf::from(path)))
        } else if let Some(a) = s.strip_prefix("grpc+tcp://") {
            addr(a).map(Self::GrpcTcp)
        } else if let Some(path) = s.strip_prefix("grpc+unix://") {
            Ok(Self::GrpcUnix(PathBuf::from(path)))
        } else {
            Err(format!(
                "{s:?}: use tcp://IP:PORT or unix:///path/to/socket (CONNECT), grpc+tcp://IP:PORT or grpc+unix:///path (gRPC)"
            ))
        }
    }
}

impl std::fmt::Display for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp(addr) => write!(f, "tcp://{addr}"),
            Self::Unix(path) => write!(f, "unix://{}", path.display()),
            Self::GrpcTcp(addr) => write!(f, "grpc+tcp://{addr}"),
            Self::GrpcUnix(path) => write!(f, "grpc+unix://{}", path.display()),
        }
    }
}

/// Where the data-path scenarios send traffic.
#[derive(Debug, Clone, clap::Args)]
pub struct DataTarget {
    /// CONNECT frontend of an external deployment (tcp://IP:PORT or unix:///path). Without it an
    /// in-process deployment (gateway + one agent, TLS on) is started.
    #[arg(long)]
    pub frontend: Option<Frontend>,
    /// Address the node-side servers (bulk, echo) listen on. With --frontend, the external
    /// deployment's agent must be able to reach it and allow its ports.
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    pub backend_ip: IpAddr,
    /// Fixed port for the bulk server (default: any free port).
    #[arg(long, default_value_t = 0)]
    pub bulk_port: u16,
    /// Fixed port for the echo server (default: any free port).
    #[arg(long, default_value_t = 0)]
    pub echo_port: u16,
    /// Emulated one-way delay, in milliseconds, of the link between the node and the gateway
    /// (in-process deployment only): the agent's connection to the gateway and the direct
    /// baseline's connection to the node-side servers both cross a relay that holds every byte
    /// this long, so both see the same round-trip time; the hop from the client to the frontend
    /// stays local, as from a kube-apiserver next to the gateway.
    #[arg(long, default_value_t = 0)]
    pub link_delay_ms: u64,
    /// In-process deployment only: the Unix socket frontend speaks Konnectivity's gRPC protocol
    /// (kube-apiserver's `proxyProtocol: GRPC`) instead of CONNECT, so one run compares the TCP
    /// CONNECT frontend with the gRPC one. (An external gRPC frontend: --frontend grpc+unix://...)
    #[arg(long)]
    pub grpc: bool,
}

/// How a client reaches a node-side server.
#[derive(Debug, Clone)]
pub enum Route {
    /// A plain TCP connection (the baseline, or a forwarding tunnel such as rathole).
    Direct(SocketAddr),
    /// `CONNECT target` through a Tether frontend.
    Connect {
        /// The frontend.
        frontend: Frontend,
        /// The node-side target.
        target: SocketAddr,
    },
}

impl Route {
    /// Opens a connection along this route.
    pub async fn open(&self) -> anyhow::Result<Conn> {
        match self {
            Self::Direct(addr) => {
                let stream = TcpStream::connect(addr).await.with_context(|| format!("cannot connect to {addr}"))?;
                let _ = stream.set_nodelay(true);
                Ok(Conn::Tcp(stream))
            }
            Self::Connect { frontend: Frontend::Tcp(proxy), target } => {
                let stream =
                    TcpStream::connect(proxy).await.with_context(|| format!("cannot connect to frontend {proxy}"))?;
                let _ = stream.set_nodelay(true);
                Ok(Conn::Tcp(connect_request(stream, *target).await?))
            }
            Self::Connect { frontend: Frontend::Unix(path), target } => {
                let stream = UnixStream::connect(path)
                    .await
                    .with_context(|| format!("cannot connect to frontend {}", path.display()))?;
                Ok(Conn::Unix(connect_request(stream, *target).await?))
            }
            Self::Connect { frontend: Frontend::GrpcTcp(addr), target } => {
                let stream =
                    TcpStream::connect(addr).await.with_context(|| format!("cannot connect to frontend {addr}"))?;
                let _ = stream.set_nodelay(true);
                grpc_dial(stream, *target).await
            }
            Self::Connect { frontend: Frontend::GrpcUnix(path), target } => {
                let stream = UnixStream::connect(path)
                    .await
                    .with_context(|| format!("cannot connect to frontend {}", path.display()))?;
                grpc_dial(stream, *target).await
            }
        }
    }
}

async fn grpc_dial<S>(stream: S, target: SocketAddr) -> anyhow::Result<Conn>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    match crate::grpc_client::dial(stream, &target.to_string()).await? {
        Ok(conn) => Ok(Conn::Grpc(Box::new(conn))),
        Err(reason) => anyhow::bail!("the gRPC frontend refused the dial: {reason}"),
    }
}

/// Sends kube-apiserver's CONNECT request and reads the answer head. The head is read with one
/// buffered read rather than byte by byte: the target speaks only after we write, so nothing but
/// the head can arrive, and a byte-wise read would charge ~40 extra syscalls per dial to the
/// tunnel's figures.
pub async fn connect_request<S>(mut stream: S, target: SocketAddr) -> anyhow::Result<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes()).await?;
    let mut head = Vec::with_capacity(128);
    let mut buf = [0u8; 512];
    let end = loop {
        let n = stream.read(&mut buf).await?;
        anyhow::ensure!(n > 0, "the frontend closed the connection before answering CONNECT");
        head.extend_from_slice(&buf[..n]);
        if let Some(pos) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos + 4;
        }
        anyhow::ensure!(head.len() < 16 * 1024, "CONNECT answer head over 16 KiB");
    };
    let text = String::from_utf8_lossy(&head[..end]);
    let status = text.split_whitespace().nth(1).unwrap_or_default().to_owned();
    anyhow::ensure!(status == "200", "CONNECT {target} answered {}", text.lines().next().unwrap_or_default());
    anyhow::ensure!(head.len() == end, "the frontend sent bytes after its 200 head");
    Ok(stream)
}

/// A client connection, TCP or Unix.
pub enum Conn {
    /// TCP.
    Tcp(TcpStream),
    /// Unix socket.
    Unix(UnixStream),
    /// A dial through the gRPC frontend.
    Grpc(Box<crate::grpc_client::GrpcConn>),
}

impl Conn {
    /// The blocking form, for the latency scenario's dedicated threads.
    pub fn into_std(self) -> io::Result<StdConn> {
        match self {
            Self::Tcp(s) => {
                let s = s.into_std()?;
                s.set_nonblocking(false)?;
                Ok(StdConn::Tcp(s))
            }
            Self::Unix(s) => {
                let s = s.into_std()?;
                s.set_nonblocking(false)?;
                Ok(StdConn::Unix(s))
            }
            Self::Grpc(_) => {
                Err(io::Error::new(io::ErrorKind::Unsupported, "the blocking scenarios do not speak gRPC; use CONNECT"))
            }
        }
    }
}

macro_rules! both {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            Conn::Tcp($s) => $e,
            Conn::Unix($s) => $e,
            Conn::Grpc($s) => $e,
        }
    };
}

impl AsyncRead for Conn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        both!(self, s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for Conn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        both!(self, s => Pin::new(s).poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        both!(self, s => Pin::new(s).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        both!(self, s => Pin::new(s).poll_shutdown(cx))
    }
}

/// A blocking client connection.
pub enum StdConn {
    /// TCP.
    Tcp(std::net::TcpStream),
    /// Unix socket.
    Unix(std::os::unix::net::UnixStream),
}

impl StdConn {
    /// A second handle to the same connection (one thread reads, one writes).
    pub fn try_clone(&self) -> io::Result<Self> {
        match self {
            Self::Tcp(s) => s.try_clone().map(Self::Tcp),
            Self::Unix(s) => s.try_clone().map(Self::Unix),
        }
    }

    /// Bounds blocking reads so a lost answer cannot hang the run.
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_read_timeout(timeout),
            Self::Unix(s) => s.set_read_timeout(timeout),
        }
    }
}

impl io::Read for StdConn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Unix(s) => s.read(buf),
        }
    }
}

impl io::Write for StdConn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The node-side servers and the routes to them.
pub struct DataPath {
    /// `local` or `external`.
    pub kind: &'static str,
    /// The bulk server.
    pub bulk: SocketAddr,
    /// The echo server.
    pub echo: SocketAddr,
    /// Tunnel frontends to measure: (label, frontend); the first is the main one.
    pub frontends: Vec<(String, Frontend)>,
    local: Option<LocalDeployment>,
    servers: Vec<JoinHandle<()>>,
    /// With `--link-delay-ms`: the delayed links, the direct routes' ones keyed by the server.
    links: Vec<(SocketAddr, DelayedLink)>,
}

impl DataPath {
    /// Starts the node-side servers and, without `--frontend`, an in-process deployment.
    pub async fn start(target: &DataTarget) -> anyhow::Result<Self> {
        let bulk_listener = TcpListener::bind((target.backend_ip, target.bulk_port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", target.backend_ip, target.bulk_port))?;
        let echo_listener = TcpListener::bind((target.backend_ip, target.echo_port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", target.backend_ip, target.echo_port))?;
        let bulk = bulk_listener.local_addr()?;
        let echo = echo_listener.local_addr()?;
        let servers = vec![backends::spawn_bulk(bulk_listener), backends::spawn_echo(echo_listener)];
        if let Some(frontend) = &target.frontend {
            anyhow::ensure!(
                target.link_delay_ms == 0,
                "--link-delay-ms works only with the in-process deployment (without --frontend)"
            );
            return Ok(Self {
                kind: "external",
                bulk,
                echo,
                frontends: vec![("tunnel".into(), frontend.clone())],
                local: None,
                servers,
                links: Vec::new(),
            });
        }
        let delay = Duration::from_millis(target.link_delay_ms);
        let mut links = Vec::new();
        let mut options = LocalOptions::default();
        if target.grpc {
            options.uds_protocol = tether_gateway::config::FrontendProtocol::Grpc;
        }
        let agent_link = if delay.is_zero() {
            None
        } else {
            for server in [bulk, echo] {
                let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
                links.push((server, DelayedLink::spawn(listener, server, delay)?));
            }
            // The agent dials the relay; the gateway's address is known once it runs.
            let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
            let relay = listener.local_addr()?;
            options.tweak_agent = Some(std::sync::Arc::new(move |_: &str, config: &mut AgentConfig| {
                config.gateway.url = format!("wss://{relay}/v1/tunnel");
            }));
            Some(listener)
        };
        let mut deployment = LocalDeployment::start(options).await?;
        if let Some(listener) = agent_link {
            let gateway = deployment.agent_addr;
            links.push((gateway, DelayedLink::spawn(listener, gateway, delay)?));
        }
        deployment
            .add_agent(AgentSpec {
                id: "node-1".into(),
                addresses: vec![target.backend_ip],
                allow: vec![allow(target.backend_ip, &[bulk.port(), echo.port()])],
                default_route: false,
            })
            .await?;
        deployment.wait_connected(Duration::from_secs(15)).await?;
        let frontends = vec![
            ("tunnel".into(), Frontend::Tcp(deployment.frontend_addr)),
            if target.grpc {
                ("tunnel (unix socket, gRPC)".into(), Frontend::GrpcUnix(deployment.frontend_uds.clone()))
            } else {
                ("tunnel (unix socket)".into(), Frontend::Unix(deployment.frontend_uds.clone()))
            },
        ];
        Ok(Self { kind: "local", bulk, echo, frontends, local: Some(deployment), servers, links })
    }

    /// The direct (baseline) route to `target`: across the delayed link with `--link-delay-ms`.
    pub fn direct(&self, target: SocketAddr) -> Route {
        Route::Direct(self.direct_addr(target))
    }

    /// Where the direct route to `target` connects: the server, or its delayed link.
    pub fn direct_addr(&self, target: SocketAddr) -> SocketAddr {
        self.links.iter().find(|(server, _)| *server == target).map_or(target, |(_, link)| link.addr())
    }

    /// A route to `target` through a chain of `hops` plain TCP relays (each copies both ways
    /// with 64 KiB buffers), then the direct route. With two hops it has the tunnel's topology -
    /// client -> frontend, gateway -> agent, agent -> server: three TCP connections and two
    /// processes copying - without TLS, WebSocket or multiplexer, so it shows what the hops alone
    /// cost on the same machine. The relays stop with [`shutdown`](Self::shutdown).
    pub async fn relay_route(&mut self, target: SocketAddr, hops: usize) -> io::Result<Route> {
        let mut upstream = self.direct_addr(target);
        for _ in 0..hops {
            let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
            let next = std::mem::replace(&mut upstream, listener.local_addr()?);
            self.servers.push(spawn_relay(listener, next, |mut client, mut server| async move {
                relay_both_ways(&mut client, &mut server).await;
            }));
        }
        Ok(Route::Direct(upstream))
    }

    /// A route to `target` through two relays with TLS between them - client -> relay (plain),
    /// relay -> relay (TLS 1.3, rustls with aws-lc-rs as in Tether), relay -> target (plain) -
    /// each copying with 64 KiB buffers. It is the two-relay chain of [`relay_route`] with the
    /// tunnel's encryption on the middle hop, where the gateway and the agent talk, but without
    /// WebSocket or multiplexer: what the encryption alone adds to the hops. It stops with
    /// [`shutdown`](Self::shutdown).
    ///
    /// [`relay_route`]: Self::relay_route
    pub async fn tls_relay_route(&mut self, target: SocketAddr) -> anyhow::Result<Route> {
        let (acceptor, connector) = {
            let dir = crate::local::ScratchDir::new("tether-tls-relay")?;
            let ca = crate::devpki::DevCa::create(dir.path(), "tls-relay")?;
            let pair = ca.server("tls-relay", &["127.0.0.1"])?;
            let cert = tls::ReloadableCert::load(&pair.cert, &pair.key)?;
            let server = tls::server_config(cert, None, &[])?;
            let roots = tls::ClientRoots { ca_file: Some(ca.ca_cert.clone()), system_roots: false };
            let client = tls::client_config(&roots, None, &[])?;
            (tokio_rustls::TlsAcceptor::from(Arc::new(server)), tokio_rustls::TlsConnector::from(Arc::new(client)))
        };
        // The far relay terminates TLS and connects on to the target (or its delayed link).
        let far = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let far_addr = far.local_addr()?;
        self.servers.push(spawn_relay(far, self.direct_addr(target), move |client, mut server| {
            let acceptor = acceptor.clone();
            async move {
                let Ok(mut client) = acceptor.accept(client).await else { return };
                relay_both_ways(&mut client, &mut server).await;
            }
        }));
        // The near relay takes the client in plain TCP and speaks TLS to the far one.
        let near = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let near_addr = near.local_addr()?;
        self.servers.push(spawn_relay(near, far_addr, move |mut client, server| {
            let connector = connector.clone();
            async move {
                let name = rustls_pki_types::ServerName::IpAddress(Ipv4Addr::LOCALHOST.into());
                let Ok(mut server) = connector.connect(name, server).await else { return };
                relay_both_ways(&mut client, &mut server).await;
            }
        }));
        Ok(Route::Direct(near_addr))
    }

    /// A route to `target` through a bare CONNECT proxy: Tether's own request parser and answer,
    /// then a TCP connection to the target and a splice, with no tunnel session in between. It
    /// makes the same two TCP connections and the same CONNECT exchange as a tunnelled dial, so
    /// it is the floor for any Konnectivity-compatible frontend on the same machine. It stops
    /// with [`shutdown`](Self::shutdown).
    pub async fn connect_relay_route(&mut self, target: SocketAddr) -> io::Result<Route> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        self.servers.push(tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(connect_relay(client));
            }
        }));
        Ok(Route::Connect { frontend: Frontend::Tcp(addr), target: self.direct_addr(target) })
    }

    /// The main tunnel route to `target`.
    pub fn tunnel(&self, target: SocketAddr) -> Route {
        let frontend = self.frontends.first().map(|f| f.1.clone()).unwrap_or(Frontend::Tcp(target));
        Route::Connect { frontend, target }
    }

    /// Stops the deployment and the servers.
    pub async fn shutdown(self) {
        if let Some(local) = self.local {
            local.shutdown().await;
        }
        for server in self.servers {
            server.abort();
        }
    }
}

/// What the baseline relays do with a connection: copy both ways with 64 KiB buffers until both
/// ends are done.
async fn relay_both_ways<A, B>(a: &mut A, b: &mut B)
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    const BUFFER: usize = 64 * 1024;
    let _ = tokio::io::copy_bidirectional_with_sizes(a, b, BUFFER, BUFFER).await;
}

/// One connection of the bare CONNECT proxy: parse, connect, answer, splice.
async fn connect_relay(mut client: TcpStream) {
    use tether_gateway::frontend::connect::{ESTABLISHED, error_response, read_request};
    let _ = client.set_nodelay(true);
    let Ok(request) = read_request(&mut client).await else { return };
    let upstream = match request.target.parse::<SocketAddr>() {
        Ok(addr) => TcpStream::connect(addr).await,
        Err(e) => Err(io::Error::new(io::ErrorKind::InvalidInput, e)),
    };
    let mut server = match upstream {
        Ok(server) => server,
        Err(e) => {
            let _ = client.write_all(&error_response(502, &e.to_string())).await;
            return;
        }
    };
    let _ = server.set_nodelay(true);
    if server.write_all(&request.early_data).await.is_err() || client.write_all(ESTABLISHED).await.is_err() {
        return;
    }
    let _ = tether_tunnel::splice::splice(&mut client, &mut server, |_, _| {}).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn frontends_parse() {
        assert!(matches!("tcp://127.0.0.1:8131".parse::<Frontend>(), Ok(Frontend::Tcp(_))));
        assert!(
            matches!("unix:///run/t.sock".parse::<Frontend>(), Ok(Frontend::Unix(p)) if p == Path::new("/run/t.sock"))
        );
        assert!("http://x".parse::<Frontend>().is_err());
    }
}
