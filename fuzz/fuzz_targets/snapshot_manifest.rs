//! Snapshot `manifest` files: JSON parsing and layout/extent validation.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::snapshot::manifest::Manifest;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(m) = Manifest::parse(text) {
            // A manifest that validates has a well-defined size.
            let _ = m.memory_bytes();
        }
    }
});
