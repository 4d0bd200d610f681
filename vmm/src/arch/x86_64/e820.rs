//! The guest's physical memory map (e820), shared by the Linux zero page and
//! the PVH start-info memory map.

use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::layout::{EBDA_START, HIMEM_START};
use crate::memory::GuestMemoryMmap;

/// Usable RAM.
pub const E820_RAM: u32 = 1;
/// Reserved: the EBDA and the legacy BIOS area.
pub const E820_RESERVED: u32 = 2;

/// One e820 range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E820Entry {
    /// First guest-physical address.
    pub addr: u64,
    /// Length in bytes.
    pub size: u64,
    /// `E820_RAM` or `E820_RESERVED`.
    pub kind: u32,
}

/// The e820 map for `mem`: base memory below the EBDA, the reserved legacy
/// area up to 1 MiB, then each RAM region from 1 MiB up.
pub fn entries(mem: &GuestMemoryMmap) -> Vec<E820Entry> {
    let mut out = vec![
        E820Entry {
            addr: 0,
            size: EBDA_START,
            kind: E820_RAM,
        },
        E820Entry {
            addr: EBDA_START,
            size: HIMEM_START - EBDA_START,
            kind: E820_RESERVED,
        },
    ];
    for region in mem.iter() {
        let start = region.start_addr().0.max(HIMEM_START);
        let end = region.start_addr().0 + region.len();
        if end > start {
            out.push(E820Entry {
                addr: start,
                size: end - start,
                kind: E820_RAM,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::ram_ranges;

    #[test]
    fn map_covers_low_and_high_ram() {
        let mem = GuestMemoryMmap::from_ranges(&ram_ranges(4 << 30)).unwrap();
        let e = entries(&mem);
        assert_eq!(e.len(), 4);
        assert_eq!(
            e[0],
            E820Entry {
                addr: 0,
                size: EBDA_START,
                kind: E820_RAM
            }
        );
        assert_eq!(e[1].kind, E820_RESERVED);
        assert_eq!(e[2].addr, HIMEM_START);
        assert_eq!(e[2].addr + e[2].size, crate::memory::MMIO_HOLE_START);
        assert_eq!(e[3].addr, 1 << 32);
        assert_eq!(e[3].size, (4u64 << 30) - crate::memory::MMIO_HOLE_START);
    }
}
