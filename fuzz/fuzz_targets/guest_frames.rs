//! The guest <-> host frame decoder fed arbitrary byte streams in arbitrary
//! chunks, and every frame it yields decoded as both message directions.
#![no_main]

use libfuzzer_sys::fuzz_target;
use proto::framing::{decode_payload, FrameDecoder};
use proto::guest::{GuestMessage, HostMessage};

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let mut decoder = FrameDecoder::new(64 * 1024);
    let chunk = usize::from(split).max(1);
    for piece in rest.chunks(chunk) {
        decoder.push(piece);
        while let Ok(Some(frame)) = decoder.next_frame() {
            let _ = decode_payload::<HostMessage>(&frame);
            let _ = decode_payload::<GuestMessage>(&frame);
        }
        assert!(
            decoder.buffered() <= 64 * 1024 + 4,
            "decoder buffers beyond its limit"
        );
    }
});
