//! The CONNECT frontends' request parser: whatever a kube-apiserver (or anything else that reaches
//! the socket) sends, in whatever pieces it arrives. A parsed request names a target and keeps
//! exactly the bytes after the head; an error has an answer that is itself valid HTTP.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tether_fuzz::{Pieces, run_for};
use tether_gateway::frontend::connect::{MAX_HEAD, error_response, read_request};

fuzz_target!(|input: &[u8]| {
    let mut pieces = Pieces::from_input(input);
    let data = pieces.data();
    let Some(result) = run_for(std::time::Duration::from_secs(1), read_request(&mut pieces)) else {
        panic!("reading a request from a finite input did not finish");
    };
    match result {
        Ok(request) => {
            assert!(!request.target.is_empty());
            let taken = pieces.consumed;
            assert!(data[..taken].ends_with(&request.early_data), "early data must be what followed the head");
            assert!(taken - request.early_data.len() <= MAX_HEAD + 64 * 1024);
        }
        Err(e) => {
            if let Some(status) = e.status() {
                let answer = error_response(status, &e.to_string());
                let mut headers = [httparse::EMPTY_HEADER; 16];
                let mut response = httparse::Response::new(&mut headers);
                let parsed = response.parse(&answer);
                assert!(matches!(parsed, Ok(httparse::Status::Complete(_))), "error answer is not HTTP: {answer:?}");
                assert_eq!(response.code, Some(status));
            }
        }
    }
});
