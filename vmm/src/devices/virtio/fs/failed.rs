//! What the device does once its backend is gone (it died, hung up, or a
//! request to it failed): the vmm itself answers every request still in the
//! rings and every later one with a FUSE error reply, `EIO`, so the guest
//! sees I/O errors instead of waiting forever. Requests are taken from the
//! used index on: the backend completed requests in ring order (virtiofsd
//! does, with its default of no thread pool), so those past the used index
//! are the ones it never answered.

use std::io::{Read, Write};

use virtio_queue::{DescriptorChain, QueueT, Reader, Writer};

use super::dirty::used_idx;
use crate::devices::virtio::DeviceCommon;
use crate::memory::GuestMemoryMmap;

/// Size of `struct fuse_in_header` up to and including `unique`.
const IN_HEADER_PREFIX: usize = 16;
/// Size of `struct fuse_out_header`.
pub const OUT_HEADER_LEN: u32 = 16;
/// The errno every request gets.
const EIO: i32 = libc::EIO;

/// Moves every queue to the first request the backend never completed.
pub fn take_over(common: &mut DeviceCommon) {
    let Some(mem) = common.mem.clone() else {
        return;
    };
    for q in &mut common.queues {
        if let Some(used) = used_idx(&mem, q) {
            q.set_next_avail(used);
            q.set_next_used(used);
        }
    }
}

/// Answers every available request of queue `q` with EIO; returns how many.
pub fn answer_all(common: &mut DeviceCommon, q: usize) -> usize {
    let Some(mem) = common.mem.clone() else {
        return 0;
    };
    let mut done = 0;
    while let Some(chain) = common.pop_chain(q, &mem) {
        let head = chain.head_index();
        let len = answer(&mem, chain);
        let Some(queue) = common.queues.get_mut(q) else {
            break;
        };
        if let Err(e) = queue.add_used(&mem, head, len) {
            tracing::warn!(error = %e, "virtio-fs cannot return a request to the guest");
            break;
        }
        done += 1;
    }
    if done > 0 {
        common.signal_used_queue(q);
    }
    done
}

/// Writes the EIO reply of one request; returns the bytes written (0 for
/// requests without a reply buffer, FORGET among them).
fn answer(mem: &GuestMemoryMmap, chain: DescriptorChain<&GuestMemoryMmap>) -> u32 {
    let unique = match Reader::new(mem, chain.clone()) {
        Ok(mut reader) => {
            let mut header = [0u8; IN_HEADER_PREFIX];
            match reader.read_exact(&mut header) {
                Ok(()) => u64::from_le_bytes(header[8..16].try_into().unwrap_or_default()),
                Err(_) => 0,
            }
        }
        Err(_) => 0,
    };
    let Ok(mut writer) = Writer::new(mem, chain) else {
        return 0;
    };
    if writer.available_bytes() < OUT_HEADER_LEN as usize {
        return 0;
    }
    let mut reply = [0u8; OUT_HEADER_LEN as usize];
    reply[0..4].copy_from_slice(&OUT_HEADER_LEN.to_le_bytes());
    reply[4..8].copy_from_slice(&(-EIO).to_le_bytes());
    reply[8..16].copy_from_slice(&unique.to_le_bytes());
    match writer.write_all(&reply) {
        Ok(()) => OUT_HEADER_LEN,
        Err(_) => 0,
    }
}
