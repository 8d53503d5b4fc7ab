//! The tunnel's own frames: stream-open frames, stream results and control messages (length
//! prefix + JSON), as either end decodes them from its peer. Whatever decodes must encode again
//! and decode to the same message.
#![no_main]

use std::fmt::Debug;

use libfuzzer_sys::fuzz_target;
use tether_tunnel::protocol::{
    self, ControlMessage, MAX_CONTROL_FRAME, MAX_STREAM_FRAME, StreamOpen, StreamResult, decode, encode,
};

fn round_trip<T>(data: &[u8], max: usize)
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + Debug,
{
    let Ok(Some((message, used))) = decode::<T>(data, max) else {
        return;
    };
    assert!(used <= data.len() && used >= protocol::LENGTH_PREFIX);
    // A message that decoded within `max` may encode a little longer (escapes are normalised).
    let Ok(bytes) = encode(&message, max.saturating_mul(2)) else {
        return;
    };
    match decode::<T>(&bytes, max.saturating_mul(2)) {
        Ok(Some((again, again_used))) => {
            assert_eq!(again, message, "a decoded message must survive encode + decode");
            assert_eq!(again_used, bytes.len());
        }
        other => panic!("{message:?} encoded to bytes that do not decode: {other:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(len)) = protocol::frame_len(data, MAX_CONTROL_FRAME) {
        assert!(len <= MAX_CONTROL_FRAME);
    }
    let kind = protocol::stream_kind_name(data);
    assert!(kind.chars().count() <= 64);
    round_trip::<StreamOpen>(data, MAX_STREAM_FRAME);
    round_trip::<StreamResult>(data, MAX_STREAM_FRAME);
    round_trip::<ControlMessage>(data, MAX_CONTROL_FRAME);
});
