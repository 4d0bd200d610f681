use std::path::PathBuf;

use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::config::DiskConfig;
use crate::devices::virtio::test_utils::memory;

fn config(disk: PathBuf, rng: bool) -> DeviceConfig {
    DeviceConfig {
        disks: vec![DiskConfig {
            path: disk,
            read_only: false,
            limits: Default::default(),
        }],
        vsock: None,
        net: None,
        rng,
        fs: Vec::new(),
    }
}

#[test]
fn devices_get_consecutive_windows_and_gsis_and_are_announced() {
    let disk = crate::devices::virtio::block::tests::TempDisk::new(8);
    let devices = create_devices(&config(disk.0.clone(), true)).unwrap();
    assert_eq!(devices.len(), 2);
    assert_eq!((devices[0].addr, devices[0].gsi), (0xd000_0000, 5));
    assert_eq!((devices[1].addr, devices[1].gsi), (0xd000_1000, 6));
    assert_eq!(
        cmdline_params(&devices),
        "virtio_mmio.device=4K@0xd0000000:5 virtio_mmio.device=4K@0xd0001000:6"
    );
}

/// A KVM VM with a disk and an rng attached on `bus`, over 4 MiB of memory.
struct Rig {
    kvm: kvm_ioctls::Kvm,
    _vm: kvm_ioctls::VmFd,
    disk: crate::devices::virtio::block::tests::TempDisk,
    cfg: DeviceConfig,
    mem: GuestMemoryMmap,
    bus: Bus,
    /// The first VM's devices; `None` once a test has ended them.
    runtime: Option<VirtioRuntime>,
}

impl Rig {
    fn new() -> Rig {
        let kvm = kvm_ioctls::Kvm::new().unwrap();
        let vm = kvm.create_vm().unwrap();
        vm.create_irq_chip().unwrap();
        let disk = crate::devices::virtio::block::tests::TempDisk::new(8);
        let cfg = config(disk.0.clone(), true);
        let mem = memory(4);
        let mut bus = Bus::new();
        let runtime = attach(&vm, &mem, &mut bus, create_devices(&cfg).unwrap()).unwrap();
        Rig {
            kvm,
            _vm: vm,
            disk,
            cfg,
            mem,
            bus,
            runtime: Some(runtime),
        }
    }

    fn runtime(&self) -> &VirtioRuntime {
        self.runtime.as_ref().expect("the rig's runtime was ended")
    }
}

/// A second VM with `state`'s devices restored on a new bus (the rig's
/// own runtime may be gone; its memory, configuration and backends serve).
fn restore_into_new_vm(rig: &Rig, state: &VirtioState) -> (kvm_ioctls::VmFd, Bus, VirtioRuntime) {
    let vm = rig.kvm.create_vm().unwrap();
    vm.create_irq_chip().unwrap();
    let mut bus = Bus::new();
    let restored = restore_devices(&rig.cfg, &rig.mem, &MemoryReady::now(), state).unwrap();
    let runtime = attach(&vm, &rig.mem, &mut bus, restored).unwrap();
    (vm, bus, runtime)
}

/// Where the tests' rng driver puts its queue.
const RNG_DESC: u64 = 0x1000;
const RNG_AVAIL: u64 = 0x2000;
const RNG_USED: u64 = 0x3000;

/// Drives the rng (slot 1) through its transport to DRIVER_OK, with a
/// 16-entry queue at `RNG_DESC`, `RNG_AVAIL` and `RNG_USED`.
fn drive_rng_to_driver_ok(bus: &Bus) {
    let rng_base = 0xd000_1000u64;
    let w = |off: u64, v: u32| assert!(bus.write(rng_base + off, &v.to_le_bytes()));
    w(0x70, 1);
    w(0x70, 3);
    w(0x24, 1);
    w(0x20, 1);
    w(0x70, 11);
    w(0x38, 16);
    w(0x80, RNG_DESC as u32);
    w(0x90, RNG_AVAIL as u32);
    w(0xa0, RNG_USED as u32);
    w(0x44, 1);
    w(0x70, 15);
}

/// The rng's used index, as the guest reads it.
fn rng_used_idx(mem: &GuestMemoryMmap) -> u16 {
    mem.read_obj(GuestAddress(RNG_USED + 2)).unwrap()
}

#[test]
fn a_whole_device_set_round_trips_through_its_state_and_mismatches_are_refused() {
    let mut rig = Rig::new();
    let rng_base = 0xd000_1000u64;
    drive_rng_to_driver_ok(&rig.bus);
    let state = rig.runtime().save().unwrap();
    let json = serde_json::to_string(&state).unwrap();
    let state: VirtioState = serde_json::from_str(&json).unwrap();
    assert_eq!(state.slots.len(), 2);
    assert_eq!(state.slots[1].transport.device_status, 15);
    rig.runtime = None;

    let (_vm2, bus2, runtime2) = restore_into_new_vm(&rig, &state);
    let mut status = [0u8; 4];
    assert!(bus2.read(rng_base + 0x70, &mut status));
    assert_eq!(u32::from_le_bytes(status), 15);
    assert_eq!(runtime2.save().unwrap(), state);

    // A configuration without the rng does not fit the snapshot.
    let no_rng = config(rig.disk.0.clone(), false);
    assert!(restore_devices(&no_rng, &rig.mem, &MemoryReady::now(), &state).is_err());
    // Nor does a snapshot whose slots were swapped.
    let mut swapped = state.clone();
    swapped.slots.swap(0, 1);
    assert!(restore_devices(&rig.cfg, &rig.mem, &MemoryReady::now(), &swapped).is_err());
}

#[test]
fn quiesced_devices_block_the_event_thread_until_released() {
    let rig = Rig::new();
    let runtime = rig.runtime();
    let quiesced = runtime.quiesce();
    // A device lock is held: nothing else can reach the device.
    let DeviceHandle::Rng(rng) = &runtime.devices[1].handle else {
        panic!("slot 1 is the rng");
    };
    assert!(rng.try_lock().is_err());
    let state = quiesced.save().unwrap();
    assert_eq!(state.slots.len(), 2);
    drop(quiesced);
    assert!(rng.try_lock().is_ok());
    assert_eq!(runtime.save().unwrap(), state);
}

#[test]
fn virtio_interrupts_skip_the_keyboard_controllers_aux_line() {
    let gsis: Vec<u32> = (0..MAX_DEVICES).map(|i| virtio_gsi(i).unwrap()).collect();
    assert_eq!(gsis.len(), 18);
    assert_eq!(gsis[..8], [5, 6, 7, 8, 9, 10, 11, 13]);
    assert_eq!(*gsis.last().unwrap(), VIRTIO_LAST_GSI);
    assert!(!gsis.contains(&crate::devices::legacy::i8042::AUX_IRQ));
    assert_eq!(virtio_gsi(MAX_DEVICES), None);
}

/// A request the guest made available (and notified, in the old process)
/// before the snapshot is served by the restored device once the VM first
/// runs, and not before: the new process never saw the old one's kick.
#[test]
fn a_restored_device_serves_requests_queued_before_the_snapshot_at_first_run() {
    let mut rig = Rig::new();
    let mem = rig.mem.clone();
    drive_rng_to_driver_ok(&rig.bus);
    // One device-writable 16-byte buffer, made available; the kick that
    // would follow is lost with the old process.
    let desc = [0x8000u64.to_le_bytes(), 0u64.to_le_bytes()].concat();
    mem.write_slice(&desc[..8], GuestAddress(RNG_DESC)).unwrap();
    mem.write_obj(16u32, GuestAddress(RNG_DESC + 8)).unwrap();
    mem.write_obj(VRING_DESC_F_WRITE as u16, GuestAddress(RNG_DESC + 12))
        .unwrap();
    mem.write_obj(0u16, GuestAddress(RNG_AVAIL + 4)).unwrap();
    mem.write_obj(1u16, GuestAddress(RNG_AVAIL + 2)).unwrap();
    let state = rig.runtime().quiesce().save().unwrap();
    rig.runtime = None;
    assert_eq!(rng_used_idx(&mem), 0);

    let (_vm2, _bus2, runtime2) = restore_into_new_vm(&rig, &state);
    let first_run = runtime2.first_run_work().unwrap();
    // Until the VM runs, nothing is served (its memory stays the snapshot's).
    assert_eq!(rng_used_idx(&mem), 0);
    first_run();
    let start = std::time::Instant::now();
    while rng_used_idx(&mem) != 1 {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "the request queued before the snapshot was never served"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let len: u32 = mem.read_obj(GuestAddress(RNG_USED + 8)).unwrap();
    assert_eq!(len, 16, "the rng filled the whole buffer");
}
