//! The life of an agent session after its handshake, as a state machine without I/O: events go
//! in (a deadline passed, the gateway started draining, a refreshed token was checked, ...),
//! actions come out (send a control message, move the token deadline, stop routing dials to the
//! session, close it). `agent_session` turns timers, channels and the control stream into events
//! and carries the actions out; the rules live here, where they are unit-tested.

use std::time::Duration;

use tether_tunnel::protocol::{ControlMessage, Drain, ServerCount, TokenRefreshResult};

/// Why a session ended (a bounded metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// No valid Hello.
    HandshakeFailed,
    /// The agent closed its control stream.
    AgentClosed,
    /// The transport broke.
    ConnectionLost,
    /// The token's acceptance ended without a refresh.
    TokenExpired,
    /// The agent broke the control protocol.
    ProtocolError,
    /// The gateway's grace period ended.
    GatewayStopped,
    /// The tenant was removed from the configuration.
    TenantRemoved,
}

impl CloseReason {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::HandshakeFailed => "handshake_failed",
            Self::AgentClosed => "agent_closed",
            Self::ConnectionLost => "connection_lost",
            Self::TokenExpired => "token_expired",
            Self::ProtocolError => "protocol_error",
            Self::GatewayStopped => "gateway_stopped",
            Self::TenantRemoved => "tenant_removed",
        }
    }
}

/// Something that happened to a live session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The token's acceptance ended (`valid_until` passed).
    TokenDeadline,
    /// A refreshed token was checked; `valid_until` is set when it was accepted.
    RefreshChecked {
        /// The answer for the agent.
        answer: TokenRefreshResult,
        /// The new end of the token's acceptance (Unix seconds), if accepted.
        valid_until: Option<u64>,
    },
    /// The gateway started draining.
    DrainStarted,
    /// The agent said it is stopping: its open streams finish, new dials go elsewhere.
    AgentLeaving,
    /// The tenant was removed from the configuration.
    TenantRemoved,
    /// The grace period after the tenant's removal is over.
    RemovalDeadline,
    /// The number of replicas changed.
    ReplicaCount(u32),
    /// The gateway's grace period is over.
    HardStop,
    /// The agent closed its control stream.
    ControlClosed,
    /// The control stream carried something that is not a control message.
    ControlBroken,
    /// The transport ended.
    TransportEnded,
    /// A control message could not be sent.
    SendFailed,
}

/// What to do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send a control message to the agent.
    Send(ControlMessage),
    /// End the token's acceptance at this Unix time instead.
    MoveTokenDeadline(u64),
    /// End the session after this long (the removal's grace period).
    ArmRemovalDeadline(Duration),
    /// Route no new dials to this session.
    StopRouting,
    /// End the session.
    Close(CloseReason),
}

/// A session's state between events.
#[derive(Debug, Clone)]
pub struct SessionLife {
    grace: Duration,
    drain_sent: bool,
    removing: bool,
    closed: Option<CloseReason>,
}

impl SessionLife {
    /// A session whose agents get `grace` to move when told to.
    pub fn new(grace: Duration) -> Self {
        Self { grace, drain_sent: false, removing: false, closed: None }
    }

    /// Whether the gateway's drain was already passed on (it is sent once).
    pub fn drain_sent(&self) -> bool {
        self.drain_sent
    }

    /// Whether the session is waiting out its tenant's removal.
    pub fn removing(&self) -> bool {
        self.removing
    }

    /// Why the session ended, once it has.
    pub fn closed(&self) -> Option<CloseReason> {
        self.closed
    }

    /// The actions `event` calls for.
    pub fn on(&mut self, event: Event) -> Vec<Action> {
        if self.closed.is_some() {
            return Vec::new();
        }
        match event {
            Event::TokenDeadline => self.close(CloseReason::TokenExpired),
            Event::RefreshChecked { answer, valid_until } => {
                let mut actions = vec![Action::Send(ControlMessage::TokenRefreshResult(answer))];
                if let Some(valid_until) = valid_until {
                    actions.insert(0, Action::MoveTokenDeadline(valid_until));
                }
                actions
            }
            Event::AgentLeaving => vec![Action::StopRouting],
            Event::DrainStarted => {
                if self.drain_sent {
                    return Vec::new();
                }
                self.drain_sent = true;
                vec![Action::StopRouting, Action::Send(self.drain("gateway shutting down"))]
            }
            Event::TenantRemoved => {
                if self.removing {
                    return Vec::new();
                }
                self.removing = true;
                vec![
                    Action::StopRouting,
                    Action::ArmRemovalDeadline(self.grace),
                    Action::Send(self.drain("cluster removed from this gateway")),
                ]
            }
            Event::RemovalDeadline => self.close(CloseReason::TenantRemoved),
            Event::ReplicaCount(count) => {
                vec![Action::Send(ControlMessage::ServerCount(ServerCount { server_count: count }))]
            }
            Event::HardStop => self.close(CloseReason::GatewayStopped),
            Event::ControlClosed => self.close(CloseReason::AgentClosed),
            Event::ControlBroken => self.close(CloseReason::ProtocolError),
            Event::TransportEnded => self.close(CloseReason::ConnectionLost),
            // A removed tenant's session that cannot tell its agent ends as removed.
            Event::SendFailed if self.removing => self.close(CloseReason::TenantRemoved),
            Event::SendFailed => self.close(CloseReason::ConnectionLost),
        }
    }

    fn drain(&self, reason: &str) -> ControlMessage {
        ControlMessage::Drain(Drain {
            deadline_ms: u64::try_from(self.grace.as_millis()).unwrap_or(u64::MAX),
            reason: reason.into(),
        })
    }

    fn close(&mut self, reason: CloseReason) -> Vec<Action> {
        self.closed = Some(reason);
        vec![Action::Close(reason)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn life() -> SessionLife {
        SessionLife::new(Duration::from_secs(30))
    }

    #[test]
    fn an_unrefreshed_token_ends_the_session_and_an_accepted_refresh_moves_the_deadline() {
        let mut s = life();
        let answer = TokenRefreshResult { ok: true, expires_at: Some(2_000), message: None };
        let actions = s.on(Event::RefreshChecked { answer: answer.clone(), valid_until: Some(2_030) });
        assert_eq!(
            actions,
            vec![Action::MoveTokenDeadline(2_030), Action::Send(ControlMessage::TokenRefreshResult(answer))]
        );
        // A refused refresh is answered and changes nothing else.
        let refused = TokenRefreshResult { ok: false, expires_at: None, message: Some("token expired".into()) };
        let actions = s.on(Event::RefreshChecked { answer: refused.clone(), valid_until: None });
        assert_eq!(actions, vec![Action::Send(ControlMessage::TokenRefreshResult(refused))]);
        assert_eq!(s.on(Event::TokenDeadline), vec![Action::Close(CloseReason::TokenExpired)]);
        assert_eq!(s.closed(), Some(CloseReason::TokenExpired));
        assert!(s.on(Event::DrainStarted).is_empty(), "a closed session does nothing more");
    }

    #[test]
    fn a_drain_is_passed_on_once_and_stops_routing() {
        let mut s = life();
        let actions = s.on(Event::DrainStarted);
        assert_eq!(actions[0], Action::StopRouting);
        assert!(matches!(&actions[1], Action::Send(ControlMessage::Drain(d)) if d.deadline_ms == 30_000));
        assert!(s.drain_sent());
        assert!(s.on(Event::DrainStarted).is_empty());
        // The session lives on until the agent leaves or the grace period ends.
        assert_eq!(s.closed(), None);
        assert_eq!(s.on(Event::ControlClosed), vec![Action::Close(CloseReason::AgentClosed)]);
    }

    #[test]
    fn a_leaving_agent_gets_no_new_dials_and_closes_its_session_itself() {
        let mut s = life();
        assert_eq!(s.on(Event::AgentLeaving), vec![Action::StopRouting]);
        assert_eq!(s.closed(), None, "open streams finish first");
        assert_eq!(s.on(Event::ControlClosed), vec![Action::Close(CloseReason::AgentClosed)]);
    }

    #[test]
    fn a_removed_tenants_session_is_drained_then_closed_after_the_grace_period() {
        let mut s = life();
        let actions = s.on(Event::TenantRemoved);
        assert_eq!(actions[..2], [Action::StopRouting, Action::ArmRemovalDeadline(Duration::from_secs(30))]);
        assert!(matches!(&actions[2], Action::Send(ControlMessage::Drain(d)) if d.reason.contains("removed")));
        assert!(s.on(Event::TenantRemoved).is_empty());
        assert_eq!(s.on(Event::SendFailed), vec![Action::Close(CloseReason::TenantRemoved)]);
        let mut s = life();
        s.on(Event::TenantRemoved);
        assert_eq!(s.on(Event::RemovalDeadline), vec![Action::Close(CloseReason::TenantRemoved)]);
    }

    #[test]
    fn replica_counts_are_passed_on_and_transport_ends_close() {
        let mut s = life();
        assert_eq!(
            s.on(Event::ReplicaCount(3)),
            vec![Action::Send(ControlMessage::ServerCount(ServerCount { server_count: 3 }))]
        );
        assert_eq!(s.on(Event::SendFailed), vec![Action::Close(CloseReason::ConnectionLost)]);
        for (event, reason) in [
            (Event::HardStop, CloseReason::GatewayStopped),
            (Event::ControlBroken, CloseReason::ProtocolError),
            (Event::TransportEnded, CloseReason::ConnectionLost),
        ] {
            assert_eq!(life().on(event), vec![Action::Close(reason)]);
        }
    }
}
