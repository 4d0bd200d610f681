//! Unit tests of the virtio-fs device against a fake vhost-user backend (a
//! thread that answers the requests the frontend makes and records them).

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::mpsc;

use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::*;
use crate::devices::virtio::test_utils::{add_chain, add_raw_chain, mock_queue, TEST_QUEUE_SIZE};
use crate::devices::virtio::{VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_VRING, VIRTIO_RING_F_EVENT_IDX};
use crate::memory::{create_shared, MemoryMode};
use crate::persist::Persist;

const GET_FEATURES: u32 = 1;
const SET_FEATURES: u32 = 2;
const SET_MEM_TABLE: u32 = 5;
const SET_VRING_NUM: u32 = 8;
const SET_VRING_ADDR: u32 = 9;
const SET_VRING_BASE: u32 = 10;
const GET_VRING_BASE: u32 = 11;
const SET_VRING_KICK: u32 = 12;
const SET_VRING_CALL: u32 = 13;
const GET_PROTOCOL_FEATURES: u32 = 15;
const GET_QUEUE_NUM: u32 = 17;
const SET_VRING_ENABLE: u32 = 18;

/// VIRTIO_FS_F_NOTIFICATION: offered by the fake, never passed to the guest.
const FS_NOTIFICATION: u64 = 1;
const PROTOCOL_FEATURES: u64 = 1 << 30;
/// VHOST_USER_PROTOCOL_F_MQ only: no reply acks, no device state.
const FAKE_PROTOCOL: u64 = 1;
/// What GET_VRING_BASE answers.
const FAKE_BASE: u32 = 5;

/// A fake backend on a socket in `dir`: answers every request, sends each
/// request code on the channel, and hangs up when the frontend does.
fn fake_backend(dir: &std::path::Path) -> (std::path::PathBuf, mpsc::Receiver<u32>) {
    let path = dir.join("fake.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let features =
            VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | FS_NOTIFICATION | PROTOCOL_FEATURES;
        loop {
            let mut hdr = [0u8; 12];
            if s.read_exact(&mut hdr).is_err() {
                return;
            }
            let code = u32::from_le_bytes(hdr[0..4].try_into().unwrap());
            let size = u32::from_le_bytes(hdr[8..12].try_into().unwrap()) as usize;
            let mut body = vec![0u8; size];
            if s.read_exact(&mut body).is_err() {
                return;
            }
            let _ = tx.send(code);
            let reply = |s: &mut UnixStream, payload: &[u8]| {
                let mut msg = Vec::new();
                msg.extend_from_slice(&code.to_le_bytes());
                msg.extend_from_slice(&(0x1u32 | 0x4).to_le_bytes());
                msg.extend_from_slice(&(payload.len() as u32).to_le_bytes());
                msg.extend_from_slice(payload);
                s.write_all(&msg).is_ok()
            };
            let ok = match code {
                GET_FEATURES => reply(&mut s, &features.to_le_bytes()),
                GET_PROTOCOL_FEATURES => reply(&mut s, &FAKE_PROTOCOL.to_le_bytes()),
                GET_QUEUE_NUM => reply(&mut s, &2u64.to_le_bytes()),
                GET_VRING_BASE => {
                    let mut state = body[0..4].to_vec();
                    state.extend_from_slice(&FAKE_BASE.to_le_bytes());
                    reply(&mut s, &state)
                }
                _ => true,
            };
            if !ok {
                return;
            }
        }
    });
    (path, rx)
}

/// 4 MiB of shared guest memory.
fn shared_memory() -> GuestMemoryMmap {
    create_shared(&[(GuestAddress(0), 4 << 20)], MemoryMode::Shared).unwrap()
}

fn drain(rx: &mpsc::Receiver<u32>) -> Vec<u32> {
    std::thread::sleep(std::time::Duration::from_millis(50));
    rx.try_iter().collect()
}

/// Configures the device's two queues from mocks at 0 and 64 KiB and activates it.
fn activate_fs<'m>(
    fs: &mut Fs,
    mem: &'m GuestMemoryMmap,
) -> [virtio_queue::mock::MockSplitQueue<'m, GuestMemoryMmap>; 2] {
    let mocks = [
        mock_queue(mem, GuestAddress(0)),
        mock_queue(mem, GuestAddress(0x1_0000)),
    ];
    for (i, m) in mocks.iter().enumerate() {
        let q = &mut fs.common_mut().queues[i];
        q.set_size(TEST_QUEUE_SIZE);
        q.set_desc_table_address(Some(m.desc_table_addr().0 as u32), Some(0));
        q.set_avail_ring_address(Some(m.avail_addr().0 as u32), Some(0));
        q.set_used_ring_address(Some(m.used_addr().0 as u32), Some(0));
        q.set_ready(true);
    }
    fs.common_mut().acked_features = fs.common().avail_features;
    fs.activate(mem.clone(), crate::devices::virtio::test_utils::interrupt())
        .unwrap();
    mocks
}

#[test]
fn the_guest_is_offered_what_the_backend_has_and_the_frontend_implements() {
    let dir = tempfile::tempdir().unwrap();
    let (path, rx) = fake_backend(dir.path());
    let fs = Fs::new("cache", &path, 1).unwrap();
    assert_eq!(
        fs.common().avail_features,
        VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX,
        "neither the notification queue feature nor the vhost-user bit reaches the guest"
    );
    assert_eq!(fs.device_type(), 26);
    assert_eq!(
        fs.common().queues.len(),
        2,
        "high-priority and one request queue"
    );
    let mut config = [0u8; 40];
    fs.read_config(0, &mut config);
    assert_eq!(&config[..6], b"cache\0");
    assert_eq!(&config[36..40], &1u32.to_le_bytes());
    let mut tail = [0xffu8; 8];
    fs.read_config(38, &mut tail);
    assert_eq!(tail, [0, 0, 0, 0, 0, 0, 0, 0], "past the end reads zero");
    let seen = drain(&rx);
    assert_eq!(&seen[..3], &[3, GET_FEATURES, GET_PROTOCOL_FEATURES]);
}

#[test]
fn activation_hands_memory_and_every_vring_to_the_backend() {
    let dir = tempfile::tempdir().unwrap();
    let (path, rx) = fake_backend(dir.path());
    let mut fs = Fs::new("cache", &path, 1).unwrap();
    let mem = shared_memory();
    drain(&rx);
    let _mocks = activate_fs(&mut fs, &mem);
    let seen = drain(&rx);
    let per_queue = [
        SET_VRING_NUM,
        SET_VRING_ADDR,
        SET_VRING_BASE,
        SET_VRING_CALL,
        SET_VRING_KICK,
        SET_VRING_ENABLE,
    ];
    let mut expected = vec![SET_FEATURES, SET_MEM_TABLE];
    expected.extend(per_queue);
    expected.extend(per_queue);
    assert_eq!(seen, expected);
    assert_eq!(fs.rings, Rings::Running);
}

#[test]
fn private_memory_fails_the_device_instead_of_hanging_the_guest() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _rx) = fake_backend(dir.path());
    let mut fs = Fs::new("cache", &path, 1).unwrap();
    let mem = crate::devices::virtio::test_utils::memory(4);
    let _mocks = activate_fs(&mut fs, &mem);
    assert!(fs.has_failed(), "the backend cannot map private memory");
}

#[test]
fn what_the_backend_writes_is_marked_dirty_and_signalled() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _rx) = fake_backend(dir.path());
    let mut fs = Fs::new("cache", &path, 1).unwrap();
    let mem = shared_memory();
    let mocks = activate_fs(&mut fs, &mem);
    // A request: header readable at 0x20_0000, reply writable at 0x21_0000
    // and 0x23_0000 (two pages apart).
    add_chain(
        &mocks[1],
        0,
        &[
            (0x20_0000, 64, false),
            (0x21_0000, 16, true),
            (0x23_0000, 4096, true),
        ],
    );
    // The backend answers through its own mapping: write the used entry
    // through the memfd, which the vmm's bitmap does not see.
    let region = mem.iter().next().unwrap();
    let file = region.file_offset().unwrap().file();
    let used = mocks[1].used_addr().0;
    file.write_all_at(&0u32.to_le_bytes(), used + 4).unwrap();
    file.write_all_at(&4112u32.to_le_bytes(), used + 8).unwrap();
    file.write_all_at(&1u16.to_le_bytes(), used + 2).unwrap();
    for r in mem.iter() {
        vm_memory::mmap::MmapRegion::bitmap(r).reset();
    }
    fs.backend_completed(1);
    let dirty = |gpa: u64| {
        let r = mem.iter().next().unwrap();
        vm_memory::bitmap::Bitmap::dirty_at(vm_memory::mmap::MmapRegion::bitmap(r), gpa as usize)
    };
    assert!(dirty(0x21_0000) && dirty(0x23_0000), "the reply buffers");
    assert!(dirty(used), "the used ring");
    assert!(!dirty(0x20_0000), "the request the backend only read");
    assert!(!dirty(0x22_0000), "between the buffers");
    let irq = fs.common().interrupt.clone().unwrap();
    assert_eq!(irq.status() & VIRTIO_MMIO_INT_VRING, VIRTIO_MMIO_INT_VRING);
    assert_eq!(fs.cursors[1].0 .0, 1);
}

#[test]
fn hostile_chains_in_the_used_ring_end_and_stay_in_memory() {
    let mem = crate::devices::virtio::test_utils::memory(4);
    let q = mock_queue(&mem, GuestAddress(0));
    let mut queue = virtio_queue::Queue::new(TEST_QUEUE_SIZE).unwrap();
    queue.set_size(TEST_QUEUE_SIZE);
    queue.set_desc_table_address(Some(q.desc_table_addr().0 as u32), Some(0));
    queue.set_avail_ring_address(Some(q.avail_addr().0 as u32), Some(0));
    queue.set_used_ring_address(Some(q.used_addr().0 as u32), Some(0));
    queue.set_ready(true);
    let next = virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16;
    let write = virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16;
    let indirect = virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;
    // A chain that loops on itself, one far outside memory, and an indirect
    // table pointing at a writable buffer.
    add_raw_chain(
        &q,
        0,
        &[SplitDescriptor::new(0x10_0000, 16, next | write, 0)],
    );
    add_raw_chain(
        &q,
        1,
        &[SplitDescriptor::new(0xffff_ffff_0000, u32::MAX, write, 0)],
    );
    mem.write_obj(0x30_0000u64, GuestAddress(0x2f_0000))
        .unwrap();
    mem.write_obj(512u32, GuestAddress(0x2f_0008)).unwrap();
    mem.write_obj(write, GuestAddress(0x2f_000c)).unwrap();
    add_raw_chain(&q, 2, &[SplitDescriptor::new(0x2f_0000, 16, indirect, 0)]);
    for (slot, head) in [(0u64, 0u32), (1, 1), (2, 2), (3, 999)] {
        mem.write_obj(head, GuestAddress(q.used_addr().0 + 4 + 8 * slot))
            .unwrap();
    }
    mem.write_obj(4u16, GuestAddress(q.used_addr().0 + 2))
        .unwrap();
    let region = mem.iter().next().unwrap();
    vm_memory::mmap::MmapRegion::bitmap(region).reset();
    let mut cursor = dirty::UsedCursor::default();
    dirty::mark_completed(&mem, &queue, &mut cursor);
    let bitmap = vm_memory::mmap::MmapRegion::bitmap(region);
    assert!(vm_memory::bitmap::Bitmap::dirty_at(bitmap, 0x10_0000));
    assert!(vm_memory::bitmap::Bitmap::dirty_at(bitmap, 0x30_0000));
    assert!(
        !vm_memory::bitmap::Bitmap::dirty_at(bitmap, 0x2f_0000),
        "the table is read, not written"
    );
    assert_eq!(cursor.0 .0, 4);
    // A used index more than a ring ahead is clipped to one ring.
    mem.write_obj(1000u16, GuestAddress(q.used_addr().0 + 2))
        .unwrap();
    dirty::mark_completed(&mem, &queue, &mut cursor);
    assert_eq!(cursor.0 .0, 1000);
}

#[test]
fn a_failed_backend_gets_every_request_answered_with_eio() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _rx) = fake_backend(dir.path());
    let mut fs = Fs::new("cache", &path, 1).unwrap();
    let mem = shared_memory();
    let mocks = activate_fs(&mut fs, &mem);
    // A LOOKUP (unique 0x77) with a reply buffer, and a FORGET without one.
    let mut header = [0u8; 40];
    header[0..4].copy_from_slice(&40u32.to_le_bytes());
    header[4..8].copy_from_slice(&1u32.to_le_bytes());
    header[8..16].copy_from_slice(&0x77u64.to_le_bytes());
    mem.write_slice(&header, GuestAddress(0x20_0000)).unwrap();
    add_chain(
        &mocks[1],
        0,
        &[(0x20_0000, 40, false), (0x21_0000, 144, true)],
    );
    add_chain(&mocks[1], 2, &[(0x20_0000, 40, false)]);
    fs.fail("test: the backend went away");
    assert!(fs.has_failed());
    assert_eq!(failed::answer_all(&mut fs.common, 1), 2);
    let mut reply = [0u8; 16];
    mem.read_slice(&mut reply, GuestAddress(0x21_0000)).unwrap();
    assert_eq!(u32::from_le_bytes(reply[0..4].try_into().unwrap()), 16);
    assert_eq!(
        i32::from_le_bytes(reply[4..8].try_into().unwrap()),
        -libc::EIO
    );
    assert_eq!(u64::from_le_bytes(reply[8..16].try_into().unwrap()), 0x77);
    let used = |i: usize| mocks[1].used().ring().ref_at(i).unwrap().load();
    assert_eq!((used(0).id(), used(0).len()), (0, 16));
    assert_eq!((used(1).id(), used(1).len()), (2, 0));
    // A reset and a new activation stay failed: the backend is not coming back.
    fs.reset();
    let _again = activate_fs(&mut fs, &mem);
    assert!(fs.has_failed());
}

#[test]
fn a_snapshot_stops_the_vrings_where_the_backend_was_and_needs_its_state() {
    let dir = tempfile::tempdir().unwrap();
    let (path, rx) = fake_backend(dir.path());
    let mut fs = Fs::new("cache", &path, 1).unwrap();
    let mem = shared_memory();
    let _mocks = activate_fs(&mut fs, &mem);
    drain(&rx);
    fs.stop_for_snapshot();
    assert_eq!(fs.rings, Rings::Stopped);
    assert_eq!(drain(&rx), vec![GET_VRING_BASE, GET_VRING_BASE]);
    assert!(fs
        .common()
        .queues
        .iter()
        .all(|q| q.next_avail() == FAKE_BASE as u16));
    // The fake cannot hand over its state: the snapshot fails, saying so.
    let err = fs.save().unwrap_err().to_string();
    assert!(
        err.contains("\"cache\"") && err.contains("DEVICE_STATE"),
        "{err}"
    );
    fs.resume_after_snapshot();
    assert_eq!(fs.rings, Rings::Running);
    let restarted = drain(&rx);
    assert_eq!(
        restarted.iter().filter(|&&c| c == SET_VRING_KICK).count(),
        2
    );
    assert!(
        !restarted.contains(&SET_MEM_TABLE),
        "the memory table stays"
    );
}

#[test]
fn an_idle_device_saves_and_a_restore_must_match_its_tag() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _rx) = fake_backend(dir.path());
    let fs = Fs::new("cache", &path, 1).unwrap();
    let state = fs.save().unwrap();
    assert_eq!((state.tag.as_str(), state.request_queues), ("cache", 1));
    assert!(!state.failed && state.backend_state.is_none());
    let mem = shared_memory();
    let args = persist::FsConstructorArgs {
        tag: "other".into(),
        socket: path.clone(),
        request_queues: 1,
        mem,
        memory_ready: MemoryReady::now(),
        interrupt: crate::devices::virtio::test_utils::interrupt(),
    };
    let err = Fs::restore(args, &state).err().unwrap().to_string();
    assert!(
        err.contains("\"cache\"") && err.contains("\"other\""),
        "{err}"
    );
}

#[test]
fn a_restored_device_waiting_for_memory_saves_the_state_it_was_given() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _rx) = fake_backend(dir.path());
    let mut fs = Fs::new("cache", &path, 1).unwrap();
    let (ready, _signal) = MemoryReady::pending().unwrap();
    fs.memory_ready = ready;
    fs.restored_state = Some(vec![1, 2, 3]);
    let mem = shared_memory();
    let _mocks = activate_fs(&mut fs, &mem);
    assert_eq!(
        fs.rings,
        Rings::WaitingForMemory,
        "the backend waits for the memory"
    );
    let state = fs.save().unwrap();
    assert_eq!(state.backend_state, Some(vec![1, 2, 3]));
    assert!(state.common.activated);
}

/// Found by a real guest restored with `--memory-backend uffd` and two
/// shares: both devices watched the one memory-ready eventfd in the one
/// event loop, the second registration failed, and that share never started.
#[test]
fn every_share_of_a_lazily_restored_vm_starts_once_memory_is_complete() {
    use event_manager::{EventManager, SubscriberOps};
    let dir = tempfile::tempdir().unwrap();
    let (ready, signal) = MemoryReady::pending().unwrap();
    let mem = shared_memory();
    let mut manager: EventManager<Arc<std::sync::Mutex<Fs>>> = EventManager::new().unwrap();
    let mut devices = Vec::new();
    for name in ["a", "b"] {
        let sub = dir.path().join(name);
        std::fs::create_dir(&sub).unwrap();
        let (path, _rx) = fake_backend(&sub);
        let mut fs = Fs::new(name, &path, 1).unwrap();
        fs.memory_ready = ready.clone();
        // Both devices' queues sit in the same pages: the fake only records.
        let _mocks = activate_fs(&mut fs, &mem);
        assert_eq!(fs.rings, Rings::WaitingForMemory);
        let fs = Arc::new(std::sync::Mutex::new(fs));
        manager.add_subscriber(fs.clone());
        devices.push(fs);
    }
    signal.done();
    for _ in 0..10 {
        manager.run_with_timeout(100).unwrap();
        if devices
            .iter()
            .all(|d| d.lock().unwrap().rings == Rings::Running)
        {
            break;
        }
    }
    for d in &devices {
        let d = d.lock().unwrap();
        assert_eq!(d.rings, Rings::Running, "share {:?} never started", d.tag());
    }
}
