//! The KVM VM: guest memory registered as memory slots, the in-kernel
//! irqchip (PIC + IOAPIC + LAPICs), the in-kernel PIT unless turned off,
//! and the TSS and identity-map pages KVM needs on Intel hosts.
//!
//! The PIT can be turned off because it lengthens the VM's close: each
//! in-kernel device is unregistered from KVM's I/O bus, each waiting for an
//! SRCU grace period, and on this project's development machine the PIT's
//! two devices added 8 ms to the 16 ms an irqchip's close took (a C program
//! creating and closing VMs). The close happens in the VM's keeper now
//! (`crate::keeper`), so the PIT stays on by default (`config::VmConfig::pit`).

pub mod coalesced_ring;
pub mod persist;

use std::sync::Arc;

use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::VmFd;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use crate::arch::x86_64::layout::{KVM_IDENTITY_MAP_ADDRESS, KVM_TSS_ADDRESS};
use crate::kvm::KvmHandle;
use crate::memory::GuestMemoryMmap;

/// Errors creating and setting up the VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// KVM_CREATE_VM failed.
    #[error("cannot create the KVM VM: {0}")]
    Create(#[source] kvm_ioctls::Error),
    /// KVM_SET_USER_MEMORY_REGION failed.
    #[error("cannot register guest memory slot {slot} with KVM: {source}")]
    MemorySlot {
        /// The slot number.
        slot: u32,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// A VM prepared ahead was used in a way its preparation does not allow
    /// (a bug in the vmm, not bad input).
    #[error("internal: the prepared VM cannot be used this way: {0}")]
    Prepared(&'static str),
    /// A VM-level setup ioctl failed.
    #[error("{what} failed: {source}")]
    Setup {
        /// Which ioctl.
        what: &'static str,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
}

fn setup(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Setup { what, source }
}

/// A created VM with its memory.
pub struct Vm {
    fd: Arc<VmFd>,
    memory: GuestMemoryMmap,
    /// The anonymous reservation `memory` was mapped over (a VM prepared on
    /// standby): it owns the mappings `memory`'s regions point into and
    /// unmaps them when dropped, after `memory`.
    _reserved: Option<GuestMemoryMmap>,
}

/// A KVM VM created before its final memory: KVM_CREATE_VM and the TSS and
/// identity-map addresses, and, when created over a memory reservation
/// ([`EmptyVm::create`] with `Some`), its memory slots, the in-kernel
/// irqchip too. A vmm on standby holds one until it learns which
/// snapshot to restore.
///
/// Order matters on some hosts: registering a memory slot once the irqchip
/// exists took 5-10 ms per slot on this project's development machine
/// (against 0.1 ms before it), so slots always come before the irqchip, and a
/// VM prepared ahead registers its slots over a reservation that the
/// snapshot's memory is later mapped onto (`MAP_FIXED`).
pub struct EmptyVm {
    fd: Arc<VmFd>,
    /// Memory slots registered over this reservation (then the irqchip
    /// exists too).
    reserved: Option<GuestMemoryMmap>,
}

/// Registers every region of `memory` as a memory slot, with KVM's dirty log
/// on (diff snapshots).
///
/// # Safety
///
/// `memory`'s mappings must stay mapped, at the same host addresses, for as
/// long as `fd` exists.
unsafe fn register_slots(fd: &VmFd, memory: &GuestMemoryMmap) -> Result<(), VmError> {
    for (slot, region) in memory.iter().enumerate() {
        let slot = slot as u32;
        let mem_region = kvm_userspace_memory_region {
            slot,
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: region.as_ptr() as u64,
            // KVM records every page the guest writes, for diff snapshots.
            flags: KVM_MEM_LOG_DIRTY_PAGES,
        };
        // SAFETY: the host range [as_ptr, as_ptr + len) is a live mmap that
        // stays mapped while `fd` exists (the caller's contract), and slots do
        // not overlap because the regions come from one validated GuestMemoryMmap.
        unsafe { fd.set_user_memory_region(mem_region) }
            .map_err(|source| VmError::MemorySlot { slot, source })?;
    }
    Ok(())
}

/// The in-kernel irqchip (both PICs, the IOAPIC and the LAPICs), after the
/// memory slots.
fn create_irqchip(fd: &VmFd) -> Result<(), VmError> {
    fd.create_irq_chip().map_err(setup("KVM_CREATE_IRQCHIP"))
}

impl EmptyVm {
    /// KVM_CREATE_VM and the TSS and identity-map addresses (before any vCPU
    /// exists, as KVM requires). With `reserved`, its regions are registered
    /// as the memory slots and the irqchip is created, so vCPUs can
    /// be created next; the restored memory must then be mapped over the
    /// reservation ([`EmptyVm::with_memory_over_reservation`]).
    pub fn create(kvm: &KvmHandle, reserved: Option<GuestMemoryMmap>) -> Result<Self, VmError> {
        let fd = kvm.kvm().create_vm().map_err(VmError::Create)?;
        // Its teardown then happens in the keeper, after this process's exit.
        crate::keeper::hand_over(std::os::fd::AsRawFd::as_raw_fd(&fd));
        fd.set_tss_address(KVM_TSS_ADDRESS as usize)
            .map_err(setup("KVM_SET_TSS_ADDR"))?;
        fd.set_identity_map_address(KVM_IDENTITY_MAP_ADDRESS)
            .map_err(setup("KVM_SET_IDENTITY_MAP_ADDR"))?;
        if let Some(memory) = &reserved {
            // SAFETY: `reserved` is kept in the EmptyVm and then the Vm, with
            // the fd, and never remapped elsewhere.
            unsafe { register_slots(&fd, memory)? };
            create_irqchip(&fd)?;
        }
        Ok(EmptyVm {
            fd: Arc::new(fd),
            reserved,
        })
    }

    /// The VM file descriptor (to create vCPUs).
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// The reservation the memory slots were registered over, if any.
    pub fn reservation(&self) -> Option<&GuestMemoryMmap> {
        self.reserved.as_ref()
    }

    /// Whether vCPUs may be created now (the irqchip exists).
    pub fn has_irqchip(&self) -> bool {
        self.reserved.is_some()
    }

    /// Registers every region of `memory` as a memory slot, then creates the
    /// irqchip. For a VM created without a reservation.
    pub fn with_memory(self, memory: GuestMemoryMmap) -> Result<Vm, VmError> {
        if self.reserved.is_some() {
            return Err(VmError::Prepared(
                "its memory slots are registered over a reservation already",
            ));
        }
        // SAFETY: the returned Vm keeps `memory` alive with the fd.
        unsafe { register_slots(&self.fd, &memory)? };
        create_irqchip(&self.fd)?;
        Ok(Vm {
            fd: self.fd,
            memory,
            _reserved: None,
        })
    }

    /// The VM with `memory`, whose regions must be mapped exactly over the
    /// reservation the slots were registered with (same guest and host
    /// addresses and sizes); KVM follows the new mappings at the same
    /// addresses, so no slot changes.
    pub fn with_memory_over_reservation(self, memory: GuestMemoryMmap) -> Result<Vm, VmError> {
        let Some(reserved) = self.reserved else {
            return Err(VmError::Prepared("it has no memory reservation"));
        };
        let same = memory.num_regions() == reserved.num_regions()
            && memory.iter().zip(reserved.iter()).all(|(m, r)| {
                m.start_addr() == r.start_addr() && m.len() == r.len() && m.as_ptr() == r.as_ptr()
            });
        if !same {
            return Err(VmError::Prepared(
                "the restored memory is not mapped over its reservation",
            ));
        }
        Ok(Vm {
            fd: self.fd,
            memory,
            _reserved: Some(reserved),
        })
    }
}

impl Vm {
    /// Creates the VM, registers `memory`, and sets up the irqchip, and the
    /// PIT when `pit`.
    pub fn new(kvm: &KvmHandle, memory: GuestMemoryMmap, pit: bool) -> Result<Self, VmError> {
        let vm = EmptyVm::create(kvm, None)?.with_memory(memory)?;
        if pit {
            vm.create_pit()?;
        }
        Ok(vm)
    }

    /// Adds the in-kernel i8254 PIT (port 0x61's speaker bit as a dummy),
    /// after the irqchip; vCPUs may exist already.
    pub fn create_pit(&self) -> Result<(), VmError> {
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        self.fd.create_pit2(pit).map_err(setup("KVM_CREATE_PIT2"))
    }

    /// The VM file descriptor.
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// The VM file descriptor, for a device that makes VM requests from a
    /// vCPU thread (the serial console's coalesced transmit).
    pub fn shared_fd(&self) -> Arc<VmFd> {
        self.fd.clone()
    }

    /// Guest memory.
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.memory
    }

    /// Pages written since the last call, per memory region (bit i of word i/64 = page i):
    /// KVM's dirty log for guest writes, merged with the VMM's own writes recorded by
    /// the guest-memory bitmap. Both are reset, so the next call reports only newer writes.
    pub fn take_dirty_pages(&self) -> Result<Vec<Vec<u64>>, VmError> {
        let mut out = Vec::new();
        for (slot, region) in self.memory.iter().enumerate() {
            let len = region.len() as usize;
            let mut pages = self
                .fd
                .get_dirty_log(slot as u32, len)
                .map_err(setup("KVM_GET_DIRTY_LOG"))?;
            // Same layout as KVM's log: bit i of word i / 64 is page i of the region.
            let vmm_writes = vm_memory::mmap::MmapRegion::bitmap(region).get_and_reset();
            for (word, vmm) in pages.iter_mut().zip(vmm_writes) {
                *word |= vmm;
            }
            out.push(pages);
        }
        Ok(out)
    }
}
