use std::path::PathBuf;

use vm_memory::GuestAddress;

use super::*;
use crate::config::DiskConfig;
use crate::devices::virtio::test_utils::memory;

fn config(disk: PathBuf, rng: bool) -> DeviceConfig {
    DeviceConfig {
        disks: vec![DiskConfig {
            path: disk,
            read_only: false,
        }],
        vsock: None,
        net: None,
        rng,
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

#[test]
fn a_whole_device_set_round_trips_through_its_state_and_mismatches_are_refused() {
    let kvm = kvm_ioctls::Kvm::new().unwrap();
    let vm = kvm.create_vm().unwrap();
    vm.create_irq_chip().unwrap();
    let disk = crate::devices::virtio::block::tests::TempDisk::new(8);
    let cfg = config(disk.0.clone(), true);
    let mem = memory(4);
    let mut bus = Bus::new();
    let runtime = attach(&vm, &mem, &mut bus, create_devices(&cfg).unwrap()).unwrap();
    // Drive the rng through its transport to DRIVER_OK.
    let rng_base = 0xd000_1000u64;
    let w = |off: u64, v: u32| assert!(bus.write(rng_base + off, &v.to_le_bytes()));
    w(0x70, 1);
    w(0x70, 3);
    w(0x24, 1);
    w(0x20, 1);
    w(0x70, 11);
    w(0x38, 16);
    w(0x80, 0x1000);
    w(0x90, 0x2000);
    w(0xa0, 0x3000);
    w(0x44, 1);
    w(0x70, 15);
    let state = runtime.save().unwrap();
    let json = serde_json::to_string(&state).unwrap();
    let state: VirtioState = serde_json::from_str(&json).unwrap();
    assert_eq!(state.slots.len(), 2);
    assert_eq!(state.slots[1].transport.device_status, 15);
    drop(runtime);

    let vm2 = kvm.create_vm().unwrap();
    vm2.create_irq_chip().unwrap();
    let mut bus2 = Bus::new();
    let restored = restore_devices(&cfg, &mem, &state).unwrap();
    let runtime2 = attach(&vm2, &mem, &mut bus2, restored).unwrap();
    let mut status = [0u8; 4];
    assert!(bus2.read(rng_base + 0x70, &mut status));
    assert_eq!(u32::from_le_bytes(status), 15);
    assert_eq!(runtime2.save().unwrap(), state);

    // A configuration without the rng does not fit the snapshot.
    assert!(restore_devices(&config(disk.0.clone(), false), &mem, &state).is_err());
    // Nor does a snapshot whose slots were swapped.
    let mut swapped = state.clone();
    swapped.slots.swap(0, 1);
    assert!(restore_devices(&cfg, &mem, &swapped).is_err());
    let _ = GuestAddress(0);
}

#[test]
fn quiesced_devices_block_the_event_thread_until_released() {
    let kvm = kvm_ioctls::Kvm::new().unwrap();
    let vm = kvm.create_vm().unwrap();
    vm.create_irq_chip().unwrap();
    let disk = crate::devices::virtio::block::tests::TempDisk::new(8);
    let cfg = config(disk.0.clone(), true);
    let mem = memory(4);
    let mut bus = Bus::new();
    let runtime = attach(&vm, &mem, &mut bus, create_devices(&cfg).unwrap()).unwrap();
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
