use std::sync::atomic::{AtomicU32, Ordering};

use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use vm_memory::{Address, Bytes, GuestAddress};

use super::persist::BlockConstructorArgs;
use super::*;
use crate::devices::virtio::test_utils::{
    activate, add_chain, add_raw_chain, interrupt, memory, mock_queue, used, used_idx,
};
use crate::persist::Persist;

const HDR: u64 = 0x10_0000;
const DATA: u64 = 0x11_0000;
const STATUS: u64 = 0x12_0000;

/// A disk image in the temp directory, removed on drop.
pub(crate) struct TempDisk(pub PathBuf);

impl TempDisk {
    pub(crate) fn new(sectors: u64) -> TempDisk {
        static N: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "vmm-blk-test-{}-{}.img",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let bytes: Vec<u8> = (0..sectors * SECTOR_SIZE)
            .map(|i| (i / SECTOR_SIZE) as u8)
            .collect();
        std::fs::write(&path, bytes).unwrap();
        TempDisk(path)
    }
}

impl Drop for TempDisk {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn header(mem: &GuestMemoryMmap, request_type: u32, sector: u64) {
    mem.write_obj(
        RequestHeader {
            request_type,
            reserved: 0,
            sector,
        },
        GuestAddress(HDR),
    )
    .unwrap();
}

fn status(mem: &GuestMemoryMmap) -> u8 {
    mem.read_obj(GuestAddress(STATUS)).unwrap()
}

fn setup(read_only: bool) -> (TempDisk, Block, GuestMemoryMmap) {
    let disk = TempDisk::new(16);
    let block = Block::new(&disk.0, read_only).unwrap();
    (disk, block, memory(4))
}

#[test]
fn reads_and_writes_sectors_and_the_file_changes() {
    let (disk, mut block, mem) = setup(false);
    assert_eq!(block.sectors(), 16);
    let q = mock_queue(&mem, GuestAddress(0));
    activate(&mut block, &mem, &[&q]);

    // Read sectors 2..4.
    header(&mem, VIRTIO_BLK_T_IN, 2);
    add_chain(
        &q,
        0,
        &[(HDR, 16, false), (DATA, 1024, true), (STATUS, 1, true)],
    );
    assert_eq!(block.process_queue(), 1);
    assert_eq!(status(&mem), VIRTIO_BLK_S_OK as u8);
    assert_eq!(used(&q, 0), (0, 1025));
    let mut buf = vec![0u8; 1024];
    mem.read_slice(&mut buf, GuestAddress(DATA)).unwrap();
    assert!(buf[..512].iter().all(|&b| b == 2) && buf[512..].iter().all(|&b| b == 3));

    // Write sector 5 from guest memory split over two descriptors.
    mem.write_slice(&[0xabu8; 512], GuestAddress(DATA)).unwrap();
    header(&mem, VIRTIO_BLK_T_OUT, 5);
    add_chain(
        &q,
        3,
        &[
            (HDR, 16, false),
            (DATA, 256, false),
            (DATA + 256, 256, false),
            (STATUS, 1, true),
        ],
    );
    assert_eq!(block.process_queue(), 1);
    assert_eq!(status(&mem), VIRTIO_BLK_S_OK as u8);
    let file = std::fs::read(&disk.0).unwrap();
    assert!(file[5 * 512..6 * 512].iter().all(|&b| b == 0xab));
    assert!(file[4 * 512..5 * 512].iter().all(|&b| b == 4));
    assert_eq!(used_idx(&q), 2);
}

#[test]
fn flush_and_get_id() {
    let (_disk, mut block, mem) = setup(false);
    let q = mock_queue(&mem, GuestAddress(0));
    activate(&mut block, &mem, &[&q]);
    header(&mem, VIRTIO_BLK_T_FLUSH, 0);
    add_chain(&q, 0, &[(HDR, 16, false), (STATUS, 1, true)]);
    block.process_queue();
    assert_eq!(status(&mem), VIRTIO_BLK_S_OK as u8);

    header(&mem, VIRTIO_BLK_T_GET_ID, 0);
    add_chain(
        &q,
        2,
        &[(HDR, 16, false), (DATA, 20, true), (STATUS, 1, true)],
    );
    block.process_queue();
    assert_eq!(status(&mem), VIRTIO_BLK_S_OK as u8);
    let mut id = [0u8; 20];
    mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert!(id.starts_with(b"vmm"), "{id:?}");

    header(&mem, 77, 0);
    add_chain(&q, 5, &[(HDR, 16, false), (STATUS, 1, true)]);
    block.process_queue();
    assert_eq!(status(&mem), VIRTIO_BLK_S_UNSUPP as u8);
}

#[test]
fn writes_to_a_read_only_disk_fail_and_leave_the_file_alone() {
    let (disk, mut block, mem) = setup(true);
    assert!(block.common.avail_features & (1 << VIRTIO_BLK_F_RO) != 0);
    let q = mock_queue(&mem, GuestAddress(0));
    activate(&mut block, &mem, &[&q]);
    let before = std::fs::read(&disk.0).unwrap();
    mem.write_slice(&[0xcdu8; 512], GuestAddress(DATA)).unwrap();
    header(&mem, VIRTIO_BLK_T_OUT, 0);
    add_chain(
        &q,
        0,
        &[(HDR, 16, false), (DATA, 512, false), (STATUS, 1, true)],
    );
    block.process_queue();
    assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(std::fs::read(&disk.0).unwrap(), before);
}

#[test]
fn requests_past_the_end_of_the_disk_fail() {
    let (_disk, mut block, mem) = setup(false);
    let q = mock_queue(&mem, GuestAddress(0));
    activate(&mut block, &mem, &[&q]);
    header(&mem, VIRTIO_BLK_T_IN, 15);
    add_chain(
        &q,
        0,
        &[(HDR, 16, false), (DATA, 1024, true), (STATUS, 1, true)],
    );
    block.process_queue();
    assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR as u8);
    // A sector number whose byte offset overflows u64.
    header(&mem, VIRTIO_BLK_T_IN, u64::MAX / 2);
    add_chain(
        &q,
        3,
        &[(HDR, 16, false), (DATA, 512, true), (STATUS, 1, true)],
    );
    block.process_queue();
    assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(used_idx(&q), 2);
}

#[test]
fn descriptors_outside_guest_memory_end_in_an_error_status() {
    let (_disk, mut block, mem) = setup(false);
    let q = mock_queue(&mem, GuestAddress(0));
    activate(&mut block, &mem, &[&q]);
    // Data buffer far outside the 4 MiB guest.
    header(&mem, VIRTIO_BLK_T_OUT, 0);
    add_chain(
        &q,
        0,
        &[
            (HDR, 16, false),
            (0x10_0000_0000, 512, false),
            (STATUS, 1, true),
        ],
    );
    block.process_queue();
    assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR as u8);
    // A data buffer that starts inside memory and runs past its end.
    header(&mem, VIRTIO_BLK_T_IN, 0);
    add_chain(
        &q,
        3,
        &[
            (HDR, 16, false),
            ((4 << 20) - 256, 512, true),
            (STATUS, 1, true),
        ],
    );
    block.process_queue();
    assert_eq!(used_idx(&q), 2);
    // Status byte outside memory: nothing to report on, the request is dropped.
    add_chain(&q, 6, &[(HDR, 16, false), (0xffff_ffff_0000, 1, true)]);
    block.process_queue();
    assert_eq!(used_idx(&q), 3);
    assert_eq!(used(&q, 2).1, 0);
}

#[test]
fn lengths_larger_than_guest_memory_end_in_an_error_status_or_a_dropped_request() {
    let (_disk, mut block, mem) = setup(false);
    let q = mock_queue(&mem, GuestAddress(0));
    activate(&mut block, &mem, &[&q]);
    let huge = 0xf000_0000u32;
    // A huge readable buffer: the request fails with an error status.
    mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    header(&mem, VIRTIO_BLK_T_OUT, 0);
    add_chain(
        &q,
        0,
        &[(HDR, 16, false), (DATA, huge, false), (STATUS, 1, true)],
    );
    block.process_queue();
    assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(used(&q, 0), (0, 1));
    // A huge writable buffer: no status byte can be located safely, dropped.
    mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    header(&mem, VIRTIO_BLK_T_IN, 0);
    add_chain(
        &q,
        3,
        &[(HDR, 16, false), (DATA, huge, true), (STATUS, 1, true)],
    );
    block.process_queue();
    assert_eq!(used(&q, 1), (3, 0));
    assert_eq!(status(&mem), 0xff);
    // A chain whose lengths add up past 4 GiB ends where the sum overflows: dropped.
    header(&mem, VIRTIO_BLK_T_IN, 0);
    add_chain(
        &q,
        6,
        &[(HDR, 16, false), (DATA, u32::MAX, true), (STATUS, 1, true)],
    );
    block.process_queue();
    assert_eq!(used(&q, 2), (6, 0));
    assert_eq!(status(&mem), 0xff);
}

#[test]
fn looping_chains_terminate() {
    let (_disk, mut block, mem) = setup(false);
    let q = mock_queue(&mem, GuestAddress(0));
    activate(&mut block, &mem, &[&q]);
    header(&mem, VIRTIO_BLK_T_IN, 0);
    let next = virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16;
    let write = virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16;
    // 0 -> 1 -> 0 -> 1 ...
    add_raw_chain(
        &q,
        0,
        &[
            SplitDescriptor::new(HDR, 16, next, 1),
            SplitDescriptor::new(DATA, 512, next | write, 0),
        ],
    );
    assert_eq!(block.process_queue(), 1);
    assert_eq!(used_idx(&q), 1);
    // Next index out of the table.
    add_raw_chain(&q, 2, &[SplitDescriptor::new(HDR, 16, next, 999)]);
    assert_eq!(block.process_queue(), 1);
}

#[test]
fn a_bogus_available_index_is_not_followed() {
    let (_disk, mut block, mem) = setup(false);
    let q = mock_queue(&mem, GuestAddress(0));
    activate(&mut block, &mem, &[&q]);
    // Claims 1000 new entries in a 16-entry ring.
    q.avail().idx().store(1000);
    assert_eq!(block.process_queue(), 0);
    assert_eq!(used_idx(&q), 0);
}

#[test]
fn nothing_happens_before_activation() {
    let (_disk, mut block, _mem) = setup(false);
    assert_eq!(block.process_queue(), 0);
    let mut cfg = [0u8; 8];
    block.read_config(0, &mut cfg);
    assert_eq!(u64::from_le_bytes(cfg), 16);
    let mut past = [0xffu8; 4];
    block.read_config(100, &mut past);
    assert_eq!(past, [0; 4]);
}

#[test]
fn state_survives_a_save_and_restore_and_bad_state_is_refused() {
    let (disk, mut block, mem) = setup(false);
    let q = mock_queue(&mem, GuestAddress(0));
    activate(&mut block, &mem, &[&q]);
    header(&mem, VIRTIO_BLK_T_FLUSH, 0);
    add_chain(&q, 0, &[(HDR, 16, false), (STATUS, 1, true)]);
    block.process_queue();
    let state = block.save().unwrap();
    let json = serde_json::to_string(&state).unwrap();
    let state: persist::BlockState = serde_json::from_str(&json).unwrap();
    let args = || BlockConstructorArgs {
        path: disk.0.clone(),
        read_only: false,
        limits: Default::default(),
        mem: mem.clone(),
        interrupt: interrupt(),
    };
    let mut restored = Block::restore(args(), &state).unwrap();
    assert!(restored.is_activated());
    // The restored queue continues where the old one stopped.
    add_chain(&q, 2, &[(HDR, 16, false), (STATUS, 1, true)]);
    assert_eq!(restored.process_queue(), 1);
    assert_eq!(used_idx(&q), 2);

    let mut bad = state.clone();
    bad.common.queues[0].size = 3;
    assert!(Block::restore(args(), &bad).is_err());
    let mut bad = state.clone();
    bad.common.queues[0].max_size = 1024;
    assert!(Block::restore(args(), &bad).is_err());
    let mut bad = state.clone();
    bad.common.queues[0].used_ring = 0x7fff_ffff_0000;
    assert!(Block::restore(args(), &bad).is_err());
    let mut bad = state.clone();
    bad.common.queues.push(bad.common.queues[0]);
    assert!(Block::restore(args(), &bad).is_err());
    let mut bad = state.clone();
    bad.sectors = 99;
    assert!(Block::restore(args(), &bad).is_err());
    let mut bad = state;
    bad.common.acked_features |= 1 << 60;
    assert!(Block::restore(args(), &bad).is_err());
}

#[test]
fn a_disk_grown_since_the_snapshot_is_served_larger_and_the_guest_told() {
    let (disk, mut block, mem) = setup(false);
    let q = mock_queue(&mem, GuestAddress(0));
    activate(&mut block, &mem, &[&q]);
    let state = block.save().unwrap();
    assert_eq!(state.sectors, 16);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&disk.0)
        .unwrap()
        .set_len(64 * SECTOR_SIZE)
        .unwrap();
    let irq = interrupt();
    let restored = Block::restore(
        BlockConstructorArgs {
            path: disk.0.clone(),
            read_only: false,
            limits: Default::default(),
            mem: mem.clone(),
            interrupt: irq.clone(),
        },
        &state,
    )
    .unwrap();
    let mut cfg = [0u8; 8];
    restored.read_config(0, &mut cfg);
    assert_eq!(u64::from_le_bytes(cfg), 64, "the new capacity");
    assert_ne!(
        irq.status() & crate::devices::virtio::VIRTIO_MMIO_INT_CONFIG,
        0,
        "a configuration change is pending for the driver"
    );
    assert_eq!(
        restored.save().unwrap().sectors,
        64,
        "later snapshots keep the new size"
    );

    // Restored at the size it had: nothing to tell.
    let irq = interrupt();
    let again = Block::restore(
        BlockConstructorArgs {
            path: disk.0.clone(),
            read_only: false,
            limits: Default::default(),
            mem: mem.clone(),
            interrupt: irq.clone(),
        },
        &restored.save().unwrap(),
    )
    .unwrap();
    assert_eq!(again.sectors(), 64);
    assert_eq!(
        irq.status() & crate::devices::virtio::VIRTIO_MMIO_INT_CONFIG,
        0
    );
}

/// VMM-side cost of one virtio-blk request (descriptor parsing, bounds checks,
/// the file I/O through the page cache, used ring update), measured around
/// `process_queue` only. Run with:
/// `cargo test -p vmm --release --lib bench_ -- --ignored --nocapture`
#[test]
#[ignore = "benchmark: prints ns/request"]
fn bench_block_request_cost() {
    let disk = TempDisk::new(2048);
    let mut block = Block::new(&disk.0, false).unwrap();
    let mem = memory(16);
    let q = mock_queue(&mem, GuestAddress(0));
    activate(&mut block, &mem, &[&q]);
    for (name, request_type, len) in [
        ("read 4 KiB", VIRTIO_BLK_T_IN, 4096u32),
        ("write 4 KiB", VIRTIO_BLK_T_OUT, 4096),
        ("read 512 B", VIRTIO_BLK_T_IN, 512),
        ("get-id", VIRTIO_BLK_T_GET_ID, 20),
    ] {
        let rounds = 4000u32;
        let mut total = std::time::Duration::ZERO;
        for round in 0..rounds {
            for slot in 0..5u16 {
                let i = u64::from(slot);
                let hdr = 0x10_0000 + i * 0x10;
                let data = 0x20_0000 + i * 0x1000;
                let status = 0x30_0000 + i;
                let sector = u64::from(round % 256) * 8;
                mem.write_obj(
                    RequestHeader {
                        request_type,
                        reserved: 0,
                        sector,
                    },
                    GuestAddress(hdr),
                )
                .unwrap();
                let writes = request_type != VIRTIO_BLK_T_OUT;
                add_chain(
                    &q,
                    slot * 3,
                    &[(hdr, 16, false), (data, len, writes), (status, 1, true)],
                );
            }
            let start = std::time::Instant::now();
            assert_eq!(block.process_queue(), 5);
            total += start.elapsed();
        }
        let n = u64::from(rounds) * 5;
        println!(
            "bench: virtio-blk {name}: {} ns/request over {n} requests",
            total.as_nanos() as u64 / n
        );
    }
}

/// A read of sector 0 as chain `first` (three descriptors).
fn queue_read(q: &virtio_queue::mock::MockSplitQueue<GuestMemoryMmap>, first: u16) {
    add_chain(
        q,
        first,
        &[(HDR, 16, false), (DATA, 512, true), (STATUS, 1, true)],
    );
}

#[test]
fn event_idx_suppresses_unwanted_interrupts_and_rearms_notification() {
    use crate::devices::virtio::test_utils::TEST_QUEUE_SIZE;
    use crate::devices::virtio::{VIRTIO_MMIO_INT_VRING, VIRTIO_RING_F_EVENT_IDX};
    let (_disk, mut block, mem) = setup(false);
    assert_ne!(block.common().avail_features & VIRTIO_RING_F_EVENT_IDX, 0);
    let q = mock_queue(&mem, GuestAddress(0));
    activate(&mut block, &mem, &[&q]);
    assert_ne!(block.common().acked_features & VIRTIO_RING_F_EVENT_IDX, 0);
    let irq = block.common().interrupt.clone().unwrap();
    let size = u64::from(TEST_QUEUE_SIZE);
    // used_event trails the available ring, avail_event the used ring.
    let used_event = q.avail_addr().unchecked_add(4 + 2 * size);
    let avail_event = q.used_addr().unchecked_add(4 + 8 * size);
    header(&mem, VIRTIO_BLK_T_IN, 0);

    // The driver wants an interrupt once the used index passes 2.
    mem.write_obj(2u16, used_event).unwrap();
    queue_read(&q, 0);
    assert_eq!(block.process_queue(), 1);
    assert_eq!(
        irq.status() & VIRTIO_MMIO_INT_VRING,
        0,
        "interrupt not wanted yet"
    );
    // Having drained the queue, the device asks to hear of the next buffer.
    assert_eq!(mem.read_obj::<u16>(avail_event).unwrap(), 1);

    queue_read(&q, 3);
    queue_read(&q, 6);
    assert_eq!(block.process_queue(), 2);
    assert_eq!(used_idx(&q), 3);
    assert_ne!(
        irq.status() & VIRTIO_MMIO_INT_VRING,
        0,
        "used index passed used_event"
    );
    assert_eq!(mem.read_obj::<u16>(avail_event).unwrap(), 3);
}

#[test]
fn without_event_idx_every_batch_interrupts() {
    use crate::devices::virtio::{VIRTIO_MMIO_INT_VRING, VIRTIO_RING_F_EVENT_IDX};
    let (_disk, mut block, mem) = setup(false);
    let q = mock_queue(&mem, GuestAddress(0));
    block.common_mut().avail_features &= !VIRTIO_RING_F_EVENT_IDX;
    activate(&mut block, &mem, &[&q]);
    let irq = block.common().interrupt.clone().unwrap();
    header(&mem, VIRTIO_BLK_T_IN, 0);
    for (i, first) in [0u16, 3, 6].into_iter().enumerate() {
        queue_read(&q, first);
        assert_eq!(block.process_queue(), 1);
        assert_ne!(irq.status() & VIRTIO_MMIO_INT_VRING, 0, "batch {i}");
        irq.ack(VIRTIO_MMIO_INT_VRING);
    }
}

#[test]
fn a_throttled_request_stays_in_the_ring_until_the_timer_fires() {
    use crate::devices::virtio::test_utils::wait_for_timer;
    use vmm_api::rate_limit::RateLimit;
    let (_disk, mut block, mem) = setup(false);
    // One request per 20 ms, and bytes enough for one 1 KiB read.
    block
        .set_limits(&IoLimit {
            bandwidth: Some(RateLimit {
                size: 1024,
                burst: 0,
                refill_ms: 20,
            }),
            ops: Some(RateLimit {
                size: 1,
                burst: 0,
                refill_ms: 20,
            }),
        })
        .unwrap();
    let q = mock_queue(&mem, GuestAddress(0));
    activate(&mut block, &mem, &[&q]);
    header(&mem, VIRTIO_BLK_T_IN, 0);
    add_chain(
        &q,
        0,
        &[(HDR, 16, false), (DATA, 1024, true), (STATUS, 1, true)],
    );
    add_chain(
        &q,
        3,
        &[(HDR, 16, false), (DATA, 1024, true), (STATUS, 1, true)],
    );
    assert_eq!(block.process_queue(), 1);
    assert_eq!(used_idx(&q), 1, "the second request waits in the ring");
    assert!(block.limiter.is_blocked());
    assert!(block.limiter.timer_fd().unwrap().is_armed().unwrap());
    assert_eq!(block.io_counters().read().throttled, 1);
    // A guest notification meanwhile does not serve it (nor count again).
    assert_eq!(block.process_queue(), 0);
    assert_eq!(block.io_counters().read().throttled, 1);

    wait_for_timer(block.limiter.timer_fd().unwrap());
    block.limiter.timer_fired();
    assert_eq!(block.process_queue(), 1);
    assert_eq!(used_idx(&q), 2);
    assert_eq!(used(&q, 1), (3, 1025), "the same chain, served whole");
    let c = block.io_counters().read();
    assert_eq!((c.reads, c.read_bytes, c.throttled), (2, 2048, 1));

    // A reset forgets the wait.
    header(&mem, VIRTIO_BLK_T_FLUSH, 0);
    add_chain(&q, 6, &[(HDR, 16, false), (STATUS, 1, true)]);
    assert_eq!(block.process_queue(), 0);
    assert!(block.limiter.is_blocked());
    block.reset();
    assert!(!block.limiter.is_blocked());
}

#[test]
fn successful_requests_are_counted_by_kind_and_failures_are_not() {
    let (_disk, mut block, mem) = setup(false);
    let q = mock_queue(&mem, GuestAddress(0));
    activate(&mut block, &mem, &[&q]);
    let counters = block.io_counters();
    header(&mem, VIRTIO_BLK_T_OUT, 1);
    add_chain(
        &q,
        0,
        &[(HDR, 16, false), (DATA, 1536, false), (STATUS, 1, true)],
    );
    header_then_process(&mut block);
    header(&mem, VIRTIO_BLK_T_FLUSH, 0);
    add_chain(&q, 3, &[(HDR, 16, false), (STATUS, 1, true)]);
    header_then_process(&mut block);
    // Past the end of the 16-sector disk: an error, not counted.
    header(&mem, VIRTIO_BLK_T_IN, 15);
    add_chain(
        &q,
        5,
        &[(HDR, 16, false), (DATA, 1024, true), (STATUS, 1, true)],
    );
    header_then_process(&mut block);
    assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR as u8);
    header(&mem, VIRTIO_BLK_T_IN, 14);
    add_chain(
        &q,
        8,
        &[(HDR, 16, false), (DATA, 1024, true), (STATUS, 1, true)],
    );
    header_then_process(&mut block);
    let c = counters.read();
    assert_eq!(
        c,
        vmm_api::protocol::BlkCounters {
            read_bytes: 1024,
            write_bytes: 1536,
            reads: 1,
            writes: 1,
            flushes: 1,
            throttled: 0,
        }
    );
}

fn header_then_process(block: &mut Block) {
    assert_eq!(block.process_queue(), 1);
}
