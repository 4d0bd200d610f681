//! Boot MSRs under real KVM: a vCPU the vmm configures has MTRRs enabled
//! with write-back as the default memory type (Linux skips PAT setup
//! otherwise), and a snapshot of the vCPU keeps that MSR.

use std::sync::Arc;

use kvm_bindings::{kvm_msr_entry, Msrs, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::VcpuFd;
use vm_memory::GuestAddress;
use vmm::arch::x86_64::loader::BootEntry;
use vmm::devices::bus::Bus;
use vmm::kvm::KvmHandle;
use vmm::memory::create_guest_memory;
use vmm::vcpu::{lock_fd, persist, Buses, Vcpu};
use vmm::vm::Vm;

const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// MTRRs enabled (bit 11), fixed ranges off, default type write-back (6).
const MTRRS_ON_DEFAULT_WB: u64 = (1 << 11) | 6;

fn read_msr(fd: &VcpuFd, index: u32) -> u64 {
    let mut msrs = Msrs::from_entries(&[kvm_msr_entry {
        index,
        ..Default::default()
    }])
    .unwrap();
    assert_eq!(
        fd.get_msrs(&mut msrs).unwrap(),
        1,
        "KVM reads MSR {index:#x}"
    );
    msrs.as_slice()[0].data
}

fn new_vcpu(kvm: &KvmHandle) -> (Vm, Vcpu) {
    let vm = Vm::new(
        kvm,
        create_guest_memory(16, vmm::memory::MemoryMode::Private).unwrap(),
        false,
    )
    .unwrap();
    let buses = Buses {
        io: Arc::new(Bus::new()),
        mmio: Arc::new(Bus::new()),
        coalesced: None,
    };
    let vcpu = Vcpu::new(vm.fd(), 0, buses).unwrap();
    (vm, vcpu)
}

/// A VM with one vCPU set up for its first instruction, as `vmm run` does.
fn configured_vcpu(kvm: &KvmHandle) -> (Vm, Vcpu) {
    let (vm, vcpu) = new_vcpu(kvm);
    let supported = kvm
        .kvm()
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .unwrap();
    let entry = BootEntry::Linux64(GuestAddress(0x10_0000));
    vcpu.configure(vm.memory(), &supported, 1, entry).unwrap();
    (vm, vcpu)
}

#[test]
fn boot_msrs_enable_mtrrs_with_write_back_as_the_default_type() {
    let kvm = KvmHandle::open().unwrap();
    let (_vm, vcpu) = configured_vcpu(&kvm);
    let shared = vcpu.fd();
    let fd = lock_fd(&shared);
    let cpuid = fd.get_cpuid2(KVM_MAX_CPUID_ENTRIES).unwrap();
    let leaf1 = cpuid.as_slice().iter().find(|e| e.function == 1).unwrap();
    assert_ne!(leaf1.edx & (1 << 12), 0, "the guest's CPUID offers MTRRs");
    let value = read_msr(&fd, MSR_MTRR_DEF_TYPE);
    assert_eq!(value, MTRRS_ON_DEFAULT_WB, "MSR_MTRRdefType = {value:#x}");
}

#[test]
fn a_vcpu_snapshot_saves_and_restores_the_mtrr_default_type() {
    let kvm = KvmHandle::open().unwrap();
    let (_vm, vcpu) = configured_vcpu(&kvm);
    let indices = persist::msrs_to_save(kvm.kvm()).unwrap();
    let state = persist::save(&lock_fd(&vcpu.fd()), 0, &indices).unwrap();
    let saved: Vec<(u32, u64)> = state
        .msrs
        .iter()
        .filter(|m| m.index == MSR_MTRR_DEF_TYPE)
        .map(|m| (m.index, m.data))
        .collect();
    assert_eq!(saved, [(MSR_MTRR_DEF_TYPE, MTRRS_ON_DEFAULT_WB)]);

    let (_vm2, fresh) = new_vcpu(&kvm);
    let shared = fresh.fd();
    let fd = lock_fd(&shared);
    assert_eq!(
        read_msr(&fd, MSR_MTRR_DEF_TYPE),
        0,
        "a new vCPU starts without"
    );
    persist::restore(&fd, &state).unwrap();
    assert_eq!(read_msr(&fd, MSR_MTRR_DEF_TYPE), MTRRS_ON_DEFAULT_WB);
}
