//! The KVM VM: guest memory registered as memory slots, the in-kernel
//! irqchip (PIC + IOAPIC + LAPICs) and PIT, and the TSS and identity-map
//! pages KVM needs on Intel hosts.

pub mod persist;

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
    fd: VmFd,
    memory: GuestMemoryMmap,
}

/// A KVM VM created ahead of its memory: the TSS and identity-map pages, the
/// in-kernel irqchip and the PIT are set up, no memory slot is registered
/// yet. A vmm on standby holds one (and its vCPUs) until it learns which
/// snapshot to restore; [`EmptyVm::with_memory`] makes it a [`Vm`].
pub struct EmptyVm {
    fd: VmFd,
}

impl EmptyVm {
    /// KVM_CREATE_VM, then the TSS and identity-map addresses (before any
    /// vCPU exists, as KVM requires), the irqchip and the PIT.
    pub fn create(kvm: &KvmHandle) -> Result<Self, VmError> {
        let fd = kvm.kvm().create_vm().map_err(VmError::Create)?;
        fd.set_tss_address(KVM_TSS_ADDRESS as usize)
            .map_err(setup("KVM_SET_TSS_ADDR"))?;
        fd.set_identity_map_address(KVM_IDENTITY_MAP_ADDRESS)
            .map_err(setup("KVM_SET_IDENTITY_MAP_ADDR"))?;
        fd.create_irq_chip().map_err(setup("KVM_CREATE_IRQCHIP"))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        fd.create_pit2(pit).map_err(setup("KVM_CREATE_PIT2"))?;
        Ok(EmptyVm { fd })
    }

    /// The VM file descriptor (to create vCPUs).
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// Registers every region of `memory` as a memory slot, with KVM's
    /// dirty log on (diff snapshots).
    pub fn with_memory(self, memory: GuestMemoryMmap) -> Result<Vm, VmError> {
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
            // SAFETY: the host range [as_ptr, as_ptr + len) is a live mmap owned by `memory`,
            // which the returned Vm keeps alive for as long as the VM fd exists, and slots do
            // not overlap because the regions come from one validated GuestMemoryMmap.
            unsafe { self.fd.set_user_memory_region(mem_region) }
                .map_err(|source| VmError::MemorySlot { slot, source })?;
        }
        Ok(Vm {
            fd: self.fd,
            memory,
        })
    }
}

impl Vm {
    /// Creates the VM, sets up the irqchip and PIT, and registers `memory`.
    pub fn new(kvm: &KvmHandle, memory: GuestMemoryMmap) -> Result<Self, VmError> {
        EmptyVm::create(kvm)?.with_memory(memory)
    }

    /// The VM file descriptor.
    pub fn fd(&self) -> &VmFd {
        &self.fd
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
