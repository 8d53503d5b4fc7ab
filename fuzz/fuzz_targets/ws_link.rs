//! The WebSocket data path (RFC 6455 framing after the upgrade), either role, fed the peer's
//! frames: arbitrary opcodes, FIN bits, masks, length encodings and payloads, or raw bytes, part of
//! them already read during the upgrade. When every frame is valid, the bytes delivered must be
//! exactly the binary payloads, and what the link sends must be well-formed frames (masked by a
//! client only) carrying exactly what was sent. Also `apply_mask` against the plain definition.
#![no_main]

use std::future::poll_fn;
use std::time::Duration;

use arbitrary::Arbitrary;
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use tether_fuzz::runtime;
use tether_tunnel::mux::{Batch, Link};
use tether_tunnel::ws_link::{WsLink, WsLinkSettings, WsRole, apply_mask};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Arbitrary, Debug)]
struct Frame {
    opcode: u8,
    fin: bool,
    /// Whether the mask bit follows the role's rule.
    mask_right: bool,
    key: [u8; 4],
    /// 0: shortest length encoding, 1: 16-bit, 2: 64-bit.
    width: u8,
    payload: Vec<u8>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    server: bool,
    /// Make every frame valid and check the delivered bytes exactly.
    valid: bool,
    accept_unmasked: bool,
    frames: Vec<Frame>,
    raw_tail: Vec<u8>,
    /// How many leading bytes arrive as the upgrade's read-ahead.
    read_ahead: u16,
    send: Vec<u8>,
    mask_check: (Vec<u8>, [u8; 4], u8),
}

fn encode(frame: &Frame, client_sends: bool, valid: bool) -> Vec<u8> {
    let mut opcode = frame.opcode & 0x0f;
    let mut fin = frame.fin;
    let mut payload = frame.payload.clone();
    if valid {
        opcode = [0x0, 0x2, 0x9, 0xA][usize::from(frame.opcode % 4)];
        if opcode >= 0x8 {
            fin = true;
            payload.truncate(125);
        }
    }
    let masked = if valid || frame.mask_right { client_sends } else { !client_sends };
    let mut out = vec![(u8::from(fin) << 7) | opcode];
    let mask_bit = if masked { 0x80 } else { 0 };
    let len = payload.len();
    match (frame.width % 3, len) {
        (0, 0..=125) => out.push(mask_bit | len as u8),
        (0 | 1, 0..=65535) if !(valid && opcode >= 0x8) => {
            out.push(mask_bit | 126);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        }
        (_, 0..=125) if valid && opcode >= 0x8 => out.push(mask_bit | len as u8),
        _ => {
            out.push(mask_bit | 127);
            out.extend_from_slice(&(len as u64).to_be_bytes());
        }
    }
    if masked {
        out.extend_from_slice(&frame.key);
        for (i, byte) in payload.iter_mut().enumerate() {
            *byte ^= frame.key[i % 4];
        }
    }
    out.extend_from_slice(&payload);
    out
}

/// The binary payload of well-formed frames in `wire`, checking the mask rule; None if malformed.
fn decode_all(mut wire: &[u8], client_sent: bool) -> Option<Vec<u8>> {
    let mut data = Vec::new();
    while !wire.is_empty() {
        let (b0, b1) = (*wire.first()?, *wire.get(1)?);
        if b0 & 0x70 != 0 || (b1 & 0x80 != 0) != client_sent {
            return None;
        }
        let (len, mut at) = match b1 & 0x7f {
            126 => (usize::from(u16::from_be_bytes([*wire.get(2)?, *wire.get(3)?])), 4),
            127 => (usize::try_from(u64::from_be_bytes(wire.get(2..10)?.try_into().ok()?)).ok()?, 10),
            n => (usize::from(n), 2),
        };
        let key = if client_sent {
            let k: [u8; 4] = wire.get(at..at + 4)?.try_into().ok()?;
            at += 4;
            Some(k)
        } else {
            None
        };
        let mut payload = wire.get(at..at + len)?.to_vec();
        if let Some(k) = key {
            for (i, byte) in payload.iter_mut().enumerate() {
                *byte ^= k[i % 4];
            }
        }
        match b0 & 0x0f {
            0x0 | 0x2 => data.extend_from_slice(&payload),
            0x8..=0xA => {}
            _ => return None,
        }
        wire = &wire[at + len..];
    }
    Some(data)
}

fuzz_target!(|input: Input| {
    let (bytes, key, offset) = &input.mask_check;
    let mut fast = bytes.clone();
    apply_mask(&mut fast, *key, usize::from(*offset));
    let plain: Vec<u8> = bytes.iter().enumerate().map(|(i, b)| b ^ key[(i + usize::from(*offset)) % 4]).collect();
    assert_eq!(fast, plain, "apply_mask differs from the definition");

    if input.frames.len() > 64 {
        return;
    }
    let role = if input.server { WsRole::Server } else { WsRole::Client };
    let client_sends = role == WsRole::Server; // the peer of a server is a client
    let mut wire = Vec::new();
    let mut expected = Vec::new();
    for frame in &input.frames {
        wire.extend_from_slice(&encode(frame, client_sends, input.valid));
        if input.valid && [0x0, 0x2].contains(&[0x0, 0x2, 0x9, 0xA][usize::from(frame.opcode % 4)]) {
            expected.extend_from_slice(&frame.payload);
        }
    }
    if !input.valid {
        wire.extend_from_slice(&input.raw_tail);
    }
    let split = usize::from(input.read_ahead).min(wire.len());
    let read_ahead = BytesMut::from(&wire[..split]);
    let rest = wire[split..].to_vec();
    let settings = WsLinkSettings {
        max_frame_size: 256 * 1024,
        read_size: 1024,
        accept_unmasked_frames: input.accept_unmasked,
        ..WsLinkSettings::default()
    };
    let send = input.send.clone();
    runtime().block_on(async move {
        let (ours, peer) = tokio::io::duplex(16 * 1024);
        let mut link = WsLink::new(ours, role, settings, read_ahead);
        let (mut peer_read, mut peer_write) = tokio::io::split(peer);
        let writer = tokio::spawn(async move {
            let _ = peer_write.write_all(&rest).await;
            // Stay open (no EOF) so that the link's own reading decides the outcome.
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(peer_write);
        });
        let collector = tokio::spawn(async move {
            let mut out = Vec::new();
            let _ = peer_read.read_to_end(&mut out).await;
            out
        });
        // What we send goes out first (interleaved with the pongs we owe).
        if !send.is_empty() {
            let mut batch = Batch::new();
            batch.push(BytesMut::from(&send[..]));
            let sent = tokio::time::timeout(Duration::from_secs(5), async {
                poll_fn(|cx| link.poll_ready(cx)).await?;
                link.start_send(batch)?;
                poll_fn(|cx| link.poll_flush(cx)).await
            })
            .await;
            assert!(sent.is_ok(), "sending one batch did not finish");
        }
        let mut received = Vec::new();
        let mut failed = false;
        let _ = tokio::time::timeout(Duration::from_secs(10), async {
            while received.len() < expected.len() || !input.valid {
                match poll_fn(|cx| link.poll_recv(cx)).await {
                    Some(Ok(chunk)) => received.extend_from_slice(&chunk),
                    Some(Err(_)) => {
                        failed = true;
                        break;
                    }
                    None => break,
                }
            }
        })
        .await;
        if input.valid {
            assert!(!failed, "valid frames made the link fail");
            assert_eq!(received, expected, "the link delivered other bytes than the binary payloads");
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), poll_fn(|cx| link.poll_close(cx))).await;
        drop(link);
        writer.abort();
        let out = collector.await.unwrap_or_default();
        if input.valid {
            let data = decode_all(&out, role == WsRole::Client)
                .unwrap_or_else(|| panic!("the link wrote malformed frames: {out:?}"));
            assert_eq!(data, send, "the link's frames do not carry what was sent");
        }
    });
});
