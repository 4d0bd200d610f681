//! Per-device I/O counters, written by the device on the event thread and
//! read by the control socket's `status` on another thread: plain atomics,
//! each counter on its own (a reader may see one updated before another).

use std::sync::atomic::{AtomicU64, Ordering};

use vmm_api::protocol::{BlkCounters, NetCounters};

/// Adds `n` to a counter.
pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

fn get(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

/// A virtio-net device's counters (see [`NetCounters`] for their meaning).
#[derive(Debug, Default)]
pub struct NetIoCounters {
    /// Frame bytes delivered to the guest.
    pub rx_bytes: AtomicU64,
    /// Frames delivered to the guest.
    pub rx_packets: AtomicU64,
    /// Frame bytes written to the tap.
    pub tx_bytes: AtomicU64,
    /// Frames written to the tap.
    pub tx_packets: AtomicU64,
    /// Times the receive limiter held a frame back.
    pub rx_throttled: AtomicU64,
    /// Times the transmit limiter held a frame back.
    pub tx_throttled: AtomicU64,
}

impl NetIoCounters {
    /// The current values.
    pub fn read(&self) -> NetCounters {
        NetCounters {
            rx_bytes: get(&self.rx_bytes),
            rx_packets: get(&self.rx_packets),
            tx_bytes: get(&self.tx_bytes),
            tx_packets: get(&self.tx_packets),
            rx_throttled: get(&self.rx_throttled),
            tx_throttled: get(&self.tx_throttled),
        }
    }
}

/// A virtio-blk device's counters (see [`BlkCounters`] for their meaning).
#[derive(Debug, Default)]
pub struct BlkIoCounters {
    /// Bytes read into guest memory.
    pub read_bytes: AtomicU64,
    /// Bytes written to the disk.
    pub write_bytes: AtomicU64,
    /// Successful read requests.
    pub reads: AtomicU64,
    /// Successful write requests.
    pub writes: AtomicU64,
    /// Successful flush requests.
    pub flushes: AtomicU64,
    /// Times the limiter held a request back.
    pub throttled: AtomicU64,
}

impl BlkIoCounters {
    /// The current values.
    pub fn read(&self) -> BlkCounters {
        BlkCounters {
            read_bytes: get(&self.read_bytes),
            write_bytes: get(&self.write_bytes),
            reads: get(&self.reads),
            writes: get(&self.writes),
            flushes: get(&self.flushes),
            throttled: get(&self.throttled),
        }
    }
}
