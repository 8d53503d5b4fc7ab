//! The multiplexer's frame reader, fed the peer's byte stream in arbitrary chunks: the frames (and
//! the first error) must not depend on how the stream was cut, whether the chunks are parts of one
//! buffer (joined without a copy) or separate buffers. A data frame whose body straddles buffers
//! comes out in pieces; joined again, the pieces must be the frame that was sent.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use tether_fuzz::Pieces;
use tether_tunnel::mux::frame::{Flags, Frame, FrameError, FrameReader, HEADER_LEN, Header};

#[derive(Debug, PartialEq)]
struct Outcome {
    /// Frames as sent: pieces joined.
    frames: Vec<(Header, Vec<u8>)>,
    /// Whether the last frame is a data frame still missing part of its body.
    open: bool,
    error: Option<FrameError>,
    buffered: usize,
}

fn drain(reader: &mut FrameReader, out: &mut Outcome) -> bool {
    loop {
        match reader.next_frame() {
            Ok(Some(frame)) => {
                let Frame { header, body } = frame;
                assert_eq!(body.len(), header.body_len());
                match out.frames.last_mut() {
                    Some((joined, bytes)) if out.open => {
                        assert_eq!(header.stream_id, joined.stream_id, "a piece of another stream");
                        assert!(!header.flags.contains(Flags::SYN) && !header.flags.contains(Flags::ACK));
                        joined.flags = joined.flags | header.flags;
                        joined.length += header.length;
                        bytes.extend_from_slice(&body);
                    }
                    _ => out.frames.push((header, body.to_vec())),
                }
                out.open = reader.inside_data_frame();
                if out.open {
                    let flags = header.flags;
                    assert!(!flags.contains(Flags::FIN) && !flags.contains(Flags::RST), "FIN or RST before the end");
                }
            }
            Ok(None) => return true,
            Err(e) => {
                out.error = Some(e);
                return false;
            }
        }
    }
}

fn read(chunks: Vec<BytesMut>) -> Outcome {
    let mut reader = FrameReader::new();
    let mut out = Outcome { frames: Vec::new(), open: false, error: None, buffered: 0 };
    for chunk in chunks {
        reader.push(chunk);
        if !drain(&mut reader, &mut out) {
            return out;
        }
    }
    out.buffered = reader.buffered();
    out
}

fuzz_target!(|input: &[u8]| {
    let pieces = Pieces::from_input(input);
    let data = pieces.data();
    let sizes: Vec<usize> = input.iter().take(8).map(|b| usize::from(*b).max(1)).collect();
    let cut = |mut len: usize| {
        let mut lens = Vec::new();
        let mut turn = 0;
        while len > 0 {
            let n = sizes.get(turn % sizes.len().max(1)).copied().unwrap_or(len).min(len);
            lens.push(n);
            len -= n;
            turn += 1;
        }
        lens
    };

    let whole = read(vec![BytesMut::from(data)]);
    // Parts of one buffer.
    let mut buffer = BytesMut::from(data);
    let shared: Vec<BytesMut> = cut(data.len()).into_iter().map(|n| buffer.split_to(n)).collect();
    assert_eq!(read(shared), whole, "chunks of one buffer");
    // Separate buffers.
    let mut at = 0;
    let separate: Vec<BytesMut> = cut(data.len())
        .into_iter()
        .map(|n| {
            at += n;
            BytesMut::from(&data[at - n..at])
        })
        .collect();
    assert_eq!(read(separate), whole, "separate buffers");

    // A header that decodes encodes to the same fields.
    if let Some(head) = data.first_chunk::<HEADER_LEN>()
        && let Ok(header) = Header::decode(head)
    {
        assert_eq!(Header::decode(&header.encode()), Ok(header));
    }
});
