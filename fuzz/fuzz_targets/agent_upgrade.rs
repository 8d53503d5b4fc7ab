//! What the agent reads from the network before its tunnel runs: a corporate proxy's answer to
//! CONNECT, and the gateway's (or a load balancer's) answer to the WebSocket upgrade, which may
//! be a 101 with the right accept key followed by frames, or anything else.
#![no_main]

use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tether_fuzz::{Pieces, run_for};
use tether_tunnel::client::{ClientSettings, upgrade_over, upgrade_request};
use tether_tunnel::proxy::{parse_status, read_head};
use tether_tunnel::ws::WsSettings;
use tokio::io::AsyncWriteExt;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;

#[derive(Arbitrary, Debug)]
enum Input<'a> {
    /// A proxy's answer to CONNECT.
    ProxyAnswer(&'a [u8]),
    /// The answer to the upgrade, as sent.
    Upgrade(&'a [u8]),
    /// A correct 101 (the right accept key and subprotocol), then arbitrary headers and bytes.
    Accepted { extra_headers: &'a str, after: &'a [u8] },
}

fuzz_target!(|input: Input| match input {
    Input::ProxyAnswer(bytes) => {
        let mut pieces = Pieces::from_input(bytes);
        let data = pieces.data();
        let Some(head) = run_for(Duration::from_secs(1), read_head(&mut pieces)) else {
            panic!("reading a proxy answer from a finite input did not finish");
        };
        if let Ok(head) = head {
            assert!(head.ends_with(b"\r\n\r\n"));
            assert_eq!(&data[..pieces.consumed], &head[..], "the head is read exactly, nothing of the tunnel");
            let _ = parse_status(&head);
        }
    }
    Input::Upgrade(answer) => upgrade(answer.to_vec(), None),
    Input::Accepted { extra_headers, after } => upgrade(after.to_vec(), Some(extra_headers.to_owned())),
});

fn upgrade(answer: Vec<u8>, accepted: Option<String>) {
    let settings = ClientSettings {
        url: http::Uri::from_static("wss://gateway.fuzz/v1/tunnel"),
        tls: None,
        tls_server_name: None,
        connect_timeout: Duration::from_secs(1),
        handshake_timeout: Duration::from_secs(1),
        ws: WsSettings::default(),
        user_agent: "tether-agent/fuzz".into(),
        proxy: None,
    };
    let Ok(request) = upgrade_request(&settings, Some("fuzz-token")) else { return };
    let key =
        request.headers().get("sec-websocket-key").and_then(|k| k.to_str().ok()).map(str::to_owned).unwrap_or_default();
    let answer = match accepted {
        None => answer,
        Some(extra) => {
            let accept = derive_accept_key(key.as_bytes());
            let mut head = format!(
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\nSec-WebSocket-Protocol: {}\r\n",
                tether_tunnel::protocol::SUBPROTOCOL
            )
            .into_bytes();
            head.extend_from_slice(extra.replace("\r\n\r\n", "\r\n").as_bytes());
            head.extend_from_slice(b"\r\n\r\n");
            head.extend_from_slice(&answer);
            head
        }
    };
    let ws = WsSettings::default();
    let _ = run_for(Duration::from_secs(5), async move {
        let (ours, mut peer) = tokio::io::duplex(64 * 1024);
        let writer = tokio::spawn(async move {
            let _ = peer.write_all(&answer).await;
            let _ = peer.shutdown().await;
            // Keep reading what the agent sends, so its writes never block.
            let mut sink = tokio::io::sink();
            let _ = tokio::io::copy(&mut peer, &mut sink).await;
        });
        if let Ok(mut link) = upgrade_over(ours, &request, &ws).await {
            use tether_tunnel::mux::Link;
            while let Some(Ok(_)) = std::future::poll_fn(|cx| link.poll_recv(cx)).await {}
        }
        writer.abort();
    });
}
