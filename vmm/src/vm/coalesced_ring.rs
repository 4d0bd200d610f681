//! KVM's coalesced-I/O ring: one page per VM where KVM records guest writes
//! to registered MMIO or port ranges (KVM_REGISTER_COALESCED_MMIO) instead
//! of leaving KVM_RUN for each, for the VMM to replay later.
//!
//! kvm-ioctls has a reader, but it lives inside a `VcpuFd` behind `&mut`:
//! it cannot be read while an exit returned by `VcpuFd::run` borrows that
//! fd (and the ring must be emptied before that exit is handled), nor by
//! several vCPU threads at once. It also reads the kernel's index without an
//! acquire barrier and uses it unchecked. This reader maps the page once per
//! VM, is shared by the vCPU threads (their owner serializes consumers) and
//! checks both indices before use.
//!
//! The protocol (virt/kvm/coalesced_mmio.c): KVM writes the entry at `last`,
//! then advances `last` after a write barrier; the VMM reads entries from
//! `first` to `last` and advances `first`. A full ring makes KVM exit to the
//! VMM for the write as if it were not registered, so nothing is lost.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use kvm_bindings::{kvm_coalesced_mmio, KVM_COALESCED_MMIO_PAGE_OFFSET};

/// The ring's page size (x86-64 pages).
const PAGE_SIZE: usize = 4096;
/// `first` and `last`, before the entries.
const HEADER: usize = 8;
/// One entry (`struct kvm_coalesced_mmio`).
const ENTRY: usize = std::mem::size_of::<kvm_coalesced_mmio>();
/// Entries in the ring (the kernel's KVM_COALESCED_MMIO_MAX).
pub const CAPACITY: u32 = ((PAGE_SIZE - HEADER) / ENTRY) as u32;

/// One write KVM recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingEntry {
    /// A port write (else MMIO).
    pub pio: bool,
    /// The port or guest-physical address written.
    pub addr: u64,
    len: u8,
    data: [u8; 8],
}

impl RingEntry {
    /// The bytes written (1 to 8).
    pub fn data(&self) -> &[u8] {
        &self.data[..usize::from(self.len)]
    }
}

/// Errors mapping or reading the ring.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// mmap of the vCPU fd's coalesced-I/O page failed.
    #[error("cannot map KVM's coalesced I/O ring: {0}")]
    Map(#[source] std::io::Error),
    /// An index outside the ring: the page is not what KVM documents.
    #[error(
        "KVM's coalesced I/O ring holds an index out of range \
         (first {first}, last {last}, capacity {CAPACITY})"
    )]
    Index {
        /// The consumer's index.
        first: u32,
        /// KVM's index.
        last: u32,
    },
    /// An entry with a length KVM never records.
    #[error("KVM's coalesced I/O ring holds an entry of {len} bytes (1 to 8 expected)")]
    Length {
        /// The entry's length.
        len: u32,
    },
}

/// Where the page lives.
enum Page {
    /// Mapped from a vCPU fd; unmapped on drop.
    Mapped(NonNull<u8>),
    /// A page of test memory standing in for KVM's.
    #[cfg(test)]
    Heap(Box<[u64; PAGE_SIZE / 8]>),
}

/// The mapped ring.
pub struct CoalescedRing {
    page: Page,
}

// SAFETY: the page is only reached through atomics (the indices) and
// volatile reads of entries below KVM's published `last`; the owner
// serializes consumers (only one advances `first` at a time).
unsafe impl Send for CoalescedRing {}
// SAFETY: as for Send: shared access is atomics and volatile reads.
unsafe impl Sync for CoalescedRing {}

impl CoalescedRing {
    /// Maps the VM's ring through one of its vCPU fds (every vCPU fd maps
    /// the same page at KVM_COALESCED_MMIO_PAGE_OFFSET).
    pub fn map(vcpu: &impl std::os::fd::AsRawFd) -> Result<Self, RingError> {
        let offset = KVM_COALESCED_MMIO_PAGE_OFFSET as usize * PAGE_SIZE;
        // SAFETY: a fresh shared mapping of one page of a vCPU fd at the
        // documented offset; nothing else is mapped at the returned address,
        // and the result is checked before use.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                vcpu.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(RingError::Map(std::io::Error::last_os_error()));
        }
        NonNull::new(addr.cast::<u8>())
            .map(|p| CoalescedRing {
                page: Page::Mapped(p),
            })
            .ok_or_else(|| RingError::Map(std::io::Error::other("mmap returned address 0")))
    }

    /// A ring over test memory, its indices at zero.
    #[cfg(test)]
    fn heap() -> Self {
        CoalescedRing {
            page: Page::Heap(Box::new([0; PAGE_SIZE / 8])),
        }
    }

    fn base(&self) -> *mut u8 {
        match &self.page {
            Page::Mapped(p) => p.as_ptr(),
            #[cfg(test)]
            Page::Heap(b) => b.as_ptr().cast_mut().cast(),
        }
    }

    /// The index at byte `offset` of the header (0: `first`, 4: `last`).
    fn index(&self, offset: usize) -> &AtomicU32 {
        // SAFETY: `offset` is 0 or 4, inside the page, 4-aligned (the page
        // is page- or 8-aligned); the page lives as long as `self`, and KVM
        // and this process only touch the index with single aligned accesses.
        unsafe { AtomicU32::from_ptr(self.base().add(offset).cast()) }
    }

    /// Whether no entry waits (a hint: KVM may add one right after).
    pub fn is_empty(&self) -> bool {
        self.index(0).load(Ordering::Relaxed) == self.index(4).load(Ordering::Acquire)
    }

    /// Takes the oldest entry, if any. Only one caller at a time may pop
    /// (it alone advances `first`).
    pub fn pop(&self) -> Result<Option<RingEntry>, RingError> {
        let first = self.index(0).load(Ordering::Relaxed);
        // Acquire pairs with KVM's write barrier before it advanced `last`:
        // every entry below `last` is complete.
        let last = self.index(4).load(Ordering::Acquire);
        if first >= CAPACITY || last >= CAPACITY {
            return Err(RingError::Index { first, last });
        }
        if first == last {
            return Ok(None);
        }
        let at = self.base().wrapping_add(HEADER + first as usize * ENTRY);
        // SAFETY: first < CAPACITY, so the entry lies inside the page
        // (HEADER + CAPACITY * ENTRY <= PAGE_SIZE), 8-aligned (HEADER and
        // ENTRY are multiples of 8); KVM finished writing it before it
        // published `last` past it.
        let raw = unsafe { std::ptr::read_volatile(at.cast::<kvm_coalesced_mmio>()) };
        self.index(0)
            .store((first + 1) % CAPACITY, Ordering::Release);
        let len = raw.len;
        if !(1..=8).contains(&len) {
            return Err(RingError::Length { len });
        }
        // SAFETY: both members of the union are a u32.
        let pio = unsafe { raw.__bindgen_anon_1.pio } != 0;
        Ok(Some(RingEntry {
            pio,
            addr: raw.phys_addr,
            len: len as u8,
            data: raw.data,
        }))
    }
}

impl Drop for CoalescedRing {
    fn drop(&mut self) {
        match &self.page {
            // SAFETY: the page was mapped by `map` with this length and is
            // not used after this.
            Page::Mapped(p) => unsafe {
                libc::munmap(p.as_ptr().cast(), PAGE_SIZE);
            },
            #[cfg(test)]
            Page::Heap(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes an entry at `last` and publishes it, as KVM does.
    fn push(ring: &CoalescedRing, pio: bool, addr: u64, data: &[u8]) {
        let last = ring.index(4).load(Ordering::Relaxed);
        let mut raw = kvm_coalesced_mmio {
            phys_addr: addr,
            len: data.len() as u32,
            ..Default::default()
        };
        raw.__bindgen_anon_1.pio = u32::from(pio);
        raw.data[..data.len()].copy_from_slice(data);
        let offset = HEADER + last as usize * ENTRY;
        // SAFETY: test memory, last < CAPACITY.
        unsafe { std::ptr::write(ring.base().add(offset).cast(), raw) };
        ring.index(4)
            .store((last + 1) % CAPACITY, Ordering::Release);
    }

    #[test]
    fn the_capacity_is_the_kernels() {
        // KVM_COALESCED_MMIO_MAX for 4 KiB pages: (4096 - 8) / 24.
        assert_eq!(ENTRY, 24);
        assert_eq!(CAPACITY, 170);
    }

    #[test]
    fn entries_come_out_in_order_across_the_wrap() {
        let ring = CoalescedRing::heap();
        assert!(ring.is_empty());
        assert_eq!(ring.pop().unwrap(), None);
        // Run the indices round the ring more than once.
        let mut seen = Vec::new();
        for round in 0..3u32 {
            for i in 0..100u32 {
                push(&ring, true, 0x3f8, &[(round * 100 + i) as u8]);
            }
            assert!(!ring.is_empty());
            while let Some(e) = ring.pop().unwrap() {
                assert!(e.pio);
                assert_eq!(e.addr, 0x3f8);
                seen.push(e.data()[0]);
            }
            assert!(ring.is_empty());
        }
        let want: Vec<u8> = (0..300u32).map(|n| n as u8).collect();
        assert_eq!(seen, want);
        assert_eq!(ring.index(0).load(Ordering::Relaxed), 300 % CAPACITY);
    }

    #[test]
    fn an_mmio_entry_keeps_its_address_and_length() {
        let ring = CoalescedRing::heap();
        push(&ring, false, 0xd000_0000, &[1, 2, 3, 4]);
        let e = ring.pop().unwrap().unwrap();
        assert!(!e.pio);
        assert_eq!(e.addr, 0xd000_0000);
        assert_eq!(e.data(), [1, 2, 3, 4]);
    }

    #[test]
    fn indices_out_of_range_and_bad_lengths_are_errors() {
        let ring = CoalescedRing::heap();
        ring.index(4).store(CAPACITY, Ordering::Relaxed);
        assert!(matches!(
            ring.pop(),
            Err(RingError::Index { first: 0, last }) if last == CAPACITY
        ));
        ring.index(4).store(0, Ordering::Relaxed);
        ring.index(0).store(u32::MAX, Ordering::Relaxed);
        assert!(matches!(ring.pop(), Err(RingError::Index { .. })));

        let ring = CoalescedRing::heap();
        push(&ring, true, 0x3f8, &[]);
        assert!(matches!(ring.pop(), Err(RingError::Length { len: 0 })));
        // The bad entry is consumed: the next one still comes out.
        push(&ring, true, 0x3f8, b"x");
        assert_eq!(ring.pop().unwrap().unwrap().data(), b"x");
    }
}
