//! The multiplexer session: many independent, flow-controlled streams over one link.
//!
//! The wire format is yamux (the HashiCorp specification; [`frame`]), so agents and gateways
//! built on the `yamux` crate interoperate with this implementation. Tether has its own because of
//! what a tunnel for kube-apiserver needs from the stream life cycle: a stream that is dropped
//! before both sides have finished is *reset*, always, so the peer frees it at once. The `yamux`
//! crate (0.14) sends nothing for a stream dropped after its write side was closed, and ignores data
//! for streams it no longer knows: a peer blocked on credit for such a stream waited forever (an
//! interrupted `kubectl logs -f` left the node-side connection open). It also copies and zero-fills
//! every frame; here a frame body is a slice of the message it arrived in.
//!
//! Everything else sees [`Session`] (open streams, close), [`Incoming`] (accept streams) and
//! [`MuxStream`] (a tokio `AsyncRead + AsyncWrite`). One task, the [`Driver`] returned by
//! [`start`], owns the [`Link`]: it reads frames and hands data to streams, and sends the frames
//! that streams queue in the session's output buffer, all queued frames in one batch (one
//! WebSocket message, one TLS write) per round.
//!
//! Bounds: a stream's receive buffer is bounded by its window (256 KiB, grown while the reader
//! keeps up, up to [`MAX_STREAM_WINDOW`], out of a per-session budget); writers wait while the
//! output buffer holds [`OUT_HIGH_WATER`] bytes; the driver stops reading while control frames it
//! owes the peer exceed [`OUT_HARD_LIMIT`]; inbound streams beyond the accept backlog or the stream
//! limit are reset.

pub mod frame;
pub mod link;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes, BytesMut};
use futures::future::poll_fn;
use futures::stream::FuturesUnordered;
use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use frame::{DEFAULT_WINDOW, Flags, Frame, FrameReader, GoAway, Header, Kind, MAX_BODY, put_frame};
pub use link::{Batch, ByteLink, Link};

/// Which end of the session this is. The agent is the client (odd stream ids), the gateway the
/// server (even ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The end that dialed the connection.
    Client,
    /// The end that accepted it.
    Server,
}

/// Multiplexer tuning.
#[derive(Debug, Clone)]
pub struct MuxSettings {
    /// Most concurrent streams on one session (both directions).
    pub max_streams: usize,
    /// Largest data frame sent; bigger writes are split.
    pub split_send_size: usize,
    /// Inbound streams queued for the acceptor before new ones are reset.
    pub accept_backlog: usize,
    /// How far, in bytes and in total, the session's streams may grow their receive windows
    /// beyond the initial 256 KiB each. A stream's window doubles while its reader keeps up and
    /// the sender runs out of credit, so a stream converges on the link's bandwidth-delay product;
    /// a stream kept at 256 KiB moves at most 256 KiB per round trip (12.5 MiB/s at 20 ms). A window
    /// is credit, not an allocation: bytes are buffered only while the local reader lags.
    pub window_growth: usize,
}

/// Default of [`MuxSettings::window_growth`]: 32 MiB per session.
pub const DEFAULT_WINDOW_GROWTH: usize = 32 * 1024 * 1024;
/// Largest receive window one stream grows to.
pub const MAX_STREAM_WINDOW: u32 = 16 * 1024 * 1024;
/// Writers wait while the output buffer holds this much.
pub const OUT_HIGH_WATER: usize = 512 * 1024;
/// The driver stops reading while frames it owes the peer exceed this (a peer that sends but never
/// reads cannot make the session buffer answers without bound).
pub const OUT_HARD_LIMIT: usize = 8 * 1024 * 1024;
/// Largest batch handed to the link at once (peers accept WebSocket messages up to 4 MiB).
const MAX_BATCH: usize = 1024 * 1024;
/// Size of a new output segment for small frames.
const SEGMENT_SIZE: usize = 16 * 1024;
/// Size of the first segment of an empty output: most batches of small frames hold one frame (a
/// request, a window update), and an allocation this small takes the allocator's fast path.
const FIRST_SEGMENT_SIZE: usize = 1024;
/// Bodies handed over from this size on stay in their own buffer; smaller ones are copied.
pub(crate) const OWNED_BODY_MIN: usize = 2048;
/// Rounds of reading and writing before the driver yields to other tasks.
const ROUNDS_PER_POLL: usize = 16;

impl Default for MuxSettings {
    fn default() -> Self {
        // 64 KiB frames: big enough that a frame's header and its bookkeeping are noise, small
        // enough that several fit in a 256 KiB window, so a transfer never becomes stop-and-wait.
        Self {
            max_streams: 8192,
            split_send_size: 64 * 1024,
            accept_backlog: 1024,
            window_growth: DEFAULT_WINDOW_GROWTH,
        }
    }
}

/// Why a stream could not be opened, or why a session ended.
#[derive(Debug, thiserror::Error)]
pub enum MuxError {
    /// The session is closed or broken.
    #[error("tunnel session is closed")]
    Closed,
    /// The session holds its maximum number of streams.
    #[error("tunnel session has reached its stream limit")]
    TooManyStreams,
    /// The peer broke the multiplexer protocol.
    #[error("multiplexer protocol error: {0}")]
    Protocol(String),
    /// The link failed.
    #[error("tunnel link failed: {0}")]
    Link(#[from] io::Error),
    /// Any other multiplexer failure.
    #[error("tunnel session error: {0}")]
    Other(String),
}

/// A handle to a running session; cheap to clone.
#[derive(Clone)]
pub struct Session {
    shared: Arc<SessionShared>,
}

impl Session {
    /// Opens a new outbound stream. The peer learns of it with its first frame (the opener always
    /// writes first in Tether's protocol), so opening costs no round trip.
    pub async fn open(&self) -> Result<MuxStream, MuxError> {
        let shared = &self.shared;
        let mut inner = shared.lock();
        if inner.ended || inner.going_away {
            return Err(MuxError::Closed);
        }
        if inner.streams.len() >= shared.max_streams {
            return Err(MuxError::TooManyStreams);
        }
        let id = inner.next_id;
        inner.next_id = id.checked_add(2).ok_or(MuxError::Closed)?;
        let cell = Arc::new(StreamCell::new(id, Flags::SYN, DEFAULT_WINDOW));
        inner.streams.insert(id, cell.clone());
        drop(inner);
        Ok(MuxStream::new(cell, shared.clone()))
    }

    /// Asks the driver to close the session: a go-away goes out, then the link closes. Streams
    /// still open fail.
    pub fn close(&self) {
        self.shared.close_requested.store(true, Ordering::Release);
        self.shared.driver.wake();
    }

    /// Whether the session has ended.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.is_cancelled()
    }

    /// Resolves when the session has ended.
    pub async fn closed(&self) {
        self.shared.closed.cancelled().await;
    }

    /// Streams currently open on this session, both directions.
    pub fn open_streams(&self) -> usize {
        self.shared.open_streams.load(Ordering::Relaxed)
    }

    /// Bytes the session has written to and read from its link so far (frames and their
    /// headers): sampled to tell a busy session from a quiet one.
    pub fn link_bytes(&self) -> u64 {
        self.shared.link_bytes.load(Ordering::Relaxed)
    }

    /// Runs `task` on the session's own task, beside the driver: for the work of one of its
    /// streams (a splice between the stream and a socket). The stream's bytes then pass between
    /// the socket and the link without a hand-over between tasks, which on a multi-threaded
    /// runtime can mean a wake-up of another worker thread per chunk; frames that such tasks
    /// queue together leave in one write. The task must not block. If the session has ended (or
    /// ends first), the task runs as a task of its own instead, so it always runs to completion
    /// (its streams fail at once).
    pub fn spawn_local<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let task: LocalTask = Box::pin(task);
        let mut inner = self.shared.lock();
        if inner.ended {
            drop(inner);
            spawn_detached(task);
            return;
        }
        inner.spawned.push(task);
        drop(inner);
        self.shared.spawn_pending.store(true, Ordering::Release);
        self.shared.driver.wake();
    }
}

/// A task run by a session's own task ([`Session::spawn_local`]).
type LocalTask = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs a session-local task on its own, once its session has stopped.
fn spawn_detached(task: LocalTask) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(task);
    }
}

/// The receiving end for streams the peer opens.
pub struct Incoming {
    // Boxed: a channel allocates its slots in blocks up front, so small slots keep an idle
    // session small (this matters with tens of thousands of agents).
    rx: mpsc::Receiver<Box<MuxStream>>,
}

impl Incoming {
    /// The next stream opened by the peer; `None` once the session has ended.
    pub async fn accept(&mut self) -> Option<MuxStream> {
        self.rx.recv().await.map(|stream| *stream)
    }
}

/// The task that drives the session; spawn it. It resolves when the session ends.
pub type Driver = Pin<Box<dyn Future<Output = Result<(), MuxError>> + Send>>;

/// Starts a session over `link` and returns its handle, its inbound streams and its driver.
pub fn start<L: Link>(link: L, role: Role, settings: &MuxSettings) -> (Session, Incoming, Driver) {
    let (in_tx, in_rx) = mpsc::channel(settings.accept_backlog.max(1));
    let shared = Arc::new(SessionShared {
        inner: Mutex::new(Inner {
            streams: HashMap::new(),
            next_id: match role {
                Role::Client => 1,
                Role::Server => 2,
            },
            out: Batch::new(),
            room_waiters: Vec::new(),
            growth_left: settings.window_growth,
            ended: false,
            going_away: false,
            spawned: Vec::new(),
        }),
        driver: AtomicWaker::new(),
        spawn_pending: std::sync::atomic::AtomicBool::new(false),
        in_local: std::sync::atomic::AtomicBool::new(false),
        open_streams: AtomicUsize::new(0),
        closed: CancellationToken::new(),
        close_requested: std::sync::atomic::AtomicBool::new(false),
        role,
        max_streams: settings.max_streams.max(1),
        split_send_size: settings.split_send_size.clamp(1024, MAX_BODY as usize),
        rtt_micros: std::sync::atomic::AtomicU64::new(0),
        link_bytes: std::sync::atomic::AtomicU64::new(0),
    });
    let session = Session { shared: shared.clone() };
    let local_wake = Arc::new(LocalWake {
        task: AtomicWaker::new(),
        polling: std::sync::atomic::AtomicBool::new(false),
        woken: std::sync::atomic::AtomicBool::new(false),
    });
    let link_wake =
        Arc::new(LinkWake { local: local_wake.clone(), readable: std::sync::atomic::AtomicBool::new(true) });
    let mut driver = SessionDriver {
        shared: shared.clone(),
        link,
        link_wake: link_wake.clone(),
        reader: FrameReader::new(),
        accept: Some(in_tx),
        pending: None,
        needs_flush: false,
        closing: false,
        close_deadline: None,
        ping: None,
        last_ping: None,
        polls_since_ping_check: 0,
        defer: Defer::default(),
        local: None,
        local_waker: Waker::from(local_wake.clone()),
        local_wake,
        rewoken: false,
    };
    let task = async move {
        let _ended = EndGuard(shared);
        // The link's waker lives beside the driver, not in it, so that a poll lends it to the
        // link's calls without cloning it.
        let link_waker = Waker::from(link_wake);
        poll_fn(|cx| driver.poll(cx, &link_waker)).await
    };
    (session, Incoming { rx: in_rx }, Box::pin(task))
}

struct SessionShared {
    inner: Mutex<Inner>,
    driver: AtomicWaker,
    /// Tasks wait in [`Inner::spawned`] for the driver.
    spawn_pending: std::sync::atomic::AtomicBool,
    /// The driver is polling its local tasks; it sends what they queue before it returns.
    in_local: std::sync::atomic::AtomicBool,
    open_streams: AtomicUsize,
    closed: CancellationToken,
    /// [`Session::close`] was called (a flag: the driver reads it on every poll, and a token's
    /// lock showed in small requests).
    close_requested: std::sync::atomic::AtomicBool,
    role: Role,
    max_streams: usize,
    split_send_size: usize,
    /// The round trip last measured with a ping, in microseconds (0 until measured).
    rtt_micros: std::sync::atomic::AtomicU64,
    /// Bytes written to and read from the link ([`Session::link_bytes`]).
    link_bytes: std::sync::atomic::AtomicU64,
}

impl SessionShared {
    fn rtt(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.rtt_micros.load(Ordering::Relaxed))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A stream queued output: the driver must run, unless it is polling its local tasks now,
    /// in which case it sends the output right after them (waking the running driver's task
    /// would requeue it, and wake an idle worker thread to take it).
    fn output_queued(&self) {
        if !self.in_local.load(Ordering::SeqCst) {
            self.driver.wake();
        }
    }

    /// Whether `id` is an id the peer may open.
    fn is_remote_id(&self, id: u32) -> bool {
        id != 0
            && match self.role {
                Role::Server => !id.is_multiple_of(2),
                Role::Client => id.is_multiple_of(2),
            }
    }
}

struct Inner {
    streams: HashMap<u32, Arc<StreamCell>>,
    next_id: u32,
    /// Frames queued for the peer.
    out: Batch,
    /// Streams whose writers wait for room in `out`.
    room_waiters: Vec<Arc<StreamCell>>,
    /// Window growth left in the session's budget.
    growth_left: usize,
    ended: bool,
    going_away: bool,
    /// Tasks handed to [`Session::spawn_local`], not yet taken by the driver.
    spawned: Vec<LocalTask>,
}

impl Inner {
    /// Queues a frame, copying its body. Small frames share segments: appended to the last one
    /// while it has room (never moved to grow it), or to a new one.
    fn queue(&mut self, header: Header, body: &[u8]) {
        let needed = frame::HEADER_LEN + body.len();
        match self.out.back_mut() {
            Some(last) if last.capacity() - last.len() >= needed => {
                put_frame(last, header, body);
                self.out.grew(needed);
            }
            _ => {
                let size = if self.out.is_empty() { FIRST_SEGMENT_SIZE } else { SEGMENT_SIZE };
                let mut segment = BytesMut::with_capacity(needed.max(size));
                put_frame(&mut segment, header, body);
                self.out.push(segment);
            }
        }
    }

    /// Queues a data frame of the first `len` bytes of `data`, removing them from it. A large body
    /// becomes a segment of its own, so it is never copied on its way to the link; a small one is
    /// copied, and `data` keeps its buffer for the next read (splitting it off would make the
    /// buffer shared, which allocates).
    fn queue_owned(&mut self, header: Header, data: &mut BytesMut, len: usize) {
        if len < OWNED_BODY_MIN {
            self.queue(header, &data[..len]);
            data.advance(len);
            return;
        }
        self.queue(header, &[]);
        self.out.push(data.split_to(len));
    }
}

/// Marks the session ended, however the driver stops (returns, or its task is dropped).
struct EndGuard(Arc<SessionShared>);

impl Drop for EndGuard {
    fn drop(&mut self) {
        let shared = &self.0;
        let (streams, waiters, spawned) = {
            let mut inner = shared.lock();
            inner.ended = true;
            inner.out = Batch::new();
            (
                std::mem::take(&mut inner.streams),
                std::mem::take(&mut inner.room_waiters),
                std::mem::take(&mut inner.spawned),
            )
        };
        for task in spawned {
            spawn_detached(task);
        }
        for cell in streams.values().chain(waiters.iter()) {
            let mut st = cell.lock();
            st.ended = true;
            st.detached = true;
            st.wake_all();
        }
        shared.closed.cancel();
    }
}

/// One stream's state, shared by its handle and the driver.
struct StreamCell {
    id: u32,
    state: Mutex<StreamState>,
}

impl StreamCell {
    fn new(id: u32, pending_flags: Flags, send_credit: u32) -> Self {
        Self {
            id,
            state: Mutex::new(StreamState {
                recv: VecDeque::new(),
                recv_len: 0,
                recv_credit: DEFAULT_WINDOW,
                consumed: 0,
                window: DEFAULT_WINDOW,
                recv_fin: false,
                last_update: None,
                send_credit,
                sent_fin: false,
                pending_flags,
                reset: false,
                ended: false,
                detached: false,
                waiting_for_room: false,
                reader: None,
                writer: None,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, StreamState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

struct StreamState {
    /// Received, not yet read.
    recv: VecDeque<Bytes>,
    recv_len: usize,
    /// Bytes the peer may still send.
    recv_credit: u32,
    /// Read by the application, not yet granted back to the peer.
    consumed: u32,
    /// This stream's receive window: `recv_credit + recv_len + consumed`.
    window: u32,
    /// The peer will send no more.
    recv_fin: bool,
    /// When credit was last granted.
    last_update: Option<std::time::Instant>,
    /// Bytes we may still send.
    send_credit: u32,
    /// We will send no more.
    sent_fin: bool,
    /// SYN (an outbound stream not announced yet) or ACK (an inbound one not acknowledged yet),
    /// carried by the next frame sent.
    pending_flags: Flags,
    /// The peer reset the stream.
    reset: bool,
    /// The session ended.
    ended: bool,
    /// No longer in the session's table (reset, or the session ended).
    detached: bool,
    waiting_for_room: bool,
    reader: Option<Waker>,
    writer: Option<Waker>,
}

impl StreamState {
    /// A read with nothing buffered: end of stream (`Ok`), why reading fails, or wait for data.
    fn poll_nothing_buffered(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.recv_fin {
            return Poll::Ready(Ok(()));
        }
        if self.reset {
            return Poll::Ready(Err(reset_error()));
        }
        if self.ended {
            return Poll::Ready(Err(session_closed_error()));
        }
        self.reader = Some(cx.waker().clone());
        Poll::Pending
    }

    fn wake_all(&mut self) {
        if let Some(w) = self.reader.take() {
            w.wake();
        }
        if let Some(w) = self.writer.take() {
            w.wake();
        }
    }

    /// Whether enough was read to return credit to the peer.
    fn update_due(&self) -> bool {
        self.consumed >= self.window / 2 && !self.recv_fin && !self.reset && !self.ended
    }

    /// The credit to grant now: what was read, plus, when the window limits the stream, as much
    /// again as the window (within the session's growth budget). The window limits the stream when
    /// half of it was read within two round trips of the previous grant: the sender then spends its
    /// credit faster than credit can come back (a link whose bandwidth-delay product exceeds the
    /// window), and a larger window keeps the data flowing.
    fn take_window_update(&mut self, growth_left: &mut usize, rtt: std::time::Duration) -> u32 {
        let now = std::time::Instant::now();
        let grow = !rtt.is_zero() && self.last_update.is_some_and(|at| now.duration_since(at) < rtt * 2);
        self.last_update = Some(now);
        let mut delta = self.consumed;
        if grow && self.window < MAX_STREAM_WINDOW {
            let grow = self.window.min(MAX_STREAM_WINDOW - self.window);
            let grow = grow.min(u32::try_from(*growth_left).unwrap_or(u32::MAX));
            self.window += grow;
            *growth_left -= grow as usize;
            delta += grow;
        }
        self.consumed = 0;
        self.recv_credit = self.recv_credit.saturating_add(delta);
        delta
    }
}

/// One stream of a session: a tokio `AsyncRead + AsyncWrite`. `shutdown` half-closes (the peer
/// reads end-of-stream and can still write). Dropping a stream that has not been finished both ways
/// resets it: the peer's reads fail after what was already delivered, and its writes fail.
pub struct MuxStream {
    cell: Arc<StreamCell>,
    session: Arc<SessionShared>,
}

impl MuxStream {
    fn new(cell: Arc<StreamCell>, session: Arc<SessionShared>) -> Self {
        session.open_streams.fetch_add(1, Ordering::Relaxed);
        Self { cell, session }
    }

    /// The stream's id on the wire.
    pub fn id(&self) -> u32 {
        self.cell.id
    }

    /// The session the stream belongs to (for [`Session::spawn_local`]).
    pub fn session(&self) -> Session {
        Session { shared: self.session.clone() }
    }

    /// Grants the peer the credit the reader freed (and any growth).
    fn send_window_update(&self) {
        let rtt = self.session.rtt();
        let mut inner = self.session.lock();
        let mut st = self.cell.lock();
        if st.detached || st.ended || inner.ended {
            return;
        }
        let delta = st.take_window_update(&mut inner.growth_left, rtt);
        if delta == 0 {
            return;
        }
        let flags = std::mem::take(&mut st.pending_flags);
        drop(st);
        inner.queue(Header::window_update(self.cell.id, delta, flags), &[]);
        drop(inner);
        self.session.output_queued();
    }
}

impl Drop for MuxStream {
    fn drop(&mut self) {
        self.session.open_streams.fetch_sub(1, Ordering::Relaxed);
        let mut inner = self.session.lock();
        let mut st = self.cell.lock();
        if st.detached {
            return;
        }
        st.detached = true;
        inner.streams.remove(&self.cell.id);
        inner.growth_left += (st.window - DEFAULT_WINDOW) as usize;
        let finished = st.sent_fin && st.recv_fin;
        // A stream the peer never heard of needs no reset.
        let announced = !st.pending_flags.contains(Flags::SYN);
        if !finished && !st.reset && !st.ended && announced && !inner.ended {
            let flags = Flags::RST | std::mem::take(&mut st.pending_flags);
            drop(st);
            inner.queue(Header::data(self.cell.id, 0, flags), &[]);
            drop(inner);
            self.session.output_queued();
        }
    }
}

fn reset_error() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, "tunnel stream reset by the peer")
}

fn session_closed_error() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "tunnel session closed")
}

impl AsyncRead for MuxStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let mut st = self.cell.lock();
        if st.recv_len > 0 {
            let mut n = 0;
            while buf.remaining() > 0 {
                let Some(chunk) = st.recv.front_mut() else { break };
                let k = chunk.len().min(buf.remaining());
                buf.put_slice(&chunk[..k]);
                chunk.advance(k);
                if chunk.is_empty() {
                    st.recv.pop_front();
                }
                n += k;
            }
            st.recv_len -= n;
            st.consumed += n as u32;
            let due = st.update_due();
            drop(st);
            if due {
                self.send_window_update();
            }
            return Poll::Ready(Ok(()));
        }
        st.poll_nothing_buffered(cx)
    }
}

impl MuxStream {
    /// Sends up to `len` bytes, once credit and room allow: `queue` puts a frame of the length it
    /// is given (at most `len`) into the output. Answers the length sent.
    fn poll_send_with(
        &self,
        cx: &mut Context<'_>,
        len: usize,
        queue: impl FnOnce(&mut Inner, Header, usize),
    ) -> Poll<io::Result<usize>> {
        if len == 0 {
            return Poll::Ready(Ok(0));
        }
        let session = &self.session;
        let mut inner = session.lock();
        let mut st = self.cell.lock();
        if st.reset {
            return Poll::Ready(Err(reset_error()));
        }
        if st.ended || inner.ended {
            return Poll::Ready(Err(session_closed_error()));
        }
        if st.sent_fin {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::BrokenPipe, "tunnel stream already shut down")));
        }
        if inner.out.len() >= OUT_HIGH_WATER {
            st.writer = Some(cx.waker().clone());
            if !st.waiting_for_room {
                st.waiting_for_room = true;
                inner.room_waiters.push(self.cell.clone());
            }
            return Poll::Pending;
        }
        if st.send_credit == 0 {
            st.writer = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let k = len.min(st.send_credit as usize).min(session.split_send_size);
        st.send_credit -= k as u32;
        let flags = std::mem::take(&mut st.pending_flags);
        drop(st);
        queue(&mut inner, Header::data(self.cell.id, k as u32, flags), k);
        drop(inner);
        session.output_queued();
        Poll::Ready(Ok(k))
    }

    /// Sends the front of `data` without copying it (the buffer's first bytes become a frame's
    /// body as they are) and removes what was sent from `data`. Answers the length sent.
    pub fn poll_send_owned(&mut self, cx: &mut Context<'_>, data: &mut BytesMut) -> Poll<io::Result<usize>> {
        let len = data.len();
        self.poll_send_with(cx, len, |inner, header, k| inner.queue_owned(header, data, k))
    }

    /// Takes received bytes as they arrived (a slice of the message they came in, not a copy), at
    /// most `max`; `None` at end of stream.
    pub fn poll_recv_chunk(&mut self, cx: &mut Context<'_>, max: usize) -> Poll<io::Result<Option<Bytes>>> {
        let mut st = self.cell.lock();
        if st.recv_len > 0
            && let Some(front) = st.recv.front_mut()
        {
            let chunk = if front.len() <= max {
                let chunk = std::mem::take(front);
                st.recv.pop_front();
                chunk
            } else {
                front.split_to(max.max(1))
            };
            st.recv_len -= chunk.len();
            st.consumed += chunk.len() as u32;
            let due = st.update_due();
            drop(st);
            if due {
                self.send_window_update();
            }
            return Poll::Ready(Ok(Some(chunk)));
        }
        st.poll_nothing_buffered(cx).map_ok(|()| None)
    }

    /// Resolves once a read would not wait (bytes or the end of the stream arrived, the peer reset
    /// the stream, or the session ended), without taking anything.
    pub async fn readable(&self) {
        std::future::poll_fn(|cx| {
            let mut st = self.cell.lock();
            if st.recv_len > 0 || st.recv_fin || st.reset || st.ended {
                return Poll::Ready(());
            }
            st.reader = Some(cx.waker().clone());
            Poll::Pending
        })
        .await;
    }

    /// Resolves once the peer has reset the stream or the session has ended, without taking any
    /// received bytes: lets work done on the stream's behalf (an agent's connect) stop as soon as
    /// the other side gives up. The stream's reader must not be polled meanwhile.
    pub async fn abandoned(&self) {
        std::future::poll_fn(|cx| {
            let mut st = self.cell.lock();
            if st.reset || st.ended {
                return Poll::Ready(());
            }
            st.reader = Some(cx.waker().clone());
            Poll::Pending
        })
        .await;
    }

    /// Half-closes: the peer reads end-of-stream after what was sent.
    pub fn finish(&mut self) {
        let mut inner = self.session.lock();
        let mut st = self.cell.lock();
        if st.sent_fin || st.reset || st.ended || inner.ended {
            return;
        }
        st.sent_fin = true;
        let flags = Flags::FIN | std::mem::take(&mut st.pending_flags);
        drop(st);
        inner.queue(Header::data(self.cell.id, 0, flags), &[]);
        drop(inner);
        self.session.output_queued();
    }
}

impl AsyncWrite for MuxStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_send_with(cx, buf.len(), |inner, header, k| inner.queue(header, &buf[..k]))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Queued frames go out as soon as the driver runs; there is nothing to wait for here.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.finish();
        Poll::Ready(Ok(()))
    }
}

/// What the driver does with a frame, decided under the session lock and carried out after it.
enum Deliver {
    None,
    Stream(Arc<StreamCell>),
    Accept(MuxStream),
}

struct SessionDriver<L> {
    shared: Arc<SessionShared>,
    link: L,
    /// The state of the waker every call on the link is made with (see [`LinkWake`]).
    link_wake: Arc<LinkWake>,
    reader: FrameReader,
    /// Dropped when the session stops taking new streams.
    accept: Option<mpsc::Sender<Box<MuxStream>>>,
    /// A batch the link has not taken yet.
    pending: Option<Batch>,
    needs_flush: bool,
    closing: bool,
    /// A closing session gives up on a peer that does not take its last frames by then.
    close_deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The ping in flight: its opaque value and when it was sent.
    ping: Option<(u32, std::time::Instant)>,
    /// When the last ping was sent.
    last_ping: Option<std::time::Instant>,
    /// Polls since [`maybe_ping`](Self::maybe_ping) last read the clock.
    polls_since_ping_check: u32,
    defer: Defer,
    /// Tasks run beside the driver ([`Session::spawn_local`]); `None` while there are none, so an
    /// idle session holds no set.
    local: Option<FuturesUnordered<LocalTask>>,
    /// The waker the local tasks are polled with, and its state.
    local_wake: Arc<LocalWake>,
    local_waker: Waker,
    /// This poll woke the driver's task itself (to yield), so it runs again anyway.
    rewoken: bool,
}

/// How often one poll of the driver runs its rounds again for local tasks woken meanwhile.
const LOCAL_REPOLLS: usize = 4;
/// How often one round polls the local task set while it reports tasks woken meanwhile.
const LOCAL_SET_POLLS: usize = 4;

/// The waker of the session-local tasks. While the driver polls, a local task woken (by a frame
/// the driver just delivered, say) only raises `woken`, which the driver checks before it returns:
/// waking the driver's own task while it runs would put it back in the run queue, and a
/// multi-threaded runtime then wakes an idle worker thread to take it, once per request. Woken at
/// any other time (its socket became ready), it wakes the driver's task.
struct LocalWake {
    task: AtomicWaker,
    polling: std::sync::atomic::AtomicBool,
    woken: std::sync::atomic::AtomicBool,
}

impl std::task::Wake for LocalWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        if !self.polling.load(Ordering::SeqCst) {
            self.task.wake();
        }
    }
}

/// The waker of the link. It records that the link woke the driver (bytes or room arrived, a
/// keepalive timer fired), so that the driver asks the link for bytes only then, or while its last
/// read returned some: a driver woken by a session-local task (a request read from a node-side
/// socket) does not try a read of the link that cannot succeed (a TLS read returning `Pending`,
/// once per small request per process). Every call on the link uses it, so no wake-up of the link
/// reaches the driver without raising the flag.
struct LinkWake {
    /// Holds the driver task's waker.
    local: Arc<LocalWake>,
    /// Set when the link wakes the driver (and at the start); cleared before each receive attempt.
    readable: std::sync::atomic::AtomicBool,
}

impl std::task::Wake for LinkWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.readable.store(true, Ordering::SeqCst);
        self.local.task.wake();
    }
}

/// Tasks still running when the driver stops go on as tasks of their own: their streams fail,
/// and they finish (closing their sockets, logging what they did).
impl<L> Drop for SessionDriver<L> {
    fn drop(&mut self) {
        let spawned = std::mem::take(&mut self.shared.lock().spawned);
        for task in spawned.into_iter().chain(self.local.take().into_iter().flatten()) {
            spawn_detached(task);
        }
    }
}

/// Coalescing of frames queued by different streams at about the same time.
///
/// Woken with frames to send, the driver goes to the back of the run queue once before writing,
/// so that the streams made ready together (a batch of requests on many connections) queue their
/// frames too, and one write carries them all instead of one write, TLS record and wake-up of the
/// peer per frame. A session with fewer than [`COALESCE_MIN_STREAMS`] streams open never defers,
/// and a deferral that gained nothing (a single busy stream among idle ones) makes the driver skip
/// the next ones, exponentially up to [`DEFER_BACKOFF_MAX`], so a lone request/response exchange
/// does not pay for the extra turn: on a multi-threaded runtime the turn can also wake an idle
/// worker.
#[derive(Default)]
struct Defer {
    /// Bytes queued when the driver put its write off; `Some` until it runs again.
    put_off_at: Option<usize>,
    /// Opportunities to skip before deferring again.
    skip: u32,
    /// The skip set after the last deferral that gained nothing.
    backoff: u32,
}

/// Open streams from which the driver defers writes: coalescing needs frames of two streams, and
/// a session's first stream is usually its control stream, which is quiet.
const COALESCE_MIN_STREAMS: usize = 3;

/// Most write opportunities skipped after deferrals that gained nothing.
const DEFER_BACKOFF_MAX: u32 = 255;

impl Defer {
    /// Whether to put off writing the `queued` bytes (the caller re-wakes the driver and returns).
    fn put_off(&mut self, queued: usize) -> bool {
        if let Some(before) = self.put_off_at.take() {
            if queued > before {
                self.backoff = 0;
            } else {
                self.backoff = (self.backoff * 2 + 1).min(DEFER_BACKOFF_MAX);
                self.skip = self.backoff;
            }
            return false;
        }
        if queued == 0 {
            return false;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return false;
        }
        self.put_off_at = Some(queued);
        true
    }
}

/// How often the round trip is measured again while the session is busy.
const RTT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);
/// Polls between two looks at the clock for the next round-trip measurement.
const PING_CHECK_POLLS: u32 = 64;

/// How long a closing session tries to deliver its go-away.
const CLOSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

impl<L: Link> SessionDriver<L> {
    /// Polls the session; runs more rounds at once when a session-local task was woken while the
    /// driver polled (see [`LocalWake`]). Every call on the link is made with `link_waker`.
    fn poll(&mut self, cx: &mut Context<'_>, link_waker: &Waker) -> Poll<Result<(), MuxError>> {
        self.local_wake.task.register(cx.waker());
        for _ in 0..LOCAL_REPOLLS {
            self.local_wake.polling.store(true, Ordering::SeqCst);
            self.rewoken = false;
            let polled = self.poll_rounds(cx, link_waker);
            self.local_wake.polling.store(false, Ordering::SeqCst);
            if polled.is_ready() || self.rewoken || !self.local_wake.woken.swap(false, Ordering::SeqCst) {
                return polled;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    fn poll_rounds(&mut self, cx: &mut Context<'_>, link_waker: &Waker) -> Poll<Result<(), MuxError>> {
        self.shared.driver.register(cx.waker());
        if !self.closing && self.shared.close_requested.load(Ordering::Acquire) {
            self.begin_close(GoAway::Normal);
        }
        if !self.closing
            && self.pending.is_none()
            && self.shared.open_streams.load(Ordering::Relaxed) >= COALESCE_MIN_STREAMS
            && self.defer.put_off(self.shared.lock().out.len())
        {
            self.rewoken = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.maybe_ping();
        let mut link_cx = Context::from_waker(link_waker);
        for _ in 0..ROUNDS_PER_POLL {
            self.poll_local();
            self.poll_send(&mut link_cx)?;
            if self.closing {
                return self.poll_finish_close(cx, &mut link_cx);
            }
            if self.shared.lock().out.len() > OUT_HARD_LIMIT {
                // The peer does not read what we owe it; stop reading until it does.
                return Poll::Pending;
            }
            let mut received = false;
            // The link is asked only when it woke the driver or its last read returned bytes: once
            // it has said Pending it has registered for its next bytes (and timers), and its wake
            // raises the flag again.
            for _ in 0..8 {
                if !self.link_wake.readable.swap(false, Ordering::SeqCst) {
                    break;
                }
                match self.link.poll_recv(&mut link_cx) {
                    Poll::Ready(Some(Ok(chunk))) => {
                        self.link_wake.readable.store(true, Ordering::SeqCst);
                        received = true;
                        self.shared.link_bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                        if let Err(e) = self.on_chunk(chunk) {
                            tracing::info!(error = %e, "closing the tunnel session");
                            self.begin_close(GoAway::ProtocolError);
                            let _ = self.poll_send(&mut link_cx);
                            let _ = self.link.poll_flush(&mut link_cx);
                            return Poll::Ready(Err(e));
                        }
                    }
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(MuxError::Link(e))),
                    Poll::Ready(None) => return Poll::Ready(Ok(())),
                    Poll::Pending => break,
                }
            }
            if !received {
                let mut inner = self.shared.lock();
                if inner.out.is_empty() {
                    // Idle: keep no output buffer (this matters with tens of thousands of agents).
                    inner.out = Batch::new();
                    return Poll::Pending;
                }
                if self.pending.is_some() {
                    return Poll::Pending;
                }
            }
        }
        // Plenty of work: let other tasks run, and come back.
        self.rewoken = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// Polls the session-local tasks that are ready (their streams got data or credit, their
    /// sockets became ready), so that what they queue leaves in this round's write.
    fn poll_local(&mut self) {
        if self.shared.spawn_pending.swap(false, Ordering::AcqRel) {
            let spawned = std::mem::take(&mut self.shared.lock().spawned);
            let local = self.local.get_or_insert_with(FuturesUnordered::new);
            for task in spawned {
                local.push(task);
            }
        }
        let Some(local) = self.local.as_mut() else { return };
        let mut cx = Context::from_waker(&self.local_waker);
        self.shared.in_local.store(true, Ordering::SeqCst);
        for _ in 0..LOCAL_SET_POLLS {
            // Wakes from here on are news: the set is about to poll every task woken before.
            self.local_wake.woken.store(false, Ordering::SeqCst);
            while let Poll::Ready(Some(())) = futures::StreamExt::poll_next_unpin(local, &mut cx) {}
            // The set wakes itself once it has polled all its tasks (so that it never starves
            // other work); a task woken for real is still queued. One more look tells them apart:
            // with nothing queued it returns at once and wakes nobody. Without it the driver ran
            // all its rounds twice for every request.
            if !self.local_wake.woken.load(Ordering::SeqCst) {
                break;
            }
        }
        self.shared.in_local.store(false, Ordering::SeqCst);
        if local.is_empty() {
            self.local = None;
        }
    }

    /// Sends queued frames as batches, then flushes (`link_cx` carries the link's waker).
    fn poll_send(&mut self, link_cx: &mut Context<'_>) -> Result<(), MuxError> {
        loop {
            if self.pending.is_none() {
                let (batch, waiters) = {
                    let mut inner = self.shared.lock();
                    if inner.out.is_empty() {
                        (None, Vec::new())
                    } else {
                        let mut batch = Batch::new();
                        while batch.len() < MAX_BATCH {
                            let Some(segment) = inner.out.pop() else { break };
                            batch.push(segment);
                        }
                        let waiters = if inner.out.len() < OUT_HIGH_WATER {
                            std::mem::take(&mut inner.room_waiters)
                        } else {
                            Vec::new()
                        };
                        (Some(batch), waiters)
                    }
                };
                for cell in waiters {
                    let mut st = cell.lock();
                    st.waiting_for_room = false;
                    if let Some(w) = st.writer.take() {
                        w.wake();
                    }
                }
                self.pending = batch;
            }
            let Some(batch) = self.pending.take() else { break };
            match self.link.poll_ready(link_cx) {
                Poll::Ready(Ok(())) => {
                    self.shared.link_bytes.fetch_add(batch.len() as u64, Ordering::Relaxed);
                    self.link.start_send(batch)?;
                    self.needs_flush = true;
                }
                Poll::Ready(Err(e)) => return Err(MuxError::Link(e)),
                Poll::Pending => {
                    self.pending = Some(batch);
                    break;
                }
            }
        }
        if self.needs_flush {
            match self.link.poll_flush(link_cx) {
                Poll::Ready(Ok(())) => self.needs_flush = false,
                Poll::Ready(Err(e)) => return Err(MuxError::Link(e)),
                Poll::Pending => {}
            }
        }
        Ok(())
    }

    /// Measures the round trip (which window growth needs): at the start, and again every
    /// [`RTT_INTERVAL`] while the session does anything. An idle session sends no pings of its own.
    fn maybe_ping(&mut self) {
        if self.ping.is_some() || self.closing {
            return;
        }
        if let Some(at) = self.last_ping {
            // Reading the clock on every poll shows in small requests; a busy session polls often.
            self.polls_since_ping_check += 1;
            if self.polls_since_ping_check < PING_CHECK_POLLS {
                return;
            }
            self.polls_since_ping_check = 0;
            if at.elapsed() < RTT_INTERVAL {
                return;
            }
        }
        let now = std::time::Instant::now();
        let opaque = self.last_ping.map_or(1, |_| fastrand::u32(..));
        self.ping = Some((opaque, now));
        self.last_ping = Some(now);
        self.shared.lock().queue(Header::ping(opaque, Flags::SYN), &[]);
    }

    fn begin_close(&mut self, code: GoAway) {
        self.closing = true;
        self.close_deadline = Some(Box::pin(tokio::time::sleep(CLOSE_TIMEOUT)));
        self.accept = None;
        let mut inner = self.shared.lock();
        inner.going_away = true;
        inner.queue(Header::go_away(code), &[]);
    }

    fn poll_finish_close(&mut self, cx: &mut Context<'_>, link_cx: &mut Context<'_>) -> Poll<Result<(), MuxError>> {
        if self.close_deadline.as_mut().is_some_and(|d| d.as_mut().poll(cx).is_ready()) {
            return Poll::Ready(Ok(()));
        }
        let drained = self.pending.is_none() && self.shared.lock().out.is_empty();
        if !drained {
            return Poll::Pending;
        }
        match self.link.poll_close(link_cx) {
            Poll::Ready(_) => Poll::Ready(Ok(())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn on_chunk(&mut self, chunk: BytesMut) -> Result<(), MuxError> {
        self.reader.push(chunk);
        while let Some(frame) = self.reader.next_frame().map_err(|e| MuxError::Protocol(e.to_string()))? {
            self.on_frame(frame)?;
        }
        Ok(())
    }

    fn on_frame(&mut self, frame: Frame) -> Result<(), MuxError> {
        let Frame { header, body } = frame;
        match header.kind {
            Kind::Ping => {
                if !header.flags.contains(Flags::ACK) {
                    self.shared.lock().queue(Header::ping(header.length, Flags::ACK), &[]);
                } else if let Some((opaque, sent)) = self.ping
                    && opaque == header.length
                {
                    let micros = u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX).max(1);
                    self.shared.rtt_micros.store(micros, Ordering::Relaxed);
                    self.ping = None;
                }
                Ok(())
            }
            Kind::GoAway => {
                // The peer is leaving: no new streams; the session ends when the link does.
                self.shared.lock().going_away = true;
                Ok(())
            }
            Kind::Data | Kind::WindowUpdate => {
                if header.stream_id == 0 {
                    return Err(MuxError::Protocol(format!("{:?} frame for stream 0", header.kind)));
                }
                let deliver = self.route(&header, &body)?;
                match deliver {
                    Deliver::None => Ok(()),
                    Deliver::Stream(cell) => self.deliver(&cell, header, body),
                    Deliver::Accept(stream) => {
                        self.accept_stream(stream);
                        Ok(())
                    }
                }
            }
        }
    }

    /// Finds (or, for a SYN, creates) the frame's stream; answers frames for unknown streams.
    fn route(&mut self, header: &Header, body: &Bytes) -> Result<Deliver, MuxError> {
        let id = header.stream_id;
        let mut inner = self.shared.lock();
        if header.flags.contains(Flags::SYN) {
            if !self.shared.is_remote_id(id) {
                return Err(MuxError::Protocol(format!("the peer opened stream {id}, which is not its id to open")));
            }
            if inner.streams.contains_key(&id) {
                return Err(MuxError::Protocol(format!("the peer opened stream {id} twice")));
            }
            if body.len() > DEFAULT_WINDOW as usize {
                return Err(MuxError::Protocol(format!("stream {id} opened with more data than its window")));
            }
            if header.flags.contains(Flags::RST) {
                return Ok(Deliver::None);
            }
            if inner.going_away || self.accept.is_none() || inner.streams.len() >= self.shared.max_streams {
                tracing::warn!(stream = id, "refusing a new stream: the session is closing or at its stream limit");
                inner.queue(Header::data(id, 0, Flags::RST), &[]);
                return Ok(Deliver::None);
            }
            let credit = if header.kind == Kind::WindowUpdate {
                DEFAULT_WINDOW.checked_add(header.length).ok_or_else(|| MuxError::Protocol("window overflow".into()))?
            } else {
                DEFAULT_WINDOW
            };
            let cell = Arc::new(StreamCell::new(id, Flags::ACK, credit));
            inner.streams.insert(id, cell.clone());
            drop(inner);
            if header.kind == Kind::Data {
                self.deliver(&cell, Header { flags: header.flags.without(Flags::SYN), ..*header }, body.clone())?;
            } else if header.flags.contains(Flags::FIN) {
                cell.lock().recv_fin = true;
            }
            return Ok(Deliver::Accept(MuxStream::new(cell, self.shared.clone())));
        }
        match inner.streams.get(&id) {
            Some(cell) => Ok(Deliver::Stream(cell.clone())),
            None => {
                // A stream this side has dropped (and reset) or never had. Data means the peer
                // still thinks it is open: tell it again, so it never waits for credit in vain.
                if header.kind == Kind::Data && !header.flags.contains(Flags::RST) && header.length > 0 {
                    inner.queue(Header::data(id, 0, Flags::RST), &[]);
                }
                Ok(Deliver::None)
            }
        }
    }

    fn deliver(&mut self, cell: &Arc<StreamCell>, header: Header, body: Bytes) -> Result<(), MuxError> {
        let mut st = cell.lock();
        if header.flags.contains(Flags::RST) {
            st.reset = true;
            st.detached = true;
            st.wake_all();
            let window = st.window;
            drop(st);
            let mut inner = self.shared.lock();
            inner.streams.remove(&cell.id);
            inner.growth_left += (window - DEFAULT_WINDOW) as usize;
            return Ok(());
        }
        match header.kind {
            Kind::Data => {
                let len = body.len() as u32;
                if len > st.recv_credit {
                    return Err(MuxError::Protocol(format!(
                        "stream {} sent {len} bytes with {} of credit",
                        cell.id, st.recv_credit
                    )));
                }
                if st.recv_fin && len > 0 {
                    return Err(MuxError::Protocol(format!("stream {} sent data after its end", cell.id)));
                }
                st.recv_credit -= len;
                if len > 0 {
                    st.recv_len += body.len();
                    st.recv.push_back(body);
                }
            }
            Kind::WindowUpdate => {
                st.send_credit = st
                    .send_credit
                    .checked_add(header.length)
                    .ok_or_else(|| MuxError::Protocol(format!("stream {} window overflow", cell.id)))?;
                if let Some(w) = st.writer.take() {
                    w.wake();
                }
            }
            Kind::Ping | Kind::GoAway => {}
        }
        if header.flags.contains(Flags::FIN) {
            st.recv_fin = true;
        }
        if (st.recv_len > 0 || st.recv_fin)
            && let Some(w) = st.reader.take()
        {
            w.wake();
        }
        Ok(())
    }

    fn accept_stream(&mut self, stream: MuxStream) {
        let Some(accept) = &self.accept else { return };
        if let Err(mpsc::error::TrySendError::Full(refused) | mpsc::error::TrySendError::Closed(refused)) =
            accept.try_send(Box::new(stream))
        {
            tracing::warn!(
                stream = refused.id(),
                "inbound stream backlog full or nobody accepting; resetting the stream"
            );
            // Dropping the stream resets it.
            drop(refused);
        }
    }
}
