//! Helpers for device unit tests: guest memory, a driver-side mock queue
//! (virtio-queue's `MockSplitQueue`) and descriptor chain building.

use std::sync::Arc;

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::QueueT;
use vm_memory::GuestAddress;

use super::{Interrupt, VirtioDevice};
use crate::devices::irq::IrqLine;
use crate::memory::GuestMemoryMmap;

/// Guest memory of `mib` MiB at address 0.
pub fn memory(mib: usize) -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), mib << 20)]).unwrap()
}

/// An interrupt on an eventfd nobody registered with KVM.
pub fn interrupt() -> Arc<Interrupt> {
    Arc::new(Interrupt::new(IrqLine::new(5).unwrap()))
}

/// Entries of the queues the tests drive.
pub const TEST_QUEUE_SIZE: u16 = 16;

/// A driver-side queue of `TEST_QUEUE_SIZE` entries at `addr`.
///
/// `MockSplitQueue` places its used ring right after `len` *bytes* of the
/// available ring (not `2 * len`), so with `len` entries the two rings
/// overlap from entry `len / 2` on. Laying the mock out for twice the size
/// keeps the used ring clear of the available entries the device reads.
pub fn mock_queue(
    mem: &GuestMemoryMmap,
    addr: GuestAddress,
) -> MockSplitQueue<'_, GuestMemoryMmap> {
    MockSplitQueue::create(mem, addr, 2 * TEST_QUEUE_SIZE)
}

/// A descriptor: (guest address, length, device-writable).
pub type Desc = (u64, u32, bool);

/// Writes a chain at descriptor `first` and makes it available (the
/// available ring wraps, unlike `MockSplitQueue::add_desc_chains`).
pub fn add_chain(q: &MockSplitQueue<GuestMemoryMmap>, first: u16, descs: &[Desc]) {
    let raw: Vec<SplitDescriptor> = descs
        .iter()
        .enumerate()
        .map(|(i, &(addr, len, writable))| {
            let mut flags = if writable { VRING_DESC_F_WRITE } else { 0 };
            if i + 1 < descs.len() {
                flags |= VRING_DESC_F_NEXT;
            }
            SplitDescriptor::new(addr, len, flags as u16, first + i as u16 + 1)
        })
        .collect();
    add_raw_chain(q, first, &raw);
}

/// Writes raw descriptors at `first` and makes `first` available as one chain
/// head, without fixing up flags: for hostile chains.
pub fn add_raw_chain(q: &MockSplitQueue<GuestMemoryMmap>, first: u16, descs: &[SplitDescriptor]) {
    for (i, d) in descs.iter().enumerate() {
        q.desc_table()
            .store(first + i as u16, RawDescriptor::from(*d))
            .unwrap();
    }
    let idx = q.avail().idx().load();
    q.avail()
        .ring()
        .ref_at(usize::from(idx) % usize::from(q_len(q)))
        .unwrap()
        .store(first);
    q.avail().idx().store(idx.wrapping_add(1));
}

fn q_len(_q: &MockSplitQueue<GuestMemoryMmap>) -> u16 {
    TEST_QUEUE_SIZE
}

/// Gives `dev` queues built from `mocks`, accepts all features and activates it.
pub fn activate(
    dev: &mut dyn VirtioDevice,
    mem: &GuestMemoryMmap,
    mocks: &[&MockSplitQueue<GuestMemoryMmap>],
) {
    for (i, m) in mocks.iter().enumerate() {
        let q = &mut dev.common_mut().queues[i];
        q.set_size(q_len(m));
        q.set_desc_table_address(
            Some(m.desc_table_addr().0 as u32),
            Some((m.desc_table_addr().0 >> 32) as u32),
        );
        q.set_avail_ring_address(
            Some(m.avail_addr().0 as u32),
            Some((m.avail_addr().0 >> 32) as u32),
        );
        q.set_used_ring_address(
            Some(m.used_addr().0 as u32),
            Some((m.used_addr().0 >> 32) as u32),
        );
        q.set_ready(true);
    }
    let avail = dev.common().avail_features;
    dev.common_mut().acked_features = avail;
    dev.activate(mem.clone(), interrupt()).unwrap();
}

/// The used ring's index.
pub fn used_idx(q: &MockSplitQueue<GuestMemoryMmap>) -> u16 {
    q.used().idx().load()
}

/// Used ring entry `i`: (head id, length).
pub fn used(q: &MockSplitQueue<GuestMemoryMmap>, i: usize) -> (u32, u32) {
    let e = q.used().ring().ref_at(i).unwrap().load();
    (e.id(), e.len())
}

/// Waits until `timer` expires (a rate limiter's wake-up): polls its fd, as
/// the event loop would, with a generous bound so a broken timer fails the
/// test instead of hanging it.
pub fn wait_for_timer(timer: &vmm_sys_util::timerfd::TimerFd) {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: timer.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, and the count says one.
    let n = unsafe { libc::poll(&mut p, 1, 30_000) };
    assert_eq!(n, 1, "the rate limiter's timer never fired");
}
