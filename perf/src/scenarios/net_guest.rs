//! What net-throughput and net-latency share: the net_perf test guest on a
//! tap, its frames, and the host side of its three modes, read and written
//! through a raw packet socket on the tap ([`crate::netns`]).
//!
//! Frames are Ethernet frames of type [`ETHERTYPE`]; byte 14 is the kind:
//! `G` go and `T` guest data (tx), `D` host data and `A` ack (rx), `P` ping
//! (echo). An ack carries the frames and bytes the guest counted, each a
//! little-endian u64 at bytes 16 and 24; a ping its sequence number at 16.
//! Sizes are Ethernet frame lengths, header included (no FCS, no
//! virtio-net header).

use std::time::{Duration, Instant};

use crate::backend::{Backend, BootSpec, NetDevice, Vm};
use crate::error::{PerfError, Result};
use crate::guests;
use crate::netns::{FrameSocket, Tap, ETHERTYPE};
use crate::runner::{Context, ScratchDir};

/// The tap's name inside the run's private network namespace.
pub const TAP: &str = "perf0";
/// The guest's MAC (locally administered).
pub const GUEST_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x07];
/// The source MAC of the frames perf sends.
pub const HOST_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0xfe];
/// Frame sizes measured: a full-size Ethernet frame and a small one.
pub const SIZES: [usize; 2] = [1514, 64];
/// Frames perf keeps sent but not yet acknowledged in rx mode: more than
/// the guest acknowledges at once (64), fewer than the tap queues (1000).
pub const WINDOW: u64 = 320;
/// Guest memory, MiB.
const MEM_MIB: u64 = 128;
/// What the guest prints once its rings are ready.
const READY: &str = "net_perf: ready";
/// Receive buffer: more than the largest frame, so a longer one shows.
const BUF: usize = 2048;

/// Kind byte: start sending (tx).
pub const GO: u8 = b'G';
/// Kind byte: guest data (tx).
pub const GUEST_DATA: u8 = b'T';
/// Kind byte: host data (rx).
pub const HOST_DATA: u8 = b'D';
/// Kind byte: the guest's acknowledgement of host data (rx).
pub const ACK: u8 = b'A';
/// Kind byte: a ping the echo guest sends back.
pub const PING: u8 = b'P';

/// A frame of `size` bytes to the guest, of kind `kind`, zero after the kind.
pub fn frame(kind: u8, size: usize) -> Vec<u8> {
    let mut f = vec![0u8; size.max(15)];
    f[..6].copy_from_slice(&GUEST_MAC);
    f[6..12].copy_from_slice(&HOST_MAC);
    f[12..14].copy_from_slice(&ETHERTYPE.to_be_bytes());
    f[14] = kind;
    f
}

/// The kind of a frame from the guest, or `None` when it is too short or
/// of another type.
pub fn kind(frame: &[u8]) -> Option<u8> {
    (frame.len() >= 15 && frame[12..14] == ETHERTYPE.to_be_bytes()).then(|| frame[14])
}

/// The little-endian u64 at `at` in `frame`, if the frame is long enough.
pub fn le64(frame: &[u8], at: usize) -> Option<u64> {
    let bytes = frame.get(at..at.checked_add(8)?)?;
    Some(u64::from_le_bytes(bytes.try_into().ok()?))
}

/// A net_perf guest running on the tap, with its scratch folder.
pub struct NetGuest {
    /// The VM.
    pub vm: Vm,
    _dir: ScratchDir,
}

impl NetGuest {
    /// Boots net_perf with `cmdline` under `backend`, its virtio-net on
    /// `tap`, and waits until it says its rings are ready.
    pub fn boot(ctx: &Context, backend: &dyn Backend, tap: &Tap, cmdline: String) -> Result<Self> {
        let dir = ctx.scratch()?;
        let spec = BootSpec {
            kernel: guests::path(guests::NET_PERF)?,
            cmdline,
            mem_mib: MEM_MIB,
            control: false,
            setup_timings: false,
            net: Some(NetDevice {
                tap: tap.name().into(),
                mac: GUEST_MAC,
            }),
        };
        let mut vm = backend.boot(&spec, dir.path(), ctx.timeout())?;
        let (_, end) = vm.process.wait_for(READY, 0, ctx.timeout())?;
        vm.process.wait_for("\n", end, ctx.timeout())?;
        Ok(NetGuest { vm, _dir: dir })
    }

    fn silent(&self, what: String) -> PerfError {
        PerfError::Net(format!(
            "{what}; {} stderr: {:?}; serial output: {:?}",
            self.vm.process.what(),
            self.vm.process.stderr_tail(),
            self.vm.process.output_tail()
        ))
    }
}

/// Frames and bytes moved in one run, and the time they took.
#[derive(Debug, Clone, Copy)]
pub struct Transfer {
    /// Frames.
    pub frames: u64,
    /// Bytes of those frames (Ethernet header included).
    pub bytes: u64,
    /// From the clock's start to its stop (see the callers).
    pub elapsed: Duration,
}

impl Transfer {
    /// Frames per second.
    pub fn frames_per_s(&self) -> f64 {
        self.frames as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// MiB per second.
    pub fn mib_per_s(&self) -> f64 {
        self.bytes as f64 / (1u64 << 20) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Guest -> host: sends the go frame to a guest booted with `mode=tx
/// count=N size=S` and receives its N frames. The clock starts right
/// before the go frame is sent and stops when the `recv` that returns the
/// N-th frame returns. Every frame must be of kind `T` and `size` bytes.
pub fn guest_to_host(
    guest: &NetGuest,
    sock: &FrameSocket,
    count: u64,
    size: usize,
    timeout: Duration,
) -> Result<Transfer> {
    sock.drain()?;
    let mut buf = vec![0u8; BUF];
    let start = Instant::now();
    sock.send(&frame(GO, 64))?;
    let (mut frames, mut bytes, mut last) = (0u64, 0u64, start);
    while frames < count {
        let Some(got) = sock.recv(&mut buf, timeout)? else {
            return Err(guest.silent(format!(
                "{frames} of {count} frames came from the guest, then none for {} s",
                timeout.as_secs()
            )));
        };
        let f = &buf[..got.len];
        if kind(f) != Some(GUEST_DATA) {
            continue;
        }
        if f.len() != size {
            return Err(guest.silent(format!(
                "the guest's frame {} arrived with {} bytes, not {size}",
                frames + 1,
                f.len()
            )));
        }
        frames += 1;
        bytes += f.len() as u64;
        last = got.at;
    }
    Ok(Transfer {
        frames,
        bytes,
        elapsed: last - start,
    })
}

/// Host -> guest: sends N frames of `size` bytes to a guest booted with
/// `mode=rx count=N`, never more than [`WINDOW`] ahead of its
/// acknowledgements. The clock starts right before the first frame is sent
/// and stops when the `recv` that returns the acknowledgement of the N-th
/// frame returns; the guest's byte count must match what was sent.
pub fn host_to_guest(
    guest: &NetGuest,
    sock: &FrameSocket,
    count: u64,
    size: usize,
    timeout: Duration,
) -> Result<Transfer> {
    sock.drain()?;
    let data = frame(HOST_DATA, size);
    let mut buf = vec![0u8; BUF];
    let (mut sent, mut acked) = (0u64, 0u64);
    let start = Instant::now();
    loop {
        while sent < count && sent - acked < WINDOW {
            sock.send(&data)?;
            sent += 1;
        }
        let Some(got) = sock.recv(&mut buf, timeout)? else {
            return Err(guest.silent(format!(
                "the guest acknowledged {acked} of the {sent} frames sent, then nothing for {} s",
                timeout.as_secs()
            )));
        };
        let f = &buf[..got.len];
        if kind(f) != Some(ACK) {
            continue;
        }
        let (Some(frames), Some(bytes)) = (le64(f, 16), le64(f, 24)) else {
            return Err(guest.silent(format!("a {}-byte ack is too short", f.len())));
        };
        if frames > sent {
            return Err(guest.silent(format!(
                "the guest acknowledged {frames} frames, but only {sent} were sent"
            )));
        }
        acked = acked.max(frames);
        if acked == count {
            let expected = count * size as u64;
            if bytes != expected {
                return Err(guest.silent(format!(
                    "the guest counted {bytes} bytes in {count} frames, not {expected}"
                )));
            }
            return Ok(Transfer {
                frames: count,
                bytes,
                elapsed: got.at - start,
            });
        }
    }
}

/// One round trip through a guest booted with `mode=echo`: a ping of
/// `size` bytes carrying `seq`, from right before it is sent to the return
/// of the `recv` that brings it back (same size, same sequence number).
pub fn round_trip(
    guest: &NetGuest,
    sock: &FrameSocket,
    seq: u64,
    size: usize,
    timeout: Duration,
) -> Result<Duration> {
    let mut ping = frame(PING, size);
    ping[16..24].copy_from_slice(&seq.to_le_bytes());
    let mut buf = vec![0u8; BUF];
    let start = Instant::now();
    sock.send(&ping)?;
    let deadline = start + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(got) = sock.recv(&mut buf, left)? else {
            return Err(guest.silent(format!(
                "ping {seq} ({size} bytes) did not come back within {} s",
                timeout.as_secs()
            )));
        };
        let f = &buf[..got.len];
        if kind(f) == Some(PING) && le64(f, 16) == Some(seq) {
            if f.len() != size {
                return Err(guest.silent(format!(
                    "ping {seq} went out with {size} bytes and came back with {}",
                    f.len()
                )));
            }
            return Ok(got.at - start);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_carry_the_type_the_kind_and_the_macs() {
        let f = frame(PING, 64);
        assert_eq!(f.len(), 64);
        assert_eq!(&f[..6], &GUEST_MAC);
        assert_eq!(&f[6..12], &HOST_MAC);
        assert_eq!(kind(&f), Some(PING));
        assert_eq!(kind(&f[..14]), None);
        let mut other = f.clone();
        other[12] = 0x08;
        assert_eq!(kind(&other), None);
        let mut ack = frame(ACK, 64);
        ack[16..24].copy_from_slice(&7u64.to_le_bytes());
        assert_eq!(le64(&ack, 16), Some(7));
        assert_eq!(le64(&ack, 60), None);
        assert_eq!(le64(&ack, usize::MAX), None);
    }

    #[test]
    fn rates_divide_by_the_elapsed_time() {
        let t = Transfer {
            frames: 1000,
            bytes: 1 << 20,
            elapsed: Duration::from_millis(500),
        };
        assert!((t.frames_per_s() - 2000.0).abs() < 1e-6);
        assert!((t.mib_per_s() - 2.0).abs() < 1e-9);
    }
}
