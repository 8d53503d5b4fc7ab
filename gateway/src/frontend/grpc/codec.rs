//! gRPC message framing over HTTP/2 bodies: every message is a 1-byte compression flag, a 4-byte
//! big-endian length and the protobuf bytes. Used by the gateway's frontend and by clients (the
//! load-test harness).

use std::fmt;
use std::future::poll_fn;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use hyper::body::Body;
use prost::Message;
use prost::encoding::{encode_varint, encoded_len_varint};

use super::proto::{Packet, PacketType};

/// Largest message accepted (gRPC's default receive limit).
pub const MAX_MESSAGE: usize = 4 * 1024 * 1024;

/// Length of the prefix in front of every message.
const PREFIX: usize = 5;

/// Why a message stream could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The HTTP/2 stream failed (reset, connection lost).
    #[error("stream failed: {0}")]
    Stream(String),
    /// A compressed message: the gateway announces no compression, so none may arrive.
    #[error("compressed messages are not supported")]
    Compressed,
    /// A message over [`MAX_MESSAGE`].
    #[error("message of {0} bytes is larger than the limit of {MAX_MESSAGE} bytes")]
    TooLarge(usize),
    /// The stream ended inside a message.
    #[error("stream ended inside a message")]
    Truncated,
    /// Not a `Packet`.
    #[error("malformed message: {0}")]
    Malformed(#[from] prost::DecodeError),
}

impl ReadError {
    /// The gRPC status code to end the stream with.
    pub fn code(&self) -> u32 {
        match self {
            Self::Stream(_) => 1, // CANCELLED: nobody is there to read it
            Self::Compressed => 12,
            Self::TooLarge(_) => 8,
            Self::Truncated | Self::Malformed(_) => 13,
        }
    }
}

/// Reads the packets of an HTTP/2 body, one message at a time. A frame is pulled from the body
/// only when no whole message is buffered, so the body's flow-control window is released only
/// as fast as the packets are taken: a slow consumer holds back its sender.
pub struct MessageReader<B> {
    body: B,
    buf: BytesMut,
    ended: bool,
}

impl<B> fmt::Debug for MessageReader<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessageReader").field("buffered", &self.buf.len()).field("ended", &self.ended).finish()
    }
}

impl<B> MessageReader<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: fmt::Display,
{
    /// Reads messages from `body`.
    pub fn new(body: B) -> Self {
        Self { body, buf: BytesMut::new(), ended: false }
    }

    /// The next packet; `None` when the body ended cleanly between messages.
    pub async fn next(&mut self) -> Result<Option<Packet>, ReadError> {
        poll_fn(|cx| self.poll_next(cx)).await
    }

    /// Polls for the next packet.
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Packet>, ReadError>> {
        loop {
            if let Some(message) = take_message(&mut self.buf)? {
                return Poll::Ready(Ok(Some(Packet::decode(message)?)));
            }
            if self.ended {
                return Poll::Ready(if self.buf.is_empty() { Ok(None) } else { Err(ReadError::Truncated) });
            }
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                None => self.ended = true,
                Some(Err(e)) => return Poll::Ready(Err(ReadError::Stream(e.to_string()))),
                Some(Ok(frame)) => {
                    // Trailers (a client's) carry nothing for this protocol.
                    if let Ok(data) = frame.into_data() {
                        if self.buf.is_empty() {
                            self.buf = BytesMut::from(data);
                        } else {
                            self.buf.extend_from_slice(&data);
                        }
                    }
                }
            }
        }
    }
}

/// Splits one whole message off the front of `buf`, checking its prefix as soon as it is there.
fn take_message(buf: &mut BytesMut) -> Result<Option<Bytes>, ReadError> {
    if buf.len() < PREFIX {
        return Ok(None);
    }
    if buf[0] != 0 {
        return Err(ReadError::Compressed);
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(ReadError::TooLarge(len));
    }
    if buf.len() < PREFIX + len {
        return Ok(None);
    }
    buf.advance(PREFIX);
    Ok(Some(buf.split_to(len).freeze()))
}

/// One packet as a length-prefixed message.
pub fn encode(packet: &Packet) -> Bytes {
    let len = packet.encoded_len();
    let mut buf = BytesMut::with_capacity(PREFIX + len);
    buf.put_u8(0);
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    // Encoding into a buffer with the exact room cannot fail.
    let _ = packet.encode(&mut buf);
    buf.freeze()
}

/// The prefix and protobuf head of a `DATA` packet carrying `len` bytes for `connect_id`: the
/// message is this head followed by the bytes themselves, so they are sent without a copy.
/// Byte for byte what encoding `Packet::data(connect_id, bytes)` gives.
pub fn data_head(connect_id: i64, len: usize) -> Bytes {
    // Data { connectID = 1 (varint), data = 3 (bytes) }; fields equal to zero are left out.
    let id = connect_id as u64;
    let id_len = if id == 0 { 0 } else { 1 + encoded_len_varint(id) };
    let data_len = if len == 0 { 0 } else { 1 + encoded_len_varint(len as u64) + len };
    let inner = id_len + data_len;
    // Packet { type = 1 (varint DATA), data = 4 (message) }.
    let packet = 2 + 1 + encoded_len_varint(inner as u64) + inner;
    let mut head = BytesMut::with_capacity(32);
    head.put_u8(0);
    head.put_u32(u32::try_from(packet).unwrap_or(u32::MAX));
    head.put_u8(0x08);
    head.put_u8(PacketType::Data as u8);
    head.put_u8(0x22);
    encode_varint(inner as u64, &mut head);
    if id != 0 {
        head.put_u8(0x08);
        encode_varint(id, &mut head);
    }
    if len != 0 {
        head.put_u8(0x1a);
        encode_varint(len as u64, &mut head);
    }
    head.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontend::grpc::proto::Payload;
    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::Frame;

    fn body_of(chunks: Vec<Bytes>) -> impl Body<Data = Bytes, Error = std::convert::Infallible> + Unpin {
        StreamBody::new(futures::stream::iter(chunks.into_iter().map(|c| Ok(Frame::data(c)))))
    }

    #[test]
    fn the_data_head_is_what_prost_encodes() {
        for (id, len) in [(1, 1), (7, 0), (0, 5), (i64::MAX, 32 * 1024), (-3, 16_384), (300, 200_000)] {
            let payload = Bytes::from(vec![0xa5; len]);
            let mut framed = data_head(id, len).to_vec();
            framed.extend_from_slice(&payload);
            assert_eq!(framed, encode(&Packet::data(id, payload)).to_vec(), "id {id} len {len}");
        }
    }

    #[tokio::test]
    async fn messages_split_and_merged_across_frames_are_read_whole() {
        let packets = vec![
            Packet::dial_request("10.0.0.1:10250", -42),
            Packet::data(9, Bytes::from(vec![1; 70_000])),
            Packet::close_request(9),
        ];
        let mut wire = Vec::new();
        for p in &packets {
            wire.extend_from_slice(&encode(p));
        }
        // Cut into uneven frames, some holding the end of one message and the start of the next.
        let chunks: Vec<Bytes> = wire.chunks(16_383).map(Bytes::copy_from_slice).collect();
        let mut reader = MessageReader::new(body_of(chunks));
        for expected in &packets {
            assert_eq!(reader.next().await.unwrap().as_ref(), Some(expected));
        }
        assert!(reader.next().await.unwrap().is_none());
        let Some(Payload::DialRequest(dial)) = &packets[0].payload else { unreachable!() };
        assert_eq!(dial.protocol, "tcp");
    }

    #[tokio::test]
    async fn bad_streams_are_refused_with_a_reason() {
        let read = |bytes: &'static [u8]| async move {
            MessageReader::new(body_of(vec![Bytes::from_static(bytes)])).next().await.unwrap_err()
        };
        assert!(matches!(read(b"\x01\x00\x00\x00\x01\x00").await, ReadError::Compressed));
        assert!(matches!(read(b"\x00\xff\xff\xff\xff").await, ReadError::TooLarge(_)));
        assert!(matches!(read(b"\x00\x00\x00\x00\x05\x08").await, ReadError::Truncated));
        assert!(matches!(read(b"\x00\x00\x00\x00\x02\xff\xff").await, ReadError::Malformed(_)));
        let body = StreamBody::new(futures::stream::iter(vec![Err::<Frame<Bytes>, _>("reset")]));
        let err = MessageReader::new(body).next().await.unwrap_err();
        assert_eq!(err.code(), 1);
        // A body that is collected whole still reads (trailers are ignored).
        let full = body_of(vec![encode(&Packet::close_dial(5))]).collect().await.unwrap().to_bytes();
        let mut reader = MessageReader::new(body_of(vec![full]));
        assert_eq!(reader.next().await.unwrap(), Some(Packet::close_dial(5)));
    }
}
