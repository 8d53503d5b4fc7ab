//! `mux-compare`: the multiplexer choice, measured. Bulk download over one and over eight
//! streams with Tether's multiplexer (`tether_tunnel::mux`, yamux's wire format), with the `yamux`
//! crate (tuned as the tunnel used it before) and with tokio-yamux, all over the same stack as the
//! tunnel (WebSocket over TLS over loopback TCP), next to direct TCP and to the WebSocket stream
//! without a multiplexer, all in one run.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use rustls_pki_types::ServerName;
use tether_tunnel::mux::{self, MuxSettings, Role};
use tether_tunnel::transport::Transport;
use tether_tunnel::ws::{WsByteStream, WsSettings};
use tether_tunnel::ws_link::{WsLink, WsRole};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::devpki::DevCa;
use crate::local::ScratchDir;
use crate::progress::Progress;
use crate::report::{Report, Table, pct};
use crate::scenarios::Outcome;
use crate::scenarios::measure::MIB;
use crate::stats::{self, Sampler, median, ratio};
use crate::svg::{self, Labels, Line};

/// Options of `mux-compare`.
#[derive(Debug, Clone, clap::Args)]
pub struct MuxCompareArgs {
    /// Seconds per measurement.
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Stream counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub streams: Vec<usize>,
    /// tokio-yamux stream windows to try, KiB (at least 256: smaller windows panic).
    #[arg(long, value_delimiter = ',', default_value = "256,4096")]
    pub tokio_yamux_windows_kib: Vec<u32>,
    /// Frame sizes (`split_send_size`) to try with Tether's multiplexer, KiB (the default is 64).
    #[arg(long, value_delimiter = ',', default_value = "64")]
    pub mux_split_kib: Vec<usize>,
    /// Also measure the `yamux` crate (what the tunnel used before its own multiplexer).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub yamux_crate: bool,
    /// What the multiplexers run over: `wss` (the tunnel's stack) or `tcp` (plain loopback TCP,
    /// to separate the multiplexer from the WebSocket and TLS layers).
    #[arg(long, default_value = "wss")]
    pub transport: String,
}

/// A byte stream a multiplexer can run over.
trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}
type BoxIo = Box<dyn Io>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stack {
    Direct,
    WsOnly,
    Tether(usize),
    YamuxCrate,
    TokioYamux(u32),
}

/// The tunnel's own frame size: Tether's multiplexer with it is labelled plainly.
fn tunnel_split_kib() -> usize {
    MuxSettings::default().split_send_size / 1024
}

impl Stack {
    fn key(self) -> String {
        match self {
            Self::Direct => "direct".into(),
            Self::WsOnly => "wss_no_mux".into(),
            Self::Tether(kib) if kib == tunnel_split_kib() => "tether_mux".into(),
            Self::Tether(kib) => format!("tether_mux_split_{kib}k"),
            Self::YamuxCrate => "yamux_crate".into(),
            Self::TokioYamux(kib) => format!("tokio_yamux_{kib}k"),
        }
    }

    fn label(self) -> String {
        match self {
            Self::Direct => "direct TCP".into(),
            Self::WsOnly => "no mux".into(),
            Self::Tether(kib) if kib == tunnel_split_kib() => "tether mux".into(),
            Self::Tether(kib) => format!("tether mux, {kib} KiB frames"),
            Self::YamuxCrate => "yamux crate".into(),
            Self::TokioYamux(kib) => format!("tokio-yamux {kib} KiB window"),
        }
    }
}

/// One end of a connected pair: plain TCP, or TLS on which a WebSocket runs. Tether's
/// multiplexer runs on the tunnel's own WebSocket link ([`WsLink`]); the other multiplexers see
/// a WebSocket byte stream (tungstenite, [`WsByteStream`]).
enum End {
    Tcp(TcpStream),
    Tls(Box<Transport>, WsRole),
}

impl End {
    async fn into_io(self) -> BoxIo {
        match self {
            Self::Tcp(tcp) => Box::new(tcp),
            Self::Tls(tls, role) => {
                let settings = WsSettings::default();
                let role = match role {
                    WsRole::Client => tokio_tungstenite::tungstenite::protocol::Role::Client,
                    WsRole::Server => tokio_tungstenite::tungstenite::protocol::Role::Server,
                };
                let ws = tokio_tungstenite::WebSocketStream::from_raw_socket(
                    *tls,
                    role,
                    Some(settings.tungstenite_config()),
                )
                .await;
                Box::new(WsByteStream::new(ws, &settings))
            }
        }
    }

    fn start_mux(self, role: Role, settings: &MuxSettings) -> (mux::Session, mux::Incoming, mux::Driver) {
        match self {
            Self::Tcp(tcp) => mux::start(mux::ByteLink::new(tcp), role, settings),
            Self::Tls(tls, ws_role) => {
                let link = WsLink::new(*tls, ws_role, WsSettings::default().link_settings(), bytes::BytesMut::new());
                mux::start(link, role, settings)
            }
        }
    }
}

/// The `yamux` crate tuned as the tunnel used it: 64 KiB frames, and room for windows to grow.
fn yamux_crate_config() -> yamux::Config {
    let mut config = yamux::Config::default();
    let streams = 8192;
    config.set_max_connection_receive_window(None);
    config.set_max_num_streams(streams);
    config.set_max_connection_receive_window(Some(streams * 256 * 1024 + tether_tunnel::mux::DEFAULT_WINDOW_GROWTH));
    config.set_split_send_size(64 * 1024);
    config
}

/// Drives a `yamux` crate connection: opens `streams` streams (client) or serves downloads on the
/// streams the peer opens (server).
async fn run_yamux_crate(
    io: BoxIo,
    mode: yamux::Mode,
    open: Option<(usize, tokio::sync::oneshot::Sender<Vec<yamux::Stream>>)>,
) {
    use tokio_util::compat::{FuturesAsyncReadCompatExt, TokioAsyncReadCompatExt};
    let mut connection = yamux::Connection::new(io.compat(), yamux_crate_config(), mode);
    let mut open = open;
    let mut opened = Vec::new();
    futures::future::poll_fn(|cx| {
        if let Some((count, _)) = &open {
            while opened.len() < *count {
                match connection.poll_new_outbound(cx) {
                    std::task::Poll::Ready(Ok(stream)) => opened.push(stream),
                    std::task::Poll::Ready(Err(_)) => return std::task::Poll::Ready(()),
                    std::task::Poll::Pending => break,
                }
            }
            if opened.len() >= *count
                && let Some((_, reply)) = open.take()
            {
                let _ = reply.send(std::mem::take(&mut opened));
            }
        }
        loop {
            match connection.poll_next_inbound(cx) {
                std::task::Poll::Ready(Some(Ok(stream))) => {
                    tokio::spawn(serve_download(stream.compat()));
                }
                std::task::Poll::Ready(_) => return std::task::Poll::Ready(()),
                std::task::Poll::Pending => return std::task::Poll::Pending,
            }
        }
    })
    .await;
}

struct Tls {
    _dir: ScratchDir,
    acceptor: TlsAcceptor,
    connector: TlsConnector,
}

impl Tls {
    fn create() -> anyhow::Result<Self> {
        tether_tunnel::tls::install_default_provider();
        let dir = ScratchDir::new("tether-muxcmp")?;
        let ca = DevCa::create(dir.path(), "muxcmp")?;
        let cert = ca.server("server", &["localhost"])?;
        let resolver = tether_tunnel::tls::ReloadableCert::load(&cert.cert, &cert.key)?;
        let server = tether_tunnel::tls::server_config(resolver, None, &[tether_tunnel::tls::ALPN_HTTP11])?;
        let roots = tether_tunnel::tls::ClientRoots { ca_file: Some(ca.ca_cert.clone()), system_roots: false };
        let client = tether_tunnel::tls::client_config(&roots, None, &[tether_tunnel::tls::ALPN_HTTP11])?;
        Ok(Self {
            _dir: dir,
            acceptor: TlsAcceptor::from(Arc::new(server)),
            connector: TlsConnector::from(Arc::new(client)),
        })
    }

    /// A connected pair over `transport`: (client end, server end).
    async fn pair(&self, transport: &str) -> anyhow::Result<(End, End)> {
        if transport == "tcp" {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let client = TcpStream::connect(listener.local_addr()?).await?;
            let (server, _) = listener.accept().await?;
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            return Ok((End::Tcp(client), End::Tcp(server)));
        }
        anyhow::ensure!(transport == "wss", "--transport {transport}: use wss or tcp");
        let (client, server) = self.tls_pair().await?;
        Ok((End::Tls(Box::new(client), WsRole::Client), End::Tls(Box::new(server), WsRole::Server)))
    }

    /// TLS over loopback TCP: (client end, server end). The WebSocket runs on it as if just
    /// upgraded.
    async fn tls_pair(&self) -> anyhow::Result<(Transport, Transport)> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let acceptor = self.acceptor.clone();
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await?;
            let _ = tcp.set_nodelay(true);
            anyhow::Ok(Transport::ServerTls(Box::new(acceptor.accept(tcp).await?)))
        });
        let tcp = TcpStream::connect(addr).await?;
        let _ = tcp.set_nodelay(true);
        let tls = self.connector.connect(ServerName::try_from("localhost")?, tcp).await?;
        Ok((Transport::ClientTls(Box::new(tls)), server.await??))
    }
}

/// Waits for one command byte, then writes pattern bytes until the peer goes away. A read stays
/// pending meanwhile: tokio-yamux processes a stream's incoming window updates only when the
/// stream is read (a write-only stream stalls until its write is woken by something else).
async fn serve_download<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S) {
    let mut command = [0u8; 1];
    if stream.read_exact(&mut command).await.is_err() {
        return;
    }
    let (mut reader, mut writer) = tokio::io::split(stream);
    let chunk = crate::backends::pattern(256 * 1024);
    let write = async { while writer.write_all(&chunk).await.is_ok() {} };
    let read = async {
        let mut sink = [0u8; 64];
        while matches!(reader.read(&mut sink).await, Ok(n) if n > 0) {}
    };
    tokio::select! {
        () = write => {}
        () = read => {}
    }
}

/// Downloads over every stream for `duration`; returns (MiB/s, per-second samples).
async fn download<S>(
    streams: Vec<S>,
    duration: Duration,
    progress: &Progress,
    label: &str,
) -> anyhow::Result<(f64, Vec<f64>)>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let counter = stats::counter();
    let live = counter.clone();
    let t0 = Instant::now();
    let phase = progress.phase(label, duration, move || {
        format!("{:.1} MiB/s", live.load(Ordering::Relaxed) as f64 / MIB / t0.elapsed().as_secs_f64().max(1e-3))
    });
    let sampler = Sampler::start(counter.clone(), Duration::from_secs(1));
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + duration;
    let mut tasks = Vec::new();
    for mut stream in streams {
        let counter = counter.clone();
        tasks.push(tokio::spawn(async move {
            stream.write_all(b"D").await?;
            stream.flush().await?;
            let mut buf = vec![0u8; 256 * 1024];
            while let Ok(read) = tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
                let n = read?;
                anyhow::ensure!(n > 0, "the server ended the stream");
                counter.fetch_add(n as u64, Ordering::Relaxed);
            }
            anyhow::Ok(stream)
        }));
    }
    let mut finished = Vec::new();
    for task in tasks {
        finished.push(task.await??);
    }
    let secs = started.elapsed().as_secs_f64();
    let samples = sampler.finish().await.into_iter().map(|v| v / MIB).collect();
    phase.done().await;
    drop(finished);
    Ok((counter.load(Ordering::Relaxed) as f64 / MIB / secs, samples))
}

/// One measurement of one stack.
struct Measured {
    mib_s: f64,
    /// This process's resident memory right after the measurement.
    rss_mib: f64,
    samples: Vec<f64>,
}

async fn measure(
    tls: &Tls,
    transport: &str,
    stack: Stack,
    streams: usize,
    duration: Duration,
    progress: &Progress,
) -> anyhow::Result<Measured> {
    let label = format!("{} x{streams}", stack.label());
    let mut background: Vec<JoinHandle<()>> = Vec::new();
    let result = match stack {
        Stack::Direct => {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            background.push(tokio::spawn(async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    let _ = tcp.set_nodelay(true);
                    tokio::spawn(serve_download(tcp));
                }
            }));
            let mut conns = Vec::new();
            for _ in 0..streams {
                let tcp = TcpStream::connect(addr).await?;
                let _ = tcp.set_nodelay(true);
                conns.push(tcp);
            }
            download(conns, duration, progress, &label).await?
        }
        Stack::WsOnly => {
            let (client, server) = tls.pair(transport).await?;
            background.push(tokio::spawn(serve_download(server.into_io().await)));
            download(vec![client.into_io().await], duration, progress, &label).await?
        }
        Stack::YamuxCrate => {
            let (client, server) = tls.pair(transport).await?;
            background.push(tokio::spawn(run_yamux_crate(server.into_io().await, yamux::Mode::Server, None)));
            let (reply, opened) = tokio::sync::oneshot::channel();
            background.push(tokio::spawn(run_yamux_crate(
                client.into_io().await,
                yamux::Mode::Client,
                Some((streams, reply)),
            )));
            use tokio_util::compat::FuturesAsyncReadCompatExt;
            let opened: Vec<_> = opened.await?.into_iter().map(|s| s.compat()).collect();
            download(opened, duration, progress, &label).await?
        }
        Stack::Tether(split_kib) => {
            let (client, server) = tls.pair(transport).await?;
            let settings = MuxSettings { split_send_size: split_kib * 1024, ..MuxSettings::default() };
            let (_server_session, mut incoming, server_driver) = server.start_mux(Role::Server, &settings);
            background.push(tokio::spawn(async move {
                let _ = server_driver.await;
            }));
            background.push(tokio::spawn(async move {
                while let Some(stream) = incoming.accept().await {
                    tokio::spawn(serve_download(stream));
                }
            }));
            let (session, _incoming, driver) = client.start_mux(Role::Client, &settings);
            background.push(tokio::spawn(async move {
                let _ = driver.await;
            }));
            let mut opened = Vec::new();
            for _ in 0..streams {
                opened.push(session.open().await?);
            }
            let result = download(opened, duration, progress, &label).await?;
            session.close();
            result
        }
        Stack::TokioYamux(window_kib) => {
            let (client, server) = tls.pair(transport).await?;
            let config = tokio_yamux::Config {
                max_stream_window_size: window_kib.max(256) * 1024,
                enable_keepalive: false,
                ..tokio_yamux::Config::default()
            };
            let mut server_session = tokio_yamux::Session::new_server(server.into_io().await, config);
            background.push(tokio::spawn(async move {
                while let Some(Ok(stream)) = server_session.next().await {
                    tokio::spawn(serve_download(stream));
                }
            }));
            let mut client_session = tokio_yamux::Session::new_client(client.into_io().await, config);
            let mut control = client_session.control();
            background.push(tokio::spawn(async move { while client_session.next().await.is_some() {} }));
            let mut opened = Vec::new();
            for _ in 0..streams {
                opened.push(control.open_stream().await.map_err(|e| anyhow::anyhow!("tokio-yamux open: {e:?}"))?);
            }
            let result = download(opened, duration, progress, &label).await?;
            control.close().await;
            result
        }
    };
    let rss_mib = crate::procs::own_rss_kib() as f64 / 1024.0;
    for task in background {
        task.abort();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(Measured { mib_s: result.0, rss_mib, samples: result.1 })
}

/// Runs the scenario.
pub async fn run(args: &MuxCompareArgs, progress: &Progress) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let tls = Tls::create()?;
    let duration = Duration::from_secs_f64(args.duration.max(0.2));
    let mut stacks = vec![Stack::Direct, Stack::WsOnly];
    stacks.extend(args.mux_split_kib.iter().map(|k| Stack::Tether((*k).clamp(16, 1024))));
    if args.yamux_crate {
        stacks.push(Stack::YamuxCrate);
    }
    stacks.extend(args.tokio_yamux_windows_kib.iter().map(|w| Stack::TokioYamux((*w).max(256))));
    let mut results: BTreeMap<(Stack, usize), Vec<Measured>> = BTreeMap::new();
    for _ in 0..args.repeat.max(1) {
        for &streams in &args.streams {
            for &stack in &stacks {
                if stack == Stack::WsOnly && streams != 1 {
                    continue;
                }
                let figure = measure(&tls, &args.transport, stack, streams.max(1), duration, progress).await?;
                results.entry((stack, streams)).or_default().push(figure);
            }
        }
    }
    let mut report = Report::new(
        "mux-compare",
        "local",
        serde_json::json!({
            "duration_s": args.duration, "repeat": args.repeat, "streams": args.streams,
            "tokio_yamux_windows_kib": args.tokio_yamux_windows_kib, "mux_split_kib": args.mux_split_kib,
            "yamux_crate": args.yamux_crate,
            "transport": args.transport,
            "stack": if args.transport == "tcp" { "plain loopback TCP" } else { "WebSocket byte stream (tether_tunnel::ws) over TLS (rustls, aws-lc-rs) over loopback TCP" },
        }),
    );
    let mut table = Table::new(&["multiplexer", "streams", "MiB/s", "vs direct", "process RSS MiB"]);
    let categories: Vec<String> =
        args.streams.iter().map(|s| if *s == 1 { "1 stream".to_owned() } else { format!("{s} streams") }).collect();
    let mut bars: Vec<Line> =
        stacks.iter().map(|s| Line { name: s.label(), points: Vec::new(), dashed: false }).collect();
    for (c, &streams) in args.streams.iter().enumerate() {
        let direct = median(
            &results
                .get(&(Stack::Direct, streams))
                .map(|v| v.iter().map(|x| x.mib_s).collect::<Vec<_>>())
                .unwrap_or_default(),
        );
        for (s, &stack) in stacks.iter().enumerate() {
            let Some(values) = results.get(&(stack, streams)) else { continue };
            let mib_s = median(&values.iter().map(|x| x.mib_s).collect::<Vec<_>>());
            let rss = values.iter().map(|x| x.rss_mib).fold(0.0, f64::max);
            let key = format!("{}_{streams}_streams_mib_s", stack.key());
            if stack == Stack::Direct {
                report.baseline.insert(key, mib_s);
            } else {
                report.tunnel.insert(key.clone(), mib_s);
                report.ratios.insert(key, ratio(mib_s, direct));
            }
            report.figures.insert(format!("{}_{streams}_streams_rss_mib", stack.key()), rss);
            bars[s].points.push((c as f64, mib_s));
            if let Some(first) = values.first() {
                report.series.push(crate::report::Series::per_second(
                    format!("{} x{streams} (first run)", stack.label()),
                    "MiB/s",
                    &first.samples,
                ));
            }
            table.row(vec![
                stack.label(),
                streams.to_string(),
                format!("{mib_s:.1}"),
                pct(ratio(mib_s, direct)),
                format!("{rss:.0}"),
            ]);
        }
    }
    report.notes.push("process RSS is this whole process's resident memory right after each measurement (allocator caches included); compare within one run only".into());
    report.machine.load_average_end = crate::report::load_average();
    report.elapsed_s = started.elapsed().as_secs_f64();
    let chart = svg::bar_chart(
        &Labels {
            title: &if args.transport == "tcp" {
                "Bulk download over plain loopback TCP: multiplexers vs direct TCP".to_owned()
            } else {
                "Bulk download over WSS (TLS, loopback): multiplexers vs direct TCP".to_owned()
            },
            x: "",
            y: "MiB/s",
        },
        &categories,
        &bars,
    );
    Ok(Outcome { report, table: table.render(), charts: vec![("mux-compare.svg".into(), chart)] })
}
