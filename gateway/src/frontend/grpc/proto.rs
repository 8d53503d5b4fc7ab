//! The messages of Konnectivity's `ProxyService` (gateway/proto/konnectivity.proto), as prost
//! types. They mirror the .proto field for field (no protoc is needed to build the gateway); the
//! end-to-end tests drive the gateway with a client generated from the .proto by grpcio-tools, so
//! a field that drifts fails the suite.

use bytes::Bytes;

/// What a [`Packet`] carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum PacketType {
    /// Client -> server: open a connection.
    DialReq = 0,
    /// Server -> client: the dial's outcome.
    DialRsp = 1,
    /// Client -> server: close an open connection.
    CloseReq = 2,
    /// Server -> client: a connection is closed.
    CloseRsp = 3,
    /// Bytes of a connection, either way.
    Data = 4,
    /// Client -> server: cancel a pending dial (or server -> client: a dial was cancelled).
    DialCls = 5,
    /// Agent <-> server only; never on a frontend.
    Drain = 6,
}

/// One message of the `Proxy` stream.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Packet {
    /// The packet type.
    #[prost(enumeration = "PacketType", tag = "1")]
    pub r#type: i32,
    /// The payload matching the type.
    #[prost(oneof = "Payload", tags = "2, 3, 4, 5, 6, 7, 8")]
    pub payload: Option<Payload>,
}

/// A packet's payload.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Payload {
    /// `dialRequest`.
    #[prost(message, tag = "2")]
    DialRequest(DialRequest),
    /// `dialResponse`.
    #[prost(message, tag = "3")]
    DialResponse(DialResponse),
    /// `data`.
    #[prost(message, tag = "4")]
    Data(Data),
    /// `closeRequest`.
    #[prost(message, tag = "5")]
    CloseRequest(CloseRequest),
    /// `closeResponse`.
    #[prost(message, tag = "6")]
    CloseResponse(CloseResponse),
    /// `closeDial`.
    #[prost(message, tag = "7")]
    CloseDial(CloseDial),
    /// `drain`.
    #[prost(message, tag = "8")]
    Drain(Drain),
}

/// Open a connection to `address`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DialRequest {
    /// Always `tcp` from kube-apiserver.
    #[prost(string, tag = "1")]
    pub protocol: String,
    /// `host:port`.
    #[prost(string, tag = "2")]
    pub address: String,
    /// The client's id for the dial.
    #[prost(int64, tag = "3")]
    pub random: i64,
}

/// A dial's outcome: an error, or the connection's id.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DialResponse {
    /// Empty on success.
    #[prost(string, tag = "1")]
    pub error: String,
    /// The connection's id (non-zero on success).
    #[prost(int64, tag = "2")]
    pub connect_id: i64,
    /// The request's `random`.
    #[prost(int64, tag = "3")]
    pub random: i64,
}

/// Close a connection.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CloseRequest {
    /// The connection.
    #[prost(int64, tag = "1")]
    pub connect_id: i64,
}

/// A connection closed.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CloseResponse {
    /// Why, when it ended in an error.
    #[prost(string, tag = "1")]
    pub error: String,
    /// The connection.
    #[prost(int64, tag = "2")]
    pub connect_id: i64,
}

/// Cancel a pending dial.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CloseDial {
    /// The dial's `random`.
    #[prost(int64, tag = "1")]
    pub random: i64,
}

/// Agent <-> server drain notice (no fields).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Drain {}

/// Bytes of a connection.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Data {
    /// The connection.
    #[prost(int64, tag = "1")]
    pub connect_id: i64,
    /// An error (unused by kube-apiserver's client).
    #[prost(string, tag = "2")]
    pub error: String,
    /// The bytes.
    #[prost(bytes = "bytes", tag = "3")]
    pub data: Bytes,
}

impl Packet {
    /// A `DIAL_REQ`.
    pub fn dial_request(address: &str, random: i64) -> Self {
        Self::with(
            PacketType::DialReq,
            Payload::DialRequest(DialRequest { protocol: "tcp".into(), address: address.into(), random }),
        )
    }

    /// A `DIAL_RSP`: `Ok(connect_id)` or the error string.
    pub fn dial_response(random: i64, outcome: Result<i64, String>) -> Self {
        let (connect_id, error) = match outcome {
            Ok(id) => (id, String::new()),
            Err(error) => (0, error),
        };
        Self::with(PacketType::DialRsp, Payload::DialResponse(DialResponse { error, connect_id, random }))
    }

    /// A `CLOSE_REQ`.
    pub fn close_request(connect_id: i64) -> Self {
        Self::with(PacketType::CloseReq, Payload::CloseRequest(CloseRequest { connect_id }))
    }

    /// A `CLOSE_RSP`, with an error string when the connection ended in one.
    pub fn close_response(connect_id: i64, error: &str) -> Self {
        Self::with(PacketType::CloseRsp, Payload::CloseResponse(CloseResponse { error: error.into(), connect_id }))
    }

    /// A `DIAL_CLS`.
    pub fn close_dial(random: i64) -> Self {
        Self::with(PacketType::DialCls, Payload::CloseDial(CloseDial { random }))
    }

    /// A `DATA`.
    pub fn data(connect_id: i64, data: Bytes) -> Self {
        Self::with(PacketType::Data, Payload::Data(Data { connect_id, error: String::new(), data }))
    }

    fn with(kind: PacketType, payload: Payload) -> Self {
        Self { r#type: kind as i32, payload: Some(payload) }
    }
}
