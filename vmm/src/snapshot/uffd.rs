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

/// Pages one fault brings in: the aligned block of this many pages around
/// the faulting one, clipped to its region, each from the layer holding it.
/// Every fault costs a round trip through this thread either way (on this
/// project's development machine 65-70 µs, most of it in KVM); a block
/// lets one fault serve the neighbours the guest is likely to touch next, as
/// the kernel's own fault-around does for file mappings (64 KiB). A sparse
/// toucher pays for it in memory: up to 15 more private pages per fault.
const FAULT_AROUND_PAGES: usize = 16;

/// Which region holds memory-file offset `offset`, and the offset into it.
fn region_at(regions: &[HostRegion], offset: u64) -> Option<(usize, usize)> {
    regions.iter().enumerate().find_map(|(i, r)| {
        let rel = offset.checked_sub(r.file_offset)?;
        (rel < r.len as u64).then_some((i, rel as usize))
    })
}

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
    if shared == Some(MemoryMode::SharedHugepages) {
        // hugetlbfs takes UFFDIO_COPY only in whole 2 MiB pages and has no
        // UFFDIO_ZEROPAGE; this handler places 4 KiB pages.
        return Err(RestoreMemoryError::Uffd(
            "2 MiB huge pages (--memory shared-hugepages) are not filled by it".into(),
        ));
    }
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
        // Runs of pages are read into this buffer, then copied into place.
        let pages = if self.fill.is_some() {
            FILL_BATCH_PAGES
        } else {
            FAULT_AROUND_PAGES
        };
        let mut buf = vec![0u8; pages * PAGE];
        while self.fill.is_some() {
            // Faults first, then one batch of filling.
            loop {
                match self.uffd.read_event() {
                    Ok(Some(Event::Pagefault { addr, .. })) => {
                        if let Err(e) = self.serve_fault(addr as usize, &mut buf) {
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
            if let Err(e) = self.fill_batch(&mut buf) {
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
                    if let Err(e) = self.serve_fault(addr as usize, &mut buf) {
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

    /// Fills the next piece of a shared restore's snapshot pages (the rest of
    /// the current extent, at most one batch, inside one region); gives the
    /// ready signal once none is left.
    fn fill_batch(&mut self, buf: &mut [u8]) -> Result<(), String> {
        let Some(fill) = self.fill.as_mut() else {
            return Ok(());
        };
        let piece = loop {
            let Some(e) = fill.todo.get(fill.at.0) else {
                break None;
            };
            if fill.at.1 >= e.len {
                fill.at = (fill.at.0 + 1, 0);
                continue;
            }
            let offset = e.offset + fill.at.1;
            let want = (e.len - fill.at.1).min((FILL_BATCH_PAGES * PAGE) as u64);
            match region_at(&self.regions, offset) {
                Some((i, rel)) => {
                    let len = want.min((self.regions[i].len - rel) as u64);
                    fill.at.1 += len;
                    break Some((i, rel, len as usize));
                }
                // Not guest memory: a validated manifest's regions cover
                // the file from 0 and its extents lie inside them, so only
                // an unchecked one gets here; the rest of the extent is
                // skipped.
                None => fill.at.1 = e.len,
            }
        };
        match piece {
            Some((i, rel, len)) => self.serve_range(&self.regions[i], rel, len, buf),
            None => {
                if let Some(signal) = self.fill.take().and_then(|mut f| f.done.take()) {
                    signal.done();
                }
                Ok(())
            }
        }
    }

    /// Serves a fault at host address `addr`: the aligned block of
    /// [`FAULT_AROUND_PAGES`] around it (clipped to its region), or, should
    /// that fail, the faulting page alone.
    fn serve_fault(&self, addr: usize, buf: &mut [u8]) -> Result<(), String> {
        let page_addr = addr & !(PAGE - 1);
        let region = self
            .regions
            .iter()
            .find(|r| page_addr >= r.host_start && page_addr - r.host_start < r.len)
            .ok_or("fault outside guest memory")?;
        let rel = page_addr - region.host_start;
        let block = FAULT_AROUND_PAGES * PAGE;
        let start = rel - rel % block;
        let end = (start + block).min(region.len);
        self.serve_range(region, start, end - start, buf)
            .or_else(|e| {
                tracing::warn!(
                    addr = format!("{page_addr:#x}"),
                    "userfaultfd: filling the pages around a fault failed ({e}); filling the faulting page alone"
                );
                self.serve_range(region, rel, PAGE, buf)
            })
    }

    /// Fills `len` bytes of `region` from offset `rel` (both page multiples,
    /// inside the region): each run of pages from the newest layer holding
    /// it, or as zero pages, at most `buf.len()` bytes per run. A page that
    /// is already there is left as it is and its waiters are woken.
    fn serve_range(
        &self,
        region: &HostRegion,
        rel: usize,
        len: usize,
        buf: &mut [u8],
    ) -> Result<(), String> {
        let end = rel + len;
        let mut at = rel;
        while at < end {
            let offset = region.file_offset + at as u64;
            let source = page_source(&self.extents, offset);
            let mut run = PAGE;
            while at + run < end
                && run + PAGE <= buf.len()
                && page_source(&self.extents, offset + run as u64) == source
            {
                run += PAGE;
            }
            if let PageSource::Layer(i) = source {
                self.files[i]
                    .read_exact_at(&mut buf[..run], offset)
                    .map_err(|e| format!("reading snapshot pages at {offset:#x}: {e}"))?;
            }
            self.place(region.host_start + at, source, &buf[..run])?;
            at += run;
        }
        Ok(())
    }

    /// Places one run of pages at host address `dst`: `bytes` (a layer's
    /// pages) or, for [`PageSource::Zero`], zero pages over `bytes.len()`.
    /// When the whole run cannot be placed at once (a page of it is already
    /// there), it is placed page by page.
    fn place(&self, dst: usize, source: PageSource, bytes: &[u8]) -> Result<(), String> {
        if self.place_pages(dst, source, bytes).is_ok() {
            return Ok(());
        }
        for at in (0..bytes.len()).step_by(PAGE) {
            let page = dst + at;
            match self.place_pages(page, source, &bytes[at..at + PAGE]) {
                Ok(()) => {}
                // Already there (a fault raced the fill, or two vCPUs
                // faulted in one block): just wake its waiters.
                Err(userfaultfd::Error::CopyFailed(errno))
                | Err(userfaultfd::Error::ZeropageFailed(errno))
                    if errno as i32 == libc::EEXIST =>
                {
                    self.uffd
                        .wake(page as *mut libc::c_void, PAGE)
                        .map_err(|e| e.to_string())?;
                }
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(())
    }

    /// One UFFDIO_COPY (a layer's pages) or UFFDIO_ZEROPAGE of `bytes.len()`
    /// bytes at `dst`, waking the threads that wait on them; an error when
    /// not all of it was placed.
    fn place_pages(
        &self,
        dst: usize,
        source: PageSource,
        bytes: &[u8],
    ) -> Result<(), userfaultfd::Error> {
        let target = dst as *mut libc::c_void;
        let placed = match source {
            // SAFETY: `dst..dst + bytes.len()` is page aligned and inside a
            // range registered with this userfaultfd (the callers keep to
            // their region's bounds), `bytes` is that long, and UFFDIO_COPY
            // only fills missing pages (it stops at one already there rather
            // than overwrite it).
            PageSource::Layer(_) => unsafe {
                self.uffd
                    .copy(bytes.as_ptr().cast(), target, bytes.len(), true)?
            },
            // SAFETY: as above; UFFDIO_ZEROPAGE maps the zero page at
            // missing, registered addresses only.
            PageSource::Zero => unsafe { self.uffd.zeropage(target, bytes.len(), true)? },
        };
        if placed == bytes.len() {
            Ok(())
        } else {
            Err(userfaultfd::Error::PartiallyCopied(placed))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::format::{FORMAT_MAJOR, FORMAT_MINOR};
    use crate::snapshot::manifest::{Manifest, SnapshotKind};
    use std::path::PathBuf;
    use std::time::{Duration, Instant};
    use vm_memory::{Bytes, GuestAddress};

    const P: u64 = PAGE as u64;

    /// The byte layer `layer` holds at every position of memory-file page
    /// `page`: never zero, and other in each layer.
    fn byte(layer: usize, page: u64) -> u8 {
        ((layer as u64 * 100 + page * 7) % 255 + 1) as u8
    }

    /// A two-layer chain over a 48-page memory file: the base holds pages
    /// 0..40 (40..48 are zero), the diff pages 5 and 18..20.
    struct Chain {
        _dir: tempfile::TempDir,
        layers: Vec<Layer>,
    }

    fn chain(regions: &[RegionLayout]) -> Chain {
        let dir = tempfile::tempdir().unwrap();
        let e = |page: u64, pages: u64| Extent {
            offset: page * P,
            len: pages * P,
        };
        let holdings = [vec![e(0, 40)], vec![e(5, 1), e(18, 2)]];
        let mut layers = Vec::new();
        for (i, extents) in holdings.into_iter().enumerate() {
            let layer_dir = dir.path().join(format!("layer{i}"));
            std::fs::create_dir(&layer_dir).unwrap();
            let file = File::create(layer_dir.join(MEMORY_FILE)).unwrap();
            file.set_len(48 * P).unwrap();
            for x in &extents {
                for page in x.offset / P..(x.offset + x.len) / P {
                    file.write_all_at(&[byte(i, page); PAGE], page * P).unwrap();
                }
            }
            let manifest = Manifest {
                format_version: [FORMAT_MAJOR, FORMAT_MINOR],
                kind: if i == 0 {
                    SnapshotKind::Full
                } else {
                    SnapshotKind::Diff
                },
                created_unix_ms: 1,
                regions: regions.to_vec(),
                parent: (i > 0).then(|| PathBuf::from("layer0")),
                extents,
            };
            layers.push(Layer {
                dir: layer_dir,
                manifest,
            });
        }
        Chain { _dir: dir, layers }
    }

    /// What memory-file page `page` holds in the chain: the diff's, else
    /// the base's, else zero.
    fn expected(page: u64) -> u8 {
        match page {
            5 | 18 | 19 => byte(1, page),
            0..40 => byte(0, page),
            _ => 0,
        }
    }

    /// Two 24-page regions, far apart in guest memory, back to back in the
    /// memory file.
    fn regions() -> Vec<RegionLayout> {
        vec![
            RegionLayout {
                gpa: 0,
                size: 24 * P,
                file_offset: 0,
            },
            RegionLayout {
                gpa: 1 << 30,
                size: 24 * P,
                file_offset: 24 * P,
            },
        ]
    }

    /// Which pages of `mem`'s region `region` are mapped (`mincore`).
    fn mapped(mem: &GuestMemoryMmap, region: usize) -> Vec<bool> {
        let r = mem.iter().nth(region).unwrap();
        let mut vec = vec![0u8; r.len() as usize / PAGE];
        // SAFETY: the region is one live mapping of `r.len()` bytes and `vec`
        // has one byte per page of it.
        let rc = unsafe { libc::mincore(r.as_ptr().cast(), r.len() as usize, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().map(|b| b & 1 == 1).collect()
    }

    /// Waits until exactly the pages `want` says of region `region` are
    /// mapped: the faulting thread is woken once its own run of pages is in
    /// place, while the handler may still be placing the rest of the block.
    fn await_mapped(mem: &GuestMemoryMmap, region: usize, want: &[bool], what: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while mapped(mem, region) != want && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(mapped(mem, region), want, "{what}");
    }

    /// The byte the guest sees at the start of page `page` of region `region`
    /// (a read that faults when the page is missing).
    fn first_byte(mem: &GuestMemoryMmap, region: usize, page: u64) -> u8 {
        let r = regions()[region];
        mem.read_obj(GuestAddress(r.gpa + page * P)).unwrap()
    }

    /// None, with the reason printed, where this host gives no userfaultfd.
    fn restored(layers: &[Layer], shared: Option<MemoryMode>) -> Option<RestoredMemory> {
        match build(layers, &regions(), shared) {
            Ok(r) => Some(r),
            Err(RestoreMemoryError::Uffd(e)) => {
                eprintln!("skipped: no userfaultfd on this host ({e})");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    fn assert_holds_the_chain(mem: &GuestMemoryMmap) {
        for (region, layout) in regions().iter().enumerate() {
            for page in 0..layout.size / P {
                let mut got = vec![0u8; PAGE];
                mem.read_slice(&mut got, GuestAddress(layout.gpa + page * P))
                    .unwrap();
                let file_page = layout.file_offset / P + page;
                assert!(
                    got.iter().all(|&b| b == expected(file_page)),
                    "region {region} page {page} (memory-file page {file_page}) holds {:#x}, \
                     not {:#x}",
                    got[0],
                    expected(file_page)
                );
            }
        }
    }

    #[test]
    fn a_fault_fills_its_block_each_page_from_the_layer_holding_it() {
        let c = chain(&regions());
        let Some(r) = restored(&c.layers, None) else {
            return;
        };
        assert!(
            mapped(&r.mem, 0).iter().all(|&m| !m),
            "nothing mapped before a touch"
        );
        // Page 3's block is pages 0..16: base pages and the diff's page 5.
        assert_eq!(first_byte(&r.mem, 0, 3), expected(3));
        let want: Vec<bool> = (0..24).map(|p| p < 16).collect();
        await_mapped(&r.mem, 0, &want, "region 0 after a touch of page 3");
        assert_eq!(
            mapped(&r.mem, 1),
            vec![false; 24],
            "another region is left alone"
        );
        // Region 1's page 20 is memory-file page 44, in the base's zero tail;
        // its block is clipped at the region's end: pages 16..24.
        assert_eq!(first_byte(&r.mem, 1, 20), 0);
        let want: Vec<bool> = (0..24).map(|p| p >= 16).collect();
        await_mapped(&r.mem, 1, &want, "region 1 after a touch of page 20");
        // Everything else faults in block by block, with the right bytes.
        assert_holds_the_chain(&r.mem);
    }

    #[test]
    fn a_page_already_in_place_is_kept_and_the_rest_of_its_block_filled() {
        let c = chain(&regions());
        let uffd = match UffdBuilder::new()
            .close_on_exec(true)
            .user_mode_only(false)
            .create()
        {
            Ok(u) => u,
            Err(e) => {
                eprintln!("skipped: no userfaultfd on this host ({e})");
                return;
            }
        };
        // Region 0's layout, registered with this handler's userfaultfd and
        // served by calling it directly (no thread).
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 24 * PAGE)]).unwrap();
        let host = mem.iter().next().unwrap().as_ptr() as usize;
        uffd.register(host as *mut libc::c_void, 24 * PAGE).unwrap();
        let handler = Handler {
            uffd,
            regions: vec![HostRegion {
                host_start: host,
                len: 24 * PAGE,
                file_offset: 0,
            }],
            files: c
                .layers
                .iter()
                .map(|l| File::open(l.dir.join(MEMORY_FILE)).unwrap())
                .collect(),
            extents: c
                .layers
                .iter()
                .map(|l| l.manifest.extents.clone())
                .collect(),
            fill: None,
        };
        // Page 9 arrives first with other bytes (as a fault racing a fill).
        handler
            .place_pages(host + 9 * PAGE, PageSource::Layer(0), &[0xee; PAGE])
            .unwrap();
        let mut buf = vec![0u8; FAULT_AROUND_PAGES * PAGE];
        handler
            .serve_fault(host + 2 * PAGE + 100, &mut buf)
            .unwrap();
        let want: Vec<bool> = (0..24).map(|p| p < 16).collect();
        assert_eq!(mapped(&mem, 0), want);
        for page in 0..16u64 {
            let b: u8 = mem.read_obj(GuestAddress(page * P)).unwrap();
            let want = if page == 9 { 0xee } else { expected(page) };
            assert_eq!(b, want, "page {page}");
        }
    }

    #[test]
    fn huge_page_memory_is_refused_with_what_to_use_instead() {
        let c = chain(&regions());
        let Err(e) = build(&c.layers, &regions(), Some(MemoryMode::SharedHugepages)) else {
            panic!("a uffd restore onto huge pages was accepted");
        };
        let msg = e.to_string();
        assert!(
            msg.contains("shared-hugepages") && msg.contains("--memory-backend file"),
            "{msg}"
        );
    }

    #[test]
    fn a_shared_restore_fills_every_page_in_the_background() {
        let c = chain(&regions());
        let Some(r) = restored(&c.layers, Some(MemoryMode::Shared)) else {
            return;
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !r.ready.is_ready() {
            assert!(Instant::now() < deadline, "the fill did not end");
            std::thread::sleep(Duration::from_millis(1));
        }
        // The base's 40 pages run across the regions' boundary (file page 24).
        for region in 0..2 {
            let m = mapped(&r.mem, region);
            let held: Vec<bool> = (0..24).map(|p| region * 24 + p < 40).collect();
            assert_eq!(m, held, "region {region}: the snapshot's pages, no more");
        }
        assert_holds_the_chain(&r.mem);
    }
}
