use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use vm_memory::{Bytes, GuestAddress};

use super::persist::{RngConstructorArgs, RngState};
use super::*;
use crate::devices::virtio::test_utils::{
    activate, add_chain, add_raw_chain, interrupt, memory, mock_queue, used, used_idx,
};
use crate::persist::Persist;

#[test]
fn fills_guest_buffers_with_random_bytes() {
    let mem = memory(4);
    let q = mock_queue(&mem, GuestAddress(0));
    let mut rng = Rng::new().unwrap();
    activate(&mut rng, &mem, &[&q]);
    add_chain(&q, 0, &[(0x10_0000, 64, true), (0x10_1000, 64, true)]);
    assert_eq!(rng.process_queue(), 1);
    assert_eq!(used(&q, 0), (0, 128));
    let mut a = [0u8; 64];
    let mut b = [0u8; 64];
    mem.read_slice(&mut a, GuestAddress(0x10_0000)).unwrap();
    mem.read_slice(&mut b, GuestAddress(0x10_1000)).unwrap();
    assert_ne!(a, [0; 64]);
    assert_ne!(a, b);
}

#[test]
fn huge_requests_are_capped() {
    let mem = memory(4);
    let q = mock_queue(&mem, GuestAddress(0));
    let mut rng = Rng::new().unwrap();
    activate(&mut rng, &mem, &[&q]);
    add_chain(&q, 0, &[(0x10_0000, 2 << 20, true)]);
    rng.process_queue();
    assert_eq!(used(&q, 0), (0, MAX_BYTES_PER_REQUEST as u32));
}

#[test]
fn bad_buffers_are_dropped() {
    let mem = memory(4);
    let q = mock_queue(&mem, GuestAddress(0));
    let mut rng = Rng::new().unwrap();
    activate(&mut rng, &mem, &[&q]);
    // Outside memory, longer than memory, read-only, and a looping chain.
    add_chain(&q, 0, &[(0x100_0000_0000, 64, true)]);
    add_chain(&q, 1, &[(0x10_0000, u32::MAX, true)]);
    add_chain(&q, 2, &[(0x10_0000, 64, false)]);
    let next = virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16;
    let write = virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16;
    add_raw_chain(
        &q,
        3,
        &[SplitDescriptor::new(0x10_0000, 16, next | write, 3)],
    );
    assert_eq!(rng.process_queue(), 4);
    assert_eq!(used_idx(&q), 4);
    assert_eq!(used(&q, 0).1, 0);
    assert_eq!(used(&q, 1).1, 0);
    assert_eq!(used(&q, 2).1, 0);
    // The loop is cut after queue-size descriptors.
    assert_eq!(used(&q, 3).1, 16 * 16);
}

#[test]
fn state_round_trips() {
    let mem = memory(4);
    let q = mock_queue(&mem, GuestAddress(0));
    let mut rng = Rng::new().unwrap();
    activate(&mut rng, &mem, &[&q]);
    add_chain(&q, 0, &[(0x10_0000, 8, true)]);
    rng.process_queue();
    let state: RngState =
        serde_json::from_str(&serde_json::to_string(&rng.save().unwrap()).unwrap()).unwrap();
    let mut restored = Rng::restore(
        RngConstructorArgs {
            mem: mem.clone(),
            interrupt: interrupt(),
        },
        &state,
    )
    .unwrap();
    add_chain(&q, 1, &[(0x10_0000, 8, true)]);
    assert_eq!(restored.process_queue(), 1);
    assert_eq!(used_idx(&q), 2);
    let mut bad = state;
    bad.common.queues[0].desc_table = 0x7;
    assert!(Rng::restore(
        RngConstructorArgs {
            mem,
            interrupt: interrupt()
        },
        &bad
    )
    .is_err());
}
