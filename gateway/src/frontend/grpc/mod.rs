//! The gRPC frontend: Konnectivity's `ProxyService.Proxy` (kube-apiserver's egress selector with
//! `proxyProtocol: GRPC`) over HTTP/2, on the same sockets, routing, limits, metrics and audit log
//! as the CONNECT frontend.
//!
//! kube-apiserver opens one HTTP/2 connection and one `Proxy` stream per dial. On that stream:
//! `DIAL_REQ` -> `DIAL_RSP` (an error string, or a connection id), then `DATA` both ways, and
//! `CLOSE_REQ` -> `CLOSE_RSP`; `DIAL_CLS` cancels a pending dial. As in konnectivity-server, a
//! packet other than `DIAL_REQ` before the dial is answered with a `CLOSE_RSP` error, `DATA` with
//! connection id 0 is ignored and `DATA` for another connection id closes the stream. Unlike
//! konnectivity-server, a stream carries one dial: a second `DIAL_REQ` gets a `DIAL_RSP` error.
//!
//! Each stream's bytes obey HTTP/2 flow control end to end: a packet is taken from the stream only
//! once the previous one is written towards the node, and bytes from the node are read only while
//! the stream's send window is open, so a slow reader stalls only its own dial.

pub mod authority;
pub mod codec;
pub mod proto;

use std::convert::Infallible;
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::buf::Chain;
use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tether_tunnel::untrusted::printable;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio_util::sync::PollSender;

use super::{Client, DialOutcome, FrontendContext};
use crate::dial::{Dialed, DialedStream};
use crate::metrics::{BYTES, DIALS};
use crate::target::DialTarget;
use crate::tenant::Tenant;
use codec::{MessageReader, ReadError};
use proto::{Packet, PacketType, Payload};

/// The method's path (the service has no package name).
pub const PATH: &str = "/ProxyService/Proxy";

/// Receive window per stream: what one dial may have in flight from kube-apiserver.
const STREAM_WINDOW: u32 = 256 * 1024;
/// Streams per connection. kube-apiserver opens a connection per dial, or (newer releases) many
/// dials over one cached connection; the tenant's stream limits apply either way.
const MAX_STREAMS: u32 = 16_384;
/// Receive window per connection: room for 256 streams' full windows, so a few stalled readers
/// on a shared connection never hold back the others.
const CONNECTION_WINDOW: u32 = STREAM_WINDOW * 256;
/// Largest chunk read from a peer replica's connection at once.
const PEER_READ: usize = 32 * 1024;
/// Largest chunk taken from an agent stream at once (one DATA packet).
const MAX_CHUNK: usize = 64 * 1024;
/// Keepalive pings on idle connections, and how long an answer may take.
const KEEPALIVE: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// Connection ids, unique within this gateway process.
static CONNECT_IDS: AtomicI64 = AtomicI64::new(1);

/// What the response body carries: a message head and its payload, sent without a copy.
type Chunk = Chain<Bytes, Bytes>;

/// Serves one client connection (HTTP/2, cleartext on a Unix socket or inside TLS) until the
/// client closes it or the drain's grace period ends. New streams stop when the drain begins.
pub async fn serve_connection<S>(io: S, tenant: Arc<Tenant>, context: Arc<FrontendContext>, who: Client)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let who = Arc::new(who);
    let started = Arc::new(AtomicBool::new(false));
    let service = {
        let (tenant, context, who, started) = (tenant.clone(), context.clone(), who.clone(), started.clone());
        service_fn(move |request: Request<Incoming>| {
            started.store(true, Ordering::Relaxed);
            let response = handle(request, &tenant, &context, &who);
            async move { Ok::<_, Infallible>(response) }
        })
    };
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_concurrent_streams(MAX_STREAMS)
        .max_header_list_size(16 * 1024)
        .keep_alive_interval(KEEPALIVE)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT);
    let connection = builder.serve_connection(TokioIo::new(authority::AuthorityFix::new(io)), service);
    tokio::pin!(connection);
    let lifecycle = context.lifecycle.clone();
    // A client that connects and never opens a stream is closed like one that never sends its
    // CONNECT request.
    let first_request = async {
        tokio::time::sleep(context.settings.connect_request_timeout).await;
        if !started.load(Ordering::Relaxed) {
            tracing::debug!(tenant = %tenant.name, peer = %who.peer, "gRPC client opened no stream in time");
            return;
        }
        std::future::pending::<()>().await;
    };
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = first_request => return,
        () = lifecycle.drain_started().cancelled() => {
            // GOAWAY: streams in flight go on, new ones go to another replica.
            connection.as_mut().graceful_shutdown();
            tokio::select! {
                result = connection.as_mut() => result,
                () = lifecycle.hard_stop().cancelled() => return,
            }
        }
    };
    if let Err(e) = result {
        tracing::debug!(tenant = %tenant.name, peer = %who.peer, error = %e, "gRPC frontend connection ended with an error");
    }
}

/// Answers one request: the `Proxy` stream (served by its own task), or a gRPC error.
fn handle(
    request: Request<Incoming>,
    tenant: &Arc<Tenant>,
    context: &Arc<FrontendContext>,
    who: &Arc<Client>,
) -> Response<ResponseBody> {
    let grpc = request.headers().get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| {
        v == "application/grpc" || v.starts_with("application/grpc+") || v.starts_with("application/grpc;")
    });
    if !grpc {
        let mut response = Response::new(ResponseBody::Empty);
        *response.status_mut() = StatusCode::UNSUPPORTED_MEDIA_TYPE;
        return response;
    }
    if request.method() != http::Method::POST || request.uri().path() != PATH {
        let method = printable(request.uri().path(), 128);
        return status_only(12, &format!("unknown method {method}: this server serves {PATH}"));
    }
    let (tx, rx) = mpsc::channel(1);
    let stream = Stream {
        out: Outbound { tx: PollSender::new(tx) },
        tenant: tenant.clone(),
        context: context.clone(),
        who: who.clone(),
        started: Instant::now(),
    };
    let inbound = MessageReader::new(request.into_body());
    context.lifecycle.spawn_connection(stream.serve(inbound));
    let mut response = Response::new(ResponseBody::Stream(rx));
    response.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    response
}

/// A gRPC answer with no messages (status in the headers, "Trailers-Only").
fn status_only(code: u32, message: &str) -> Response<ResponseBody> {
    let mut response = Response::new(ResponseBody::Empty);
    response.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    for (name, value) in status_headers(code, message) {
        if let Some(name) = name {
            response.headers_mut().insert(name, value);
        }
    }
    response
}

/// `grpc-status` and, when there is one, `grpc-message` (percent-encoded as gRPC requires).
fn status_headers(code: u32, message: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("grpc-status", HeaderValue::from(code));
    if !message.is_empty() {
        let mut encoded = String::with_capacity(message.len());
        for byte in message.bytes() {
            if (0x20..0x7f).contains(&byte) && byte != b'%' {
                encoded.push(char::from(byte));
            } else {
                encoded.push_str(&format!("%{byte:02X}"));
            }
        }
        if let Ok(value) = HeaderValue::from_str(&encoded) {
            headers.insert("grpc-message", value);
        }
    }
    headers
}

/// The response body: the frames the stream's task sends, ending with the trailers.
pub enum ResponseBody {
    /// No body (the status is in the headers).
    Empty,
    /// Frames from the stream's task.
    Stream(mpsc::Receiver<Frame<Chunk>>),
}

impl Body for ResponseBody {
    type Data = Chunk;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Chunk>, Infallible>>> {
        match self.get_mut() {
            Self::Empty => Poll::Ready(None),
            Self::Stream(rx) => rx.poll_recv(cx).map(|frame| frame.map(Ok)),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Self::Empty)
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Empty => SizeHint::with_exact(0),
            Self::Stream(_) => SizeHint::default(),
        }
    }
}

/// The sending half of a stream's response. Capacity one: a frame is produced only when the
/// previous one has been taken by HTTP/2, which takes it only while the send window is open.
struct Outbound {
    tx: PollSender<Frame<Chunk>>,
}

impl Outbound {
    /// Sends a packet; false when the client has gone.
    async fn packet(&mut self, packet: &Packet) -> bool {
        self.send(Frame::data(codec::encode(packet).chain(Bytes::new()))).await
    }

    async fn send(&mut self, frame: Frame<Chunk>) -> bool {
        if poll_fn(|cx| self.tx.poll_reserve(cx)).await.is_err() {
            return false;
        }
        self.tx.send_item(frame).is_ok()
    }

    /// Ends the response with a gRPC status.
    async fn finish(mut self, code: u32, message: &str) {
        let _ = self.send(Frame::trailers(status_headers(code, message))).await;
    }

    /// Resolves when the client has gone (the response body was dropped).
    async fn closed(&mut self) {
        if let Some(tx) = self.tx.get_ref() {
            tx.closed().await;
        }
    }
}

/// One `Proxy` stream: at most one dial.
struct Stream {
    out: Outbound,
    tenant: Arc<Tenant>,
    context: Arc<FrontendContext>,
    who: Arc<Client>,
    started: Instant,
}

/// How an established connection ended.
enum End {
    /// The client sent `CLOSE_REQ`.
    CloseRequested,
    /// The client ended its half of the stream without `CLOSE_REQ`.
    ClientDone,
    /// The client's stream failed or a message was bad.
    ClientFailed(ReadError),
    /// `DATA` for a connection id that is not this stream's.
    Mismatch(i64),
    /// The node side closed.
    NodeClosed,
    /// The node side failed.
    NodeFailed(io::Error),
    /// The client stopped reading (reset, gone).
    ClientGone,
    /// The drain's grace period ended.
    Shutdown,
}

impl Stream {
    async fn serve<B>(mut self, mut inbound: MessageReader<B>)
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: std::fmt::Display,
    {
        // Before the dial: konnectivity-server's answers to a client that skips DIAL_REQ.
        let request = loop {
            let packet = match inbound.next().await {
                Ok(Some(packet)) => packet,
                Ok(None) => return self.out.finish(0, "").await,
                Err(e) => return self.out.finish(e.code(), &e.to_string()).await,
            };
            match (kind(&packet), packet.payload) {
                (PacketType::DialReq, Some(Payload::DialRequest(request))) => break request,
                (PacketType::DialReq, _) => break proto::DialRequest::default(),
                (PacketType::CloseReq, payload) => {
                    let id = match payload {
                        Some(Payload::CloseRequest(close)) => close.connect_id,
                        _ => 0,
                    };
                    if !self.out.packet(&Packet::close_response(id, "backend uninitialized")).await {
                        return;
                    }
                }
                (PacketType::Data, payload) => {
                    let id = match payload {
                        Some(Payload::Data(data)) => data.connect_id,
                        _ => 0,
                    };
                    self.out.packet(&Packet::close_response(id, "backend not initialized")).await;
                    return self.out.finish(0, "").await;
                }
                // DIAL_CLS with no dial pending, and anything else: ignored.
                _ => {}
            }
        };
        let random = request.random;
        let address = printable(&request.address, 256);
        let target = match DialTarget::parse(&request.address) {
            Ok(target) => target,
            Err(reason) => {
                self.audit(&address, "bad_request", 400, None, (0, 0));
                self.out.packet(&Packet::dial_response(random, Err(reason.to_string()))).await;
                return self.out.finish(0, "").await;
            }
        };
        let shown = target.to_string();

        // The dial, abandoned at once when the client cancels it or goes away: dropping it frees
        // the pending-dial slot, the stream slot and the half-open tunnel stream.
        let dial = self.context.dialer.dial(&self.tenant, &target, "grpc");
        tokio::pin!(dial);
        let cancelled = loop {
            tokio::select! {
                biased;
                dialed = &mut dial => break Ok(dialed),
                packet = inbound.next() => match packet {
                    Ok(Some(packet)) => match (kind(&packet), packet.payload) {
                        (PacketType::DialCls, Some(Payload::CloseDial(close))) if close.random == random => {
                            break Err("cancelled by DIAL_CLS");
                        }
                        (PacketType::DialReq, Some(Payload::DialRequest(second))) => {
                            let refused = Packet::dial_response(second.random, Err("this stream already carries a dial; open a stream per dial".into()));
                            if !self.out.packet(&refused).await {
                                break Err("client went away");
                            }
                        }
                        _ => {}
                    },
                    Ok(None) | Err(_) => break Err("client went away"),
                },
                () = self.out.closed() => break Err("client went away"),
            }
        };
        let dialed = match cancelled {
            Ok(dialed) => dialed,
            Err(why) => {
                tracing::info!(tenant = %self.tenant.name, peer = %self.who.peer, target = %shown, "dial abandoned: {why}");
                metrics::counter!(DIALS, "tenant" => self.tenant.name.to_string(), "result" => "cancelled", "protocol" => "grpc").increment(1);
                self.audit(&shown, "cancelled", 499, None, (0, 0));
                return self.out.finish(0, "").await;
            }
        };
        let mut dialed = match dialed {
            Ok(dialed) => dialed,
            Err(e) => {
                tracing::info!(tenant = %self.tenant.name, peer = %self.who.peer, target = %shown, status = e.status(), error = %e, "dial failed");
                self.audit(&shown, e.label(), e.status(), None, (0, 0));
                self.out.packet(&Packet::dial_response(random, Err(e.to_string()))).await;
                return self.out.finish(0, "").await;
            }
        };
        let connect_id = CONNECT_IDS.fetch_add(1, Ordering::Relaxed);
        if !self.out.packet(&Packet::dial_response(random, Ok(connect_id))).await {
            self.audit(&shown, "ok", 200, Some(&dialed), (0, 0));
            return;
        }

        let mut bridge = Bridge::new(&self.tenant.name, connect_id);
        let end = tokio::select! {
            end = bridge.run(&mut inbound, &mut dialed.stream, &mut self.out) => end,
            () = self.context.lifecycle.hard_stop().cancelled() => End::Shutdown,
        };
        let bytes = (bridge.to_node, bridge.from_node);
        // Close the node side first (a reset tells the agent to close the target at once).
        let carrier = dialed.carrier.clone();
        let audit_dialed = AuditParties { agent: dialed.agent.take(), via_replica: dialed.via_replica.take() };
        drop(dialed);
        let (close_error, status) = match &end {
            End::CloseRequested | End::NodeClosed | End::ClientDone => (String::new(), 0),
            End::Mismatch(other) => (format!("mismatched connection IDs ({other} on connection {connect_id})"), 0),
            End::NodeFailed(e) => (e.to_string(), 0),
            End::Shutdown => ("gateway shutting down".to_owned(), 0),
            End::ClientFailed(e) => (String::new(), e.code()),
            End::ClientGone => (String::new(), 1),
        };
        if let End::NodeFailed(e) = &end {
            tracing::debug!(tenant = %self.tenant.name, peer = %self.who.peer, target = %shown, agent = %carrier, error = %e, "tunnelled connection ended with an error");
        }
        if let End::Shutdown = end {
            tracing::info!(tenant = %self.tenant.name, peer = %self.who.peer, target = %shown, "closing tunnelled connection: drain grace period over");
        }
        self.audit_with(&shown, "ok", 200, &audit_dialed, bytes);
        if !matches!(end, End::ClientGone | End::ClientFailed(_)) {
            self.out.packet(&Packet::close_response(connect_id, &close_error)).await;
        }
        let message = match &end {
            End::ClientFailed(e) => e.to_string(),
            _ => String::new(),
        };
        self.out.finish(status, &message).await;
    }

    fn audit(&self, target: &str, result: &str, status: u16, dialed: Option<&Dialed>, bytes: (u64, u64)) {
        let parties = AuditParties {
            agent: dialed.and_then(|d| d.agent.clone()),
            via_replica: dialed.and_then(|d| d.via_replica.clone()),
        };
        self.audit_with(target, result, status, &parties, bytes);
    }

    fn audit_with(&self, target: &str, result: &str, status: u16, parties: &AuditParties, bytes: (u64, u64)) {
        let outcome = DialOutcome {
            target,
            result,
            status,
            agent: parties.agent.as_deref(),
            via_replica: parties.via_replica.as_deref(),
            bytes,
        };
        self.who.audit_dial(&self.tenant, &self.context, "grpc", self.started, &outcome);
    }
}

struct AuditParties {
    agent: Option<String>,
    via_replica: Option<String>,
}

fn kind(packet: &Packet) -> PacketType {
    PacketType::try_from(packet.r#type).unwrap_or(PacketType::Drain)
}

/// Both directions of an established connection, in one task.
struct Bridge {
    connect_id: i64,
    /// A DATA payload not yet fully written towards the node.
    pending: Bytes,
    /// Scratch buffer for reads from a peer replica (held only while data arrives).
    scratch: BytesMut,
    node_done: bool,
    to_node: u64,
    from_node: u64,
    to_agent: metrics::Counter,
    from_agent: metrics::Counter,
}

impl Bridge {
    fn new(tenant: &str, connect_id: i64) -> Self {
        Self {
            connect_id,
            pending: Bytes::new(),
            scratch: BytesMut::new(),
            node_done: false,
            to_node: 0,
            from_node: 0,
            to_agent: metrics::counter!(BYTES, "tenant" => tenant.to_owned(), "direction" => "to_agent"),
            from_agent: metrics::counter!(BYTES, "tenant" => tenant.to_owned(), "direction" => "from_agent"),
        }
    }

    async fn run<B>(&mut self, inbound: &mut MessageReader<B>, node: &mut DialedStream, out: &mut Outbound) -> End
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: std::fmt::Display,
    {
        poll_fn(|cx| {
            // Either direction may end the connection; each makes what progress it can.
            if let Poll::Ready(end) = self.poll_to_node(cx, inbound, node) {
                return Poll::Ready(end);
            }
            self.poll_from_node(cx, node, out)
        })
        .await
    }

    /// Client -> node: the next DATA packet is taken only when the previous one is written.
    fn poll_to_node<B>(
        &mut self,
        cx: &mut Context<'_>,
        inbound: &mut MessageReader<B>,
        node: &mut DialedStream,
    ) -> Poll<End>
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: std::fmt::Display,
    {
        loop {
            while !self.pending.is_empty() {
                match Pin::new(&mut *node).poll_write(cx, &self.pending) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(End::NodeFailed(io::ErrorKind::WriteZero.into())),
                    Poll::Ready(Ok(n)) => {
                        self.pending.advance(n);
                        self.to_node += n as u64;
                        self.to_agent.increment(n as u64);
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(End::NodeFailed(e)),
                    Poll::Pending => return Poll::Pending,
                }
            }
            let packet = match ready!(inbound.poll_next(cx)) {
                Ok(Some(packet)) => packet,
                Ok(None) => return Poll::Ready(End::ClientDone),
                Err(e) => return Poll::Ready(End::ClientFailed(e)),
            };
            match (kind(&packet), packet.payload) {
                (PacketType::Data, Some(Payload::Data(data))) => {
                    if data.connect_id == 0 {
                        continue;
                    }
                    if data.connect_id != self.connect_id {
                        return Poll::Ready(End::Mismatch(data.connect_id));
                    }
                    self.pending = data.data;
                }
                (PacketType::CloseReq, _) => return Poll::Ready(End::CloseRequested),
                _ => {}
            }
        }
    }

    /// Node -> client: a chunk is taken from the node only when the response can take a frame.
    fn poll_from_node(&mut self, cx: &mut Context<'_>, node: &mut DialedStream, out: &mut Outbound) -> Poll<End> {
        if self.node_done {
            return Poll::Pending;
        }
        loop {
            match out.tx.poll_reserve(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(_)) => return Poll::Ready(End::ClientGone),
                Poll::Pending => return Poll::Pending,
            }
            let chunk = match ready!(self.poll_chunk(cx, node)) {
                Ok(Some(chunk)) => chunk,
                Ok(None) => {
                    self.node_done = true;
                    out.tx.abort_send();
                    return Poll::Ready(End::NodeClosed);
                }
                Err(e) => return Poll::Ready(End::NodeFailed(e)),
            };
            self.from_node += chunk.len() as u64;
            self.from_agent.increment(chunk.len() as u64);
            let head = codec::data_head(self.connect_id, chunk.len());
            if out.tx.send_item(Frame::data(head.chain(chunk))).is_err() {
                return Poll::Ready(End::ClientGone);
            }
        }
    }

    /// The next bytes from the node, without a copy from an agent's stream.
    fn poll_chunk(&mut self, cx: &mut Context<'_>, node: &mut DialedStream) -> Poll<io::Result<Option<Bytes>>> {
        match node {
            DialedStream::Local(stream) => stream.poll_recv_chunk(cx, MAX_CHUNK),
            DialedStream::Peer(stream) => {
                if self.scratch.capacity() < PEER_READ / 4 {
                    self.scratch = BytesMut::with_capacity(PEER_READ);
                }
                match tokio_util::io::poll_read_buf(Pin::new(stream), cx, &mut self.scratch) {
                    Poll::Pending => {
                        // Idle: hold no buffer.
                        self.scratch = BytesMut::new();
                        Poll::Pending
                    }
                    Poll::Ready(Ok(0)) => Poll::Ready(Ok(None)),
                    Poll::Ready(Ok(_)) => Poll::Ready(Ok(Some(self.scratch.split().freeze()))),
                    Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                }
            }
        }
    }
}
