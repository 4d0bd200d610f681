//! Identity page tables for the 64-bit boot entry: the first GiB mapped with
//! 2 MiB pages, which is what the Linux 64-bit boot protocol promises the
//! kernel (it builds its own tables right away).

use vm_memory::{Bytes, GuestAddress};

use super::layout::{PDE_START, PDPTE_START, PML4_START};
use crate::memory::GuestMemoryMmap;

const PRESENT_WRITABLE: u64 = 0x03;
const PAGE_SIZE_2M_FLAG: u64 = 0x80;

/// Writes PML4, PDPT and PD, and returns the value for CR3.
pub fn write_identity_map(mem: &GuestMemoryMmap) -> Result<u64, vm_memory::GuestMemoryError> {
    mem.write_obj(PDPTE_START | PRESENT_WRITABLE, GuestAddress(PML4_START))?;
    mem.write_obj(PDE_START | PRESENT_WRITABLE, GuestAddress(PDPTE_START))?;
    for i in 0..512u64 {
        let entry = (i << 21) | PRESENT_WRITABLE | PAGE_SIZE_2M_FLAG;
        mem.write_obj(entry, GuestAddress(PDE_START + i * 8))?;
    }
    Ok(PML4_START)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_map_the_first_gib() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        assert_eq!(write_identity_map(&mem).unwrap(), PML4_START);
        let pml4: u64 = mem.read_obj(GuestAddress(PML4_START)).unwrap();
        assert_eq!(pml4, PDPTE_START | 3);
        let last: u64 = mem.read_obj(GuestAddress(PDE_START + 511 * 8)).unwrap();
        assert_eq!(last, (511 << 21) | 0x83);
    }
}
