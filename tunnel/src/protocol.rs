//! Wire protocol v1, sans-IO.
//!
//! Every stream on the multiplexer starts with one [`StreamOpen`] frame from the opener and one
//! [`StreamResult`] frame from the acceptor; after that the stream carries raw bytes. The control
//! stream carries [`ControlMessage`] frames for its whole life.
//!
//! A frame is a 4-byte big-endian length followed by that many bytes of a UTF-8 JSON object. Unknown
//! fields are ignored and unknown kinds decode to an `Unknown` variant, so newer peers can add to the
//! protocol without breaking older ones. See `docs/protocol.md` for the full specification.

use std::fmt;
use std::net::IpAddr;

use bytes::{BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The WebSocket subprotocol that selects this version of the protocol.
pub const SUBPROTOCOL: &str = "tether.v1";
/// The HTTP path of the agent endpoint on the gateway.
pub const TUNNEL_PATH: &str = "/v1/tunnel";
/// Upgrade request header by which an agent that holds a session already says so
/// ([`ADDITIONAL_SESSION`]): the gateway then takes no agent slot of the tenant before the upgrade,
/// and checks at the Hello that the agent holds one on this replica (its sessions share it) or
/// that one is free.
pub const SESSION_HEADER: &str = "tether-session";
/// The value of [`SESSION_HEADER`] for a session beyond the agent's first.
pub const ADDITIONAL_SESSION: &str = "additional";
/// The protocol version carried in the control stream's open frame.
pub const PROTOCOL_VERSION: u32 = 1;
/// Largest stream open or stream result frame, length prefix excluded.
pub const MAX_STREAM_FRAME: usize = 4 * 1024;
/// Largest control-stream frame, length prefix excluded.
pub const MAX_CONTROL_FRAME: usize = 64 * 1024;
/// Size of the length prefix in front of every frame.
pub const LENGTH_PREFIX: usize = 4;

/// Why bytes could not be decoded into a frame.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// The length prefix announces more than the limit for this kind of frame.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Announced length.
        len: usize,
        /// Limit that applies.
        max: usize,
    },
    /// The frame body is not a JSON object of the expected shape.
    #[error("malformed frame: {0}")]
    Malformed(String),
}

/// Why a message could not be encoded.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// The encoded message is larger than the limit for its kind of frame.
    #[error("encoded frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Encoded length.
        len: usize,
        /// Limit that applies.
        max: usize,
    },
    /// Serialisation failed (cannot happen for the types of this module).
    #[error("cannot encode frame: {0}")]
    Json(#[from] serde_json::Error),
}

/// Encodes `msg` as one frame: length prefix plus JSON body, refusing bodies over `max` bytes.
pub fn encode<T: Serialize>(msg: &T, max: usize) -> Result<Bytes, EncodeError> {
    let mut out = BytesMut::with_capacity(128);
    out.put_u32(0);
    serde_json::to_writer((&mut out).writer(), msg)?;
    let len = out.len() - LENGTH_PREFIX;
    if len > max {
        return Err(EncodeError::TooLarge { len, max });
    }
    let prefix = u32::try_from(len).map_err(|_| EncodeError::TooLarge { len, max })?;
    out[..LENGTH_PREFIX].copy_from_slice(&prefix.to_be_bytes());
    Ok(out.freeze())
}

/// Decodes one frame from the front of `buf`.
///
/// Returns `Ok(None)` while `buf` holds less than a whole frame, or the message and the number of
/// bytes it used. An announced length over `max` fails at once, before its body arrives.
pub fn decode<T: DeserializeOwned>(buf: &[u8], max: usize) -> Result<Option<(T, usize)>, DecodeError> {
    let Some(len) = frame_len(buf, max)? else {
        return Ok(None);
    };
    let end = LENGTH_PREFIX + len;
    if buf.len() < end {
        return Ok(None);
    }
    let msg = serde_json::from_slice(&buf[LENGTH_PREFIX..end]).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    Ok(Some((msg, end)))
}

/// Reads the length prefix at the front of `buf`, if it is all there, and checks it against `max`.
pub fn frame_len(buf: &[u8], max: usize) -> Result<Option<usize>, DecodeError> {
    let Some(prefix) = buf.get(..LENGTH_PREFIX) else {
        return Ok(None);
    };
    let mut be = [0u8; LENGTH_PREFIX];
    be.copy_from_slice(prefix);
    let len = u32::from_be_bytes(be) as usize;
    if len > max {
        return Err(DecodeError::TooLarge { len, max });
    }
    Ok(Some(len))
}

/// The first frame on every stream: what the opener wants this stream to be.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StreamOpen {
    /// The session's control stream, opened once by the agent right after connecting.
    Control(ControlOpen),
    /// Gateway -> agent: open a TCP connection to a node-side target.
    Dial(DialRequest),
    /// Agent -> gateway: carry node-side traffic to a named control-plane target.
    Forward(ForwardRequest),
    /// A kind this peer does not know; refused with [`ErrorCode::Unsupported`].
    #[serde(other)]
    Unknown,
}

/// Body of the control stream's open frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlOpen {
    /// Highest protocol version the agent speaks.
    pub version: u32,
}

/// Body of a dial stream's open frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DialRequest {
    /// `host:port` as the client asked for it (`[v6]:port` for IPv6 literals).
    pub target: String,
    /// How long the agent may spend connecting, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Correlates the gateway's and the agent's logs for one dial.
    #[serde(default)]
    pub request_id: u64,
}

/// Body of a forward stream's open frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardRequest {
    /// Name of a control-plane target in the tenant's allow list (never a free `host:port`).
    pub target: String,
}

/// The acceptor's answer to a [`StreamOpen`]; raw bytes follow only when it is `ok`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamResult {
    /// Whether the stream is open for data.
    pub ok: bool,
    /// Why not, when `ok` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<ErrorCode>,
    /// A short human-readable reason, when `ok` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl StreamResult {
    /// The stream is open.
    pub fn ok() -> Self {
        Self { ok: true, code: None, message: None }
    }

    /// The stream is refused with `code` and a reason.
    pub fn refused(code: ErrorCode, message: impl Into<String>) -> Self {
        Self { ok: false, code: Some(code), message: Some(message.into()) }
    }
}

/// Why a stream was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The target is not on the allow list.
    NotAllowed,
    /// The target could not be resolved or connected to.
    DialFailed,
    /// Connecting to the target took longer than allowed.
    Timeout,
    /// The named target does not exist.
    UnknownTarget,
    /// The stream kind is not supported by this peer.
    Unsupported,
    /// A limit was reached (streams, pending dials).
    LimitExceeded,
    /// The open frame was malformed.
    BadRequest,
    /// The peer is shutting down and takes no new streams.
    Draining,
    /// A code this peer does not know.
    #[serde(other)]
    Other,
}

impl ErrorCode {
    /// Stable snake_case name, used in metrics labels and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotAllowed => "not_allowed",
            Self::DialFailed => "dial_failed",
            Self::Timeout => "timeout",
            Self::UnknownTarget => "unknown_target",
            Self::Unsupported => "unsupported",
            Self::LimitExceeded => "limit_exceeded",
            Self::BadRequest => "bad_request",
            Self::Draining => "draining",
            Self::Other => "other",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Messages on the control stream, in both directions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ControlMessage {
    /// Agent -> gateway, first message: who the agent is and what it serves.
    Hello(Hello),
    /// Gateway -> agent, answer to Hello.
    Welcome(Welcome),
    /// Gateway -> agent: move to another replica before the deadline.
    Drain(Drain),
    /// Agent -> gateway: a fresh token for this live session.
    TokenRefresh(TokenRefresh),
    /// Gateway -> agent: the answer to a TokenRefresh.
    TokenRefreshResult(TokenRefreshResult),
    /// Agent -> gateway: the agent's identifiers changed.
    IdentifiersUpdate(Identifiers),
    /// Gateway -> agent: the number of gateway replicas changed (scale-out or scale-in).
    ServerCount(ServerCount),
    /// Agent -> gateway: the agent is stopping; route no new dials to this session, while the
    /// streams already open finish (the agent closes the session when they are done or its grace
    /// period is over).
    Leaving(Leaving),
    /// A message this peer does not know; ignored.
    #[serde(other)]
    Unknown,
}

/// The agent's introduction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Stable id of this agent (by default the node name).
    pub agent_id: String,
    /// Agent software version.
    #[serde(default)]
    pub version: String,
    /// What the agent can reach, used to route dials to it.
    #[serde(default)]
    pub identifiers: Identifiers,
    /// Optional features the agent supports.
    #[serde(default)]
    pub capabilities: Vec<String>,
}

/// What an agent declares it can reach.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identifiers {
    /// Host names (node name, FQDNs).
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Individual addresses (IPv4 and IPv6).
    #[serde(default)]
    pub addresses: Vec<IpAddr>,
    /// Networks in CIDR notation, e.g. `10.0.0.0/8`, `fd00::/64`.
    #[serde(default)]
    pub cidrs: Vec<String>,
    /// Whether dials that match no agent may be sent to this one.
    #[serde(default)]
    pub default_route: bool,
}

/// The gateway's answer to Hello.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// Stable id of the gateway replica.
    pub server_id: String,
    /// How many replicas serve this tenant (agents keep a session to each).
    #[serde(default = "one")]
    pub server_count: u32,
    /// The identity the gateway registered the agent under (a node name from the token wins).
    #[serde(default)]
    pub agent_id: String,
    /// Keepalive interval the gateway uses, in milliseconds.
    #[serde(default)]
    pub ping_interval_ms: u64,
    /// Most concurrent streams the gateway accepts on this session.
    #[serde(default)]
    pub max_streams: u32,
    /// Seconds since the Unix epoch when the session's token expires; refresh before then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_expires_at: Option<u64>,
}

fn one() -> u32 {
    1
}

/// Move to another replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drain {
    /// Milliseconds until the gateway closes the session.
    pub deadline_ms: u64,
    /// Why, for logs.
    #[serde(default)]
    pub reason: String,
}

/// The agent is going away.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leaving {
    /// Milliseconds until the agent closes the session at the latest.
    pub deadline_ms: u64,
    /// Why, for logs.
    #[serde(default)]
    pub reason: String,
}

/// How many gateway replicas serve the tenant now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerCount {
    /// Replicas; agents keep one session to each.
    pub server_count: u32,
}

/// A fresh token for a live session.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRefresh {
    /// The token. Never logged: `Debug` redacts it.
    pub token: String,
}

impl fmt::Debug for TokenRefresh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenRefresh").field("token", &"<redacted>").finish()
    }
}

/// The answer to a token refresh.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRefreshResult {
    /// Whether the token was accepted.
    pub ok: bool,
    /// Seconds since the Unix epoch when the accepted token expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<u64>,
    /// Why the token was refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Reads the `kind` of a stream open frame body for error messages about unknown kinds.
pub fn stream_kind_name(frame: &[u8]) -> String {
    #[derive(Deserialize)]
    struct Kind {
        kind: String,
    }
    let body = frame.get(LENGTH_PREFIX..).unwrap_or_default();
    serde_json::from_slice::<Kind>(body).map(|k| k.kind.chars().take(64).collect()).unwrap_or_else(|_| "?".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<T: Serialize + DeserializeOwned + PartialEq + fmt::Debug>(msg: &T, max: usize) {
        let bytes = encode(msg, max).unwrap();
        let (back, used): (T, usize) = decode(&bytes, max).unwrap().unwrap();
        assert_eq!(&back, msg);
        assert_eq!(used, bytes.len());
    }

    #[test]
    fn stream_frames_round_trip() {
        round_trip(&StreamOpen::Control(ControlOpen { version: 1 }), MAX_STREAM_FRAME);
        round_trip(
            &StreamOpen::Dial(DialRequest { target: "10.0.0.5:10250".into(), timeout_ms: Some(5000), request_id: 42 }),
            MAX_STREAM_FRAME,
        );
        round_trip(
            &StreamOpen::Dial(DialRequest { target: "[fd00::1]:22".into(), timeout_ms: None, request_id: 0 }),
            MAX_STREAM_FRAME,
        );
        round_trip(&StreamOpen::Forward(ForwardRequest { target: "kube-apiserver".into() }), MAX_STREAM_FRAME);
        round_trip(&StreamResult::ok(), MAX_STREAM_FRAME);
        round_trip(&StreamResult::refused(ErrorCode::NotAllowed, "port 22 is not allowed"), MAX_STREAM_FRAME);
    }

    #[test]
    fn control_messages_round_trip() {
        round_trip(
            &ControlMessage::Hello(Hello {
                agent_id: "node-1".into(),
                version: "0.1.0".into(),
                identifiers: Identifiers {
                    hosts: vec!["node-1".into(), "node-1.example.com".into()],
                    addresses: vec!["10.0.0.5".parse().unwrap(), "fd00::5".parse().unwrap()],
                    cidrs: vec!["10.0.0.0/24".into()],
                    default_route: true,
                },
                capabilities: vec!["forward".into()],
            }),
            MAX_CONTROL_FRAME,
        );
        round_trip(
            &ControlMessage::Welcome(Welcome {
                server_id: "gw-0".into(),
                server_count: 3,
                agent_id: "node-1".into(),
                ping_interval_ms: 20_000,
                max_streams: 4096,
                token_expires_at: Some(1_700_000_000),
            }),
            MAX_CONTROL_FRAME,
        );
        round_trip(&ControlMessage::Drain(Drain { deadline_ms: 30_000, reason: "shutdown".into() }), MAX_CONTROL_FRAME);
        round_trip(&ControlMessage::TokenRefresh(TokenRefresh { token: "a.b.c".into() }), MAX_CONTROL_FRAME);
        round_trip(
            &ControlMessage::TokenRefreshResult(TokenRefreshResult {
                ok: false,
                expires_at: None,
                message: Some("expired".into()),
            }),
            MAX_CONTROL_FRAME,
        );
        round_trip(&ControlMessage::IdentifiersUpdate(Identifiers::default()), MAX_CONTROL_FRAME);
        round_trip(&ControlMessage::ServerCount(ServerCount { server_count: 4 }), MAX_CONTROL_FRAME);
    }

    #[test]
    fn wire_format_is_length_prefixed_json() {
        let bytes = encode(&StreamResult::ok(), MAX_STREAM_FRAME).unwrap();
        assert_eq!(&bytes[..4], &(bytes.len() as u32 - 4).to_be_bytes());
        assert_eq!(&bytes[4..], br#"{"ok":true}"#);
    }

    #[test]
    fn truncated_input_asks_for_more() {
        let bytes = encode(&StreamOpen::Forward(ForwardRequest { target: "kas".into() }), MAX_STREAM_FRAME).unwrap();
        for cut in 0..bytes.len() {
            assert_eq!(decode::<StreamOpen>(&bytes[..cut], MAX_STREAM_FRAME), Ok(None), "cut at {cut}");
        }
    }

    #[test]
    fn trailing_bytes_are_left_for_the_stream() {
        let mut bytes = encode(&StreamResult::ok(), MAX_STREAM_FRAME).unwrap().to_vec();
        let frame_len = bytes.len();
        bytes.extend_from_slice(b"raw payload");
        let (_, used) = decode::<StreamResult>(&bytes, MAX_STREAM_FRAME).unwrap().unwrap();
        assert_eq!(used, frame_len);
        assert_eq!(&bytes[used..], b"raw payload");
    }

    #[test]
    fn oversized_frames_fail_before_the_body_arrives() {
        let prefix = (MAX_STREAM_FRAME as u32 + 1).to_be_bytes();
        assert_eq!(
            decode::<StreamOpen>(&prefix, MAX_STREAM_FRAME),
            Err(DecodeError::TooLarge { len: MAX_STREAM_FRAME + 1, max: MAX_STREAM_FRAME })
        );
        assert_eq!(
            decode::<StreamOpen>(&u32::MAX.to_be_bytes(), MAX_STREAM_FRAME),
            Err(DecodeError::TooLarge { len: u32::MAX as usize, max: MAX_STREAM_FRAME })
        );
        let big = DialRequest { target: "x".repeat(MAX_STREAM_FRAME), timeout_ms: None, request_id: 1 };
        assert!(matches!(encode(&StreamOpen::Dial(big), MAX_STREAM_FRAME), Err(EncodeError::TooLarge { .. })));
    }

    #[test]
    fn unknown_kinds_and_types_decode_to_unknown() {
        let frame = with_prefix(br#"{"kind":"teleport","target":"moon:1"}"#);
        let (open, _) = decode::<StreamOpen>(&frame, MAX_STREAM_FRAME).unwrap().unwrap();
        assert_eq!(open, StreamOpen::Unknown);
        assert_eq!(stream_kind_name(&frame), "teleport");

        let frame = with_prefix(br#"{"type":"weather_report","sunny":true}"#);
        let (msg, _) = decode::<ControlMessage>(&frame, MAX_CONTROL_FRAME).unwrap().unwrap();
        assert_eq!(msg, ControlMessage::Unknown);

        let frame = with_prefix(br#"{"ok":false,"code":"cosmic_rays","message":"m"}"#);
        let (result, _) = decode::<StreamResult>(&frame, MAX_STREAM_FRAME).unwrap().unwrap();
        assert_eq!(result.code, Some(ErrorCode::Other));
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let frame = with_prefix(br#"{"kind":"dial","target":"a:1","request_id":7,"priority":"high","trace":{"x":1}}"#);
        let (open, _) = decode::<StreamOpen>(&frame, MAX_STREAM_FRAME).unwrap().unwrap();
        assert_eq!(open, StreamOpen::Dial(DialRequest { target: "a:1".into(), timeout_ms: None, request_id: 7 }));
        let frame = with_prefix(br#"{"type":"welcome","server_id":"gw","future":[1,2,3]}"#);
        let (msg, _) = decode::<ControlMessage>(&frame, MAX_CONTROL_FRAME).unwrap().unwrap();
        assert!(matches!(msg, ControlMessage::Welcome(Welcome { server_count: 1, .. })));
    }

    #[test]
    fn malformed_bodies_are_errors() {
        for body in [&b"not json"[..], b"[]", b"{}", br#"{"kind":"dial"}"#, br#"{"kind":7}"#, b"\xff\xfe"] {
            let frame = with_prefix(body);
            assert!(
                matches!(decode::<StreamOpen>(&frame, MAX_STREAM_FRAME), Err(DecodeError::Malformed(_))),
                "{body:?}"
            );
        }
    }

    #[test]
    fn tokens_are_redacted_in_debug_output() {
        let msg = ControlMessage::TokenRefresh(TokenRefresh { token: "eyJsecret".into() });
        let shown = format!("{msg:?}");
        assert!(!shown.contains("eyJsecret"), "{shown}");
    }

    /// A cheap stand-in for a fuzzer that runs on stable: random and mutated frames never panic the
    /// decoder, and whatever decodes re-encodes.
    #[test]
    fn random_input_never_panics() {
        let seeds: Vec<Bytes> = vec![
            encode(
                &StreamOpen::Dial(DialRequest { target: "h:1".into(), timeout_ms: Some(1), request_id: 2 }),
                MAX_STREAM_FRAME,
            )
            .unwrap(),
            encode(
                &ControlMessage::Hello(Hello {
                    agent_id: "a".into(),
                    version: String::new(),
                    identifiers: Identifiers::default(),
                    capabilities: vec![],
                }),
                MAX_CONTROL_FRAME,
            )
            .unwrap(),
        ];
        let mut rng = fastrand::Rng::with_seed(0x7e7e);
        for i in 0..20_000 {
            let mut input = if i % 2 == 0 {
                seeds[i % seeds.len()].to_vec()
            } else {
                (0..rng.usize(0..64)).map(|_| rng.u8(..)).collect()
            };
            for _ in 0..rng.usize(0..4) {
                if !input.is_empty() {
                    let at = rng.usize(..input.len());
                    input[at] = rng.u8(..);
                }
            }
            if let Ok(Some((msg, _))) = decode::<StreamOpen>(&input, MAX_STREAM_FRAME) {
                encode(&msg, MAX_CONTROL_FRAME).unwrap();
            }
            if let Ok(Some((msg, _))) = decode::<ControlMessage>(&input, MAX_CONTROL_FRAME) {
                encode(&msg, MAX_CONTROL_FRAME * 2).unwrap();
            }
            let _ = decode::<StreamResult>(&input, MAX_STREAM_FRAME);
            let _ = stream_kind_name(&input);
        }
    }

    fn with_prefix(body: &[u8]) -> Vec<u8> {
        let mut v = (body.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(body);
        v
    }
}
