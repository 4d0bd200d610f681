use std::sync::{Arc, Mutex};

use vm_memory::GuestAddress;

use super::persist::{MmioConstructorArgs, MmioState};
use super::*;
use crate::devices::virtio::rng::Rng;
use crate::devices::virtio::test_utils::{interrupt, memory};
use crate::devices::virtio::VIRTIO_MMIO_INT_CONFIG;
use crate::persist::Persist;

fn transport() -> (MmioTransport, Arc<Mutex<Rng>>) {
    let rng = Arc::new(Mutex::new(Rng::new().unwrap()));
    let t = MmioTransport::new(rng.clone(), memory(1), interrupt());
    (t, rng)
}

fn r(t: &mut MmioTransport, off: u64) -> u32 {
    let mut b = [0u8; 4];
    t.read(off, &mut b);
    u32::from_le_bytes(b)
}

fn w(t: &mut MmioTransport, off: u64, v: u32) {
    t.write(off, &v.to_le_bytes());
}

/// Negotiates VERSION_1 and configures queue 0 with 16 entries in the first page.
fn negotiate(t: &mut MmioTransport) {
    w(t, STATUS, S_ACK);
    w(t, STATUS, S_ACK | S_DRIVER);
    w(t, DRIVER_FEATURES_SEL, 1);
    w(t, DRIVER_FEATURES, 1);
    w(t, STATUS, S_ACK | S_DRIVER | S_FEATURES_OK);
    assert_eq!(r(t, STATUS), S_ACK | S_DRIVER | S_FEATURES_OK);
}

fn setup_queue(t: &mut MmioTransport, size: u32) {
    w(t, QUEUE_SEL, 0);
    w(t, QUEUE_NUM, size);
    w(t, QUEUE_DESC_LOW, 0x1000);
    w(t, QUEUE_DRIVER_LOW, 0x2000);
    w(t, QUEUE_DEVICE_LOW, 0x3000);
    w(t, QUEUE_READY, 1);
}

#[test]
fn identifies_as_a_modern_virtio_mmio_device() {
    let (mut t, _) = transport();
    assert_eq!(r(&mut t, MAGIC), 0x7472_6976);
    assert_eq!(r(&mut t, VERSION), 2);
    assert_eq!(r(&mut t, DEVICE_ID), 4);
    assert_eq!(r(&mut t, VENDOR), VENDOR_ID);
    w(&mut t, DEVICE_FEATURES_SEL, 1);
    assert_eq!(r(&mut t, DEVICE_FEATURES) & 1, 1, "VERSION_1 offered");
    w(&mut t, QUEUE_SEL, 0);
    assert_eq!(
        r(&mut t, QUEUE_NUM_MAX),
        u32::from(crate::devices::virtio::rng::QUEUE_SIZE)
    );
    w(&mut t, QUEUE_SEL, 7);
    assert_eq!(r(&mut t, QUEUE_NUM_MAX), 0, "no such queue");
    // Sub-word and unaligned register accesses read as zero.
    let mut b = [0xffu8; 2];
    t.read(MAGIC, &mut b);
    assert_eq!(b, [0, 0]);
}

#[test]
fn full_initialisation_activates_the_device_and_reset_undoes_it() {
    let (mut t, rng) = transport();
    negotiate(&mut t);
    setup_queue(&mut t, 16);
    assert_eq!(r(&mut t, QUEUE_READY), 1);
    w(
        &mut t,
        STATUS,
        S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
    );
    assert_eq!(r(&mut t, STATUS) & S_DRIVER_OK, S_DRIVER_OK);
    assert!(rng.lock().unwrap().is_activated());
    assert_eq!(
        rng.lock().unwrap().common().acked_features,
        VIRTIO_F_VERSION_1
    );
    // Queue registers are frozen once running.
    w(&mut t, QUEUE_NUM, 8);
    assert_eq!(rng.lock().unwrap().common().queues[0].size(), 16);
    // Interrupt status and ack.
    t.interrupt().signal_used_queue();
    assert_eq!(r(&mut t, INTERRUPT_STATUS), 1);
    w(&mut t, INTERRUPT_ACK, 1);
    assert_eq!(r(&mut t, INTERRUPT_STATUS), 0);

    w(&mut t, STATUS, 0);
    assert_eq!(r(&mut t, STATUS), 0);
    assert!(!rng.lock().unwrap().is_activated());
    assert_eq!(r(&mut t, QUEUE_READY), 0);
    assert_eq!(rng.lock().unwrap().common().acked_features, 0);
}

#[test]
fn a_driver_without_version_1_cannot_set_features_ok() {
    let (mut t, _) = transport();
    w(&mut t, STATUS, S_ACK);
    w(&mut t, STATUS, S_ACK | S_DRIVER);
    w(&mut t, DRIVER_FEATURES_SEL, 0);
    w(&mut t, DRIVER_FEATURES, 0xffff_ffff);
    w(&mut t, STATUS, S_ACK | S_DRIVER | S_FEATURES_OK);
    assert_eq!(r(&mut t, STATUS) & S_FEATURES_OK, 0);
}

#[test]
fn features_the_device_does_not_offer_are_not_acknowledged() {
    let (mut t, rng) = transport();
    w(&mut t, STATUS, S_ACK);
    w(&mut t, STATUS, S_ACK | S_DRIVER);
    w(&mut t, DRIVER_FEATURES_SEL, 1);
    w(&mut t, DRIVER_FEATURES, 0xffff_ffff);
    w(&mut t, DRIVER_FEATURES_SEL, 5);
    w(&mut t, DRIVER_FEATURES, 0xffff_ffff);
    assert_eq!(
        rng.lock().unwrap().common().acked_features,
        VIRTIO_F_VERSION_1
    );
}

#[test]
fn out_of_order_status_writes_are_ignored() {
    let (mut t, rng) = transport();
    w(
        &mut t,
        STATUS,
        S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
    );
    assert_eq!(r(&mut t, STATUS), 0);
    w(&mut t, STATUS, S_ACK);
    w(&mut t, STATUS, S_ACK | S_DRIVER_OK);
    assert_eq!(r(&mut t, STATUS), S_ACK);
    assert!(!rng.lock().unwrap().is_activated());
    // Queue setup before FEATURES_OK is ignored.
    setup_queue(&mut t, 16);
    assert_eq!(r(&mut t, QUEUE_READY), 0);
    // FAILED is accepted at any time and stops further progress.
    w(&mut t, STATUS, S_ACK | S_FAILED);
    assert_eq!(r(&mut t, STATUS), S_ACK | S_FAILED);
}

#[test]
fn bad_queue_sizes_are_refused_and_driver_ok_then_needs_reset() {
    for size in [0u32, 3, 12, 1 << 16, 4096, u32::MAX] {
        let (mut t, rng) = transport();
        negotiate(&mut t);
        setup_queue(&mut t, size);
        assert_eq!(r(&mut t, QUEUE_READY), 0, "size {size}");
        w(
            &mut t,
            STATUS,
            S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
        );
        let status = r(&mut t, STATUS);
        assert_eq!(status & S_DRIVER_OK, 0, "size {size}");
        assert_eq!(status & S_NEEDS_RESET, S_NEEDS_RESET);
        assert_eq!(r(&mut t, INTERRUPT_STATUS) & 2, 2, "config interrupt");
        assert!(!rng.lock().unwrap().is_activated());
        // A reset recovers the device.
        w(&mut t, STATUS, 0);
        negotiate(&mut t);
        setup_queue(&mut t, 16);
        w(
            &mut t,
            STATUS,
            S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
        );
        assert!(rng.lock().unwrap().is_activated());
    }
}

#[test]
fn rings_outside_guest_memory_fail_activation() {
    let (mut t, rng) = transport();
    negotiate(&mut t);
    w(&mut t, QUEUE_SEL, 0);
    w(&mut t, QUEUE_NUM, 16);
    w(&mut t, QUEUE_DESC_LOW, 0x1000);
    w(&mut t, QUEUE_DESC_HIGH, 0x10);
    w(&mut t, QUEUE_DRIVER_LOW, 0x2000);
    w(&mut t, QUEUE_DEVICE_LOW, 0x3000);
    w(&mut t, QUEUE_READY, 1);
    w(
        &mut t,
        STATUS,
        S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
    );
    assert_eq!(r(&mut t, STATUS) & S_NEEDS_RESET, S_NEEDS_RESET);
    assert!(!rng.lock().unwrap().is_activated());
}

#[test]
fn queue_notify_without_an_ioeventfd_signals_the_queue_event() {
    let (mut t, rng) = transport();
    w(&mut t, QUEUE_NOTIFY_OFFSET, 0);
    assert_eq!(
        rng.lock().unwrap().common().queue_evts[0].read().unwrap(),
        1
    );
    // A queue index that does not exist is ignored.
    w(&mut t, QUEUE_NOTIFY_OFFSET, 9);
}

/// Found by a real Linux guest: its virtio-fs driver (with FUSE_DAX) read
/// SHMLen 0 as a region of length 0 at 0, failed to reserve it and refused
/// the device; an absent region reads as all ones (virtio 1.2, 4.2.2).
#[test]
fn shared_memory_regions_read_as_absent() {
    let (mut t, _) = transport();
    for sel in [0, 1, 7] {
        w(&mut t, 0xac, sel);
        for off in [SHM_LEN_LOW, SHM_LEN_HIGH, SHM_BASE_LOW, SHM_BASE_HIGH] {
            assert_eq!(r(&mut t, off), SHM_ABSENT, "region {sel} offset {off:#x}");
        }
    }
}

#[test]
fn config_space_reads_go_to_the_device() {
    let (mut t, _) = transport();
    let mut b = [0xffu8; 8];
    t.read(CONFIG_OFFSET, &mut b);
    assert_eq!(b, [0; 8]);
}

#[test]
fn transport_state_round_trips_and_bad_state_is_refused() {
    let (mut t, rng) = transport();
    negotiate(&mut t);
    setup_queue(&mut t, 16);
    w(
        &mut t,
        STATUS,
        S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
    );
    let state = t.save().unwrap();
    let json = serde_json::to_string(&state).unwrap();
    let state: MmioState = serde_json::from_str(&json).unwrap();
    let args = || MmioConstructorArgs {
        device: rng.clone(),
        mem: memory(1),
        interrupt: interrupt(),
    };
    let mut restored = MmioTransport::restore(args(), &state).unwrap();
    assert_eq!(r(&mut restored, STATUS), state.device_status);

    let mut bad = state.clone();
    bad.device_status |= 0x1000;
    assert!(MmioTransport::restore(args(), &bad).is_err());
    let mut bad = state.clone();
    bad.size_refused.push(true);
    assert!(MmioTransport::restore(args(), &bad).is_err());
    let mut bad = state.clone();
    bad.interrupt_status = 0xff;
    assert!(MmioTransport::restore(args(), &bad).is_err());
    // A configuration change the device raised while being restored (a
    // grown disk) survives the transport's restore, as a new generation.
    let irq = interrupt();
    irq.set_status(VIRTIO_MMIO_INT_CONFIG);
    let mut changed = MmioTransport::restore(
        MmioConstructorArgs {
            device: rng.clone(),
            mem: memory(1),
            interrupt: irq.clone(),
        },
        &state,
    )
    .unwrap();
    assert_eq!(
        r(&mut changed, INTERRUPT_STATUS),
        state.interrupt_status | VIRTIO_MMIO_INT_CONFIG
    );
    assert_eq!(
        r(&mut changed, CONFIG_GENERATION),
        state.config_generation.wrapping_add(1)
    );
    assert_eq!(
        r(&mut restored, CONFIG_GENERATION),
        state.config_generation,
        "nothing raised: the snapshot's generation"
    );
    // DRIVER_OK in the state but the device is not running.
    rng.lock().unwrap().reset();
    assert!(MmioTransport::restore(args(), &state).is_err());
    let _ = GuestAddress(0);
}
