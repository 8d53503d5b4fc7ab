//! The gRPC frontend's message reader (length-prefixed protobuf `Packet`s in an HTTP/2 request
//! body), fed a kube-apiserver's byte stream in arbitrary DATA-frame pieces. Every packet read
//! must encode back to bytes that read as the same packet, and the zero-copy `DATA` head must be
//! byte for byte what encoding the whole packet gives.
#![no_main]

use std::convert::Infallible;

use bytes::Bytes;
use http_body::Frame;
use http_body_util::StreamBody;
use libfuzzer_sys::fuzz_target;
use tether_fuzz::runtime;
use tether_gateway::frontend::grpc::codec::{MessageReader, data_head, encode};
use tether_gateway::frontend::grpc::proto::{Packet, Payload};

fn body(chunks: Vec<Bytes>) -> StreamBody<futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>> {
    StreamBody::new(futures::stream::iter(chunks.into_iter().map(|c| Ok(Frame::data(c))).collect::<Vec<_>>()))
}

async fn read_all(chunks: Vec<Bytes>) -> (Vec<Packet>, bool) {
    let mut reader = MessageReader::new(body(chunks));
    let mut packets = Vec::new();
    loop {
        match reader.next().await {
            Ok(Some(packet)) => packets.push(packet),
            Ok(None) => return (packets, true),
            Err(_) => return (packets, false),
        }
    }
}

fuzz_target!(|input: &[u8]| {
    let Some((&cut, data)) = input.split_first() else { return };
    let size = usize::from(cut).max(1);
    let chunks: Vec<Bytes> = data.chunks(size).map(Bytes::copy_from_slice).collect();
    runtime().block_on(async move {
        let (packets, _) = read_all(chunks).await;
        // How the body was cut into frames does not change what is read.
        let (whole, _) = read_all(vec![Bytes::copy_from_slice(data)]).await;
        assert_eq!(packets, whole);
        for packet in packets {
            let bytes = encode(&packet);
            let (again, clean) = read_all(vec![bytes]).await;
            assert!(clean, "an encoded packet does not read back: {packet:?}");
            assert_eq!(again, vec![packet.clone()]);
            if let Some(Payload::Data(d)) = &packet.payload {
                let mut fast = data_head(d.connect_id, d.data.len()).to_vec();
                fast.extend_from_slice(&d.data);
                assert_eq!(fast, encode(&Packet::data(d.connect_id, d.data.clone())).to_vec(), "data_head differs");
            }
        }
    });
});
