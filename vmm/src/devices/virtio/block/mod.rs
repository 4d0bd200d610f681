//! virtio-blk: a raw disk image file, optionally read-only, with flush and
//! get-id. Data moves between the file and guest memory through a bounded
//! copy buffer; a request is checked against the disk's size before any I/O.
//!
//! Requests may be rate limited (data bytes and requests, see
//! [`super::rate_limiter`]): a request the limiter refuses stays in the
//! guest's ring (the pop is undone) until the limiter's timer fires. A
//! request's bytes are its data (not the header or status byte); flush,
//! get-id and malformed requests cost one request and no bytes.

pub mod persist;

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK,
    VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT,
};
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_queue::{DescriptorChain, QueueT, Reader, Writer};
use vm_memory::bitmap::BitmapSlice;
use vm_memory::ByteValued;
use vmm_api::rate_limit::IoLimit;

use super::io_counters::{add, BlkIoCounters};
use super::rate_limiter::RateLimiter;
use super::{read_config_bytes, ActivateError, DeviceCommon, Interrupt, VirtioDevice};
use crate::memory::GuestMemoryMmap;

/// Sector size used by the virtio-blk protocol.
pub const SECTOR_SIZE: u64 = 512;
/// Maximum descriptors per request the queue offers (its size).
pub const QUEUE_SIZE: u16 = 256;

/// Errors opening a disk.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The image cannot be opened.
    #[error("cannot open disk image {path}: {source} (check the path and its permissions; add ,ro for a read-only image)")]
    Open {
        /// The image.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// An eventfd could not be created.
    #[error("cannot create the virtio-blk queue eventfd: {0}")]
    Eventfd(#[source] io::Error),
    /// The rate limiter's timerfd could not be created.
    #[error("cannot create the virtio-blk rate limiter timer (timerfd): {0}")]
    Timer(#[source] io::Error),
}

/// The request header a driver puts first in each chain.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RequestHeader {
    request_type: u32,
    reserved: u32,
    sector: u64,
}

// SAFETY: RequestHeader is plain data of integers without padding (4 + 4 + 8 bytes);
// any byte pattern is a valid value.
unsafe impl ByteValued for RequestHeader {}

/// A disk image with its size and identity.
struct Disk {
    file: File,
    path: PathBuf,
    read_only: bool,
    /// Size in 512-byte sectors (a trailing partial sector is not exposed).
    sectors: u64,
    id: [u8; VIRTIO_BLK_ID_BYTES as usize],
}

/// The file at a moving offset, for `io::copy`.
struct FileAt<'a> {
    file: &'a File,
    pos: u64,
}

impl Read for FileAt<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl Write for FileAt<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.file.write_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Disk {
    fn open(path: &Path, read_only: bool) -> Result<Disk, BlockError> {
        let open_err = |source| BlockError::Open {
            path: path.into(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(open_err)?;
        let meta = file.metadata().map_err(open_err)?;
        let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        let text = format!("vmm{:x}-{:x}", meta.dev(), meta.ino());
        let n = text.len().min(id.len());
        id[..n].copy_from_slice(&text.as_bytes()[..n]);
        Ok(Disk {
            file,
            path: path.into(),
            read_only,
            sectors: meta.len() / SECTOR_SIZE,
            id,
        })
    }

    /// The byte offset of `sector` if `len` bytes from there fit on the disk.
    fn offset(&self, sector: u64, len: usize) -> Option<u64> {
        let start = sector.checked_mul(SECTOR_SIZE)?;
        let end = start.checked_add(len as u64)?;
        (end <= self.sectors * SECTOR_SIZE).then_some(start)
    }

    /// Runs one request; returns the status and the bytes written into guest buffers.
    fn execute<B: BitmapSlice>(
        &self,
        header: RequestHeader,
        reader: &mut Reader<'_, B>,
        writer: &mut Writer<'_, B>,
    ) -> (u8, u32) {
        let ioerr = (VIRTIO_BLK_S_IOERR as u8, 0);
        match header.request_type {
            VIRTIO_BLK_T_IN => {
                let len = writer.available_bytes();
                let Some(pos) = self.offset(header.sector, len) else {
                    return ioerr;
                };
                let mut src = FileAt {
                    file: &self.file,
                    pos,
                }
                .take(len as u64);
                match io::copy(&mut src, writer) {
                    Ok(n) if n == len as u64 => (VIRTIO_BLK_S_OK as u8, len as u32),
                    Ok(n) => (VIRTIO_BLK_S_IOERR as u8, n as u32),
                    Err(e) => {
                        tracing::debug!(error = %e, "virtio-blk read failed");
                        ioerr
                    }
                }
            }
            VIRTIO_BLK_T_OUT => {
                if self.read_only {
                    return ioerr;
                }
                let len = reader.available_bytes();
                let Some(pos) = self.offset(header.sector, len) else {
                    return ioerr;
                };
                let mut dst = FileAt {
                    file: &self.file,
                    pos,
                };
                match io::copy(reader, &mut dst) {
                    Ok(n) if n == len as u64 => (VIRTIO_BLK_S_OK as u8, 0),
                    Ok(_) => ioerr,
                    Err(e) => {
                        tracing::debug!(error = %e, "virtio-blk write failed");
                        ioerr
                    }
                }
            }
            VIRTIO_BLK_T_FLUSH => {
                if self.read_only {
                    return (VIRTIO_BLK_S_OK as u8, 0);
                }
                match self.file.sync_data() {
                    Ok(()) => (VIRTIO_BLK_S_OK as u8, 0),
                    Err(e) => {
                        tracing::warn!(path = %self.path.display(), error = %e, "virtio-blk flush failed");
                        ioerr
                    }
                }
            }
            VIRTIO_BLK_T_GET_ID => {
                let n = writer.available_bytes().min(self.id.len());
                match writer.write_all(&self.id[..n]) {
                    Ok(()) => (VIRTIO_BLK_S_OK as u8, n as u32),
                    Err(_) => ioerr,
                }
            }
            _ => (VIRTIO_BLK_S_UNSUPP as u8, 0),
        }
    }
}

/// The virtio-blk device.
pub struct Block {
    common: DeviceCommon,
    disk: Disk,
    limiter: RateLimiter,
    counters: Arc<BlkIoCounters>,
}

impl Block {
    /// Opens `path` (read-only when `read_only`) as a virtio-blk disk.
    pub fn new(path: &Path, read_only: bool) -> Result<Block, BlockError> {
        let disk = Disk::open(path, read_only)?;
        let mut features = 1u64 << VIRTIO_BLK_F_FLUSH;
        if read_only {
            features |= 1 << VIRTIO_BLK_F_RO;
        }
        let common = DeviceCommon::new(features, &[QUEUE_SIZE]).map_err(BlockError::Eventfd)?;
        Ok(Block {
            common,
            disk,
            limiter: RateLimiter::unlimited(),
            counters: Arc::default(),
        })
    }

    /// Sets the bandwidth and IOPS limits (full buckets from now).
    pub fn set_limits(&mut self, limits: &IoLimit) -> Result<(), BlockError> {
        self.limiter = RateLimiter::new(limits, Instant::now()).map_err(BlockError::Timer)?;
        Ok(())
    }

    /// The request counters, shared with whoever reports them.
    pub fn io_counters(&self) -> Arc<BlkIoCounters> {
        self.counters.clone()
    }

    /// Capacity in 512-byte sectors.
    pub fn sectors(&self) -> u64 {
        self.disk.sectors
    }

    /// Whether guest writes are refused.
    pub fn read_only(&self) -> bool {
        self.disk.read_only
    }

    /// Handles every available request; returns how many were completed.
    pub fn process_queue(&mut self) -> usize {
        let Some(mem) = self.common.mem.clone() else {
            return 0;
        };
        let mut done = 0;
        while !self.limiter.is_blocked() {
            let Some(chain) = self.common.pop_chain(0, &mem) else {
                break;
            };
            if !self.limiter.is_unlimited()
                && !self
                    .limiter
                    .consume(1, request_bytes(&mem, &chain), Instant::now())
            {
                self.common.undo_pop(0);
                add(&self.counters.throttled, 1);
                break;
            }
            let head = chain.head_index();
            let used = handle_request(&self.disk, &mem, chain, &self.counters);
            if let Err(e) = self.common.queues[0].add_used(&mem, head, used) {
                tracing::warn!(error = %e, "virtio-blk cannot return a request to the guest");
                break;
            }
            done += 1;
        }
        if done > 0 {
            self.common.signal_used_queue(0);
        }
        done
    }
}

/// The data bytes a request moves, for the rate limiter: what a read may
/// fill (the writable bytes but the status byte), what a write carries (the
/// readable bytes after the header); 0 for anything else or a chain that
/// cannot be read (it costs one request, and is answered or dropped as usual).
fn request_bytes(mem: &GuestMemoryMmap, chain: &DescriptorChain<&GuestMemoryMmap>) -> u64 {
    let Ok(mut reader) = Reader::new(mem, chain.clone()) else {
        return 0;
    };
    let Ok(header) = reader.read_obj::<RequestHeader>() else {
        return 0;
    };
    match header.request_type {
        VIRTIO_BLK_T_IN => Writer::new(mem, chain.clone())
            .map(|w| w.available_bytes().saturating_sub(1) as u64)
            .unwrap_or(0),
        VIRTIO_BLK_T_OUT => reader.available_bytes() as u64,
        _ => 0,
    }
}

/// Parses and runs one request chain, counting it in `counters` when it
/// succeeds; returns the used length (0 when the chain is too broken to
/// even carry a status byte: the request is dropped).
fn handle_request(
    disk: &Disk,
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<&GuestMemoryMmap>,
    counters: &BlkIoCounters,
) -> u32 {
    let mut writer = match Writer::new(mem, chain.clone()) {
        Ok(w) => w,
        Err(e) => {
            tracing::debug!(error = %e, "virtio-blk request with bad writable buffers dropped");
            return 0;
        }
    };
    let total = writer.available_bytes();
    if total == 0 {
        tracing::debug!("virtio-blk request without a status byte dropped");
        return 0;
    }
    let mut status_writer = match writer.split_at(total - 1) {
        Ok(s) => s,
        Err(_) => return 0,
    };
    let (status, written) = match Reader::new(mem, chain) {
        Ok(mut reader) => match reader.read_obj::<RequestHeader>() {
            Ok(header) => {
                let to_write = reader.available_bytes() as u64;
                let (status, written) = disk.execute(header, &mut reader, &mut writer);
                if u32::from(status) == VIRTIO_BLK_S_OK {
                    count(counters, header.request_type, u64::from(written), to_write);
                }
                (status, written)
            }
            Err(_) => (VIRTIO_BLK_S_IOERR as u8, 0),
        },
        Err(e) => {
            tracing::debug!(error = %e, "virtio-blk request with bad readable buffers");
            (VIRTIO_BLK_S_IOERR as u8, 0)
        }
    };
    match status_writer.write_obj(status) {
        Ok(()) => written.saturating_add(1),
        Err(_) => written,
    }
}

/// Counts a successful request of `request_type` that filled `read` bytes
/// of guest buffers or wrote `written` bytes to the disk.
fn count(counters: &BlkIoCounters, request_type: u32, read: u64, written: u64) {
    match request_type {
        VIRTIO_BLK_T_IN => {
            add(&counters.reads, 1);
            add(&counters.read_bytes, read);
        }
        VIRTIO_BLK_T_OUT => {
            add(&counters.writes, 1);
            add(&counters.write_bytes, written);
        }
        VIRTIO_BLK_T_FLUSH => add(&counters.flushes, 1),
        _ => {}
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }
    fn common(&self) -> &DeviceCommon {
        &self.common
    }
    fn common_mut(&mut self) -> &mut DeviceCommon {
        &mut self.common
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_blk_config starts with `le64 capacity`.
        read_config_bytes(&self.disk.sectors.to_le_bytes(), offset, data);
    }
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), ActivateError> {
        self.common.activate(mem, interrupt)?;
        // Requests queued before DRIVER_OK are served now.
        self.process_queue();
        Ok(())
    }
    fn reset(&mut self) {
        self.common.reset();
        self.limiter.unblock();
    }
}

impl MutEventSubscriber for Block {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        if let Some(evt) = self.common.queue_evts.first() {
            if events.fd() == std::os::fd::AsRawFd::as_raw_fd(evt) {
                let _ = evt.read();
                self.process_queue();
                return;
            }
        }
        if self.limiter.owns_fd(events.fd()) {
            self.limiter.timer_fired();
            self.process_queue();
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        self.common.watch_queues(ops, "virtio-blk");
        if let Some(timer) = self.limiter.timer_fd() {
            if let Err(e) = ops.add(Events::new(timer, EventSet::IN)) {
                tracing::error!(error = ?e, "cannot watch the virtio-blk rate limiter timer");
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
