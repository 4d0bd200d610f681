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
});
