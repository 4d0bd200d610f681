//! The VM generation ID (Microsoft's "Virtual Machine Generation ID"
//! specification, as Linux's `drivers/virt/vmgenid.c` reads it): 16 random
//! bytes in reserved guest memory, whose address the DSDT's
//! `\_SB.VGEN.ADDR` method returns. The VMM writes a fresh value on every
//! boot and every restore; with the GED's notification the guest learns it
//! is a new instance (a clone of a snapshot) and reseeds its RNG.

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::memory::GuestMemoryMmap;

/// Size of the generation ID.
pub const VMGENID_LEN: usize = 16;
/// Required alignment of its address.
const VMGENID_ALIGN: u64 = 8;

/// Errors placing or updating the generation ID.
#[derive(Debug, thiserror::Error)]
pub enum VmGenIdError {
    /// The host could not provide random bytes.
    #[error("cannot draw a new VM generation ID from the host's getrandom: {0}")]
    Random(std::io::Error),
    /// The address is not 8-byte aligned or the 16 bytes are not all guest RAM.
    #[error("the VM generation ID at {addr:#x} is not 8-byte aligned inside guest RAM")]
    Misplaced {
        /// The address.
        addr: u64,
    },
    /// Writing guest memory failed.
    #[error("cannot write the VM generation ID at {addr:#x}: {source}")]
    Write {
        /// The address.
        addr: u64,
        /// The error.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
}

/// The generation ID's place in guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmGenId {
    addr: u64,
}

impl VmGenId {
    /// The ID at `addr`, checked to be aligned and inside `mem` (the address
    /// may come from a snapshot file).
    pub fn at(addr: u64, mem: &GuestMemoryMmap) -> Result<Self, VmGenIdError> {
        if addr % VMGENID_ALIGN != 0 || !mem.check_range(GuestAddress(addr), VMGENID_LEN) {
            return Err(VmGenIdError::Misplaced { addr });
        }
        Ok(VmGenId { addr })
    }

    /// The guest-physical address of the 16 bytes.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Draws 16 random bytes from the host and writes them into guest memory.
    pub fn write_new(&self, mem: &GuestMemoryMmap) -> Result<[u8; VMGENID_LEN], VmGenIdError> {
        let mut id = [0u8; VMGENID_LEN];
        crate::random::fill(&mut id).map_err(VmGenIdError::Random)?;
        mem.write_slice(&id, GuestAddress(self.addr))
            .map_err(|source| VmGenIdError::Write {
                addr: self.addr,
                source,
            })?;
        Ok(id)
    }

    /// Reads the current ID from guest memory.
    pub fn read(&self, mem: &GuestMemoryMmap) -> Result<[u8; VMGENID_LEN], VmGenIdError> {
        let mut id = [0u8; VMGENID_LEN];
        mem.read_slice(&mut id, GuestAddress(self.addr))
            .map_err(|source| VmGenIdError::Write {
                addr: self.addr,
                source,
            })?;
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::ram_ranges;

    #[test]
    fn every_write_is_a_new_random_id_at_the_address() {
        let mem = GuestMemoryMmap::from_ranges(&ram_ranges(2 << 20)).unwrap();
        let id = VmGenId::at(0xe0040, &mem).unwrap();
        let first = id.write_new(&mem).unwrap();
        let second = id.write_new(&mem).unwrap();
        assert_ne!(first, second);
        assert_ne!(first, [0; VMGENID_LEN]);
        assert_eq!(id.read(&mem).unwrap(), second);
        let mut raw = [0u8; VMGENID_LEN];
        mem.read_slice(&mut raw, GuestAddress(0xe0040)).unwrap();
        assert_eq!(raw, second);
    }

    #[test]
    fn misaligned_or_outside_addresses_are_refused() {
        let mem = GuestMemoryMmap::from_ranges(&ram_ranges(2 << 20)).unwrap();
        for addr in [0xe0044, (2 << 20) - 8, 2 << 20, u64::MAX - 7] {
            assert!(
                matches!(VmGenId::at(addr, &mem), Err(VmGenIdError::Misplaced { .. })),
                "{addr:#x}"
            );
        }
        assert!(VmGenId::at((2 << 20) - 16, &mem).is_ok());
    }
}
