//! A client of the gRPC frontend that behaves as kube-apiserver's (konnectivity-client's
//! single-use tunnel): one HTTP/2 connection and one `Proxy` stream per dial, `DIAL_REQ`, then
//! `DATA` both ways and `CLOSE_REQ`. The dialed connection is an `AsyncRead + AsyncWrite`, so every
//! load-test scenario can run over it.

use std::convert::Infallible;
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use anyhow::Context as _;
use bytes::{Buf, Bytes, BytesMut};
use hyper::body::{Body, Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tether_gateway::frontend::grpc::codec::{self, MessageReader};
use tether_gateway::frontend::grpc::proto::{Packet, PacketType, Payload};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_util::sync::PollSender;

/// A dial through the gRPC frontend.
pub struct GrpcConn {
    tx: PollSender<Bytes>,
    inbound: MessageReader<Incoming>,
    connect_id: i64,
    unread: Bytes,
    closed: bool,
    _connection: tokio::task::JoinHandle<()>,
}

/// The request body: messages as the dial writes them.
struct Outgoing(mpsc::Receiver<Bytes>);

impl Body for Outgoing {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|m| m.map(|b| Ok(Frame::data(b))))
    }
}

/// Dials `target` over `stream` (a connection to a gRPC frontend): `Ok(Err(reason))` when the
/// gateway answered the dial with an error.
pub async fn dial<S>(stream: S, target: &str) -> anyhow::Result<Result<GrpcConn, String>>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(256 * 1024)
        .handshake(TokioIo::new(stream))
        .await
        .context("HTTP/2 handshake with the gRPC frontend")?;
    let connection = tokio::spawn(async move {
        let _ = connection.await;
    });
    let (tx, rx) = mpsc::channel(4);
    let request = http::Request::post("http://localhost/ProxyService/Proxy")
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header(http::header::TE, "trailers")
        .body(Outgoing(rx))?;
    let random = i64::from(fastrand::u32(..)) << 16 | 1;
    tx.send(codec::encode(&Packet::dial_request(target, random))).await.context("sending DIAL_REQ")?;
    let response = sender.send_request(request).await.context("opening the Proxy stream")?;
    anyhow::ensure!(response.status() == http::StatusCode::OK, "gRPC frontend answered HTTP {}", response.status());
    let mut inbound = MessageReader::new(response.into_body());
    let answer = inbound.next().await?.context("the Proxy stream ended before DIAL_RSP")?;
    let Some(Payload::DialResponse(answer)) = answer.payload else {
        anyhow::bail!("expected DIAL_RSP, got packet type {}", answer.r#type);
    };
    anyhow::ensure!(answer.random == random, "DIAL_RSP for another dial");
    if !answer.error.is_empty() {
        return Ok(Err(answer.error));
    }
    Ok(Ok(GrpcConn {
        tx: PollSender::new(tx),
        inbound,
        connect_id: answer.connect_id,
        unread: Bytes::new(),
        closed: false,
        _connection: connection,
    }))
}

impl GrpcConn {
    /// The connection id the gateway gave the dial.
    pub fn connect_id(&self) -> i64 {
        self.connect_id
    }

    fn send(&mut self, cx: &mut Context<'_>, message: Bytes) -> Poll<io::Result<()>> {
        ready!(self.tx.poll_reserve(cx)).map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))?;
        Poll::Ready(self.tx.send_item(message).map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe)))
    }
}

impl AsyncRead for GrpcConn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            if !self.unread.is_empty() {
                let n = self.unread.len().min(buf.remaining());
                buf.put_slice(&self.unread[..n]);
                self.unread.advance(n);
                return Poll::Ready(Ok(()));
            }
            if self.closed {
                return Poll::Ready(Ok(()));
            }
            let packet = ready!(self.inbound.poll_next(cx)).map_err(io::Error::other)?;
            match packet {
                None => self.closed = true,
                Some(packet) => match (PacketType::try_from(packet.r#type), packet.payload) {
                    (Ok(PacketType::Data), Some(Payload::Data(data))) => self.unread = data.data,
                    (Ok(PacketType::CloseRsp), _) => self.closed = true,
                    _ => {}
                },
            }
        }
    }
}

impl AsyncWrite for GrpcConn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let n = buf.len().min(64 * 1024);
        let head = codec::data_head(self.connect_id, n);
        let mut message = BytesMut::with_capacity(head.len() + n);
        message.extend_from_slice(&head);
        message.extend_from_slice(&buf[..n]);
        ready!(self.send(cx, message.freeze()))?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    /// `CLOSE_REQ`: Konnectivity has no half-close, so this ends the connection both ways.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let close = codec::encode(&Packet::close_request(self.connect_id));
        self.send(cx, close)
    }
}

/// Waits until the gateway has answered a `CLOSE_REQ` (or the stream ended).
pub async fn close(mut conn: GrpcConn) -> io::Result<()> {
    use tokio::io::AsyncWriteExt;
    conn.shutdown().await?;
    let mut sink = [0u8; 4096];
    loop {
        let mut buf = ReadBuf::new(&mut sink);
        poll_fn(|cx| Pin::new(&mut conn).poll_read(cx, &mut buf)).await?;
        if buf.filled().is_empty() {
            return Ok(());
        }
    }
}
