//! Rate limits and I/O counters of virtio-blk and virtio-net, end to end:
//! a test guest moves a known amount of data through a limited device; the
//! time that took is at least what the limit allows (a lower bound only: a
//! loaded machine is slower, never faster, than its limit), and the
//! control socket's counters equal what moved. Without a limit the
//! counters count all the same.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use vmm_api::{Client, StatusReply};

/// A vmm running a test guest, its serial lines on a channel.
struct Vm {
    child: Child,
    lines: mpsc::Receiver<String>,
    socket: PathBuf,
    started: Instant,
    _dir: tempfile::TempDir,
}

impl Vm {
    fn start(guest_name: &str, cmdline: &str, devices: &[&str]) -> Vm {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vm.sock");
        let kernel = guest(guest_name);
        let started = Instant::now();
        let mut child = vmm()
            .args(["run", "--kernel", kernel.to_str().unwrap()])
            .args(["--serial", "stdout", "--cmdline", cmdline])
            .args(["--control-socket", socket.to_str().unwrap()])
            .args(devices)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn vmm");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Vm {
            child,
            lines,
            socket,
            started,
            _dir: dir,
        }
    }

    /// Waits for the serial line `end`; returns the time since the start
    /// and the guest's output up to it.
    fn wait_for(&mut self, end: &str) -> (Duration, String) {
        let mut out = String::new();
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let done = line == end;
                    out.push_str(&line);
                    out.push('\n');
                    if done {
                        return (self.started.elapsed(), out);
                    }
                }
                Err(_) => {
                    let _ = self.child.kill();
                    let mut err = String::new();
                    if let Some(mut e) = self.child.stderr.take() {
                        let _ = std::io::Read::read_to_string(&mut e, &mut err);
                    }
                    panic!("no {end:?} from the guest in time; output:\n{out}\nstderr:\n{err}");
                }
            }
        }
    }

    /// The status answer, then a stop.
    fn status_and_stop(&mut self) -> StatusReply {
        let mut c = Client::connect_retry(
            &self.socket,
            Duration::from_secs(10),
            Duration::from_secs(10),
        )
        .expect("control socket");
        let status = c.status().expect("status");
        c.stop().expect("stop");
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "the vmm did not stop");
            std::thread::sleep(Duration::from_millis(10));
        }
        status
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn disk(dir: &Path) -> PathBuf {
    let path = dir.join("disk.img");
    let mut bytes = vec![0u8; 64 * 512];
    bytes[..8].copy_from_slice(b"VMMDISK0");
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Bulk reads of the block guest: 1 KiB each.
const BULK: u64 = 48;

/// What the block guest moves, as (reads, read bytes, writes, write bytes,
/// flushes): sector 0, a write of sector 1 and its read back, a flush, a
/// get-id (not a read), then the bulk reads.
const BLOCK_GUEST: (u64, u64, u64, u64, u64) = (2 + BULK, 512 + 512 + BULK * 1024, 1, 512, 1);

fn block_guest_counters(limit: Option<&str>) -> (Duration, StatusReply) {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = disk(dir.path()).display().to_string();
    if let Some(l) = limit {
        spec.push(',');
        spec.push_str(l);
    }
    let cmdline = format!("console=ttyS0 bulk={BULK} hold=1");
    let mut vm = Vm::start("virtio_blk", &cmdline, &["--disk", &spec]);
    let (elapsed, out) = vm.wait_for("blk: end");
    assert!(out.contains(&format!("blk.bulk_done={BULK}")), "{out}");
    assert!(out.contains("blk.readback_matches=1"), "{out}");
    let status = vm.status_and_stop();
    assert_eq!(status.disks.len(), 1, "{status:?}");
    assert_eq!(status.net, None);
    let c = status.disks[0];
    let (reads, read_bytes, writes, write_bytes, flushes) = BLOCK_GUEST;
    assert_eq!(
        (c.reads, c.read_bytes, c.writes, c.write_bytes, c.flushes),
        (reads, read_bytes, writes, write_bytes, flushes),
        "{c:?}"
    );
    (elapsed, status)
}

#[test]
fn a_bandwidth_limited_disk_is_never_faster_than_its_limit_and_counts_what_it_moved() {
    // 16 KiB/s with a 16 KiB bucket: the guest's ~49.5 KiB cannot take less
    // than (49.5 - 16) / 16 s, however fast or loaded the host is.
    let rate = 16 * 1024u64;
    let (elapsed, status) = block_guest_counters(Some("bw=16K"));
    let c = status.disks[0];
    let moved = c.read_bytes + c.write_bytes;
    let floor = Duration::from_secs_f64((moved - rate) as f64 / rate as f64);
    assert!(
        elapsed >= floor,
        "{moved} bytes at {rate} B/s took {elapsed:?}, less than {floor:?}"
    );
    assert!(c.throttled >= 1, "{c:?}");
}

#[test]
fn an_iops_limited_disk_is_never_faster_than_its_limit() {
    // 20 requests per 100 ms (200/s) with a 20-request bucket; the guest
    // makes 2 + 1 + 1 + 1 + BULK requests (get-id counts too).
    let (elapsed, status) = block_guest_counters(Some("iops=20/100"));
    let requests = 5 + BULK;
    let floor = Duration::from_secs_f64((requests - 20) as f64 / 200.0);
    assert!(elapsed >= floor, "{requests} requests took {elapsed:?}");
    assert!(status.disks[0].throttled >= 1);
}

#[test]
fn an_unlimited_disk_counts_too() {
    let (_, status) = block_guest_counters(None);
    assert_eq!(status.disks[0].throttled, 0);
}

mod net {
    use super::*;

    use crate::common::tap::HostTap;

    /// The guest's frame: 14-byte Ethernet header and 64 bytes of payload.
    const FRAME: u64 = 78;
    /// Frames after the first one.
    const COUNT: u64 = 30;

    fn net_guest(tag: &str, limits: &str) -> Option<(Duration, StatusReply, (u64, u64))> {
        let name = format!("vrl{tag}{}", std::process::id() % 100_000);
        let tap = match HostTap::create(&name) {
            Ok(tap) => tap,
            Err(why) => {
                println!("SKIPPED net rate limit test: cannot create a tap ({why})");
                return None;
            }
        };
        let before = tap.received();
        let net = format!("{name},mac=02:11:22:33:44:55{limits}");
        let cmdline = format!("console=ttyS0 tx_count={COUNT} hold=1");
        let mut vm = Vm::start("virtio_net", &cmdline, &["--net", &net]);
        let (elapsed, out) = vm.wait_for("net: end");
        assert!(out.contains(&format!("net.tx_done={COUNT}")), "{out}");
        let status = vm.status_and_stop();
        let after = tap.received();
        let c = status.net.expect("a net device has counters");
        assert_eq!(
            (c.tx_packets, c.tx_bytes),
            (COUNT + 1, (COUNT + 1) * FRAME),
            "{c:?}"
        );
        // The host saw exactly that on the tap.
        assert_eq!(
            (after.0 - before.0, after.1 - before.1),
            (c.tx_packets, c.tx_bytes)
        );
        Some((elapsed, status, (c.tx_packets, c.tx_bytes)))
    }

    #[test]
    fn a_packet_limited_guest_nic_is_never_faster_than_its_limit() {
        // 10 frames per second with a 10-frame bucket: 31 frames take at
        // least 2.1 s.
        let Some((elapsed, status, (packets, _))) = net_guest("o", ",tx_ops=10") else {
            return;
        };
        let floor = Duration::from_secs_f64((packets - 10) as f64 / 10.0);
        assert!(elapsed >= floor, "{packets} frames took {elapsed:?}");
        assert!(status.net.unwrap().tx_throttled >= 1);
    }

    #[test]
    fn a_bandwidth_limited_guest_nic_is_never_faster_than_its_limit() {
        // 1000 bytes per second, bucket 1000: 31 x 78 bytes take at least 1.4 s.
        let Some((elapsed, _, (_, bytes))) = net_guest("b", ",tx_bw=1000") else {
            return;
        };
        let floor = Duration::from_secs_f64((bytes - 1000) as f64 / 1000.0);
        assert!(elapsed >= floor, "{bytes} bytes took {elapsed:?}");
    }

    #[test]
    fn an_unlimited_guest_nic_counts_too() {
        let Some((_, status, _)) = net_guest("u", "") else {
            return;
        };
        assert_eq!(status.net.unwrap().tx_throttled, 0);
    }
}
