//! Dirty tracking for memory a vhost-user backend writes. The backend writes
//! guest memory through its own mapping of the memfd, which neither KVM's
//! dirty log nor the vmm's bitmap sees; a diff snapshot would miss those
//! pages. The backend only writes into the device-writable buffers of the
//! requests it completes (and the used ring), so each used-ring entry added
//! since the last look is followed back to its descriptor chain and every
//! writable buffer in it is marked dirty. The descriptors are in guest
//! memory and untrusted: every index, length and address is checked, and a
//! chain is followed for at most the queue size (indirect tables: their own
//! length) so a looping chain ends.

use std::num::Wrapping;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::memory::GuestMemoryMmap;

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;
/// Size of one descriptor.
const DESC_SIZE: u64 = 16;

/// One queue's position in the used ring as far as dirty marking went.
#[derive(Debug, Default, Clone, Copy)]
pub struct UsedCursor(pub Wrapping<u16>);

/// Marks `len` bytes at `addr` dirty in guest memory's bitmap (clipped to
/// guest RAM).
pub fn mark(mem: &GuestMemoryMmap, addr: u64, len: u64) {
    let mut at = addr;
    let end = addr.saturating_add(len);
    while at < end {
        let Some(region) = mem.find_region(GuestAddress(at)) else {
            return;
        };
        let offset = at - region.start_addr().0;
        let n = (region.len() - offset).min(end - at);
        vm_memory::bitmap::Bitmap::mark_dirty(
            vm_memory::mmap::MmapRegion::bitmap(region),
            offset as usize,
            n as usize,
        );
        at += n;
    }
}

/// The used ring's index as the backend last wrote it.
pub fn used_idx(mem: &GuestMemoryMmap, queue: &Queue) -> Option<u16> {
    let at = queue.used_ring().checked_add(2)?;
    mem.read_obj::<u16>(GuestAddress(at)).ok()
}

/// Marks dirty the writable buffers of every used entry from `cursor` to the
/// used index in memory, and the used ring itself; moves `cursor` there.
pub fn mark_completed(mem: &GuestMemoryMmap, queue: &Queue, cursor: &mut UsedCursor) {
    let size = queue.size();
    if !queue.ready() || size == 0 {
        return;
    }
    let Some(now) = used_idx(mem, queue) else {
        return;
    };
    // The used ring: flags, idx, `size` elements of 8 bytes, avail_event.
    mark(mem, queue.used_ring(), 4 + 8 * u64::from(size) + 2);
    let mut next = cursor.0;
    // At most one ring's worth: more would mean the index was corrupted.
    let pending = (Wrapping(now) - next).0.min(size);
    for _ in 0..pending {
        let slot = u64::from(next.0 % size);
        let elem = queue.used_ring() + 4 + 8 * slot;
        if let Ok(head) = mem.read_obj::<u32>(GuestAddress(elem)) {
            mark_chain(mem, queue.desc_table(), size, head);
        }
        next += Wrapping(1);
    }
    cursor.0 = Wrapping(now);
}

/// A descriptor as laid out in guest memory.
struct Desc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

fn read_desc(mem: &GuestMemoryMmap, table: u64, index: u32) -> Option<Desc> {
    let at = table.checked_add(u64::from(index) * DESC_SIZE)?;
    let mut raw = [0u8; DESC_SIZE as usize];
    mem.read_slice(&mut raw, GuestAddress(at)).ok()?;
    Some(Desc {
        addr: u64::from_le_bytes(raw[0..8].try_into().ok()?),
        len: u32::from_le_bytes(raw[8..12].try_into().ok()?),
        flags: u16::from_le_bytes(raw[12..14].try_into().ok()?),
        next: u16::from_le_bytes(raw[14..16].try_into().ok()?),
    })
}

/// Marks the writable buffers of the chain starting at descriptor `head`.
fn mark_chain(mem: &GuestMemoryMmap, table: u64, size: u16, head: u32) {
    if head >= u32::from(size) {
        return;
    }
    let mut index = head;
    for _ in 0..size {
        let Some(d) = read_desc(mem, table, index) else {
            return;
        };
        if d.flags & F_INDIRECT != 0 {
            mark_indirect(mem, d.addr, d.len);
        } else if d.flags & F_WRITE != 0 {
            mark(mem, d.addr, u64::from(d.len));
        }
        if d.flags & F_NEXT == 0 || d.next >= size {
            return;
        }
        index = u32::from(d.next);
    }
}

/// Marks the writable buffers listed in an indirect table of `len` bytes.
fn mark_indirect(mem: &GuestMemoryMmap, table: u64, len: u32) {
    let count = u64::from(len) / DESC_SIZE;
    let Ok(count) = u16::try_from(count) else {
        return;
    };
    let mut index = 0u32;
    for _ in 0..count {
        let Some(d) = read_desc(mem, table, index) else {
            return;
        };
        // Indirect tables may not nest.
        if d.flags & F_WRITE != 0 && d.flags & F_INDIRECT == 0 {
            mark(mem, d.addr, u64::from(d.len));
        }
        if d.flags & F_NEXT == 0 || d.next >= count {
            return;
        }
        index = u32::from(d.next);
    }
}
