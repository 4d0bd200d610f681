//! Guest memory for a restored VM, built from a chain of snapshot layers so
//! that restore time does not grow with guest memory size:
//!
//! * `file`: each region maps the base memory file MAP_PRIVATE, so pages load
//!   from the page cache on first touch and writes stay private to this VM;
//!   the pages of each diff layer (only those) are then copied over it.
//! * `uffd`: anonymous memory registered with userfaultfd; a handler thread
//!   serves each first touch with the page from the newest layer that holds
//!   it (or a zero page).
//!
//! Shared memory (a memfd, for vhost-user backends) cannot map the memory
//! file, so `file` copies every layer's pages into a fresh memfd, and `uffd`
//! registers the memfd with userfaultfd (missing-page faults on shmem) and
//! fills its snapshot pages in the background, between faults: the backend
//! maps the memfd without going through the fault handler, so it may only be
//! given the memory (see `MemoryReady`) once those pages are in place.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use vm_memory::mmap::{MmapRegionBuilder, NewBitmap};
use vm_memory::{
    bitmap::AtomicBitmap, Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion,
    GuestRegionMmap,
};

use super::manifest::{Layer, RegionLayout, MEMORY_FILE};
use super::memory_file::{file_offset_to_gpa, split_by_region};
pub use super::pages::RestoreMemoryError;
use crate::memory::{create_shared, GuestMemoryMmap, MemoryMode, MemoryReady};

/// Restored guest memory and whether its snapshot pages are all in place.
pub struct RestoredMemory {
    /// The memory.
    pub mem: GuestMemoryMmap,
    /// Complete now, or once the background filling ends (shared uffd).
    pub ready: MemoryReady,
}

/// How restored guest memory is populated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryBackend {
    /// MAP_PRIVATE mapping of the memory file (default).
    #[default]
    File,
    /// Anonymous memory filled on demand by a userfaultfd handler.
    Uffd,
}

impl FromStr for MemoryBackend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "file" => Ok(MemoryBackend::File),
            "uffd" => Ok(MemoryBackend::Uffd),
            other => Err(format!(
                "unknown memory backend {other:?}: expected file or uffd"
            )),
        }
    }
}

fn open_memory(layer: &Layer) -> Result<(PathBuf, File), RestoreMemoryError> {
    let path = layer.dir.join(MEMORY_FILE);
    let file = File::open(&path).map_err(|source| RestoreMemoryError::Io {
        path: path.clone(),
        source,
    })?;
    Ok((path, file))
}

/// Builds guest memory for the chain `layers` (base first) with `backend`,
/// backed as `mode` says.
pub fn build(
    layers: &[Layer],
    backend: MemoryBackend,
    mode: MemoryMode,
) -> Result<RestoredMemory, RestoreMemoryError> {
    let Some(base) = layers.first() else {
        return Err(RestoreMemoryError::Map("empty snapshot chain".into()));
    };
    let regions = base.manifest.regions.clone();
    let now = |mem| RestoredMemory {
        mem,
        ready: MemoryReady::now(),
    };
    match (backend, mode.is_shared()) {
        (MemoryBackend::File, false) => build_file_backed(layers, &regions).map(now),
        (MemoryBackend::Uffd, false) => super::uffd::build(layers, &regions, None),
        (MemoryBackend::File, true) => build_shared_copy(layers, &regions, mode).map(now),
        (MemoryBackend::Uffd, true) => super::uffd::build(layers, &regions, Some(mode)),
    }
}

/// The guest ranges of `regions`.
pub(super) fn ranges(
    regions: &[RegionLayout],
) -> Result<Vec<(GuestAddress, usize)>, RestoreMemoryError> {
    regions
        .iter()
        .map(|r| {
            usize::try_from(r.size)
                .map(|size| (GuestAddress(r.gpa), size))
                .map_err(|_| RestoreMemoryError::Map("region too large".into()))
        })
        .collect()
}

/// A fresh memfd with every layer's pages copied in, oldest first.
fn build_shared_copy(
    layers: &[Layer],
    regions: &[RegionLayout],
    mode: MemoryMode,
) -> Result<GuestMemoryMmap, RestoreMemoryError> {
    let mem = create_shared(&ranges(regions)?, mode)
        .map_err(|e| RestoreMemoryError::Map(e.to_string()))?;
    for layer in layers {
        apply_diff(&mem, regions, layer)?;
    }
    for region in mem.iter() {
        vm_memory::mmap::MmapRegion::bitmap(region).reset();
    }
    Ok(mem)
}

fn build_file_backed(
    layers: &[Layer],
    regions: &[RegionLayout],
) -> Result<GuestMemoryMmap, RestoreMemoryError> {
    let (_, base_file) = open_memory(&layers[0])?;
    let base_file = Arc::new(base_file);
    let guest_regions = regions
        .iter()
        .map(|r| {
            // SAFETY: no raw pointer given: the region makes its own mapping.
            region_size(r)
                .and_then(|size| unsafe { private_file_region(&base_file, r, size, None) })
        })
        .collect::<Result<Vec<_>, _>>()?;
    with_diffs(guest_regions, layers, regions)
}

fn region_size(r: &RegionLayout) -> Result<usize, RestoreMemoryError> {
    usize::try_from(r.size).map_err(|_| RestoreMemoryError::Map("region too large".into()))
}

/// Region `r` of the base memory file `file`, mapped MAP_PRIVATE: by a new
/// mmap, or, with `at`, the mapping the caller already made there.
///
/// # Safety
///
/// With `Some(at)`, `at` must be the start of a live mapping of `size`
/// bytes of `file` at `r.file_offset`, owned elsewhere and kept while the
/// region lives. `None` has no requirement.
unsafe fn private_file_region(
    file: &Arc<File>,
    r: &RegionLayout,
    size: usize,
    at: Option<*mut u8>,
) -> Result<GuestRegionMmap<AtomicBitmap>, RestoreMemoryError> {
    let mut builder = MmapRegionBuilder::new_with_bitmap(size, AtomicBitmap::with_len(size))
        .with_file_offset(FileOffset::from_arc(file.clone(), r.file_offset))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_NORESERVE | libc::MAP_PRIVATE);
    if let Some(host) = at {
        // SAFETY: the caller's contract: `host` starts a live mapping of
        // `size` bytes that outlives the region (which will not unmap it).
        builder = unsafe { builder.with_raw_mmap_pointer(host) };
    }
    let mapping = builder
        .build()
        .map_err(|e| RestoreMemoryError::Map(e.to_string()))?;
    GuestRegionMmap::new(mapping, GuestAddress(r.gpa))
        .ok_or_else(|| RestoreMemoryError::Map(format!("region at {:#x} wraps", r.gpa)))
}

/// The guest memory of `guest_regions` (the base layer) with the pages of
/// the chain's other layers copied over, and nothing marked dirty.
fn with_diffs(
    guest_regions: Vec<GuestRegionMmap<AtomicBitmap>>,
    layers: &[Layer],
    regions: &[RegionLayout],
) -> Result<GuestMemoryMmap, RestoreMemoryError> {
    let mem = GuestMemoryMmap::from_regions(guest_regions)
        .map_err(|e| RestoreMemoryError::Map(e.to_string()))?;
    for layer in layers.iter().skip(1) {
        apply_diff(&mem, regions, layer)?;
    }
    // The memory now equals the top snapshot: nothing is dirty relative to it.
    for region in mem.iter() {
        vm_memory::mmap::MmapRegion::bitmap(region).reset();
    }
    Ok(mem)
}

/// Guest memory for the chain `layers` mapped over `reserved`, the
/// anonymous reservation a vmm on standby registered with KVM ahead: each
/// region maps the base memory file MAP_PRIVATE with MAP_FIXED at the
/// reservation's address (KVM follows the new mapping, so no memory slot
/// changes), then the diff layers' pages are copied over, as for `file`.
/// Only the `file` backend with private memory restores this way; the
/// regions must match the reservation's (see `LoadedSnapshot::fits`).
///
/// The returned regions do not own their mappings: `reserved` does, and
/// must outlive them (the VM keeps both).
pub fn build_over(
    layers: &[Layer],
    reserved: &GuestMemoryMmap,
    backend: MemoryBackend,
    mode: MemoryMode,
) -> Result<GuestMemoryMmap, RestoreMemoryError> {
    if backend != MemoryBackend::File || mode.is_shared() {
        return Err(RestoreMemoryError::Map(
            "memory reserved on standby restores only with the file backend and private memory"
                .into(),
        ));
    }
    let Some(base) = layers.first() else {
        return Err(RestoreMemoryError::Map("empty snapshot chain".into()));
    };
    let regions = &base.manifest.regions;
    if regions.len() != reserved.num_regions() {
        return Err(RestoreMemoryError::Map(
            "the snapshot's memory regions differ from the reservation".into(),
        ));
    }
    let (path, base_file) = open_memory(base)?;
    let base_file = Arc::new(base_file);
    let mut guest_regions = Vec::with_capacity(regions.len());
    for (r, slot) in regions.iter().zip(reserved.iter()) {
        let size = region_size(r)?;
        if r.gpa != slot.start_addr().0 || r.size != slot.len() {
            return Err(RestoreMemoryError::Map(format!(
                "the snapshot's region at {:#x} ({} bytes) differs from the reservation's",
                r.gpa, r.size
            )));
        }
        let offset = libc::off_t::try_from(r.file_offset)
            .map_err(|_| RestoreMemoryError::Map("file offset too large".into()))?;
        let host = slot.as_ptr();
        // SAFETY: [host, host + size) is exactly one region of `reserved`, a
        // mapping this process owns and keeps while the returned memory
        // lives; MAP_FIXED replaces that range and nothing else. The file
        // holds the whole layout (checked when the manifest was loaded).
        let mapped = unsafe {
            libc::mmap(
                host.cast(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                base_file.as_raw_fd(),
                offset,
            )
        };
        if mapped == libc::MAP_FAILED || mapped.cast::<u8>() != host {
            return Err(RestoreMemoryError::Io {
                path: path.clone(),
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: `host` starts the mapping just made of `size` bytes of the
        // file at `r.file_offset`, which `reserved` owns, keeps while the
        // returned memory lives (the VM holds both) and unmaps.
        guest_regions.push(unsafe { private_file_region(&base_file, r, size, Some(host))? });
    }
    with_diffs(guest_regions, layers, regions)
}

/// Copies a layer's pages (those its manifest lists) over `mem`.
fn apply_diff(
    mem: &GuestMemoryMmap,
    regions: &[RegionLayout],
    layer: &Layer,
) -> Result<(), RestoreMemoryError> {
    let (path, file) = open_memory(layer)?;
    let io = |source| RestoreMemoryError::Io {
        path: path.clone(),
        source,
    };
    let mut buf = vec![0u8; 1 << 20];
    for extent in &layer.manifest.extents {
        for part in split_by_region(regions, *extent) {
            let mut done = 0;
            while done < part.len {
                let n = (part.len - done).min(buf.len() as u64) as usize;
                file.read_exact_at(&mut buf[..n], part.offset + done)
                    .map_err(io)?;
                let gpa = file_offset_to_gpa(regions, part.offset + done)
                    .ok_or_else(|| RestoreMemoryError::Map("extent outside memory".into()))?;
                mem.write_slice(&buf[..n], GuestAddress(gpa))
                    .map_err(|e| RestoreMemoryError::Map(e.to_string()))?;
                done += n as u64;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_names_parse() {
        assert_eq!("file".parse::<MemoryBackend>(), Ok(MemoryBackend::File));
        assert_eq!("uffd".parse::<MemoryBackend>(), Ok(MemoryBackend::Uffd));
        assert!("disk".parse::<MemoryBackend>().is_err());
    }
}
