//! Snapshot `state` files: container checks, CRC, then the postcard payload.
//! Inputs are mostly fed through a valid container (so the fuzzer reaches the
//! payload decoder), sometimes raw.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::snapshot::format;
use vmm::snapshot::state::MachineState;

fuzz_target!(|data: &[u8]| {
    let _ = MachineState::decode(data);
    let wrapped = format::encode(data);
    if let Ok(state) = MachineState::decode(&wrapped) {
        // Anything that decodes must re-encode without panicking.
        let _ = state.encode();
    }
    // The same bytes as format 1.0 and 1.1 payloads (each decoded with its
    // version's layout).
    for minor in [0, 1] {
        if let Ok(state) = MachineState::decode(&format::encode_minor(data, minor)) {
            let _ = state.encode();
        }
    }
});
