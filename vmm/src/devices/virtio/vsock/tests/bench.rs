//! The device's own cost per packet (an ignored test that prints).

use super::*;

/// VMM-side cost of one virtio-vsock data packet in each direction (header
/// parsing, credit accounting, the Unix socket write or read, used ring
/// update), measured around `process_tx` / `process_rx` only. Run with:
/// `cargo test -p vmm --release --lib bench_ -- --ignored --nocapture`
#[test]
#[ignore = "benchmark: prints ns/packet"]
fn bench_vsock_packet_cost() {
    let mut h = Harness::new();
    h.post_rx(NRX);
    let (_l, host) = connect(&mut h, 1 << 31);
    let payload = vec![7u8; 4096];

    // Guest -> host: a host thread drains the socket.
    let mut reader = host.try_clone().unwrap();
    reader
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let drain = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0usize;
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 {
                break;
            }
            total += n;
        }
        total
    });
    let rounds = 500;
    let mut total = Duration::ZERO;
    for _ in 0..rounds {
        for _ in 0..8 {
            let mut rw = h.hdr(OP_RW, 1000, 5000);
            rw.buf_alloc = 1 << 31;
            h.queue_tx(rw, &payload);
        }
        let start = std::time::Instant::now();
        assert_eq!(h.dev.lock().unwrap().process_tx(), 8);
        total += start.elapsed();
        h.pump();
        while h.dev.lock().unwrap().buffered_bytes() > 0 {
            std::thread::sleep(Duration::from_micros(50));
            h.pump();
        }
    }
    let n = rounds as u64 * 8;
    println!(
        "bench: virtio-vsock guest->host 4 KiB RW: {} ns/packet over {n} packets",
        total.as_nanos() as u64 / n
    );
    assert_eq!(h.dev.lock().unwrap().connection_count(), 1);

    // Host -> guest: the socket holds data, the guest has buffers.
    while h.recv().is_some() {}
    let mut writer = host.try_clone().unwrap();
    let mut total = Duration::ZERO;
    let mut packets = 0u64;
    for _ in 0..rounds {
        for _ in 0..NRX {
            writer.write_all(&payload).unwrap();
        }
        // Let the event loop see the socket become readable (no guest buffers yet).
        h.pump();
        let mut received = 0usize;
        let mut tries = 0;
        while received < payload.len() * usize::from(NRX) {
            tries += 1;
            assert!(
                tries < 10_000,
                "no progress: {:?}",
                h.dev.lock().unwrap().stats()
            );
            h.post_rx_quiet(NRX);
            let start = std::time::Instant::now();
            let sent = h.dev.lock().unwrap().process_rx();
            total += start.elapsed();
            packets += sent as u64;
            while let Some((_, data)) = h.recv() {
                received += data.len();
            }
            if sent == 0 {
                h.pump();
                while let Some((_, data)) = h.recv() {
                    received += data.len();
                }
            }
        }
    }
    println!(
        "bench: virtio-vsock host->guest RW (up to 4 KiB): {} ns/packet over {packets} packets",
        total.as_nanos() as u64 / packets.max(1)
    );
    drop(writer);
    drop(host);
    let _ = drain.join();
}
