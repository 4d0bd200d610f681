//! Guest physical memory: the PC-like layout (RAM below the 32-bit MMIO hole,
//! the rest above 4 GiB) and its allocation with vm-memory.

use vm_memory::{GuestAddress, GuestMemoryRegion};

/// The guest memory type used throughout the VMM. The atomic bitmap records
/// every page the VMM itself writes (device DMA, boot structures), which KVM's
/// dirty log does not see; diff snapshots combine both.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<vm_memory::bitmap::AtomicBitmap>;

/// Start of the 32-bit MMIO hole (3 GiB): devices, the IOAPIC and the LAPIC live above it.
pub const MMIO_HOLE_START: u64 = 0xC000_0000;
/// First address above 4 GiB, where RAM resumes after the MMIO hole.
pub const FIRST_ADDR_PAST_32BITS: u64 = 1 << 32;
/// Smallest guest the VMM accepts, in MiB: the boot structures need the first MiB.
pub const MIN_MEM_MIB: u64 = 2;
/// Page size used for dirty tracking and alignment.
pub const PAGE_SIZE: u64 = 4096;

/// Errors creating guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The requested size is too small to boot anything.
    #[error("guest memory of {0} MiB is too small: at least {MIN_MEM_MIB} MiB is needed")]
    TooSmall(u64),
    /// The requested size exceeds what the host has.
    #[error(
        "guest memory of {requested_mib} MiB is more than the host has ({host_mib} MiB of RAM)"
    )]
    MoreThanHost {
        /// Requested size.
        requested_mib: u64,
        /// The host's total RAM.
        host_mib: u64,
    },
    /// mmap of guest memory failed.
    #[error("cannot allocate {mib} MiB of guest memory: {source}")]
    Allocate {
        /// Requested size.
        mib: u64,
        /// The vm-memory error.
        #[source]
        source: vm_memory::mmap::FromRangesError,
    },
}

/// The RAM ranges `(start, length)` for a guest of `mem_bytes`, split around the MMIO hole.
pub fn ram_ranges(mem_bytes: u64) -> Vec<(GuestAddress, usize)> {
    let low = mem_bytes.min(MMIO_HOLE_START);
    let mut ranges = vec![(GuestAddress(0), low as usize)];
    if mem_bytes > MMIO_HOLE_START {
        ranges.push((
            GuestAddress(FIRST_ADDR_PAST_32BITS),
            (mem_bytes - MMIO_HOLE_START) as usize,
        ));
    }
    ranges
}

/// The host's total RAM in MiB, read from /proc/meminfo; `None` if it cannot be read.
pub fn host_mem_mib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

/// Checks a requested guest size against the minimum and the host's RAM.
pub fn validate_size(mem_mib: u64, host_mib: Option<u64>) -> Result<(), MemoryError> {
    if mem_mib < MIN_MEM_MIB {
        return Err(MemoryError::TooSmall(mem_mib));
    }
    if let Some(host_mib) = host_mib {
        if mem_mib > host_mib {
            return Err(MemoryError::MoreThanHost {
                requested_mib: mem_mib,
                host_mib,
            });
        }
    }
    Ok(())
}

/// Allocates anonymous, lazily-backed guest memory of `mem_mib` MiB.
pub fn create_guest_memory(mem_mib: u64) -> Result<GuestMemoryMmap, MemoryError> {
    validate_size(mem_mib, host_mem_mib())?;
    let ranges = ram_ranges(mem_mib << 20);
    GuestMemoryMmap::from_ranges(&ranges).map_err(|source| MemoryError::Allocate {
        mib: mem_mib,
        source,
    })
}

/// The end (exclusive) of RAM below the MMIO hole.
pub fn low_ram_end(mem: &GuestMemoryMmap) -> u64 {
    use vm_memory::GuestMemoryBackend;
    mem.iter()
        .find(|r| r.start_addr() == GuestAddress(0))
        .map(|r| r.len())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_guest_is_one_range_below_the_hole() {
        assert_eq!(ram_ranges(256 << 20), vec![(GuestAddress(0), 256 << 20)]);
    }

    #[test]
    fn large_guest_splits_around_the_hole() {
        let r = ram_ranges(4 << 30);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0], (GuestAddress(0), MMIO_HOLE_START as usize));
        assert_eq!(r[1], (GuestAddress(1 << 32), (1 << 30) as usize));
    }

    #[test]
    fn sizes_are_checked() {
        assert!(matches!(
            validate_size(0, Some(1024)),
            Err(MemoryError::TooSmall(0))
        ));
        assert!(matches!(
            validate_size(4096, Some(1024)),
            Err(MemoryError::MoreThanHost { .. })
        ));
        assert!(validate_size(128, Some(1024)).is_ok());
    }
}
