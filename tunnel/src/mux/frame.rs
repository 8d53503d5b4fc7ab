//! yamux frames (the HashiCorp yamux specification), sans-IO: a 12-byte header, then, for data
//! frames only, `length` bytes of body.
//!
//! ```text
//! +---------+--------+---------+-------------+-------------+
//! | version | type   | flags   | stream id   | length      |
//! | u8 (0)  | u8     | u16 BE  | u32 BE      | u32 BE      |
//! +---------+--------+---------+-------------+-------------+
//! ```
//!
//! [`FrameReader`] cuts frames out of the chunks a link delivers. A body that lies within one chunk,
//! or across chunks that are neighbours in one read buffer, is handed on as a slice of it (no
//! copy). A data frame whose body straddles separate buffers is handed on in pieces, each a slice
//! of its own buffer, as if the peer had sent it as several smaller frames: SYN and ACK go with
//! the first piece, FIN and RST with the last. Only a header that straddles two buffers (at most
//! 12 bytes) is copied, and small bodies are copied out so that they do not pin a large chunk in
//! memory.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 12;
/// The only protocol version.
pub const VERSION: u8 = 0;
/// The receive window every stream starts with, on both sides (fixed by the specification).
pub const DEFAULT_WINDOW: u32 = 256 * 1024;
/// Largest data-frame body accepted or sent (rust-yamux refuses larger ones too).
pub const MAX_BODY: u32 = 1024 * 1024;

/// Frame types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Stream data (the body follows the header).
    Data,
    /// More send credit for a stream (`length` is the increment).
    WindowUpdate,
    /// Liveness and round-trip probe (`length` is an opaque value echoed back).
    Ping,
    /// The session is ending (`length` is a [`GoAway`] code).
    GoAway,
}

impl Kind {
    fn code(self) -> u8 {
        match self {
            Self::Data => 0,
            Self::WindowUpdate => 1,
            Self::Ping => 2,
            Self::GoAway => 3,
        }
    }
}

/// Header flags.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct Flags(pub u16);

impl Flags {
    /// No flag.
    pub const NONE: Self = Self(0);
    /// Opens a stream.
    pub const SYN: Self = Self(1);
    /// Acknowledges a stream (or answers a ping).
    pub const ACK: Self = Self(2);
    /// Half-close: the sender sends no more data on the stream.
    pub const FIN: Self = Self(4);
    /// Aborts the stream in both directions.
    pub const RST: Self = Self(8);

    /// Whether every flag in `other` is set.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// These flags with those in `other` cleared.
    pub fn without(self, other: Self) -> Self {
        Self(self.0 & !other.0)
    }
}

impl std::ops::BitOr for Flags {
    type Output = Self;
    fn bitor(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }
}

impl std::fmt::Debug for Flags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names = [(Self::SYN, "SYN"), (Self::ACK, "ACK"), (Self::FIN, "FIN"), (Self::RST, "RST")];
        let set: Vec<&str> = names.iter().filter(|(flag, _)| self.contains(*flag)).map(|(_, n)| *n).collect();
        write!(f, "{}", if set.is_empty() { "-".to_owned() } else { set.join("|") })
    }
}

/// `GoAway` codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GoAway {
    /// Normal termination.
    Normal,
    /// The peer broke the protocol.
    ProtocolError,
    /// An internal error.
    InternalError,
}

impl GoAway {
    /// The wire value.
    pub fn code(self) -> u32 {
        match self {
            Self::Normal => 0,
            Self::ProtocolError => 1,
            Self::InternalError => 2,
        }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The frame type.
    pub kind: Kind,
    /// Its flags.
    pub flags: Flags,
    /// The stream (0 for session-level frames).
    pub stream_id: u32,
    /// Body length (data), window increment (window update), opaque value (ping) or code (go away).
    pub length: u32,
}

/// Why bytes are not a frame header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A version other than 0.
    #[error("unsupported multiplexer version {0}")]
    Version(u8),
    /// A type other than the four defined.
    #[error("unknown multiplexer frame type {0}")]
    Kind(u8),
    /// A data frame longer than [`MAX_BODY`].
    #[error("multiplexer frame of {0} bytes is larger than {MAX_BODY}")]
    TooLarge(u32),
}

impl Header {
    /// A data frame header for `length` body bytes.
    pub fn data(stream_id: u32, length: u32, flags: Flags) -> Self {
        Self { kind: Kind::Data, flags, stream_id, length }
    }

    /// A window update granting `increment` more bytes.
    pub fn window_update(stream_id: u32, increment: u32, flags: Flags) -> Self {
        Self { kind: Kind::WindowUpdate, flags, stream_id, length: increment }
    }

    /// A ping (or, with [`Flags::ACK`], the answer to one).
    pub fn ping(opaque: u32, flags: Flags) -> Self {
        Self { kind: Kind::Ping, flags, stream_id: 0, length: opaque }
    }

    /// A go-away with `code`.
    pub fn go_away(code: GoAway) -> Self {
        Self { kind: Kind::GoAway, flags: Flags::NONE, stream_id: 0, length: code.code() }
    }

    /// Bytes of body that follow this header.
    pub fn body_len(&self) -> usize {
        if self.kind == Kind::Data { self.length as usize } else { 0 }
    }

    /// The 12 header bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0] = VERSION;
        out[1] = self.kind.code();
        out[2..4].copy_from_slice(&self.flags.0.to_be_bytes());
        out[4..8].copy_from_slice(&self.stream_id.to_be_bytes());
        out[8..12].copy_from_slice(&self.length.to_be_bytes());
        out
    }

    /// Parses and checks 12 header bytes.
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Self, FrameError> {
        if bytes[0] != VERSION {
            return Err(FrameError::Version(bytes[0]));
        }
        let kind = match bytes[1] {
            0 => Kind::Data,
            1 => Kind::WindowUpdate,
            2 => Kind::Ping,
            3 => Kind::GoAway,
            other => return Err(FrameError::Kind(other)),
        };
        let word = |at: usize| u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
        let header =
            Self { kind, flags: Flags(u16::from_be_bytes([bytes[2], bytes[3]])), stream_id: word(4), length: word(8) };
        if kind == Kind::Data && header.length > MAX_BODY {
            return Err(FrameError::TooLarge(header.length));
        }
        Ok(header)
    }
}

/// Appends a frame (header, then `body`) to `out`.
pub fn put_frame(out: &mut BytesMut, header: Header, body: &[u8]) {
    out.put_slice(&header.encode());
    out.put_slice(body);
}

/// A frame cut out of the byte stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Its header.
    pub header: Header,
    /// The body (data frames only; empty otherwise).
    pub body: Bytes,
}

/// Cuts frames out of the chunks of the peer's byte stream. Push a chunk, then take frames until
/// [`next_frame`](Self::next_frame) answers `None`, then push the next chunk.
#[derive(Debug, Default)]
pub struct FrameReader {
    /// The start of a header that straddles separate buffers, being completed by copying.
    partial: BytesMut,
    /// What is left of the chunks pushed.
    rest: BytesMut,
    /// Length of the data pushed last, to judge what a slice of it would pin.
    chunk_len: usize,
    /// A data frame whose body is being handed on in pieces.
    body: Option<BodyLeft>,
}

/// What remains of a data frame handed on in pieces.
#[derive(Debug, Clone, Copy)]
struct BodyLeft {
    header: Header,
    left: usize,
    /// Whether a piece has gone out (SYN and ACK travel with the first piece only).
    started: bool,
}

impl FrameReader {
    /// A reader with nothing buffered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the next chunk; call after [`next_frame`](Self::next_frame) has answered `None`. A
    /// chunk that continues the previous one in memory (the next part of the same read buffer)
    /// joins it without a copy.
    pub fn push(&mut self, chunk: BytesMut) {
        self.chunk_len = chunk.len();
        if self.rest.is_empty() {
            self.rest = chunk;
        } else if self.rest.as_ptr_range().end == chunk.as_ptr() {
            // O(1) when both are parts of one buffer (unsplit checks; it copies otherwise).
            self.rest.unsplit(chunk);
            self.chunk_len = self.rest.len();
        } else {
            // What is left is the start of a header (a body would have been handed on).
            let rest = std::mem::replace(&mut self.rest, chunk);
            self.partial.extend_from_slice(&rest);
        }
    }

    /// Whether the last frame handed on was a piece of a data frame whose body has more to come.
    pub fn inside_data_frame(&self) -> bool {
        self.body.is_some()
    }

    /// Bytes held for a frame that is not complete yet (bounded by one header and one chunk).
    pub fn buffered(&self) -> usize {
        self.partial.len() + self.rest.len()
    }

    /// The next frame (or piece of a data frame), `None` when more bytes are needed, or an error
    /// for a header that is not valid (the session must end: the stream cannot be resynchronised).
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if let Some(body) = self.body {
            return Ok(self.next_piece(body));
        }
        let header = if self.partial.is_empty() {
            if self.rest.len() < HEADER_LEN {
                return Ok(None);
            }
            let header = Header::decode(head(&self.rest))?;
            if self.rest.len() >= HEADER_LEN + header.body_len() {
                // The whole frame is here.
                let mut frame = self.rest.split_to(HEADER_LEN + header.body_len());
                let body = self.own(frame.split_off(HEADER_LEN));
                return Ok(Some(Frame { header, body }));
            }
            self.rest.advance(HEADER_LEN);
            header
        } else {
            let take = HEADER_LEN.saturating_sub(self.partial.len()).min(self.rest.len());
            self.partial.extend_from_slice(&self.rest.split_to(take));
            if self.partial.len() < HEADER_LEN {
                return Ok(None);
            }
            let header = Header::decode(head(&self.partial))?;
            self.partial.clear();
            header
        };
        if header.body_len() == 0 {
            return Ok(Some(Frame { header, body: Bytes::new() }));
        }
        let body = BodyLeft { header, left: header.body_len(), started: false };
        self.body = Some(body);
        Ok(self.next_piece(body))
    }

    /// The next piece of a data frame's body: what the current chunk holds of it.
    fn next_piece(&mut self, mut body: BodyLeft) -> Option<Frame> {
        let take = body.left.min(self.rest.len());
        if take == 0 {
            return None;
        }
        let piece = self.rest.split_to(take);
        body.left -= take;
        let mut flags = body.header.flags;
        if body.started {
            flags = flags.without(Flags::SYN | Flags::ACK);
        }
        if body.left > 0 {
            flags = flags.without(Flags::FIN | Flags::RST);
        }
        body.started = true;
        self.body = (body.left > 0).then_some(body);
        let length = u32::try_from(take).unwrap_or(u32::MAX);
        let header = Header::data(body.header.stream_id, length, flags);
        Some(Frame { header, body: self.own(piece) })
    }

    /// A body as handed on: a slice of its chunk, or a copy when it is small next to the chunk
    /// (a small slice would pin its whole chunk for as long as the stream keeps it).
    fn own(&self, body: BytesMut) -> Bytes {
        if body.len() * 4 >= self.chunk_len { body.freeze() } else { Bytes::copy_from_slice(&body) }
    }
}

fn head(bytes: &[u8]) -> &[u8; HEADER_LEN] {
    // Callers check the length first; an empty array is never reached.
    bytes.first_chunk::<HEADER_LEN>().unwrap_or(&[0xff; HEADER_LEN])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame_bytes(header: Header, body: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        put_frame(&mut out, header, body);
        out.to_vec()
    }

    #[test]
    fn headers_round_trip_and_match_the_specification_layout() {
        let header = Header::data(7, 3, Flags::SYN | Flags::FIN);
        let bytes = header.encode();
        assert_eq!(bytes, [0, 0, 0, 5, 0, 0, 0, 7, 0, 0, 0, 3]);
        assert_eq!(Header::decode(&bytes), Ok(header));
        let ping = Header::ping(0xdead_beef, Flags::ACK);
        assert_eq!(ping.encode(), [0, 2, 0, 2, 0, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef]);
        assert_eq!(ping.body_len(), 0);
        assert_eq!(Header::go_away(GoAway::ProtocolError).encode()[8..], [0, 0, 0, 1]);
    }

    #[test]
    fn bad_headers_are_refused() {
        let mut bytes = Header::data(1, 0, Flags::NONE).encode();
        bytes[0] = 1;
        assert_eq!(Header::decode(&bytes), Err(FrameError::Version(1)));
        bytes[0] = 0;
        bytes[1] = 9;
        assert_eq!(Header::decode(&bytes), Err(FrameError::Kind(9)));
        let big = Header::data(1, MAX_BODY + 1, Flags::NONE).encode();
        assert_eq!(Header::decode(&big), Err(FrameError::TooLarge(MAX_BODY + 1)));
        // A window update's length is an increment, not a body: any value is a valid header.
        assert!(Header::decode(&Header::window_update(1, u32::MAX, Flags::NONE).encode()).is_ok());
    }

    #[test]
    fn frames_are_cut_from_chunks_split_anywhere() {
        let frames = [
            (Header::data(1, 5, Flags::SYN), b"hello".to_vec()),
            (Header::window_update(1, 1000, Flags::ACK), Vec::new()),
            (Header::data(3, 70_000, Flags::NONE), vec![7u8; 70_000]),
            (Header::ping(42, Flags::NONE), Vec::new()),
            (Header::data(1, 0, Flags::FIN), Vec::new()),
        ];
        let mut stream = Vec::new();
        for (header, body) in &frames {
            stream.extend(frame_bytes(*header, body));
        }
        for chunk_size in [1, 5, 12, 13, 100, 4096, 70_012, stream.len()] {
            let mut reader = FrameReader::new();
            let mut got: Vec<(Header, Vec<u8>)> = Vec::new();
            let mut open_piece = false;
            for chunk in stream.chunks(chunk_size) {
                // Every chunk is a buffer of its own, as after a read into a new buffer.
                reader.push(BytesMut::from(chunk));
                while let Some(frame) = reader.next_frame().unwrap() {
                    // Pieces of one data frame are joined again: the stream sees the same bytes.
                    match got.last_mut() {
                        Some((header, body)) if open_piece => {
                            assert_eq!(frame.header.stream_id, header.stream_id);
                            assert!(!frame.header.flags.contains(Flags::SYN), "SYN only on the first piece");
                            header.flags = header.flags | frame.header.flags;
                            header.length += frame.header.length;
                            body.extend_from_slice(&frame.body);
                        }
                        _ => got.push((frame.header, frame.body.to_vec())),
                    }
                    assert_eq!(frame.header.body_len(), frame.body.len());
                    open_piece = reader.inside_data_frame();
                }
            }
            assert_eq!(got, frames, "chunks of {chunk_size}");
            assert_eq!(reader.buffered(), 0);
        }
    }

    #[test]
    fn a_data_frame_across_separate_buffers_goes_on_in_slices_of_them() {
        let stream = frame_bytes(Header::data(5, 60_000, Flags::SYN | Flags::FIN), &[3u8; 60_000]);
        let (first, second) = (BytesMut::from(&stream[..30_000]), BytesMut::from(&stream[30_000..]));
        let ranges = [first.as_ptr_range(), second.as_ptr_range()];
        let mut reader = FrameReader::new();
        reader.push(first);
        let head = reader.next_frame().unwrap().unwrap();
        assert!(reader.next_frame().unwrap().is_none());
        reader.push(second);
        let tail = reader.next_frame().unwrap().unwrap();
        assert!(reader.next_frame().unwrap().is_none());
        assert!(ranges[0].contains(&head.body.as_ptr()), "the first piece is a slice of the first buffer");
        assert!(ranges[1].contains(&tail.body.as_ptr()), "the second piece is a slice of the second buffer");
        assert_eq!(head.header, Header::data(5, 30_000 - 12, Flags::SYN));
        assert_eq!(tail.header, Header::data(5, 30_012, Flags::FIN));
        assert_eq!(head.body.len() + tail.body.len(), 60_000);
        assert_eq!(reader.buffered(), 0);
    }

    #[test]
    fn a_body_inside_one_chunk_is_not_copied_but_a_small_one_is() {
        let mut stream = frame_bytes(Header::data(1, 60_000, Flags::NONE), &[1u8; 60_000]);
        stream.extend(frame_bytes(Header::data(3, 10, Flags::NONE), &[2u8; 10]));
        let chunk = BytesMut::from(&stream[..]);
        let range = chunk.as_ptr_range();
        let mut reader = FrameReader::new();
        reader.push(chunk);
        let big = reader.next_frame().unwrap().unwrap();
        assert!(range.contains(&big.body.as_ptr()), "a large body is a slice of the chunk");
        let small = reader.next_frame().unwrap().unwrap();
        assert!(!range.contains(&small.body.as_ptr()), "a small body is copied out");
        assert_eq!(&small.body[..], &[2u8; 10]);
    }

    #[test]
    fn a_frame_across_neighbouring_chunks_of_one_buffer_is_not_copied() {
        let stream = frame_bytes(Header::data(1, 60_000, Flags::NONE), &[1u8; 60_000]);
        let mut buffer = BytesMut::from(&stream[..]);
        let range = buffer.as_ptr_range();
        // The cut is inside the header: the chunks join again, and the frame comes out whole.
        let first = buffer.split_to(6);
        let mut reader = FrameReader::new();
        reader.push(first);
        assert!(reader.next_frame().unwrap().is_none());
        reader.push(buffer);
        let frame = reader.next_frame().unwrap().unwrap();
        assert!(range.contains(&frame.body.as_ptr()), "the body is a slice of the read buffer");
        assert_eq!(frame.body.len(), 60_000);
    }

    #[test]
    fn an_invalid_header_is_reported_before_its_body_arrives() {
        let mut reader = FrameReader::new();
        let mut bytes = Header::data(1, MAX_BODY + 1, Flags::NONE).encode().to_vec();
        bytes.truncate(12);
        reader.push(BytesMut::from(&bytes[..]));
        assert!(matches!(reader.next_frame(), Err(FrameError::TooLarge(_))));
    }
}
