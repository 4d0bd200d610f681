//! The userfaultfd restore backend: guest memory whose pages are filled on
//! first touch, by a handler thread inside the vmm, from the newest snapshot
//! layer that holds them. Anonymous memory by default; for shared memory (a
//! memfd that vhost-user backends map) the handler also fills every snapshot
//! page in the background, a batch at a time between faults, and says when
//! it is done (`MemoryReady`): a backend touching a page of the memfd that is
//! still missing would see zeros, as its own mapping raises no fault here.

use std::fs::File;
use std::os::unix::fs::FileExt;

use userfaultfd::{Event, Uffd, UffdBuilder};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::manifest::{Extent, Layer, RegionLayout, MEMORY_FILE};
use super::pages::{page_source, PageSource, RestoreMemoryError, PAGE};
use super::restore_memory::{ranges, RestoredMemory};
use crate::memory::{create_shared, GuestMemoryMmap, MemoryMode, MemoryReady, ReadySignal};

/// Snapshot pages filled per background batch of a shared restore, between
/// looks for faults (so a fault waits for at most one batch: 1 MiB).
const FILL_BATCH_PAGES: usize = 256;

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
    /// Shared memory: the pages still to fill and the signal to give once done.
    fill: Option<Fill>,
}

/// The background filling of a shared restore: every memory-file page some
/// layer holds, in file order.
struct Fill {
    /// Memory-file extents of all layers, merged and sorted.
    todo: Vec<Extent>,
    /// Index into `todo` and the offset reached inside it.
    at: (usize, u64),
    done: Option<ReadySignal>,
}

fn uffd_err(e: impl std::fmt::Display) -> RestoreMemoryError {
    RestoreMemoryError::Uffd(e.to_string())
}

/// Allocates memory for `regions` (anonymous, or a shared memfd when `shared`
/// gives its mode), registers it with a new userfaultfd and starts the thread
/// that serves its faults from `layers`.
pub(super) fn build(
    layers: &[Layer],
    regions: &[RegionLayout],
    shared: Option<MemoryMode>,
) -> Result<RestoredMemory, RestoreMemoryError> {
    let ranges = ranges(regions)?;
    let mem = match shared {
        Some(mode) => create_shared(&ranges, mode),
        None => GuestMemoryMmap::from_ranges(&ranges).map_err(|source| {
            crate::memory::MemoryError::Allocate {
                mib: regions.iter().map(|r| r.size).sum::<u64>() >> 20,
                source,
            }
        }),
    }
    .map_err(|e| RestoreMemoryError::Map(e.to_string()))?;
    let mut builder = UffdBuilder::new();
    builder
        .close_on_exec(true)
        // A shared restore looks for faults between fill batches.
        .non_blocking(shared.is_some())
        .user_mode_only(false);
    if shared.is_some() {
        builder.require_features(userfaultfd::FeatureFlags::MISSING_SHMEM);
    }
    let uffd = builder.create().map_err(uffd_err)?;
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
    let extents: Vec<Vec<Extent>> = layers.iter().map(|l| l.manifest.extents.clone()).collect();
    let (ready, fill) = match shared {
        Some(_) => {
            let (ready, signal) = MemoryReady::pending().map_err(uffd_err)?;
            let fill = Fill {
                todo: merged(&extents),
                at: (0, 0),
                done: Some(signal),
            };
            (ready, Some(fill))
        }
        None => (MemoryReady::now(), None),
    };
    let handler = Handler {
        uffd,
        regions: host_regions,
        files,
        extents,
        fill,
    };
    std::thread::Builder::new()
        .name("uffd".into())
        .spawn(move || handler.run())
        .map_err(uffd_err)?;
    Ok(RestoredMemory { mem, ready })
}

/// Every layer's extents as one sorted list of disjoint extents.
fn merged(layers: &[Vec<Extent>]) -> Vec<Extent> {
    let mut all: Vec<Extent> = layers.iter().flatten().copied().collect();
    all.sort_by_key(|e| e.offset);
    let mut out: Vec<Extent> = Vec::with_capacity(all.len());
    for e in all {
        match out.last_mut() {
            Some(last) if e.offset <= last.offset + last.len => {
                last.len = last.len.max(e.offset + e.len - last.offset);
            }
            _ => out.push(e),
        }
    }
    out
}

impl Handler {
    fn run(mut self) {
        crate::seccomp::apply_or_die(crate::seccomp::ThreadKind::Device);
        let mut page = vec![0u8; PAGE];
        while self.fill.is_some() {
            // Faults first, then one batch of filling.
            loop {
                match self.uffd.read_event() {
                    Ok(Some(Event::Pagefault { addr, .. })) => {
                        if let Err(e) = self.serve(addr as usize, &mut page) {
                            tracing::error!(
                                addr = format!("{:#x}", addr as usize),
                                "userfaultfd: {e}"
                            );
                        }
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(e) => {
                        tracing::error!("userfaultfd handler stops: {e}");
                        return;
                    }
                }
            }
            if let Err(e) = self.fill_batch(&mut page) {
                tracing::error!("filling restored shared memory stops: {e}");
                return;
            }
        }
        loop {
            if !self.wait_readable() {
                return;
            }
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

    /// Blocks until the (non-blocking, shared-restore) userfaultfd has an
    /// event; true at once for a blocking one. False when it cannot be waited on.
    fn wait_readable(&self) -> bool {
        use std::os::fd::AsRawFd;
        let mut pfd = libc::pollfd {
            fd: self.uffd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        loop {
            // SAFETY: `pfd` is one valid pollfd for the duration of the call.
            let n = unsafe { libc::poll(&mut pfd, 1, -1) };
            if n >= 0 {
                return true;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                tracing::error!("userfaultfd handler stops: cannot wait for faults: {e}");
                return false;
            }
        }
    }

    /// Fills the next batch of snapshot pages of a shared restore; gives the
    /// ready signal after the last.
    fn fill_batch(&mut self, page: &mut [u8]) -> Result<(), String> {
        let Some(fill) = self.fill.as_mut() else {
            return Ok(());
        };
        let mut offsets = Vec::with_capacity(FILL_BATCH_PAGES);
        while offsets.len() < FILL_BATCH_PAGES {
            let Some(e) = fill.todo.get(fill.at.0) else {
                break;
            };
            if fill.at.1 >= e.len {
                fill.at = (fill.at.0 + 1, 0);
                continue;
            }
            offsets.push(e.offset + fill.at.1);
            fill.at.1 += PAGE as u64;
        }
        let finished = offsets.is_empty();
        for offset in offsets {
            if let Some(addr) = self.host_address(offset) {
                self.serve(addr, page)?;
            }
        }
        if finished {
            if let Some(signal) = self.fill.take().and_then(|mut f| f.done.take()) {
                signal.done();
            }
        }
        Ok(())
    }

    /// The host address of memory-file offset `offset`.
    fn host_address(&self, offset: u64) -> Option<usize> {
        self.regions.iter().find_map(|r| {
            let rel = offset.checked_sub(r.file_offset)?;
            (rel < r.len as u64).then(|| r.host_start + rel as usize)
        })
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
