//! Guest physical memory: the PC-like layout (RAM below the 32-bit MMIO hole,
//! the rest above 4 GiB) and its allocation with vm-memory: private anonymous
//! memory, or a memfd mapped MAP_SHARED that vhost-user backends (virtiofsd)
//! map too.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::str::FromStr;
use std::sync::Arc;

use vm_memory::mmap::{MmapRegionBuilder, NewBitmap};
use vm_memory::{
    bitmap::AtomicBitmap, FileOffset, GuestAddress, GuestMemoryRegion, GuestRegionMmap,
};

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
/// Huge page size of `--memory shared-hugepages` (the x86-64 2 MiB page).
pub const HUGE_PAGE_SIZE: u64 = 2 << 20;

/// How guest RAM is backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryMode {
    /// Private anonymous memory (the default without vhost-user devices).
    #[default]
    Private,
    /// One memfd mapped MAP_SHARED: its file descriptor can be handed to a
    /// vhost-user backend, which then maps the same pages.
    Shared,
    /// As `Shared`, on a hugetlbfs memfd of 2 MiB pages (the host must have
    /// free huge pages: `vm.nr_hugepages`); the size must be a multiple of 2 MiB.
    SharedHugepages,
}

impl MemoryMode {
    /// Whether the memory is a shareable memfd.
    pub fn is_shared(self) -> bool {
        !matches!(self, MemoryMode::Private)
    }
}

impl FromStr for MemoryMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "private" => Ok(MemoryMode::Private),
            "shared" => Ok(MemoryMode::Shared),
            "shared-hugepages" => Ok(MemoryMode::SharedHugepages),
            other => Err(format!(
                "unknown memory mode {other:?}: expected private, shared or shared-hugepages"
            )),
        }
    }
}

impl std::fmt::Display for MemoryMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MemoryMode::Private => "private",
            MemoryMode::Shared => "shared",
            MemoryMode::SharedHugepages => "shared-hugepages",
        })
    }
}

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
    /// The shared-memory file could not be created or sized.
    #[error("cannot create the {mib} MiB shared guest memory file (memfd{hugetlb}): {source}")]
    Memfd {
        /// Requested size.
        mib: u64,
        /// ", hugetlb" for huge pages.
        hugetlb: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Mapping the shared-memory file failed.
    #[error("cannot map {mib} MiB of shared guest memory: {reason}")]
    MapShared {
        /// Requested size.
        mib: u64,
        /// vm-memory's error.
        reason: String,
    },
    /// A huge-page guest whose size is not a whole number of huge pages.
    #[error(
        "guest memory of {0} MiB cannot be backed by 2 MiB huge pages: give an even number of MiB"
    )]
    NotHugePageAligned(u64),
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

/// Allocates lazily-backed guest memory of `mem_mib` MiB, backed as `mode` says.
pub fn create_guest_memory(mem_mib: u64, mode: MemoryMode) -> Result<GuestMemoryMmap, MemoryError> {
    validate_size(mem_mib, host_mem_mib())?;
    let ranges = ram_ranges(mem_mib << 20);
    if mode.is_shared() {
        return create_shared(&ranges, mode);
    }
    GuestMemoryMmap::from_ranges(&ranges).map_err(|source| MemoryError::Allocate {
        mib: mem_mib,
        source,
    })
}

/// Guest memory for `ranges` on one new memfd (regions at consecutive file
/// offsets), mapped MAP_SHARED; pages are allocated on first touch.
pub fn create_shared(
    ranges: &[(GuestAddress, usize)],
    mode: MemoryMode,
) -> Result<GuestMemoryMmap, MemoryError> {
    let total: u64 = ranges.iter().map(|r| r.1 as u64).sum();
    let mib = total >> 20;
    let hugepages = mode == MemoryMode::SharedHugepages;
    if hugepages && ranges.iter().any(|r| r.1 as u64 % HUGE_PAGE_SIZE != 0) {
        return Err(MemoryError::NotHugePageAligned(mib));
    }
    let file = Arc::new(
        memfd(total, hugepages).map_err(|source| MemoryError::Memfd {
            mib,
            hugetlb: if hugepages { ", hugetlb" } else { "" },
            source,
        })?,
    );
    let map_err = |reason: String| MemoryError::MapShared { mib, reason };
    // Huge pages are reserved when mapped, so a host without enough of them
    // fails here, with a message, rather than with SIGBUS on first touch.
    let flags = if hugepages {
        libc::MAP_SHARED
    } else {
        libc::MAP_SHARED | libc::MAP_NORESERVE
    };
    let mut regions = Vec::with_capacity(ranges.len());
    let mut offset = 0u64;
    for &(gpa, len) in ranges {
        let mapping = MmapRegionBuilder::new_with_bitmap(len, AtomicBitmap::with_len(len))
            .with_file_offset(FileOffset::from_arc(file.clone(), offset))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(flags)
            .build()
            .map_err(|e| {
                map_err(if hugepages {
                    format!(
                        "{e} (not enough free 2 MiB huge pages: the host has {} free; raise \
                         vm.nr_hugepages)",
                        free_huge_pages().map_or("an unknown number".into(), |n| n.to_string())
                    )
                } else {
                    e.to_string()
                })
            })?;
        let region = GuestRegionMmap::new(mapping, gpa)
            .ok_or_else(|| map_err(format!("region at {:#x} wraps", gpa.0)))?;
        regions.push(region);
        offset += len as u64;
    }
    GuestMemoryMmap::from_regions(regions).map_err(|e| map_err(e.to_string()))
}

/// The host's free huge pages (`HugePages_Free` in /proc/meminfo).
fn free_huge_pages() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("HugePages_Free:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A new memfd of `len` bytes (sparse until touched).
fn memfd(len: u64, hugepages: bool) -> std::io::Result<File> {
    let mut flags = libc::MFD_CLOEXEC;
    if hugepages {
        flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_2MB;
    }
    // SAFETY: the name is a NUL-terminated literal and the flags are valid;
    // the call only returns a new file descriptor (or -1).
    let fd = unsafe { libc::memfd_create(c"agentvm-guest-memory".as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len)?;
    Ok(file)
}

/// Tells whether every snapshot page of restored guest memory is in place.
/// Lazily restored shared memory (userfaultfd) is filled in the background;
/// a vhost-user backend maps the memfd itself, bypassing the fault handler,
/// so it may only be given the memory once the filling is done.
#[derive(Clone, Default)]
pub struct MemoryReady {
    pending: Option<Arc<ReadyState>>,
}

struct ReadyState {
    done: std::sync::atomic::AtomicBool,
    evt: vmm_sys_util::eventfd::EventFd,
}

/// The filling side of a [`MemoryReady`]: call `done` once every page is in place.
pub struct ReadySignal(Arc<ReadyState>);

impl MemoryReady {
    /// Memory that is complete now.
    pub fn now() -> MemoryReady {
        MemoryReady::default()
    }

    /// Memory still being filled, and the signal to call when it is done.
    pub fn pending() -> std::io::Result<(MemoryReady, ReadySignal)> {
        let state = Arc::new(ReadyState {
            done: std::sync::atomic::AtomicBool::new(false),
            evt: vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK)?,
        });
        Ok((
            MemoryReady {
                pending: Some(state.clone()),
            },
            ReadySignal(state),
        ))
    }

    /// Whether every page is in place.
    pub fn is_ready(&self) -> bool {
        self.pending
            .as_ref()
            .is_none_or(|s| s.done.load(std::sync::atomic::Ordering::Acquire))
    }

    /// An eventfd that becomes (and stays) readable when the memory is
    /// complete; `None` when it already was. Watchers must not read it.
    pub fn eventfd(&self) -> Option<&vmm_sys_util::eventfd::EventFd> {
        self.pending.as_ref().map(|s| &s.evt)
    }
}

impl ReadySignal {
    /// Marks the memory complete and wakes the watchers.
    pub fn done(self) {
        self.0
            .done
            .store(true, std::sync::atomic::Ordering::Release);
        if let Err(e) = self.0.evt.write(1) {
            tracing::error!(error = %e, "cannot signal that guest memory is restored");
        }
    }
}

/// Whether `mem` is a shareable memfd (every region has a file behind it
/// mapped MAP_SHARED), as vhost-user backends need.
pub fn is_shared(mem: &GuestMemoryMmap) -> bool {
    use vm_memory::GuestMemoryBackend;
    mem.iter()
        .all(|r| r.file_offset().is_some() && r.flags() & libc::MAP_SHARED != 0)
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
    fn shared_memory_is_one_memfd_seen_through_every_mapping() {
        use vm_memory::{Bytes, GuestMemoryBackend};
        let ranges = [(GuestAddress(0), 1 << 20), (GuestAddress(1 << 32), 1 << 20)];
        let mem = create_shared(&ranges, MemoryMode::Shared).unwrap();
        assert!(is_shared(&mem));
        let regions: Vec<_> = mem.iter().collect();
        let (f0, f1) = (
            regions[0].file_offset().unwrap(),
            regions[1].file_offset().unwrap(),
        );
        assert_eq!((f0.start(), f1.start()), (0, 1 << 20));
        mem.write_obj(0xabcdu32, GuestAddress((1 << 32) + 8))
            .unwrap();
        // The second region lives at file offset 1 MiB: read it through the file.
        let mut buf = [0u8; 4];
        std::os::unix::fs::FileExt::read_exact_at(f1.file(), &mut buf, (1 << 20) + 8).unwrap();
        assert_eq!(u32::from_le_bytes(buf), 0xabcd);
        assert!(!is_shared(&GuestMemoryMmap::from_ranges(&ranges).unwrap()));
    }

    #[test]
    fn memory_ready_tells_once_filled() {
        assert!(MemoryReady::now().is_ready());
        assert!(MemoryReady::now().eventfd().is_none());
        let (ready, signal) = MemoryReady::pending().unwrap();
        let watcher = ready.clone();
        assert!(!watcher.is_ready());
        assert!(
            watcher.eventfd().unwrap().read().is_err(),
            "not readable yet"
        );
        signal.done();
        assert!(watcher.is_ready() && ready.is_ready());
        assert_eq!(watcher.eventfd().unwrap().read().unwrap(), 1);
    }

    #[test]
    fn memory_modes_parse_and_huge_pages_need_whole_pages() {
        assert_eq!("shared".parse(), Ok(MemoryMode::Shared));
        assert_eq!("private".parse(), Ok(MemoryMode::Private));
        assert_eq!("shared-hugepages".parse(), Ok(MemoryMode::SharedHugepages));
        assert!("hugepages".parse::<MemoryMode>().is_err());
        assert_eq!(MemoryMode::SharedHugepages.to_string(), "shared-hugepages");
        let odd = [(GuestAddress(0), 3 << 20)];
        assert!(matches!(
            create_shared(&odd, MemoryMode::SharedHugepages),
            Err(MemoryError::NotHugePageAligned(3))
        ));
        // A host with too few huge pages refuses the mapping, saying so
        // (rather than SIGBUS when the guest first touches its memory).
        let want = 64u64;
        if free_huge_pages().is_some_and(|free| free < want / 2) {
            let ranges = [(GuestAddress(0), (want as usize) << 20)];
            let Err(err) = create_shared(&ranges, MemoryMode::SharedHugepages) else {
                panic!("64 MiB of huge pages mapped on a host without them");
            };
            assert!(err.to_string().contains("vm.nr_hugepages"), "{err}");
        } else {
            println!("skipped the no-huge-pages case: this host has free huge pages");
        }
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
