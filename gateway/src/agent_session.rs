//! One connected agent: the control-stream handshake (Hello -> Welcome), registration for routing,
//! token refresh and expiry, drain, and streams the agent opens.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tether_tunnel::framed::{FrameError, forward_frames, read_frame, read_raw_frame, write_frame};
use tether_tunnel::mux::{self, Incoming, MuxStream, Role};
use tether_tunnel::protocol::{
    self, ControlMessage, ErrorCode, Hello, MAX_CONTROL_FRAME, MAX_STREAM_FRAME, StreamOpen, StreamResult,
    TokenRefreshResult, Welcome,
};
use tether_tunnel::untrusted::printable;
use tokio::io::{AsyncWrite, WriteHalf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::time::Instant;

use crate::auth::token::Identity;
use crate::claims;
use crate::lifecycle::Lifecycle;
use crate::metrics::{AGENT_CONNECTS, AGENT_SESSIONS, AGENTS, SESSIONS_CLOSED, TOKEN_REFRESHES};
use crate::registry::{AgentIdentifiers, AgentSession};
use crate::session_life::{Action, CloseReason, Event, SessionLife};
use crate::settings::SessionSettings;
use crate::tenant::{AgentSlot, SlotRefused, Tenant};

/// What every agent session of this gateway shares.
pub struct Sessions {
    /// Identity, transport tuning and timeouts.
    pub settings: SessionSettings,
    /// Drain and stop.
    pub lifecycle: Arc<Lifecycle>,
    /// Agent sessions across all tenants (`limits.max_agent_sessions`).
    pub slots: Arc<Semaphore>,
    /// The replica count, when peers are configured.
    pub replicas: Option<watch::Receiver<u32>>,
    next_conn_id: AtomicU64,
}

impl Sessions {
    /// Sessions with these settings, at most `max_sessions` at once.
    pub fn new(
        settings: SessionSettings,
        lifecycle: Arc<Lifecycle>,
        max_sessions: usize,
        replicas: Option<watch::Receiver<u32>>,
    ) -> Self {
        Self {
            settings,
            lifecycle,
            slots: Arc::new(Semaphore::new(max_sessions)),
            replicas,
            next_conn_id: AtomicU64::new(1),
        }
    }
}

/// What a session holds against the gateway's and its tenant's limits, for its whole life: a
/// session slot (`limits.max_agent_sessions`) and, from its Hello on, its agent's slot under the
/// tenant's `max_agents` (shared by all sessions of that agent).
pub struct SessionSlots {
    _global: OwnedSemaphorePermit,
    /// An agent slot taken before the upgrade for a session that may be its agent's first here.
    reserved: Option<OwnedSemaphorePermit>,
    agent: Option<Arc<AgentSlot>>,
}

impl SessionSlots {
    /// Takes a session slot and, unless the agent says it holds a session already (`additional`,
    /// checked at its Hello), an agent slot of the tenant; or says which limit is full.
    pub fn reserve(sessions: &Sessions, tenant: &Tenant, additional: bool) -> Result<Self, &'static str> {
        let reserved = if additional {
            None
        } else {
            Some(tenant.agent_slots.reserve().ok_or("this cluster has reached its agent limit (limits.max_agents)")?)
        };
        let global_slot = sessions
            .slots
            .clone()
            .try_acquire_owned()
            .map_err(|_| "this gateway has reached its agent session limit (limits.max_agent_sessions)")?;
        Ok(Self { _global: global_slot, reserved, agent: None })
    }

    /// Takes `agent_id`'s slot under the tenant's agent limit: its own if it holds one here,
    /// else the one reserved or a free one.
    fn claim_agent(&mut self, tenant: &Tenant, agent_id: &str) -> Result<(), SlotRefused> {
        self.agent = Some(tenant.agent_slots.claim(agent_id, self.reserved.take())?);
        Ok(())
    }
}

/// Runs a session from just after the upgrade until it ends.
pub async fn run<T>(
    sessions: Arc<Sessions>,
    tenant: Arc<Tenant>,
    identity: Identity,
    io: T,
    peer: SocketAddr,
    mut slots: SessionSlots,
) where
    T: mux::Link,
{
    let (session, mut incoming, driver) = mux::start(io, Role::Server, &sessions.settings.mux);
    let driver = tokio::spawn(driver);
    let reason = serve(&sessions, &tenant, identity, &session, &mut incoming, peer, &mut slots).await;
    session.close();
    match tokio::time::timeout(Duration::from_secs(5), driver).await {
        Ok(Ok(Err(e))) => tracing::info!(tenant = %tenant.name, %peer, error = %e, "agent tunnel ended"),
        Err(_) => tracing::debug!(tenant = %tenant.name, %peer, "session driver did not stop in time"),
        _ => {}
    }
    metrics::counter!(SESSIONS_CLOSED, "tenant" => tenant.name.to_string(), "reason" => reason.label()).increment(1);
    drop(slots);
}

async fn serve(
    sessions: &Sessions,
    tenant: &Arc<Tenant>,
    identity: Identity,
    session: &mux::Session,
    incoming: &mut Incoming,
    peer: SocketAddr,
    slots: &mut SessionSlots,
) -> CloseReason {
    let settings = &sessions.settings;
    let conn_id = sessions.next_conn_id.fetch_add(1, Ordering::Relaxed);
    // Short-lived states are boxed so the session's long-lived future stays small (memory per
    // idle agent).
    let handshake = Box::pin(tokio::time::timeout(settings.handshake_timeout, accept_hello(incoming))).await;
    let (mut control, hello) = match handshake {
        Ok(Ok(pair)) => pair,
        Ok(Err(e)) => {
            tracing::info!(tenant = %tenant.name, %peer, error = %e, "agent handshake failed");
            return CloseReason::HandshakeFailed;
        }
        Err(_) => {
            tracing::info!(tenant = %tenant.name, %peer, "agent sent no Hello in time");
            return CloseReason::HandshakeFailed;
        }
    };

    let agent_id = match agent_id(&hello, &identity) {
        Ok(id) => id,
        Err(reason) => return Box::pin(refuse_hello(&mut control, tenant, peer, &reason.to_string(), BAD_HELLO)).await,
    };
    let identifiers = match AgentIdentifiers::from_declared(&hello.identifiers, identity.node_name.as_deref()) {
        Ok(ids) => ids,
        Err(reason) => return refuse_hello(&mut control, tenant, peer, &reason.to_string(), BAD_HELLO).await,
    };
    // The tenant's agent limit counts agents: a session of an agent that holds one here shares
    // its slot, any other takes the one reserved before the upgrade or a free one.
    if let Err(refused) = slots.claim_agent(tenant, &agent_id) {
        return Box::pin(refuse_hello(&mut control, tenant, peer, &refused.to_string(), OVER_LIMIT)).await;
    }
    let mut replicas = sessions.replicas.clone();
    let welcome = ControlMessage::Welcome(Welcome {
        server_id: settings.server_id.clone(),
        server_count: replicas.as_mut().map(|c| *c.borrow_and_update()).unwrap_or(1),
        agent_id: agent_id.clone(),
        ping_interval_ms: u64::try_from(settings.ping_interval.as_millis()).unwrap_or(u64::MAX),
        max_streams: u32::try_from(settings.mux.max_streams).unwrap_or(u32::MAX),
        token_expires_at: Some(identity.expires_at),
    });
    let greeted = async {
        write_frame(&mut control, &StreamResult::ok(), MAX_STREAM_FRAME).await?;
        write_frame(&mut control, &welcome, MAX_CONTROL_FRAME).await
    };
    if let Err(e) = Box::pin(greeted).await {
        tracing::info!(tenant = %tenant.name, %peer, error = %e, "agent went away during the handshake");
        return CloseReason::HandshakeFailed;
    }

    let (control_tx, mut control_rx) = mpsc::channel(16);
    let node_bound = identity.node_name.is_some();
    let entry = Arc::new(AgentSession::new(
        conn_id,
        agent_id.clone(),
        node_bound,
        peer,
        session.clone(),
        identifiers,
        control_tx,
    ));
    let _registration = Registration::new(tenant.clone(), entry.clone());
    metrics::counter!(AGENT_CONNECTS, "tenant" => tenant.name.to_string(), "result" => "ok").increment(1);
    tracing::info!(tenant = %tenant.name, agent = %agent_id, %peer, version = %hello.version, "agent connected");

    let (control_read, mut control_write) = tokio::io::split(control);
    let (message_tx, mut messages) = mpsc::channel(16);
    let reader = AbortOnDrop(tokio::spawn(forward_frames(control_read, MAX_CONTROL_FRAME, message_tx)));
    let mut subject = identity.subject;
    let token_deadline = tokio::time::sleep_until(deadline(identity.valid_until));
    tokio::pin!(token_deadline);
    // Armed when the tenant is removed: the session closes when the drain grace period is over.
    let removal_deadline = tokio::time::sleep(Duration::MAX / 4);
    tokio::pin!(removal_deadline);
    let lifecycle = &sessions.lifecycle;
    let mut life = SessionLife::new(settings.drain_grace_period);

    let reason = loop {
        let event = tokio::select! {
            () = &mut token_deadline => {
                tracing::warn!(tenant = %tenant.name, agent = %agent_id, "closing session: token expired without refresh");
                Event::TokenDeadline
            }
            message = messages.recv() => match message.map(|m| *m) {
                None => Event::ControlClosed,
                Some(Err(e)) => {
                    tracing::info!(tenant = %tenant.name, agent = %agent_id, error = %e, "bad control message");
                    Event::ControlBroken
                }
                Some(Ok(ControlMessage::TokenRefresh(refresh))) => {
                    let (answer, valid_until) = Box::pin(refresh_token(tenant, &agent_id, &mut subject, &refresh.token)).await;
                    Event::RefreshChecked { answer, valid_until }
                }
                Some(Ok(ControlMessage::IdentifiersUpdate(update))) => {
                    let node = identity.node_name.as_deref();
                    match AgentIdentifiers::from_declared(&update, node) {
                        Ok(ids) => {
                            let refused = tenant.registry.update_identifiers(&entry, ids, &tenant.claims());
                            claims::report(&tenant.name, &agent_id, &refused);
                        }
                        Err(e) => tracing::info!(tenant = %tenant.name, agent = %agent_id, error = %e, "identifier update ignored"),
                    }
                    continue;
                }
                Some(Ok(ControlMessage::Leaving(leaving))) => {
                    tracing::info!(tenant = %tenant.name, agent = %agent_id, reason = ?leaving.reason.chars().take(200).collect::<String>(), deadline_ms = leaving.deadline_ms, open_streams = entry.load(), "agent is leaving; no new dials for this session");
                    Event::AgentLeaving
                }
                Some(Ok(other)) => {
                    tracing::debug!(tenant = %tenant.name, agent = %agent_id, ?other, "control message ignored");
                    continue;
                }
            },
            outgoing = control_rx.recv() => {
                if let Some(message) = outgoing
                    && send(&mut control_write, &message).await.is_err() {
                        Event::SendFailed
                    } else {
                        continue;
                    }
            }
            stream = incoming.accept() => match stream {
                Some(stream) => {
                    let (tenant, agent_id, replica) = (tenant.clone(), agent_id.clone(), settings.server_id.clone());
                    // On the session's own task: its bytes then pass between the target's socket
                    // and the tunnel without a hand-over between worker threads.
                    session.spawn_local(lifecycle.track_connection(async move {
                        serve_inbound(stream, &tenant, &agent_id, &replica).await;
                    }));
                    continue;
                }
                None => Event::TransportEnded,
            },
            () = lifecycle.drain_started().cancelled(), if !life.drain_sent() => Event::DrainStarted,
            () = tenant.removed.cancelled(), if !life.removing() => {
                tracing::info!(tenant = %tenant.name, agent = %agent_id, "tenant removed; draining its agent");
                Event::TenantRemoved
            }
            () = &mut removal_deadline, if life.removing() => Event::RemovalDeadline,
            changed = async { match replicas.as_mut() { Some(c) => c.changed().await, None => std::future::pending().await } } => {
                if changed.is_err() {
                    replicas = None;
                    continue;
                }
                Event::ReplicaCount(replicas.as_mut().map(|c| *c.borrow_and_update()).unwrap_or(1))
            }
            () = lifecycle.hard_stop().cancelled() => Event::HardStop,
        };
        let mut closed = None;
        let mut pending = std::collections::VecDeque::from(life.on(event));
        while let Some(action) = pending.pop_front() {
            match action {
                Action::Send(message) => {
                    if send(&mut control_write, &message).await.is_err() {
                        pending.extend(life.on(Event::SendFailed));
                    }
                }
                Action::MoveTokenDeadline(valid_until) => token_deadline.as_mut().reset(deadline(valid_until)),
                Action::ArmRemovalDeadline(grace) => removal_deadline.as_mut().reset(Instant::now() + grace),
                Action::StopRouting => entry.set_draining(),
                Action::Close(reason) => closed = Some(reason),
            }
        }
        if let Some(reason) = closed {
            break reason;
        }
    };
    drop(reader);
    tracing::info!(tenant = %tenant.name, agent = %agent_id, %peer, reason = reason.label(), "agent session closed");
    reason
}

/// Why an agent's handshake failed.
#[derive(Debug, thiserror::Error)]
enum HandshakeError {
    #[error("session closed before the control stream")]
    NoControlStream,
    #[error("first stream was {0:?}, not control")]
    NotControl(String),
    #[error("expected Hello, got {0}")]
    NotHello(String),
    #[error(transparent)]
    Frame(#[from] FrameError),
}

/// Waits for the control stream and the agent's Hello.
async fn accept_hello(incoming: &mut Incoming) -> Result<(MuxStream, Hello), HandshakeError> {
    let mut control = incoming.accept().await.ok_or(HandshakeError::NoControlStream)?;
    let raw = read_raw_frame(&mut control, MAX_STREAM_FRAME).await?;
    match protocol::decode::<StreamOpen>(&raw, MAX_STREAM_FRAME) {
        Ok(Some((StreamOpen::Control(_), _))) => {}
        _ => {
            let refusal = StreamResult::refused(ErrorCode::BadRequest, "the first stream must be the control stream");
            let _ = write_frame(&mut control, &refusal, MAX_STREAM_FRAME).await;
            return Err(HandshakeError::NotControl(format!("{:?}", protocol::stream_kind_name(&raw))));
        }
    }
    match read_frame::<ControlMessage, _>(&mut control, MAX_CONTROL_FRAME).await {
        Ok(ControlMessage::Hello(hello)) => Ok((control, hello)),
        Ok(other) => Err(HandshakeError::NotHello(format!("{other:?}"))),
        Err(e) => Err(e.into()),
    }
}

/// An agent id that cannot be registered.
#[derive(Debug, thiserror::Error)]
#[error("agent_id must be 1-253 printable ASCII characters")]
struct BadAgentId;

/// The agent's registered id: the node a bound token proves wins over what the agent claims.
fn agent_id(hello: &Hello, identity: &Identity) -> Result<String, BadAgentId> {
    if let Some(node) = &identity.node_name {
        if !hello.agent_id.is_empty() && !hello.agent_id.eq_ignore_ascii_case(node) {
            tracing::warn!(claimed = %printable(&hello.agent_id, 253), proven = %node, "agent id differs from the node its token is bound to; using the node");
        }
        return Ok(node.clone());
    }
    let id = hello.agent_id.trim();
    if id.is_empty() || id.len() > 253 || !id.chars().all(|c| c.is_ascii_graphic()) {
        return Err(BadAgentId);
    }
    Ok(id.to_owned())
}

/// A Hello refused for what it says: the error code sent and the `result` label counted.
const BAD_HELLO: (ErrorCode, &str) = (ErrorCode::BadRequest, "bad_hello");
/// A Hello refused because a limit is full (as before the upgrade).
const OVER_LIMIT: (ErrorCode, &str) = (ErrorCode::LimitExceeded, "limit");

async fn refuse_hello(
    control: &mut MuxStream,
    tenant: &Tenant,
    peer: SocketAddr,
    reason: &str,
    (code, label): (ErrorCode, &'static str),
) -> CloseReason {
    if code == ErrorCode::LimitExceeded {
        tracing::warn!(tenant = %tenant.name, %peer, reason, "agent refused at its Hello: limit reached");
    } else {
        tracing::info!(tenant = %tenant.name, %peer, reason, "agent Hello refused");
    }
    metrics::counter!(AGENT_CONNECTS, "tenant" => tenant.name.to_string(), "result" => label).increment(1);
    let _ = write_frame(control, &StreamResult::refused(code, reason), MAX_STREAM_FRAME).await;
    CloseReason::HandshakeFailed
}

/// Checks a refreshed token: valid for the tenant and for the same subject as the session's.
/// Returns the answer for the agent and, when accepted, the session's new deadline.
async fn refresh_token(
    tenant: &Tenant,
    agent_id: &str,
    subject: &mut String,
    token: &str,
) -> (TokenRefreshResult, Option<u64>) {
    let refused = |message: String, label: &'static str| {
        metrics::counter!(TOKEN_REFRESHES, "tenant" => tenant.name.to_string(), "result" => label).increment(1);
        tracing::warn!(tenant = %tenant.name, agent = %agent_id, reason = %message, "token refresh refused");
        (TokenRefreshResult { ok: false, expires_at: None, message: Some(message) }, None)
    };
    match tenant.verifier().verify(token).await {
        Err(e) => refused(e.to_string(), e.label()),
        Ok(identity) if identity.subject != *subject => {
            refused("the new token is for a different subject".into(), "subject_changed")
        }
        Ok(identity) => {
            metrics::counter!(TOKEN_REFRESHES, "tenant" => tenant.name.to_string(), "result" => "ok").increment(1);
            tracing::debug!(tenant = %tenant.name, agent = %agent_id, expires_at = identity.expires_at, "token refreshed");
            *subject = identity.subject;
            (
                TokenRefreshResult { ok: true, expires_at: Some(identity.expires_at), message: None },
                Some(identity.valid_until),
            )
        }
    }
}

/// Streams agents open towards the gateway: forward streams go to the allow-listed control-plane
/// targets; other kinds are refused with a reason.
async fn serve_inbound(mut stream: MuxStream, tenant: &Tenant, agent_id: &str, replica: &str) {
    let header =
        tokio::time::timeout(crate::forward::HEADER_TIMEOUT, read_raw_frame(&mut stream, MAX_STREAM_FRAME)).await;
    // A stream that sends nothing, or an oversized or broken header, is reset by dropping it.
    let Ok(Ok(raw)) = header else { return };
    let refusal = match protocol::decode::<StreamOpen>(&raw, MAX_STREAM_FRAME) {
        Ok(Some((StreamOpen::Forward(request), _))) => {
            return crate::forward::serve(stream, tenant, &request.target, agent_id, replica).await;
        }
        Ok(Some((StreamOpen::Control(_), _))) => {
            StreamResult::refused(ErrorCode::BadRequest, "a session has exactly one control stream")
        }
        Ok(Some((StreamOpen::Dial(_), _))) => {
            StreamResult::refused(ErrorCode::Unsupported, "the gateway does not accept dial streams")
        }
        Ok(Some((StreamOpen::Unknown, _))) => StreamResult::refused(
            ErrorCode::Unsupported,
            format!("unknown stream kind {:?}", protocol::stream_kind_name(&raw)),
        ),
        Ok(None) | Err(_) => StreamResult::refused(ErrorCode::BadRequest, "malformed stream header"),
    };
    let _ = write_frame(&mut stream, &refusal, MAX_STREAM_FRAME).await;
}

async fn send<W: AsyncWrite + Unpin>(writer: &mut WriteHalf<W>, message: &ControlMessage) -> Result<(), FrameError> {
    write_frame(writer, message, MAX_CONTROL_FRAME).await
}

/// A Unix time (a token's `valid_until`) as a timer deadline.
fn deadline(valid_until: u64) -> Instant {
    Instant::now() + Duration::from_secs(valid_until.saturating_sub(tether_tunnel::jwt::now_unix()))
}

/// Registration in the tenant's routing table and the sessions gauge, undone on drop.
struct Registration {
    tenant: Arc<Tenant>,
    entry: Arc<AgentSession>,
}

impl Registration {
    fn new(tenant: Arc<Tenant>, entry: Arc<AgentSession>) -> Self {
        let registered = tenant.registry.register(entry.clone(), &tenant.claims());
        claims::report(&tenant.name, &entry.agent_id, &registered.refused);
        if registered.first {
            metrics::gauge!(AGENTS, "tenant" => tenant.name.to_string()).increment(1.0);
        }
        metrics::gauge!(AGENT_SESSIONS, "tenant" => tenant.name.to_string()).increment(1.0);
        Self { tenant, entry }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.entry.set_draining();
        if self.tenant.registry.deregister(&self.entry) {
            metrics::gauge!(AGENTS, "tenant" => self.tenant.name.to_string()).decrement(1.0);
        }
        metrics::gauge!(AGENT_SESSIONS, "tenant" => self.tenant.name.to_string()).decrement(1.0);
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
