//! The userfaultfd restore backend: anonymous guest memory whose pages are
//! filled on first touch, by a handler thread inside the vmm, from the newest
//! snapshot layer that holds them.

use std::fs::File;
use std::os::unix::fs::FileExt;

use userfaultfd::{Event, Uffd, UffdBuilder};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::manifest::{Extent, Layer, RegionLayout, MEMORY_FILE};
use super::pages::{page_source, PageSource, RestoreMemoryError, PAGE};
use crate::memory::GuestMemoryMmap;

/// One registered region: host range and its place in the memory files.
struct HostRegion {
    host_start: usize,
    len: usize,
    file_offset: u64,
}

/// Everything the fault handler needs; moved into its thread.
struct Handler {
    uffd: Uffd,
    regions: Vec<HostRegion>,
    files: Vec<File>,
    extents: Vec<Vec<Extent>>,
}

fn uffd_err(e: impl std::fmt::Display) -> RestoreMemoryError {
    RestoreMemoryError::Uffd(e.to_string())
}

/// Allocates anonymous memory for `regions`, registers it with a new
/// userfaultfd and starts the thread that serves its faults from `layers`.
pub(super) fn build(
    layers: &[Layer],
    regions: &[RegionLayout],
) -> Result<GuestMemoryMmap, RestoreMemoryError> {
    let ranges: Vec<(vm_memory::GuestAddress, usize)> = regions
        .iter()
        .map(|r| (vm_memory::GuestAddress(r.gpa), r.size as usize))
        .collect();
    let mem = GuestMemoryMmap::from_ranges(&ranges)
        .map_err(|e| RestoreMemoryError::Map(e.to_string()))?;
    let uffd = UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(false)
        .user_mode_only(false)
        .create()
        .map_err(uffd_err)?;
    let mut host_regions = Vec::new();
    for (region, layout) in mem.iter().zip(regions) {
        let len = region.len() as usize;
        let start = region.as_ptr();
        uffd.register(start.cast(), len).map_err(uffd_err)?;
        host_regions.push(HostRegion {
            host_start: start as usize,
            len,
            file_offset: layout.file_offset,
        });
    }
    let mut files = Vec::new();
    for layer in layers {
        let path = layer.dir.join(MEMORY_FILE);
        files.push(File::open(&path).map_err(|source| RestoreMemoryError::Io { path, source })?);
    }
    let handler = Handler {
        uffd,
        regions: host_regions,
        files,
        extents: layers.iter().map(|l| l.manifest.extents.clone()).collect(),
    };
    std::thread::Builder::new()
        .name("uffd".into())
        .spawn(move || handler.run())
        .map_err(uffd_err)?;
    Ok(mem)
}

impl Handler {
    fn run(self) {
        crate::seccomp::apply_or_die(crate::seccomp::ThreadKind::Device);
        let mut page = vec![0u8; PAGE];
        loop {
            match self.uffd.read_event() {
                Ok(Some(Event::Pagefault { addr, .. })) => {
                    if let Err(e) = self.serve(addr as usize, &mut page) {
                        // The faulting thread stays blocked; say why loudly.
                        tracing::error!(addr = format!("{:#x}", addr as usize), "userfaultfd: {e}");
                    }
                }
                Ok(Some(_)) | Ok(None) => {}
                Err(e) => {
                    tracing::error!("userfaultfd handler stops: {e}");
                    return;
                }
            }
        }
    }

    fn serve(&self, addr: usize, page: &mut [u8]) -> Result<(), String> {
        let page_addr = addr & !(PAGE - 1);
        let region = self
            .regions
            .iter()
            .find(|r| page_addr >= r.host_start && page_addr < r.host_start + r.len)
            .ok_or("fault outside guest memory")?;
        let offset = region.file_offset + (page_addr - region.host_start) as u64;
        let dst = page_addr as *mut libc::c_void;
        let result = match page_source(&self.extents, offset) {
            PageSource::Layer(i) => {
                self.files[i]
                    .read_exact_at(page, offset)
                    .map_err(|e| format!("reading snapshot page at {offset:#x}: {e}"))?;
                // SAFETY: `dst` is a page-aligned address inside a range registered with this
                // userfaultfd, `page` is a PAGE-sized buffer, and UFFDIO_COPY only fills a missing
                // page atomically (it fails with EEXIST rather than overwrite).
                unsafe { self.uffd.copy(page.as_ptr().cast(), dst, PAGE, true) }.map(|_| ())
            }
            // SAFETY: as above; UFFDIO_ZEROPAGE maps the zero page at a missing, registered address.
            PageSource::Zero => unsafe { self.uffd.zeropage(dst, PAGE, true) }.map(|_| ()),
        };
        match result {
            Ok(()) => Ok(()),
            // Another fault on the same page was served first: just wake the waiters.
            Err(userfaultfd::Error::CopyFailed(errno))
            | Err(userfaultfd::Error::ZeropageFailed(errno))
                if errno as i32 == libc::EEXIST =>
            {
                self.uffd.wake(dst, PAGE).map_err(|e| e.to_string())
            }
            Err(e) => Err(e.to_string()),
        }
    }
}
