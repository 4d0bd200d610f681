use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use event_manager::{EventManager, SubscriberOps};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Address, Bytes, GuestAddress};

use super::conn::TX_BUF_ALLOC;
use super::persist::{VsockConstructorArgs, VsockState};
use super::*;
use crate::devices::virtio::test_utils::{
    activate, add_chain, interrupt, memory, mock_queue, used, used_idx, TEST_QUEUE_SIZE,
};
use crate::persist::Persist;

const GUEST_CID: u64 = 3;
const TX_BUFS: u64 = 0x10_0000;
const RX_BUFS: u64 = 0x20_0000;
const RX_BUF_LEN: u32 = 44 + 4096;
const NRX: u16 = 8;

fn uds_path() -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    std::env::temp_dir().join(format!(
        "vmm-vsock-unit-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ))
}

struct Harness {
    mem: &'static GuestMemoryMmap,
    dev: Arc<Mutex<Vsock>>,
    em: EventManager<Arc<Mutex<Vsock>>>,
    rx: MockSplitQueue<'static, GuestMemoryMmap>,
    tx: MockSplitQueue<'static, GuestMemoryMmap>,
    ev: MockSplitQueue<'static, GuestMemoryMmap>,
    uds: PathBuf,
    tx_next: u16,
    rx_seen: u16,
    rx_posted: u16,
}

impl Harness {
    fn new() -> Harness {
        let mem: &'static GuestMemoryMmap = Box::leak(Box::new(memory(8)));
        let uds = uds_path();
        let mut vsock = Vsock::new(GUEST_CID as u32, &uds).unwrap();
        let rx = mock_queue(mem, GuestAddress(0));
        let tx = mock_queue(mem, GuestAddress(0x1_0000));
        let ev = mock_queue(mem, GuestAddress(0x2_0000));
        activate(&mut vsock, mem, &[&rx, &tx, &ev]);
        let dev = Arc::new(Mutex::new(vsock));
        let mut em = EventManager::new().unwrap();
        em.add_subscriber(dev.clone());
        let mut h = Harness {
            mem,
            dev,
            em,
            rx,
            tx,
            ev,
            uds,
            tx_next: 0,
            rx_seen: 0,
            rx_posted: 0,
        };
        h.pump();
        h
    }

    fn pump(&mut self) {
        for _ in 0..50 {
            if self.em.run_with_timeout(20).unwrap() == 0 {
                return;
            }
        }
    }

    fn post_rx(&mut self, n: u16) {
        for _ in 0..n {
            let i = self.rx_posted % NRX;
            add_chain(
                &self.rx,
                i,
                &[(RX_BUFS + u64::from(i) * 0x2000, RX_BUF_LEN, true)],
            );
            self.rx_posted += 1;
        }
        self.dev.lock().unwrap().common.queue_evts[RX_QUEUE]
            .write(1)
            .unwrap();
        self.pump();
    }

    /// Tops the receive queue up to `n` outstanding buffers without running the event loop.
    fn post_rx_quiet(&mut self, n: u16) {
        let outstanding = self.rx_posted.wrapping_sub(self.rx_seen);
        for _ in outstanding..n {
            let i = self.rx_posted % NRX;
            add_chain(
                &self.rx,
                i,
                &[(RX_BUFS + u64::from(i) * 0x2000, RX_BUF_LEN, true)],
            );
            self.rx_posted += 1;
        }
    }

    fn hdr(&self, op: u16, src_port: u32, dst_port: u32) -> PacketHeader {
        PacketHeader {
            src_cid: GUEST_CID,
            dst_cid: HOST_CID,
            src_port,
            dst_port,
            len: 0,
            type_: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: 64 * 1024,
            fwd_cnt: 0,
        }
    }

    /// Queues one packet on the tx queue without notifying.
    fn queue_tx(&mut self, mut hdr: PacketHeader, payload: &[u8]) {
        hdr.len = payload.len() as u32;
        let i = self.tx_next % 16;
        let addr = TX_BUFS + u64::from(i) * 0x1_0000;
        self.mem.write_obj(hdr, GuestAddress(addr)).unwrap();
        self.mem
            .write_slice(payload, GuestAddress(addr + HEADER_LEN as u64))
            .unwrap();
        add_chain(
            &self.tx,
            i,
            &[(addr, (HEADER_LEN + payload.len()) as u32, false)],
        );
        self.tx_next += 1;
    }

    fn send(&mut self, hdr: PacketHeader, payload: &[u8]) {
        self.queue_tx(hdr, payload);
        self.dev.lock().unwrap().common.queue_evts[TX_QUEUE]
            .write(1)
            .unwrap();
        self.pump();
    }

    /// The next packet the device put on the rx queue.
    fn recv(&mut self) -> Option<(PacketHeader, Vec<u8>)> {
        if used_idx(&self.rx) == self.rx_seen {
            return None;
        }
        let (id, len) = used(&self.rx, usize::from(self.rx_seen % 16));
        self.rx_seen += 1;
        let addr = RX_BUFS + u64::from(id) * 0x2000;
        let hdr: PacketHeader = self.mem.read_obj(GuestAddress(addr)).unwrap();
        let mut payload = vec![0u8; len as usize - HEADER_LEN];
        self.mem
            .read_slice(&mut payload, GuestAddress(addr + HEADER_LEN as u64))
            .unwrap();
        Some((hdr, payload))
    }

    fn host_listener(&self, port: u32) -> UnixListener {
        let path = format!("{}_{port}", self.uds.display());
        let _ = std::fs::remove_file(&path);
        UnixListener::bind(path).unwrap()
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.uds);
    }
}

fn op(p: &Option<(PacketHeader, Vec<u8>)>) -> Option<u16> {
    p.as_ref().map(|(h, _)| h.op)
}

/// Connects guest port 1000 to host port 5000; returns the host side.
fn connect(h: &mut Harness, buf_alloc: u32) -> (UnixListener, UnixStream) {
    let listener = h.host_listener(5000);
    let mut req = h.hdr(OP_REQUEST, 1000, 5000);
    req.buf_alloc = buf_alloc;
    h.send(req, &[]);
    let resp = h.recv();
    assert_eq!(op(&resp), Some(OP_RESPONSE));
    let (hdr, _) = resp.unwrap();
    assert_eq!(
        (hdr.src_cid, hdr.dst_cid, hdr.src_port, hdr.dst_port),
        (HOST_CID, GUEST_CID, 5000, 1000)
    );
    let (stream, _) = listener.accept().unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    (listener, stream)
}

#[test]
fn guest_connection_carries_data_both_ways() {
    let mut h = Harness::new();
    h.post_rx(NRX);
    let (_l, mut host) = connect(&mut h, 64 * 1024);
    h.send(h.hdr(OP_RW, 1000, 5000), b"ping");
    let mut buf = [0u8; 4];
    host.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"ping");

    host.write_all(b"pong").unwrap();
    h.pump();
    let (hdr, payload) = h.recv().unwrap();
    assert_eq!({ hdr.op }, OP_RW);
    assert_eq!(payload, b"pong");
    // The device reports what it forwarded to the host.
    assert_eq!({ hdr.fwd_cnt }, 4);

    // Host closes: the guest is told nothing more comes.
    drop(host);
    h.pump();
    let (hdr, _) = h.recv().unwrap();
    assert_eq!((hdr.op, hdr.flags), (OP_SHUTDOWN, SHUTDOWN_SEND));
    h.send(h.hdr(OP_RST, 1000, 5000), &[]);
    assert_eq!(h.dev.lock().unwrap().connection_count(), 0);
}

/// A receive buffer with room for a header and no data is skipped; it used
/// to be read into with length 0, and the read's 0 was taken for the host's
/// end of stream (the guest was told SHUTDOWN and the data never came).
#[test]
fn a_header_only_receive_buffer_is_not_taken_for_the_hosts_end_of_stream() {
    let mut h = Harness::new();
    h.post_rx(1);
    let (_l, mut host) = connect(&mut h, 64 * 1024);
    let i = h.rx_posted % NRX;
    add_chain(
        &h.rx,
        i,
        &[(RX_BUFS + u64::from(i) * 0x2000, HEADER_LEN as u32, true)],
    );
    h.rx_posted += 1;
    host.write_all(b"data").unwrap();
    h.dev.lock().unwrap().common.queue_evts[RX_QUEUE]
        .write(1)
        .unwrap();
    h.pump();
    assert_eq!(
        used_idx(&h.rx),
        h.rx_seen + 1,
        "the small buffer is returned"
    );
    let (_, len) = used(&h.rx, usize::from(h.rx_seen % 16));
    assert_eq!(len, 0, "nothing is written where no data fits");
    h.rx_seen += 1;
    h.post_rx(1);
    let (hdr, payload) = h.recv().expect("the data, in the next buffer");
    assert_eq!((hdr.op, payload.as_slice()), (OP_RW, &b"data"[..]));
    assert!(h.recv().is_none(), "and no SHUTDOWN");
}

#[test]
fn a_host_that_shuts_its_write_side_still_gets_the_guests_answer() {
    let mut h = Harness::new();
    h.post_rx(NRX);
    let (_l, mut host) = connect(&mut h, 64 * 1024);
    host.write_all(b"question").unwrap();
    host.shutdown(std::net::Shutdown::Write).unwrap();
    h.pump();
    let (hdr, payload) = h.recv().unwrap();
    assert_eq!((hdr.op, payload.as_slice()), (OP_RW, &b"question"[..]));
    let (hdr, _) = h.recv().unwrap();
    // Send shut, receive open: the guest may still answer.
    assert_eq!((hdr.op, hdr.flags), (OP_SHUTDOWN, SHUTDOWN_SEND));
    h.send(h.hdr(OP_RW, 1000, 5000), b"answer");
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 6];
    host.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"answer");
    // The guest ends its side too: the host reads the end.
    let mut bye = h.hdr(OP_SHUTDOWN, 1000, 5000);
    bye.flags = SHUTDOWN_SEND | SHUTDOWN_RCV;
    h.send(bye, &[]);
    let mut rest = Vec::new();
    host.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
}

#[test]
fn guest_connecting_to_nothing_gets_a_reset() {
    let mut h = Harness::new();
    h.post_rx(2);
    h.send(h.hdr(OP_REQUEST, 1000, 4242), &[]);
    assert_eq!(op(&h.recv()), Some(OP_RST));
    // Data for a connection that does not exist: reset too.
    h.send(h.hdr(OP_RW, 1000, 4242), b"x");
    assert_eq!(op(&h.recv()), Some(OP_RST));
}

#[test]
fn host_connect_handshake() {
    let mut h = Harness::new();
    h.post_rx(NRX);
    let mut host = UnixStream::connect(&h.uds).unwrap();
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    host.write_all(b"CONNECT 52\n").unwrap();
    h.pump();
    let (req, _) = h.recv().expect("REQUEST to the guest");
    assert_eq!(
        (req.op, req.dst_port, req.dst_cid),
        (OP_REQUEST, 52, GUEST_CID)
    );
    let local = req.src_port;
    h.send(h.hdr(OP_RESPONSE, 52, local), &[]);
    let mut line = [0u8; 64];
    let n = host.read(&mut line).unwrap();
    assert_eq!(
        std::str::from_utf8(&line[..n]).unwrap(),
        format!("OK {local}\n")
    );
    host.write_all(b"data").unwrap();
    h.pump();
    let (hdr, payload) = h.recv().unwrap();
    assert_eq!((hdr.op, payload.as_slice()), (OP_RW, &b"data"[..]));
}

#[test]
fn bad_connect_lines_close_the_host_socket() {
    let mut h = Harness::new();
    for line in [&b"HELLO 5\n"[..], b"CONNECT x\n", &[b'C'; 100]] {
        let mut host = UnixStream::connect(&h.uds).unwrap();
        host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        host.write_all(line).unwrap();
        h.pump();
        let mut buf = [0u8; 8];
        // Closed: end of file, or a reset when the device left bytes unread.
        match host.read(&mut buf) {
            Ok(n) => assert_eq!(n, 0, "{line:?}"),
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{line:?}"),
        }
    }
    assert!(h.dev.lock().unwrap().pending_hosts.is_empty());
}

#[test]
fn a_guest_that_never_consumes_data_costs_the_host_nothing_unbounded() {
    let mut h = Harness::new();
    h.post_rx(NRX);
    // The guest advertises 4 KiB and never reports consuming anything.
    let (_l, mut host) = connect(&mut h, 4096);
    host.set_nonblocking(true).unwrap();
    let chunk = vec![0x5au8; 64 * 1024];
    let mut written = 0usize;
    let mut blocked = false;
    for _ in 0..256 {
        match host.write(&chunk) {
            Ok(n) => written += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                blocked = true;
                break;
            }
            Err(e) => panic!("{e}"),
        }
        h.pump();
    }
    h.post_rx(NRX);
    let mut delivered = 0usize;
    while let Some((hdr, payload)) = h.recv() {
        if hdr.op == OP_RW {
            delivered += payload.len();
        }
    }
    assert!(
        blocked,
        "the host writer never blocked after {written} bytes"
    );
    assert!(written < 16 << 20, "{written} bytes accepted");
    assert_eq!(delivered, 4096, "exactly the guest's credit is delivered");
    assert_eq!(h.dev.lock().unwrap().buffered_bytes(), 0);
}

#[test]
fn a_guest_exceeding_its_credit_is_reset() {
    let mut h = Harness::new();
    h.post_rx(NRX);
    // The host never reads, so guest data piles up in the device up to TX_BUF_ALLOC.
    let (_l, _host) = connect(&mut h, 4096);
    let payload = vec![1u8; 60 * 1024];
    let mut reset = false;
    for _ in 0..64 {
        h.send(h.hdr(OP_RW, 1000, 5000), &payload);
        assert!(h.dev.lock().unwrap().buffered_bytes() <= TX_BUF_ALLOC as usize);
        while let Some(p) = h.recv() {
            reset |= p.0.op == OP_RST;
        }
        if reset {
            break;
        }
    }
    assert!(reset, "a guest ignoring the device's buf_alloc is reset");
    assert_eq!(h.dev.lock().unwrap().buffered_bytes(), 0);
}

#[test]
fn malformed_packets_are_dropped_or_reset() {
    let mut h = Harness::new();
    h.post_rx(NRX);
    let (_l, _host) = connect(&mut h, 4096);
    // Spoofed source CID: dropped silently.
    let mut spoof = h.hdr(OP_RW, 1000, 5000);
    spoof.src_cid = 77;
    h.send(spoof, b"x");
    assert!(h.recv().is_none());
    // Length larger than the payload: reset.
    let mut long = h.hdr(OP_RW, 1000, 5000);
    long.len = 1 << 30;
    let i = h.tx_next % 16;
    let addr = TX_BUFS + u64::from(i) * 0x1_0000;
    h.mem.write_obj(long, GuestAddress(addr)).unwrap();
    add_chain(&h.tx, i, &[(addr, HEADER_LEN as u32 + 4, false)]);
    h.tx_next += 1;
    h.dev.lock().unwrap().common.queue_evts[TX_QUEUE]
        .write(1)
        .unwrap();
    h.pump();
    assert_eq!(op(&h.recv()), Some(OP_RST));
    // Header outside guest memory, and a chain shorter than a header: dropped.
    let i = h.tx_next % 16;
    add_chain(&h.tx, i, &[(0x40_0000_0000, 44, false)]);
    add_chain(&h.tx, (i + 1) % 16, &[(TX_BUFS, 8, false)]);
    h.tx_next += 2;
    h.dev.lock().unwrap().common.queue_evts[TX_QUEUE]
        .write(1)
        .unwrap();
    h.pump();
    assert!(h.recv().is_none());
    assert_eq!(h.dev.lock().unwrap().stats().tx_packets, 5);
    // Unknown op on a live connection: reset.
    let (_l2, _host2) = connect(&mut h, 4096);
    h.send(h.hdr(99, 1000, 5000), &[]);
    assert_eq!(op(&h.recv()), Some(OP_RST));
}

#[test]
fn control_packets_waiting_for_a_guest_without_buffers_are_bounded() {
    let mut h = Harness::new();
    // No rx buffers: every refused REQUEST queues a reset.
    for round in 0..(MAX_PENDING_CONTROL / 16 + 2) {
        for j in 0..16u32 {
            h.queue_tx(h.hdr(OP_REQUEST, round as u32 * 16 + j, 1), &[]);
        }
        h.dev.lock().unwrap().common.queue_evts[TX_QUEUE]
            .write(1)
            .unwrap();
        h.pump();
    }
    let dev = h.dev.lock().unwrap();
    assert!(dev.rx_control.len() <= MAX_PENDING_CONTROL);
    assert!(dev.stats().control_dropped > 0);
}

#[test]
fn device_reset_closes_connections() {
    let mut h = Harness::new();
    h.post_rx(NRX);
    let (_l, mut host) = connect(&mut h, 4096);
    h.dev.lock().unwrap().reset();
    h.pump();
    let mut buf = [0u8; 4];
    assert_eq!(host.read(&mut buf).unwrap(), 0);
    assert_eq!(h.dev.lock().unwrap().conns.len(), 0);
}

#[test]
fn a_stale_socket_file_is_replaced_but_a_live_one_is_not() {
    let path = uds_path();
    drop(UnixListener::bind(&path).unwrap());
    let v = Vsock::new(3, &path).expect("stale socket replaced");
    assert!(matches!(
        Vsock::new(3, &path),
        Err(VsockError::Listen { .. })
    ));
    drop(v);
    let _ = std::fs::remove_file(&path);
}

type Loop = EventManager<Arc<Mutex<Vsock>>>;

/// A device the guest has not started, with its event loop.
fn unstarted_device() -> (PathBuf, Arc<Mutex<Vsock>>, Loop) {
    let uds = uds_path();
    let dev = Arc::new(Mutex::new(Vsock::new(GUEST_CID as u32, &uds).unwrap()));
    let mut em: Loop = EventManager::new().unwrap();
    em.add_subscriber(dev.clone());
    (uds, dev, em)
}

/// Runs the event loop until the device has closed `host` (end of file or
/// a reset); false if it is still open after 20 s.
fn closed_by_device(em: &mut Loop, host: &UnixStream) -> bool {
    host.set_nonblocking(true).unwrap();
    let give_up = std::time::Instant::now() + Duration::from_secs(20);
    while std::time::Instant::now() < give_up {
        em.run_with_timeout(50).unwrap();
        match (&*host).read(&mut [0u8; 64]) {
            Ok(0) => return true,
            Ok(_) => panic!("the device sent bytes to a host connection it never established"),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(e) => panic!("reading the host socket: {e}"),
        }
    }
    false
}

const SHORT: handshake::HandshakeLimits = handshake::HandshakeLimits {
    connect: Duration::from_millis(100),
    admission: Duration::from_millis(300),
};

#[test]
fn host_connections_made_before_the_guest_starts_the_device_wait() {
    let mem: &'static GuestMemoryMmap = Box::leak(Box::new(memory(8)));
    let (uds, dev, mut em) = unstarted_device();
    let mut host = UnixStream::connect(&uds).unwrap();
    host.write_all(b"CONNECT 77\n").unwrap();
    for _ in 0..3 {
        em.run_with_timeout(20).unwrap();
    }
    assert!(
        dev.lock().unwrap().conns.is_empty(),
        "the guest is not asked before it starts the device"
    );
    // A driver resets the device before starting it: the host keeps waiting.
    dev.lock().unwrap().reset();
    em.run_with_timeout(20).unwrap();

    let rx = mock_queue(mem, GuestAddress(0));
    let tx = mock_queue(mem, GuestAddress(0x1_0000));
    let ev = mock_queue(mem, GuestAddress(0x2_0000));
    add_chain(&rx, 0, &[(RX_BUFS, RX_BUF_LEN, true)]);
    activate(&mut *dev.lock().unwrap(), mem, &[&rx, &tx, &ev]);
    for _ in 0..5 {
        em.run_with_timeout(20).unwrap();
    }
    assert_eq!(used_idx(&rx), 1);
    let hdr: PacketHeader = mem.read_obj(GuestAddress(RX_BUFS)).unwrap();
    assert_eq!(({ hdr.op }, { hdr.dst_port }), (OP_REQUEST, 77));
    let _ = std::fs::remove_file(&uds);
}

#[test]
fn a_host_connection_to_a_guest_that_never_starts_the_device_is_closed() {
    let (uds, dev, mut em) = unstarted_device();
    dev.lock().unwrap().set_handshake_limits(SHORT);
    // One with a complete CONNECT line, one that never finishes it.
    let mut waiting = UnixStream::connect(&uds).unwrap();
    waiting.write_all(b"CONNECT 1024\n").unwrap();
    let mut silent = UnixStream::connect(&uds).unwrap();
    silent.write_all(b"CONN").unwrap();
    assert!(
        closed_by_device(&mut em, &waiting),
        "still waiting after 20 s"
    );
    assert!(
        closed_by_device(&mut em, &silent),
        "still waiting after 20 s"
    );
    let d = dev.lock().unwrap();
    assert!(d.pending_hosts.is_empty() && d.conns.is_empty());
    assert_eq!(d.stats().handshake_timeouts, 2);
    drop(d);
    let _ = std::fs::remove_file(&uds);
}

/// A started device with [`SHORT`] limits, a host that asked for guest port
/// 52, and the REQUEST the guest got for it.
fn host_connect_with_short_limits() -> (Harness, UnixStream, PacketHeader) {
    let mut h = Harness::new();
    h.dev.lock().unwrap().set_handshake_limits(SHORT);
    h.post_rx(NRX);
    let mut host = UnixStream::connect(&h.uds).unwrap();
    host.write_all(b"CONNECT 52\n").unwrap();
    h.pump();
    let (req, _) = h.recv().expect("REQUEST to the guest");
    assert_eq!((req.op, req.dst_port), (OP_REQUEST, 52));
    (h, host, req)
}

#[test]
fn a_host_connection_the_guest_never_answers_is_closed_and_the_guest_reset() {
    let (mut h, host, req) = host_connect_with_short_limits();
    // The guest answers nothing.
    assert!(closed_by_device(&mut h.em, &host), "still open after 20 s");
    let (rst, _) = h.recv().expect("a reset for the abandoned request");
    assert_eq!(
        (rst.op, rst.src_port, rst.dst_port),
        (OP_RST, req.src_port, 52)
    );
    assert_eq!(h.dev.lock().unwrap().stats().handshake_timeouts, 1);
    // A late RESPONSE opens nothing: it is answered with a reset.
    h.send(h.hdr(OP_RESPONSE, 52, req.src_port), &[]);
    assert_eq!(op(&h.recv()), Some(OP_RST));
    assert_eq!(h.dev.lock().unwrap().connection_count(), 0);
}

#[test]
fn an_answered_connection_outlives_the_handshake_deadline() {
    let (mut h, mut host, req) = host_connect_with_short_limits();
    h.send(h.hdr(OP_RESPONSE, 52, req.src_port), &[]);
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut line = [0u8; 32];
    let n = host.read(&mut line).unwrap();
    assert!(line[..n].starts_with(b"OK "));
    // Well past both deadlines, with the timer firing meanwhile.
    let until = std::time::Instant::now() + SHORT.admission * 2;
    while std::time::Instant::now() < until {
        h.em.run_with_timeout(50).unwrap();
    }
    host.write_all(b"still here").unwrap();
    h.pump();
    let (hdr, payload) = h.recv().unwrap();
    assert_eq!((hdr.op, payload.as_slice()), (OP_RW, &b"still here"[..]));
    assert_eq!(h.dev.lock().unwrap().stats().handshake_timeouts, 0);
}

#[test]
fn a_host_listener_that_never_accepts_does_not_stall_the_device() {
    let mut h = Harness::new();
    let listener = h.host_listener(5000);
    // SAFETY: listen(2) on a socket this test owns, only shrinking its backlog.
    assert_eq!(
        unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&listener), 2) },
        0
    );
    // Far more connections than a listen backlog holds: once it is full the
    // device refuses them instead of blocking in connect().
    for round in 0..4u32 {
        for j in 0..16u32 {
            h.queue_tx(h.hdr(OP_REQUEST, round * 16 + j, 5000), &[]);
        }
        h.dev.lock().unwrap().common.queue_evts[TX_QUEUE]
            .write(1)
            .unwrap();
        h.pump();
    }
    let dev = h.dev.lock().unwrap();
    assert_eq!(dev.stats().tx_packets, 64);
    assert!(
        dev.connection_count() < 64,
        "{} connections open",
        dev.connection_count()
    );
}

mod bench;
mod restore;
