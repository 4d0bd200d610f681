//! Control-socket request lines.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::control::protocol::parse_request;

fuzz_target!(|data: &[u8]| {
    if let Ok(line) = std::str::from_utf8(data) {
        let _ = parse_request(line);
    }
});
