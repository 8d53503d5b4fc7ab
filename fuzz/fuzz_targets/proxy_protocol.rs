//! The PROXY protocol (v1 and v2) reader in front of the agent endpoint, fed whatever a load
//! balancer, or anyone else, sends first. It must consume exactly the header and nothing of the
//! TLS handshake behind it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tether_fuzz::{Pieces, run_for};
use tether_gateway::proxy_protocol::{V1_MAX, V2_MAX_BODY, parse_v1, parse_v2_body, parse_v2_prefix, read_header};

fuzz_target!(|input: &[u8]| {
    let mut pieces = Pieces::from_input(input);
    let data = pieces.data();
    let Some(result) = run_for(std::time::Duration::from_secs(1), read_header(&mut pieces)) else {
        panic!("reading a PROXY header from a finite input did not finish");
    };
    if result.is_ok() {
        let taken = pieces.consumed;
        if data.starts_with(b"PROXY ") {
            // v1: the line, CRLF included, and not a byte more.
            assert!(taken <= V1_MAX && data[..taken].ends_with(b"\r\n"), "v1 header of {taken} bytes");
            assert_eq!(data[..taken].iter().filter(|b| **b == b'\n').count(), 1);
        } else {
            let prefix: &[u8; 16] = data.first_chunk().expect("a v2 header has 16 fixed bytes");
            let len = parse_v2_prefix(prefix).expect("an accepted v2 header has a valid prefix");
            assert!(len <= V2_MAX_BODY);
            assert_eq!(taken, 16 + len, "v2 header must be consumed exactly");
        }
    }
    let _ = parse_v1(data);
    if let Some(prefix) = data.first_chunk::<16>()
        && let Ok(len) = parse_v2_prefix(prefix)
    {
        let body = &data[16..];
        let _ = parse_v2_body(prefix, &body[..len.min(body.len())]);
    }
});
