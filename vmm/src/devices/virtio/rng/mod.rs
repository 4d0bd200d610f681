//! virtio-rng: fills the guest's buffers with bytes from the host's
//! getrandom(2). At most `MAX_BYTES_PER_REQUEST` per request, so a guest
//! asking for gigabytes costs the host a bounded amount of work.

pub mod persist;

use std::io::Write;
use std::os::fd::AsRawFd;

use event_manager::{EventOps, Events, MutEventSubscriber};
use virtio_bindings::virtio_ids::VIRTIO_ID_RNG;
use virtio_queue::{DescriptorChain, QueueT, Writer};

use super::{DeviceCommon, VirtioDevice};
use crate::memory::GuestMemoryMmap;

/// Queue size offered.
pub const QUEUE_SIZE: u16 = 64;
/// Most bytes returned for one request.
pub const MAX_BYTES_PER_REQUEST: usize = 64 * 1024;

/// Errors creating the device.
#[derive(Debug, thiserror::Error)]
pub enum RngError {
    /// An eventfd could not be created.
    #[error("cannot create the virtio-rng queue eventfd: {0}")]
    Eventfd(#[source] std::io::Error),
}

/// The virtio-rng device.
pub struct Rng {
    common: DeviceCommon,
}

impl Rng {
    /// A new entropy device.
    pub fn new() -> Result<Rng, RngError> {
        Ok(Rng {
            common: DeviceCommon::new(0, &[QUEUE_SIZE]).map_err(RngError::Eventfd)?,
        })
    }

    /// Handles every available request; returns how many were completed.
    pub fn process_queue(&mut self) -> usize {
        let Some(mem) = self.common.mem.clone() else {
            return 0;
        };
        let mut done = 0;
        while let Some(chain) = self.common.pop_chain(0, &mem) {
            let head = chain.head_index();
            let len = fill(&mem, chain);
            if let Err(e) = self.common.queues[0].add_used(&mem, head, len) {
                tracing::warn!(error = %e, "virtio-rng cannot return a buffer to the guest");
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

/// Fills the writable part of `chain`; returns the bytes written.
fn fill(mem: &GuestMemoryMmap, chain: DescriptorChain<&GuestMemoryMmap>) -> u32 {
    let mut writer = match Writer::new(mem, chain) {
        Ok(w) => w,
        Err(e) => {
            tracing::debug!(error = %e, "virtio-rng request with bad buffers dropped");
            return 0;
        }
    };
    let mut left = writer.available_bytes().min(MAX_BYTES_PER_REQUEST);
    let mut buf = [0u8; 4096];
    let mut written = 0usize;
    while left > 0 {
        let n = left.min(buf.len());
        if let Err(e) = crate::random::fill(&mut buf[..n]) {
            tracing::warn!(error = %e, "host getrandom failed");
            break;
        }
        if writer.write_all(&buf[..n]).is_err() {
            break;
        }
        written += n;
        left -= n;
    }
    written as u32
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_RNG
    }
    fn common(&self) -> &DeviceCommon {
        &self.common
    }
    fn common_mut(&mut self) -> &mut DeviceCommon {
        &mut self.common
    }
    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
}

impl MutEventSubscriber for Rng {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        if let Some(evt) = self.common.queue_evts.first() {
            if events.fd() == evt.as_raw_fd() {
                let _ = evt.read();
                self.process_queue();
            }
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        self.common.watch_queues(ops, "virtio-rng");
    }
}

#[cfg(test)]
mod tests;
