//! The gRPC frontend's HTTP/2 pre-pass (frontend/grpc/authority.rs), which decodes a client's
//! header blocks (HPACK) to replace a socket path given as `:authority`, fed arbitrary frames:
//! header blocks encoded from arbitrary headers (split over CONTINUATION frames, padded, with
//! priority), other frames, and raw bytes. When the client's frames are well-formed, the frames
//! that come out must carry exactly the same headers, `:authority` made valid, and everything
//! else unchanged.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use loona_hpack::{Decoder, Encoder};
use tether_fuzz::runtime;
use tether_gateway::frontend::grpc::authority::AuthorityFix;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

#[derive(Arbitrary, Debug)]
enum Item {
    Headers {
        stream: u8,
        headers: Vec<(Vec<u8>, Vec<u8>)>,
        authority: Option<Vec<u8>>,
        end_stream: bool,
        /// Fragment size for CONTINUATION frames (0: one frame).
        split: u8,
        pad: Option<u8>,
        priority: Option<[u8; 5]>,
    },
    /// A frame of another type (DATA, SETTINGS, WINDOW_UPDATE...).
    Other {
        kind: u8,
        flags: u8,
        stream: u8,
        payload: Vec<u8>,
    },
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct Input {
    preface: bool,
    items: Vec<Item>,
    piece: u8,
}

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

type Headers = Vec<(Vec<u8>, Vec<u8>)>;

/// The header lists and the other frames of a client's (or the adapter's) byte stream.
fn parse(mut bytes: &[u8]) -> Option<(Vec<Headers>, Vec<Vec<u8>>)> {
    bytes = bytes.strip_prefix(PREFACE)?;
    let mut decoder = Decoder::new();
    let (mut blocks, mut others, mut block) = (Vec::new(), Vec::new(), Vec::new());
    while !bytes.is_empty() {
        let head = bytes.get(..9)?;
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let (kind, flags) = (head[3], head[4]);
        let payload = bytes.get(9..9 + len)?;
        if kind == HEADERS || kind == CONTINUATION {
            let mut fragment = payload;
            if kind == HEADERS {
                let pad = if flags & PADDED != 0 { usize::from(*fragment.first()?) } else { 0 };
                if flags & PADDED != 0 {
                    fragment = &fragment[1..];
                }
                if flags & PRIORITY != 0 {
                    fragment = fragment.get(5..)?;
                }
                fragment = &fragment[..fragment.len().checked_sub(pad)?];
            }
            block.extend_from_slice(fragment);
            if flags & END_HEADERS != 0 {
                blocks.push(decoder.decode(&block).ok()?);
                block.clear();
            }
        } else {
            others.push(bytes[..9 + len].to_vec());
        }
        bytes = &bytes[9 + len..];
    }
    Some((blocks, others))
}

fuzz_target!(|input: Input| {
    if input.items.len() > 32 {
        return;
    }
    let mut wire = Vec::new();
    if input.preface {
        wire.extend_from_slice(PREFACE);
    }
    let mut encoder = Encoder::new();
    let mut well_formed = input.preface;
    let mut expected: Vec<Headers> = Vec::new();
    for item in &input.items {
        match item {
            Item::Headers { stream, headers, authority, end_stream, split, pad, priority } => {
                let stream = u32::from(*stream) * 2 + 1;
                let mut list: Headers = Vec::new();
                if let Some(a) = authority {
                    list.push((b":authority".to_vec(), a.clone()));
                }
                list.extend(headers.iter().cloned());
                let block = encoder.encode(list.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
                let first_max = if *split == 0 { block.len() } else { usize::from(*split) };
                let (first, mut rest) = block.split_at(first_max.min(block.len()));
                let mut payload = Vec::new();
                let mut flags = if *end_stream { END_STREAM } else { 0 };
                if let Some(p) = pad {
                    flags |= PADDED;
                    payload.push(*p);
                }
                if let Some(p) = priority {
                    flags |= PRIORITY;
                    payload.extend_from_slice(p);
                }
                payload.extend_from_slice(first);
                if let Some(p) = pad {
                    payload.resize(payload.len() + usize::from(*p), 0);
                }
                if rest.is_empty() {
                    flags |= END_HEADERS;
                }
                if payload.len() > 16_384 {
                    well_formed = false;
                }
                frame(&mut wire, HEADERS, flags, stream, &payload);
                while !rest.is_empty() {
                    let n = rest.len().min(usize::from(*split).max(1));
                    let flags = if n == rest.len() { END_HEADERS } else { 0 };
                    frame(&mut wire, CONTINUATION, flags, stream, &rest[..n]);
                    rest = &rest[n..];
                }
                for (name, value) in &mut list {
                    if name.as_slice() == b":authority" && http::uri::Authority::try_from(value.as_slice()).is_err() {
                        *value = b"localhost".to_vec();
                    }
                }
                if block.len() > 64 * 1024 {
                    well_formed = false;
                }
                expected.push(list);
            }
            Item::Other { kind, flags, stream, payload } => {
                if *kind == HEADERS || *kind == CONTINUATION || payload.len() > 16_384 {
                    well_formed = false;
                }
                frame(&mut wire, *kind, *flags, u32::from(*stream), payload);
            }
            Item::Raw(bytes) => {
                well_formed = false;
                wire.extend_from_slice(bytes);
            }
        }
    }
    let piece = usize::from(input.piece).max(1);
    let out = runtime().block_on(async move {
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let writer = tokio::spawn(async move {
            for chunk in wire.chunks(piece) {
                if client.write_all(chunk).await.is_err() {
                    break;
                }
            }
        });
        let mut fix = AuthorityFix::new(server);
        let mut out = Vec::new();
        let result = fix.read_to_end(&mut out).await;
        writer.abort();
        (result.is_ok(), out)
    });
    if well_formed {
        let (clean, out) = out;
        assert!(clean, "well-formed frames failed the adapter");
        let (blocks, _) = parse(&out).unwrap_or_else(|| panic!("the adapter wrote malformed frames: {out:?}"));
        assert_eq!(blocks, expected, "header blocks changed beyond :authority");
    }
});
