//! A restored guest's monotonic clock under real KVM: it continues from the
//! snapshot's value and does not count the time the VM spent paused or on
//! disk, like a machine woken from suspend (the vmm's README, *Clocks across
//! a restore*). kvmclock (`KVM_SET_CLOCK` with no flags) and the TSC (the
//! saved `IA32_TSC`) are what a guest's CLOCK_MONOTONIC is made of; each is
//! saved, some hundreds of milliseconds pass, and each is restored into a
//! new VM the way `vmm restore` does (`vm::persist`, then the vCPU's
//! `vcpu::persist`). Read right after, each is the saved value plus no more
//! than the time the restore itself took. A restore that added the interval
//! (`KVM_CLOCK_REALTIME`, or a TSC moved on by host time) fails here. The
//! TSC is checked only where KVM lets the vmm set it (it says when not).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_clock_data, kvm_msr_entry, Msrs, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::VcpuFd;
use vm_memory::GuestAddress;
use vmm::arch::x86_64::loader::BootEntry;
use vmm::devices::bus::Bus;
use vmm::kvm::KvmHandle;
use vmm::memory::create_guest_memory;
use vmm::vcpu::{lock_fd, persist as vcpu_persist, Buses, Vcpu};
use vmm::vm::{persist as vm_persist, Vm};

const MSR_IA32_TSC: u32 = 0x10;
/// How long the "snapshot" lies between save and restore.
const PAUSED: Duration = Duration::from_millis(800);
/// What a running guest's clocks might read at its snapshot: far from a
/// new VM's (which start near zero), so a restore that ignored the saved
/// values would show too.
const GUEST_UPTIME: Duration = Duration::from_secs(1000);
/// Allowance for the clocks' rates against the host's CLOCK_MONOTONIC and
/// for rounding (the measured restore window already bounds the rest).
const SLACK: Duration = Duration::from_millis(5);

fn read_tsc(fd: &VcpuFd) -> u64 {
    let mut msrs = Msrs::from_entries(&[kvm_msr_entry {
        index: MSR_IA32_TSC,
        ..Default::default()
    }])
    .unwrap();
    assert_eq!(fd.get_msrs(&mut msrs).unwrap(), 1, "KVM reads IA32_TSC");
    msrs.as_slice()[0].data
}

/// A VM with one vCPU set up for its first instruction, as `vmm run` does.
fn booted(kvm: &KvmHandle) -> (Vm, Vcpu) {
    let vm = Vm::new(
        kvm,
        create_guest_memory(16, vmm::memory::MemoryMode::Private).unwrap(),
        true,
    )
    .unwrap();
    let vcpu = Vcpu::new(vm.fd(), 0, buses()).unwrap();
    let supported = kvm
        .kvm()
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .unwrap();
    vcpu.configure(
        vm.memory(),
        &supported,
        1,
        BootEntry::Linux64(GuestAddress(0x10_0000)),
    )
    .unwrap();
    (vm, vcpu)
}

fn buses() -> Buses {
    Buses {
        io: Arc::new(Bus::new()),
        mmio: Arc::new(Bus::new()),
        coalesced: None,
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap()
}

#[test]
fn a_restored_vm_s_clocks_continue_from_the_snapshot_without_the_paused_time() {
    let kvm = KvmHandle::open().unwrap();
    let (vm, vcpu) = booted(&kvm);
    let shared = vcpu.fd();
    let fd = lock_fd(&shared);
    let tsc_khz = u64::from(fd.get_tsc_khz().expect("KVM reports the TSC frequency"));
    let cycles = |d: Duration| nanos(d) * tsc_khz / 1_000_000;
    // The guest has been up for a while when its snapshot is taken.
    vm.fd()
        .set_clock(&kvm_clock_data {
            clock: nanos(GUEST_UPTIME),
            ..Default::default()
        })
        .unwrap();
    let uptime = Msrs::from_entries(&[kvm_msr_entry {
        index: MSR_IA32_TSC,
        data: cycles(GUEST_UPTIME),
        ..Default::default()
    }])
    .unwrap();
    assert_eq!(fd.set_msrs(&uptime).unwrap(), 1);
    // Some KVM hosts (nested ones, this development machine among them)
    // ignore writes to IA32_TSC: a vCPU's TSC is the host's whatever the
    // vmm writes, so there is no guest TSC to restore and nothing to check.
    let tsc_is_the_vms = read_tsc(&fd)
        .checked_sub(cycles(GUEST_UPTIME))
        .is_some_and(|ahead| ahead < cycles(Duration::from_secs(1)));
    if !tsc_is_the_vms {
        println!(
            "TSC not checked: this host's KVM does not take IA32_TSC writes (the vCPU's \
             TSC reads {} after writing {}); kvmclock is checked",
            read_tsc(&fd),
            cycles(GUEST_UPTIME)
        );
    }

    // Saved as a snapshot saves them (the VM is not running).
    let vm_state = vm_persist::save(vm.fd(), true).unwrap();
    let msr_indices = vcpu_persist::msrs_to_save(kvm.kvm()).unwrap();
    let vcpu_state = vcpu_persist::save(&fd, 0, &msr_indices).unwrap();
    let saved_at = Instant::now();
    let saved_clock = vm_state.clock.clock;
    let saved_tsc = vcpu_state
        .msrs
        .iter()
        .find(|m| m.index == MSR_IA32_TSC)
        .expect("the snapshot holds IA32_TSC")
        .data;
    drop(fd);
    drop((vcpu, vm));

    // The snapshot lies on disk for a while.
    while saved_at.elapsed() < PAUSED {
        std::thread::sleep(PAUSED.saturating_sub(saved_at.elapsed()));
    }
    let paused = saved_at.elapsed();

    // Restored into a new VM in `vmm restore`'s order: the VM's state,
    // then each vCPU's.
    let vm2 = Vm::new(
        &kvm,
        create_guest_memory(16, vmm::memory::MemoryMode::Private).unwrap(),
        true,
    )
    .unwrap();
    let start = Instant::now();
    vm_persist::restore(vm2.fd(), &vm_state, true).unwrap();
    let vcpu2 = Vcpu::new(vm2.fd(), 0, buses()).unwrap();
    let shared2 = vcpu2.fd();
    let fd2 = lock_fd(&shared2);
    vcpu_persist::restore(&fd2, &vcpu_state).unwrap();
    let clock = vm2.fd().get_clock().unwrap().clock;
    let tsc = read_tsc(&fd2);
    let window = start.elapsed();

    let report = format!(
        "saved kvmclock {saved_clock} ns and TSC {saved_tsc}; restored after {paused:?}; \
         read kvmclock {clock} ns and TSC {tsc} within {window:?} of the restore"
    );
    assert!(clock >= saved_clock, "kvmclock went back: {report}");
    assert!(
        clock - saved_clock <= nanos(window + SLACK),
        "kvmclock moved on by more than the restore took (the paused time \
         was {} ns): {report}",
        nanos(paused)
    );
    if tsc_is_the_vms {
        assert!(tsc >= saved_tsc, "the TSC went back: {report}");
        assert!(
            tsc - saved_tsc <= cycles(window + SLACK),
            "the TSC moved on by more than the restore took (the paused time \
             was {} cycles): {report}",
            cycles(paused)
        );
    }
}
