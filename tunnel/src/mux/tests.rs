use super::*;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

fn pair(settings: &MuxSettings) -> ((Session, Incoming), (Session, Incoming)) {
    let (a, b) = tokio::io::duplex(1 << 20);
    let (client, client_in, client_driver) = start(ByteLink::new(a), Role::Client, settings);
    let (server, server_in, server_driver) = start(ByteLink::new(b), Role::Server, settings);
    tokio::spawn(client_driver);
    tokio::spawn(server_driver);
    ((client, client_in), (server, server_in))
}

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), future).await.unwrap_or_else(|_| panic!("timed out: {what}"))
}

#[tokio::test]
async fn streams_open_both_ways_and_half_close() {
    let ((client, mut client_in), (server, mut server_in)) = pair(&MuxSettings::default());
    let mut out = client.open().await.unwrap();
    out.write_all(b"ping").await.unwrap();
    out.shutdown().await.unwrap();
    let mut inbound = server_in.accept().await.unwrap();
    let mut got = Vec::new();
    inbound.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"ping");
    // Half-closed by the client, the stream still carries the answer back.
    inbound.write_all(b"pong").await.unwrap();
    inbound.shutdown().await.unwrap();
    let mut answer = Vec::new();
    out.read_to_end(&mut answer).await.unwrap();
    assert_eq!(answer, b"pong");

    let mut reverse = server.open().await.unwrap();
    assert_eq!(reverse.id() % 2, 0, "the server opens even stream ids");
    reverse.write_all(b"x").await.unwrap();
    let mut at_client = client_in.accept().await.unwrap();
    let mut one = [0u8; 1];
    at_client.read_exact(&mut one).await.unwrap();
    assert_eq!(&one, b"x");
    assert!(client.open_streams() >= 1);
}

#[tokio::test]
async fn bulk_data_arrives_intact_both_ways_at_once() {
    let ((client, _), (_server, mut server_in)) = pair(&MuxSettings::default());
    let payload: Vec<u8> = (0..6 * 1024 * 1024).map(|i: u32| (i % 251) as u8).collect();
    let out = client.open().await.unwrap();
    let (mut out_read, mut out_write) = tokio::io::split(out);
    let sent = payload.clone();
    tokio::spawn(async move {
        out_write.write_all(&sent).await.unwrap();
        out_write.shutdown().await.unwrap();
    });
    let writer = tokio::spawn(async move {
        // Read while writing: an echo with neither side reading would fill both windows.
        let mut back = Vec::new();
        out_read.read_to_end(&mut back).await.unwrap();
        back
    });
    let mut inbound = server_in.accept().await.unwrap();
    let (mut read, mut write) = tokio::io::split(&mut inbound);
    let echo = async {
        let copied = tokio::io::copy(&mut read, &mut write).await.unwrap();
        write.shutdown().await.unwrap();
        copied
    };
    assert_eq!(within("echo", echo).await, payload.len() as u64);
    assert_eq!(within("writer", writer).await.unwrap(), payload);
}

#[tokio::test]
async fn a_stalled_stream_does_not_block_the_others() {
    let ((client, _), (_server, mut server_in)) = pair(&MuxSettings::default());
    // Stream 1: the receiver never reads; the sender fills the stream window and blocks.
    let mut stalled = client.open().await.unwrap();
    let stalled_writer = tokio::spawn(async move {
        let chunk = vec![1u8; 64 * 1024];
        loop {
            if stalled.write_all(&chunk).await.is_err() {
                break;
            }
        }
    });
    let _unread = server_in.accept().await.unwrap();
    // Stream 2 still moves 8 MiB.
    let mut busy = client.open().await.unwrap();
    let payload = vec![2u8; 8 << 20];
    let sender = tokio::spawn(async move {
        busy.write_all(&payload).await.unwrap();
        busy.shutdown().await.unwrap();
    });
    let mut other = server_in.accept().await.unwrap();
    let mut got = Vec::new();
    within("the busy stream", other.read_to_end(&mut got)).await.unwrap();
    assert_eq!(got.len(), 8 << 20);
    sender.await.unwrap();
    assert!(!stalled_writer.is_finished(), "the stalled stream is still blocked on its own window");
    stalled_writer.abort();
}

#[tokio::test]
async fn the_stream_limit_is_enforced() {
    let settings = MuxSettings { max_streams: 2, ..MuxSettings::default() };
    let ((client, _), (_server, mut server_in)) = pair(&settings);
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = client.open().await.unwrap();
        s.write_all(b"x").await.unwrap();
        held.push(s);
        held.push(server_in.accept().await.unwrap());
    }
    assert!(matches!(client.open().await, Err(MuxError::TooManyStreams)));
    // A dropped stream frees its slot.
    held.truncate(2);
    assert!(client.open().await.is_ok());
}

#[tokio::test]
async fn closing_ends_the_session_on_both_sides() {
    let ((client, _client_in), (server, mut server_in)) = pair(&MuxSettings::default());
    let mut open = client.open().await.unwrap();
    open.write_all(b"x").await.unwrap();
    let mut accepted = server_in.accept().await.unwrap();
    client.close();
    within("client end", client.closed()).await;
    within("server end", server.closed()).await;
    assert!(server_in.accept().await.is_none());
    assert!(matches!(client.open().await, Err(MuxError::Closed)));
    // Streams of an ended session fail instead of pretending a clean end of stream.
    let mut byte = [0u8; 1];
    assert_eq!(accepted.read_exact(&mut byte).await.unwrap(), 1, "what arrived is still delivered");
    let err = accepted.read(&mut byte).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
    assert!(open.write_all(b"more").await.is_err());
}

/// The defect behind an interrupted `kubectl logs -f` leaving the node-side connection open: one
/// side half-closes, the other keeps writing until it runs out of credit, then the first side
/// drops the stream without reading. The writer must fail at once instead of waiting forever.
#[tokio::test]
async fn dropping_a_half_closed_stream_resets_it_and_frees_a_blocked_writer() {
    let ((client, _), (server, mut server_in)) = pair(&MuxSettings::default());
    let mut kas_side = client.open().await.unwrap();
    kas_side.write_all(b"GET /logs?follow=true").await.unwrap();
    kas_side.shutdown().await.unwrap();
    let mut node_side = server_in.accept().await.unwrap();
    let mut request = Vec::new();
    node_side.read_to_end(&mut request).await.unwrap();
    let writer = tokio::spawn(async move {
        let chunk = vec![b'l'; 64 * 1024];
        loop {
            if let Err(e) = node_side.write_all(&chunk).await {
                return e;
            }
        }
    });
    // The writer fills the 256 KiB window and blocks on credit.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!writer.is_finished());
    drop(kas_side);
    let err = within("the blocked writer to fail", writer).await.unwrap();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionReset);
    within("both sides to forget the stream", async {
        while client.open_streams() + server.open_streams() > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

#[tokio::test]
async fn data_sent_before_a_reset_is_delivered_then_the_reset_is_an_error() {
    let ((client, _), (_server, mut server_in)) = pair(&MuxSettings::default());
    let mut opener = client.open().await.unwrap();
    opener.write_all(b"dial 10.0.0.5:22").await.unwrap();
    let mut answerer = server_in.accept().await.unwrap();
    let mut request = [0u8; 16];
    answerer.read_exact(&mut request).await.unwrap();
    answerer.write_all(b"refused: not allowed").await.unwrap();
    drop(answerer);
    let mut answer = [0u8; 20];
    opener.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"refused: not allowed");
    let err = opener.read(&mut [0u8; 8]).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "a reset is not a clean end of stream");
    assert_eq!(opener.write(b"x").await.unwrap_err().kind(), io::ErrorKind::ConnectionReset);
}

#[tokio::test]
async fn a_finished_stream_is_closed_without_a_reset() {
    let ((client, _), (_server, mut server_in)) = pair(&MuxSettings::default());
    let mut a = client.open().await.unwrap();
    a.write_all(b"q").await.unwrap();
    a.shutdown().await.unwrap();
    let mut b = server_in.accept().await.unwrap();
    b.write_all(b"a").await.unwrap();
    b.shutdown().await.unwrap();
    let mut got = Vec::new();
    b.read_to_end(&mut got).await.unwrap();
    drop(b);
    let mut answer = Vec::new();
    a.read_to_end(&mut answer).await.unwrap();
    assert_eq!(answer, b"a");
}

#[test]
fn windows_grow_when_the_window_limits_the_stream_and_only_within_the_budget() {
    let cell = StreamCell::new(1, Flags::NONE, DEFAULT_WINDOW);
    let mut st = cell.lock();
    let rtt = Duration::from_millis(50);
    let mut budget = 10 * 1024 * 1024;
    let half = DEFAULT_WINDOW / 2;
    let read_half = |st: &mut StreamState| {
        st.recv_credit -= half;
        st.consumed += half;
    };
    // The first grant has nothing to compare with: no growth.
    read_half(&mut st);
    assert_eq!(st.take_window_update(&mut budget, rtt), half);
    // Half a window read again within two round trips: the window limits the stream; double it.
    read_half(&mut st);
    assert_eq!(st.take_window_update(&mut budget, rtt), half + DEFAULT_WINDOW);
    assert_eq!(st.window, 2 * DEFAULT_WINDOW);
    assert_eq!(budget, 10 * 1024 * 1024 - DEFAULT_WINDOW as usize);
    assert_eq!(st.recv_credit + st.recv_len as u32 + st.consumed, st.window, "credit accounting holds");
    // No round trip measured yet: no growth.
    read_half(&mut st);
    let window = st.window;
    assert_eq!(st.take_window_update(&mut budget, Duration::ZERO), half);
    assert_eq!(st.window, window);
    // A slow reader (the previous grant was long ago): no growth.
    st.last_update = Some(std::time::Instant::now() - Duration::from_secs(1));
    read_half(&mut st);
    assert_eq!(st.take_window_update(&mut budget, rtt), half);
    // An exhausted budget stops growth.
    read_half(&mut st);
    let mut empty = 0;
    assert_eq!(st.take_window_update(&mut empty, rtt), half);
    assert_eq!(st.window, window);
}

/// A hand-driven peer speaking raw frames, to check what goes over the wire.
struct RawPeer {
    io: DuplexStream,
    reader: FrameReader,
}

impl RawPeer {
    fn start(
        role: Role,
        settings: &MuxSettings,
    ) -> (Self, Session, Incoming, tokio::task::JoinHandle<Result<(), MuxError>>) {
        let (a, b) = tokio::io::duplex(1 << 20);
        let (session, incoming, driver) = start(ByteLink::new(a), role, settings);
        (Self { io: b, reader: FrameReader::new() }, session, incoming, tokio::spawn(driver))
    }

    async fn send(&mut self, header: Header, body: &[u8]) {
        let mut out = BytesMut::new();
        put_frame(&mut out, header, body);
        self.io.write_all(&out).await.unwrap();
    }

    /// The next frame, skipping the session's own round-trip pings.
    async fn next(&mut self) -> Option<Frame> {
        loop {
            if let Some(frame) = self.reader.next_frame().unwrap() {
                if frame.header.kind == Kind::Ping && !frame.header.flags.contains(Flags::ACK) {
                    continue;
                }
                return Some(frame);
            }
            let mut buf = vec![0u8; 64 * 1024];
            let n = within("a frame", self.io.read(&mut buf)).await.unwrap();
            if n == 0 {
                return None;
            }
            buf.truncate(n);
            self.reader.push(BytesMut::from(&buf[..]));
        }
    }

    /// The next frame that is not a window update.
    async fn next_non_update(&mut self) -> Option<Frame> {
        loop {
            let frame = self.next().await?;
            if frame.header.kind != Kind::WindowUpdate {
                return Some(frame);
            }
        }
    }
}

#[tokio::test]
async fn data_for_a_dropped_stream_is_answered_with_a_reset() {
    let (mut peer, _session, mut incoming, _driver) = RawPeer::start(Role::Server, &MuxSettings::default());
    peer.send(Header::data(1, 5, Flags::SYN), b"hello").await;
    let stream = incoming.accept().await.unwrap();
    drop(stream);
    let reset = peer.next().await.unwrap();
    assert_eq!(reset.header, Header::data(1, 0, Flags::RST | Flags::ACK));
    // The peer did not see it yet and sends more: it is told again.
    peer.send(Header::data(1, 3, Flags::NONE), b"abc").await;
    assert_eq!(peer.next().await.unwrap().header, Header::data(1, 0, Flags::RST));
}

#[tokio::test]
async fn a_session_measures_the_round_trip_with_a_ping() {
    let (mut peer, session, _incoming, _driver) = RawPeer::start(Role::Server, &MuxSettings::default());
    let mut buf = vec![0u8; 1024];
    let n = within("the ping", peer.io.read(&mut buf)).await.unwrap();
    peer.reader.push(BytesMut::from(&buf[..n]));
    let ping = peer.reader.next_frame().unwrap().unwrap();
    assert_eq!((ping.header.kind, ping.header.flags), (Kind::Ping, Flags::SYN));
    tokio::time::sleep(Duration::from_millis(30)).await;
    peer.send(Header::ping(ping.header.length, Flags::ACK), &[]).await;
    within("the round trip", async {
        while session.shared.rtt().is_zero() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(session.shared.rtt() >= Duration::from_millis(30));
}

#[tokio::test]
async fn pings_are_answered_and_the_first_frame_acknowledges_a_stream() {
    let (mut peer, _session, mut incoming, _driver) = RawPeer::start(Role::Server, &MuxSettings::default());
    peer.send(Header::ping(77, Flags::SYN), &[]).await;
    assert_eq!(peer.next().await.unwrap().header, Header::ping(77, Flags::ACK));
    peer.send(Header::window_update(3, 1000, Flags::SYN), &[]).await;
    let mut stream = incoming.accept().await.unwrap();
    stream.write_all(b"hi").await.unwrap();
    let first = peer.next().await.unwrap();
    assert_eq!(first.header, Header::data(3, 2, Flags::ACK));
    assert_eq!(&first.body[..], b"hi");
    stream.shutdown().await.unwrap();
    assert_eq!(peer.next().await.unwrap().header, Header::data(3, 0, Flags::FIN));
}

#[tokio::test]
async fn an_outbound_stream_is_announced_by_its_first_frame_and_respects_credit() {
    let (mut peer, session, _incoming, _driver) = RawPeer::start(Role::Client, &MuxSettings::default());
    let mut stream = session.open().await.unwrap();
    assert_eq!(stream.id(), 1);
    let big = vec![9u8; 300 * 1024];
    let writer = tokio::spawn(async move {
        stream.write_all(&big).await.unwrap();
        stream
    });
    let mut received = 0;
    let mut first = true;
    while received < DEFAULT_WINDOW as usize {
        let frame = peer.next_non_update().await.unwrap();
        assert_eq!(frame.header.flags.contains(Flags::SYN), first, "only the first frame carries SYN");
        first = false;
        received += frame.body.len();
    }
    assert_eq!(received, DEFAULT_WINDOW as usize, "the sender stops at the peer's window");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!writer.is_finished());
    peer.send(Header::window_update(1, 64 * 1024, Flags::ACK), &[]).await;
    let _stream = within("the writer to finish", writer).await.unwrap();
}

#[tokio::test]
async fn protocol_violations_end_the_session_with_a_go_away() {
    for (what, header, body) in [
        (
            "more data than the window",
            Header::data(1, DEFAULT_WINDOW + 1, Flags::SYN),
            vec![0u8; DEFAULT_WINDOW as usize + 1],
        ),
        ("a stream id of the wrong side", Header::data(2, 1, Flags::SYN), vec![0u8]),
        ("data on stream 0", Header::data(0, 1, Flags::NONE), vec![0u8]),
    ] {
        let (mut peer, session, _incoming, driver) = RawPeer::start(Role::Server, &MuxSettings::default());
        peer.send(header, &body).await;
        let result = within(what, driver).await.unwrap();
        assert!(matches!(result, Err(MuxError::Protocol(_))), "{what}: {result:?}");
        assert!(session.is_closed(), "{what}");
        let go_away = peer.next().await.unwrap();
        assert_eq!(go_away.header, Header::go_away(GoAway::ProtocolError), "{what}");
    }
    // A header that is not yamux at all.
    let (mut peer, _session, _incoming, driver) = RawPeer::start(Role::Server, &MuxSettings::default());
    peer.io.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    assert!(matches!(within("garbage", driver).await.unwrap(), Err(MuxError::Protocol(_))));
}

#[tokio::test]
async fn streams_beyond_the_accept_backlog_are_reset() {
    let settings = MuxSettings { accept_backlog: 1, ..MuxSettings::default() };
    let (mut peer, _session, mut incoming, _driver) = RawPeer::start(Role::Server, &settings);
    peer.send(Header::data(1, 1, Flags::SYN), b"a").await;
    peer.send(Header::data(3, 1, Flags::SYN), b"b").await;
    assert_eq!(peer.next().await.unwrap().header, Header::data(3, 0, Flags::RST | Flags::ACK));
    let first = incoming.accept().await.unwrap();
    assert_eq!(first.id(), 1);
}

/// Drives a `yamux` crate connection: accepted streams echo, and `open` requests open streams.
fn yamux_peer(
    io: DuplexStream,
    mode: yamux::Mode,
) -> tokio::sync::mpsc::Sender<tokio::sync::oneshot::Sender<yamux::Stream>> {
    use futures::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio_util::compat::TokioAsyncReadCompatExt;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<tokio::sync::oneshot::Sender<yamux::Stream>>(8);
    let mut connection = yamux::Connection::new(io.compat(), yamux::Config::default(), mode);
    tokio::spawn(async move {
        let mut waiting: Option<tokio::sync::oneshot::Sender<yamux::Stream>> = None;
        poll_fn(|cx| {
            loop {
                if waiting.is_none()
                    && let Poll::Ready(Some(reply)) = rx.poll_recv(cx)
                {
                    waiting = Some(reply);
                }
                let Some(reply) = waiting.take() else { break };
                match connection.poll_new_outbound(cx) {
                    Poll::Ready(Ok(stream)) => {
                        let _ = reply.send(stream);
                    }
                    Poll::Ready(Err(_)) => return Poll::Ready(()),
                    Poll::Pending => {
                        waiting = Some(reply);
                        break;
                    }
                }
            }
            loop {
                match connection.poll_next_inbound(cx) {
                    Poll::Ready(Some(Ok(stream))) => {
                        tokio::spawn(async move {
                            let (mut read, mut write) = stream.split();
                            let _ = futures::io::copy(&mut read, &mut write).await;
                            let _ = write.close().await;
                        });
                    }
                    Poll::Ready(_) => return Poll::Ready(()),
                    Poll::Pending => return Poll::Pending,
                }
            }
        })
        .await;
    });
    tx
}

#[tokio::test]
async fn interoperates_with_the_yamux_crate_as_either_side() {
    let payload: Vec<u8> = (0..3 * 1024 * 1024).map(|i: u32| (i % 253) as u8).collect();
    for (our_role, their_mode) in [(Role::Server, yamux::Mode::Client), (Role::Client, yamux::Mode::Server)] {
        let (ours, theirs) = tokio::io::duplex(1 << 20);
        let (session, _incoming, driver) = start(ByteLink::new(ours), our_role, &MuxSettings::default());
        tokio::spawn(driver);
        let _opener = yamux_peer(theirs, their_mode);
        // Our stream to their echo: 3 MiB out, half-close, 3 MiB back, clean end.
        let mut stream = session.open().await.unwrap();
        let (mut read, mut write) = tokio::io::split(&mut stream);
        let sent = payload.clone();
        let send = async move {
            write.write_all(&sent).await.unwrap();
            write.shutdown().await.unwrap();
        };
        let mut back = Vec::new();
        let receive = read.read_to_end(&mut back);
        let (_, received) = within("echo through yamux", futures::future::join(send, receive)).await;
        received.unwrap();
        assert_eq!(back, payload, "{our_role:?}");
    }
}

#[tokio::test]
async fn a_yamux_crate_peer_blocked_on_a_dropped_half_closed_stream_is_freed() {
    use futures::AsyncWriteExt as _;
    let (ours, theirs) = tokio::io::duplex(1 << 20);
    let (_session, mut incoming, driver) = start(ByteLink::new(ours), Role::Server, &MuxSettings::default());
    tokio::spawn(driver);
    let opener = yamux_peer(theirs, yamux::Mode::Client);
    let (reply, stream) = tokio::sync::oneshot::channel();
    opener.send(reply).await.unwrap();
    let mut theirs = stream.await.unwrap();
    theirs.write_all(b"request").await.unwrap();
    let mut ours = incoming.accept().await.unwrap();
    ours.shutdown().await.unwrap();
    let mut request = [0u8; 7];
    ours.read_exact(&mut request).await.unwrap();
    let writer = tokio::spawn(async move {
        let chunk = vec![0u8; 64 * 1024];
        loop {
            if theirs.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!writer.is_finished(), "the yamux writer is blocked on credit");
    drop(ours);
    within("the yamux writer to see the reset", writer).await.unwrap();
}

#[tokio::test]
async fn abandoned_resolves_on_a_reset_or_the_sessions_end_and_not_before() {
    let ((client, _), (server, mut server_in)) = pair(&MuxSettings::default());
    let mut out = client.open().await.unwrap();
    out.write_all(b"dial please").await.unwrap();
    let inbound = server_in.accept().await.unwrap();
    // Data, even a half-close, is not giving up.
    out.shutdown().await.unwrap();
    let early = tokio::time::timeout(Duration::from_millis(200), inbound.abandoned()).await;
    assert!(early.is_err(), "abandoned before the peer gave up");
    drop(out);
    within("abandoned after a reset", inbound.abandoned()).await;

    let mut second = client.open().await.unwrap();
    second.write_all(b"x").await.unwrap();
    let inbound = server_in.accept().await.unwrap();
    client.close();
    within("abandoned when the session ends", inbound.abandoned()).await;
    drop(server);
}

/// A link that counts the batches the session hands it, and how often the session reads it.
struct CountingLink {
    inner: ByteLink<DuplexStream>,
    batches: Arc<AtomicUsize>,
    reads: Arc<AtomicUsize>,
}

impl CountingLink {
    fn new(inner: DuplexStream) -> Self {
        Self { inner: ByteLink::new(inner), batches: Arc::default(), reads: Arc::default() }
    }
}

impl Link for CountingLink {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<BytesMut>>> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.poll_recv(cx)
    }
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.inner.poll_ready(cx)
    }
    fn start_send(&mut self, batch: Batch) -> io::Result<()> {
        self.batches.fetch_add(1, Ordering::SeqCst);
        self.inner.start_send(batch)
    }
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.inner.poll_flush(cx)
    }
    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.inner.poll_close(cx)
    }
}

/// Requests arriving together on many connections: each stream's task queues its frame and wakes
/// the driver, which a multi-threaded runtime runs next (its "LIFO slot"). Without deferring its
/// write once, the driver would send every frame on its own (one write, TLS record and wake-up of
/// the peer each); with it, the frames leave together.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn frames_queued_by_many_streams_at_once_leave_in_a_few_writes() {
    const STREAMS: usize = 32;
    let (a, b) = tokio::io::duplex(1 << 20);
    let link = CountingLink::new(a);
    let batches = link.batches.clone();
    let (client, _client_in, client_driver) = start(link, Role::Client, &MuxSettings::default());
    let (_server, mut server_in, server_driver) = start(ByteLink::new(b), Role::Server, &MuxSettings::default());
    tokio::spawn(client_driver);
    tokio::spawn(server_driver);

    let (go_tx, go_rx) = tokio::sync::watch::channel(false);
    let mut writers = Vec::new();
    for _ in 0..STREAMS {
        let mut stream = client.open().await.unwrap();
        let mut go = go_rx.clone();
        writers.push(tokio::spawn(async move {
            go.wait_for(|go| *go).await.unwrap();
            stream.write_all(&[7u8; 100]).await.unwrap();
            stream
        }));
    }
    // Let the session's first ping go out and every writer wait.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = batches.load(Ordering::SeqCst);
    // Wake all writers from a task on the runtime's worker, as its I/O driver would.
    tokio::spawn(async move { go_tx.send(true).unwrap() }).await.unwrap();
    for _ in 0..STREAMS {
        let mut accepted = within("a stream is accepted", server_in.accept()).await.unwrap();
        let mut got = [0u8; 100];
        within("its request arrives", accepted.read_exact(&mut got)).await.unwrap();
        assert_eq!(got, [7u8; 100]);
    }
    let writes = batches.load(Ordering::SeqCst) - before;
    assert!(writes <= 4, "{STREAMS} frames queued together went out in {writes} writes");
    for writer in writers {
        drop(writer.await.unwrap());
    }
}

#[test]
fn a_deferral_that_gains_nothing_backs_off_and_one_that_gains_resets() {
    let mut defer = Defer::default();
    assert!(!defer.put_off(0), "nothing to write, nothing to put off");
    assert!(defer.put_off(100), "a first write is put off once");
    assert!(!defer.put_off(100), "and then written");
    // Nothing was gained: the next opportunity is skipped, then the one after is tried again.
    assert!(!defer.put_off(100));
    assert!(defer.put_off(100));
    assert!(!defer.put_off(100));
    // Two failures in a row: three opportunities skipped.
    let skipped = (0..10).take_while(|_| !defer.put_off(100)).count();
    assert_eq!(skipped, 3);
    // This one gains (another stream queued meanwhile): the next write is put off at once.
    assert!(!defer.put_off(300));
    assert!(defer.put_off(100));
    assert!(!defer.put_off(100));
    // The backoff is bounded.
    for _ in 0..1000 {
        if defer.put_off(100) {
            assert!(!defer.put_off(100));
        }
    }
    let skipped = (0..1000).take_while(|_| !defer.put_off(100)).count();
    assert!(skipped <= DEFER_BACKOFF_MAX as usize, "skipped {skipped}");
}

/// A session-local task runs on the driver's own task (no hand-over between tasks for its
/// stream's bytes); tasks still running when the session ends, and tasks handed over after it
/// ended, run to completion as tasks of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_local_tasks_run_on_the_drivers_task_and_outlive_the_session() {
    let (a, b) = tokio::io::duplex(1 << 20);
    let settings = MuxSettings::default();
    let (client, _client_in, client_driver) = start(ByteLink::new(a), Role::Client, &settings);
    let (server, mut server_in, server_driver) = start(ByteLink::new(b), Role::Server, &settings);
    tokio::spawn(client_driver);
    let server_driver = tokio::spawn(server_driver);
    let driver_task = server_driver.id();

    let mut out = client.open().await.unwrap();
    out.write_all(b"hello").await.unwrap();
    let mut inbound = within("accept", server_in.accept()).await.unwrap();
    let (ran_on, ran_on_rx) = tokio::sync::oneshot::channel();
    let (finished, finished_rx) = tokio::sync::oneshot::channel();
    server.spawn_local(async move {
        let _ = ran_on.send(tokio::task::id());
        let mut word = [0u8; 5];
        inbound.read_exact(&mut word).await.unwrap();
        inbound.write_all(&word).await.unwrap();
        // Waits for more until the session ends under it.
        let mut rest = Vec::new();
        let ended = inbound.read_to_end(&mut rest).await;
        let _ = finished.send(ended.is_err());
    });
    assert_eq!(within("the task runs", ran_on_rx).await.unwrap(), driver_task);
    let mut echo = [0u8; 5];
    within("echo", out.read_exact(&mut echo)).await.unwrap();
    assert_eq!(&echo, b"hello");

    server.close();
    within("the driver stops", server_driver).await.unwrap().unwrap();
    assert!(within("the task finishes", finished_rx).await.unwrap(), "its stream failed when the session ended");

    let (late, late_rx) = tokio::sync::oneshot::channel();
    server.spawn_local(async move {
        let _ = late.send(tokio::task::id());
    });
    assert_ne!(within("a task handed over late runs", late_rx).await.unwrap(), driver_task);
}

/// Request and response through a session-local task, one at a time: each request wakes the
/// driver once (its link has data) and the response leaves in the same poll, so the driver reads
/// its link a few times per exchange. The local task set's own yield once it has polled every
/// task is not taken for a task woken again (it used to make the driver run all its rounds twice).
#[tokio::test(flavor = "current_thread")]
async fn an_exchange_with_a_local_task_costs_one_pass_of_the_driver() {
    const EXCHANGES: usize = 200;
    let (a, b) = tokio::io::duplex(1 << 20);
    let link = CountingLink::new(b);
    let reads = link.reads.clone();
    let settings = MuxSettings::default();
    let (client, _client_in, client_driver) = start(ByteLink::new(a), Role::Client, &settings);
    let (server, mut server_in, server_driver) = start(link, Role::Server, &settings);
    tokio::spawn(client_driver);
    tokio::spawn(server_driver);

    let mut out = client.open().await.unwrap();
    out.write_all(b"hello").await.unwrap();
    let mut inbound = within("accept", server_in.accept()).await.unwrap();
    server.spawn_local(async move {
        let mut word = [0u8; 5];
        while inbound.read_exact(&mut word).await.is_ok() {
            if inbound.write_all(&word).await.is_err() {
                break;
            }
        }
    });
    let mut echo = [0u8; 5];
    within("first echo", out.read_exact(&mut echo)).await.unwrap();
    // Let the first ping's answer and the window updates settle.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let before = reads.load(Ordering::SeqCst);
    for _ in 0..EXCHANGES {
        out.write_all(b"again").await.unwrap();
        within("echo", out.read_exact(&mut echo)).await.unwrap();
        assert_eq!(&echo, b"again");
    }
    let per_exchange = (reads.load(Ordering::SeqCst) - before) as f64 / EXCHANGES as f64;
    assert!(per_exchange <= 3.5, "the driver read its link {per_exchange:.2} times per exchange");
}

/// A driver woken only by a session-local task (bytes read from a node-side socket) sends them
/// without asking the link for bytes it was never told about: the link is read when it woke the
/// driver, not on every wake (that read returned `Pending` once per small request).
#[tokio::test(flavor = "current_thread")]
async fn a_driver_woken_by_a_local_task_does_not_read_its_link() {
    const MESSAGES: usize = 200;
    let (a, b) = tokio::io::duplex(1 << 20);
    let link = CountingLink::new(a);
    let reads = link.reads.clone();
    let settings = MuxSettings::default();
    let (client, _client_in, client_driver) = start(link, Role::Client, &settings);
    let (_server, mut server_in, server_driver) = start(ByteLink::new(b), Role::Server, &settings);
    tokio::spawn(client_driver);
    tokio::spawn(server_driver);

    let mut out = client.open().await.unwrap();
    out.write_all(b"hello").await.unwrap();
    let mut inbound = within("accept", server_in.accept()).await.unwrap();
    let mut word = [0u8; 5];
    within("first message", inbound.read_exact(&mut word)).await.unwrap();
    // The node-side socket: the local task copies what arrives on it into the stream.
    let (mut socket, mut node_side) = tokio::io::duplex(1024);
    client.spawn_local(async move {
        let mut word = [0u8; 5];
        while node_side.read_exact(&mut word).await.is_ok() {
            if out.write_all(&word).await.is_err() {
                break;
            }
        }
    });
    // Let the first ping's answer settle.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let before = reads.load(Ordering::SeqCst);
    for _ in 0..MESSAGES {
        socket.write_all(b"again").await.unwrap();
        within("message", inbound.read_exact(&mut word)).await.unwrap();
        assert_eq!(&word, b"again");
    }
    let reads = reads.load(Ordering::SeqCst) - before;
    assert!(reads < MESSAGES / 10, "the driver read its link {reads} times for {MESSAGES} messages it only sent");
}
