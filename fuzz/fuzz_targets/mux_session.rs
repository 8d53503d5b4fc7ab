//! A live multiplexer session (either role) whose peer sends arbitrary frames: valid headers with
//! arbitrary kinds, flags, stream ids, lengths and bodies, interleaved with raw bytes, while this
//! side accepts, opens, reads, writes and closes streams. Besides never panicking, the session must
//! end once its link closes, and every stream must then see the end instead of hanging.
#![no_main]

use std::time::Duration;

use arbitrary::Arbitrary;
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use tether_fuzz::runtime;
use tether_tunnel::mux::frame::HEADER_LEN;
use tether_tunnel::mux::{self, ByteLink, MuxSettings, MuxStream, Role};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Arbitrary, Debug)]
enum Step {
    /// A frame from the peer. `kind` 4 and up is not a valid type.
    Frame { kind: u8, flags: u8, stream: u8, length: u32, body: u16 },
    /// Bytes from the peer, as they are.
    Raw(Vec<u8>),
    /// Accept the next inbound stream, if one is queued.
    Accept,
    /// Open a stream to the peer.
    Open,
    /// Read up to this many bytes from one of our streams.
    Read { stream: u8, max: u16 },
    /// Write this many bytes to one of our streams.
    Write { stream: u8, len: u16 },
    /// Half-close one of our streams.
    Shutdown { stream: u8 },
    /// Drop one of our streams (a reset).
    Drop { stream: u8 },
    /// Let time pass.
    Wait { millis: u8 },
}

#[derive(Arbitrary, Debug)]
struct Input {
    server: bool,
    steps: Vec<Step>,
}

const STEP: Duration = Duration::from_millis(5);

fn frame(kind: u8, flags: u8, stream: u8, length: u32, body: u16) -> Vec<u8> {
    let kind = kind % 5;
    let body = usize::from(body % 4096);
    // Data frames usually announce their body; sometimes they lie (the reader must cope).
    let length = if kind == 0 && length % 4 != 0 { body as u32 } else { length };
    let mut out = Vec::with_capacity(HEADER_LEN + body);
    out.push(0);
    out.push(kind);
    out.extend_from_slice(&u16::from(flags & 0x0f).to_be_bytes());
    out.extend_from_slice(&u32::from(stream).to_be_bytes());
    out.extend_from_slice(&length.to_be_bytes());
    out.resize(out.len() + body, 0x5a);
    out
}

fn pick(streams: &mut [MuxStream], at: u8) -> Option<&mut MuxStream> {
    let n = streams.len();
    if n == 0 { None } else { streams.get_mut(usize::from(at) % n) }
}

fuzz_target!(|input: Input| {
    if input.steps.len() > 256 {
        return;
    }
    runtime().block_on(async move {
        let (ours, peer) = tokio::io::duplex(64 * 1024);
        let role = if input.server { Role::Server } else { Role::Client };
        let settings =
            MuxSettings { max_streams: 16, split_send_size: 4096, accept_backlog: 4, window_growth: 1 << 20 };
        let (session, mut incoming, driver) = mux::start(ByteLink::new(ours), role, &settings);
        let driver = tokio::spawn(driver);
        let (mut peer_read, mut peer_write) = tokio::io::split(peer);
        // The peer reads everything this side sends.
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            while let Ok(n) = peer_read.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        });
        let mut streams: Vec<MuxStream> = Vec::new();
        for step in input.steps {
            match step {
                Step::Frame { kind, flags, stream, length, body } => {
                    let bytes = frame(kind, flags, stream, length, body);
                    let _ = tokio::time::timeout(STEP, peer_write.write_all(&bytes)).await;
                }
                Step::Raw(bytes) => {
                    let _ = tokio::time::timeout(STEP, peer_write.write_all(&bytes)).await;
                }
                Step::Accept => {
                    if let Ok(Some(stream)) = tokio::time::timeout(STEP, incoming.accept()).await {
                        streams.push(stream);
                    }
                }
                Step::Open => {
                    if let Ok(Ok(stream)) = tokio::time::timeout(STEP, session.open()).await {
                        streams.push(stream);
                    }
                }
                Step::Read { stream, max } => {
                    if let Some(s) = pick(&mut streams, stream) {
                        let mut buf = BytesMut::with_capacity(usize::from(max).max(1));
                        let _ = tokio::time::timeout(STEP, s.read_buf(&mut buf)).await;
                    }
                }
                Step::Write { stream, len } => {
                    if let Some(s) = pick(&mut streams, stream) {
                        let data = vec![0xa5u8; usize::from(len)];
                        let _ = tokio::time::timeout(STEP, s.write_all(&data)).await;
                    }
                }
                Step::Shutdown { stream } => {
                    if let Some(s) = pick(&mut streams, stream) {
                        let _ = tokio::time::timeout(STEP, s.shutdown()).await;
                    }
                }
                Step::Drop { stream } => {
                    if !streams.is_empty() {
                        let n = streams.len();
                        streams.swap_remove(usize::from(stream) % n);
                    }
                }
                Step::Wait { millis } => tokio::time::sleep(Duration::from_millis(u64::from(millis))).await,
            }
        }
        // The peer goes away: the session ends, and every stream learns it.
        let _ = peer_write.shutdown().await;
        drop(peer_write);
        match tokio::time::timeout(Duration::from_secs(60), driver).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => panic!("the session driver panicked: {e}"),
            Err(_) => panic!("the session did not end after its link closed"),
        }
        assert!(session.is_closed(), "the driver ended but the session does not say closed");
        for mut stream in streams {
            let mut buf = [0u8; 4096];
            let ended = tokio::time::timeout(Duration::from_secs(60), async {
                loop {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    }
                }
            })
            .await;
            assert!(ended.is_ok(), "a stream still waits for data after its session ended");
        }
        assert!(
            tokio::time::timeout(Duration::from_secs(60), session.open()).await.is_ok_and(|r| r.is_err()),
            "opening a stream on an ended session must fail at once"
        );
        reader.abort();
    });
});
