//! virtio-net on a tap interface: the transmit queue writes guest frames to
//! the tap, frames read from the tap fill the guest's receive buffers. One
//! frame at most waits on the host side while the guest has no receive
//! buffer; the rest stay in the tap's own (bounded) kernel queue.
//!
//! Each direction may be rate limited (bytes and frames, see
//! [`super::rate_limiter`]); bytes are counted without the virtio-net header.
//! A transmit frame the limiter refuses stays in the guest's ring (the pop
//! is undone) until the limiter's timer fires; a received frame it refuses
//! stays the one pending frame, and the tap is not read until then.

pub mod persist;
pub mod tap;

use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_net::VIRTIO_NET_F_MAC;
use virtio_queue::{DescriptorChain, QueueT, Reader, Writer};
use vmm_api::rate_limit::NetLimits;

use super::io_counters::{add, NetIoCounters};
use super::rate_limiter::RateLimiter;
use super::{read_config_bytes, ActivateError, DeviceCommon, Interrupt, VirtioDevice};
use crate::memory::GuestMemoryMmap;
use tap::{Tap, TapError, VNET_HDR_LEN};

/// Receive queue index.
pub const RX_QUEUE: usize = 0;
/// Transmit queue index.
pub const TX_QUEUE: usize = 1;
/// Queue size offered for both queues.
pub const QUEUE_SIZE: u16 = 256;
/// Largest frame accepted, header included: 64 KiB of payload, an Ethernet
/// header and the virtio-net header.
pub const MAX_FRAME: usize = 65535 + 14 + VNET_HDR_LEN;

/// Errors creating the device.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The tap could not be opened.
    #[error(transparent)]
    Tap(#[from] TapError),
    /// An eventfd could not be created.
    #[error("cannot create the virtio-net queue eventfds: {0}")]
    Eventfd(#[source] io::Error),
    /// A rate limiter's timerfd could not be created.
    #[error("cannot create the virtio-net rate limiter timer (timerfd): {0}")]
    Timer(#[source] io::Error),
}

/// The virtio-net device.
pub struct Net {
    common: DeviceCommon,
    tap: Tap,
    mac: Option<[u8; 6]>,
    tx_buf: Vec<u8>,
    rx_buf: Vec<u8>,
    /// Length of the frame in `rx_buf` waiting for a guest buffer.
    rx_pending: Option<usize>,
    /// Counters, for tests and logs.
    stats: NetStats,
    /// Limits frames to the guest.
    rx_limiter: RateLimiter,
    /// Limits frames from the guest.
    tx_limiter: RateLimiter,
    /// Bytes and frames moved, for the control socket.
    counters: Arc<NetIoCounters>,
}

/// Frame counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NetStats {
    /// Frames sent to the tap.
    pub tx_frames: u64,
    /// Guest frames dropped (malformed, oversized, tap full).
    pub tx_dropped: u64,
    /// Frames delivered to the guest.
    pub rx_frames: u64,
    /// Host frames dropped (guest buffer too small).
    pub rx_dropped: u64,
}

impl Net {
    /// Opens (or creates) tap `tap_name`; `mac` is offered to the guest when given.
    pub fn new(tap_name: &str, mac: Option<[u8; 6]>) -> Result<Net, NetError> {
        Net::with_tap(Tap::open(tap_name)?, mac)
    }

    /// A device on an already open tap (or tap-like endpoint, see [`Tap::from_file`]).
    pub fn with_tap(tap: Tap, mac: Option<[u8; 6]>) -> Result<Net, NetError> {
        let features = if mac.is_some() {
            1u64 << VIRTIO_NET_F_MAC
        } else {
            0
        };
        Ok(Net {
            common: DeviceCommon::new(features, &[QUEUE_SIZE, QUEUE_SIZE])
                .map_err(NetError::Eventfd)?,
            tap,
            mac,
            tx_buf: vec![0; MAX_FRAME],
            rx_buf: vec![0; MAX_FRAME],
            rx_pending: None,
            stats: NetStats::default(),
            rx_limiter: RateLimiter::unlimited(),
            tx_limiter: RateLimiter::unlimited(),
            counters: Arc::default(),
        })
    }

    /// Sets the receive and transmit limits (full buckets from now).
    pub fn set_limits(&mut self, limits: &NetLimits) -> Result<(), NetError> {
        let now = Instant::now();
        self.rx_limiter = RateLimiter::new(&limits.rx, now).map_err(NetError::Timer)?;
        self.tx_limiter = RateLimiter::new(&limits.tx, now).map_err(NetError::Timer)?;
        Ok(())
    }

    /// Frame counters.
    pub fn stats(&self) -> NetStats {
        self.stats
    }

    /// The byte and frame counters, shared with whoever reports them.
    pub fn io_counters(&self) -> Arc<NetIoCounters> {
        self.counters.clone()
    }

    /// Asks the transmit limiter for a guest frame; `false` (the frame must
    /// wait) undoes the pop. A chain too broken to read is not charged: it
    /// is dropped without reaching the tap.
    fn admit_tx(
        &mut self,
        mem: &GuestMemoryMmap,
        chain: &DescriptorChain<&GuestMemoryMmap>,
    ) -> bool {
        if self.tx_limiter.is_unlimited() {
            return true;
        }
        let len = match Reader::new(mem, chain.clone()) {
            Ok(r) => r.available_bytes(),
            Err(_) => return true,
        };
        if !(VNET_HDR_LEN..=MAX_FRAME).contains(&len) {
            return true;
        }
        let bytes = (len - VNET_HDR_LEN) as u64;
        if self.tx_limiter.consume(1, bytes, Instant::now()) {
            return true;
        }
        self.common.undo_pop(TX_QUEUE);
        add(&self.counters.tx_throttled, 1);
        false
    }

    /// Sends every frame the guest queued for transmission.
    pub fn process_tx(&mut self) -> usize {
        let Some(mem) = self.common.mem.clone() else {
            return 0;
        };
        let mut done = 0;
        while !self.tx_limiter.is_blocked() {
            let Some(chain) = self.common.pop_chain(TX_QUEUE, &mem) else {
                break;
            };
            if !self.admit_tx(&mem, &chain) {
                break;
            }
            let head = chain.head_index();
            self.send_frame(&mem, chain);
            if let Err(e) = self.common.queues[TX_QUEUE].add_used(&mem, head, 0) {
                tracing::warn!(error = %e, "virtio-net cannot return a tx buffer");
                break;
            }
            done += 1;
        }
        if done > 0 {
            self.common.signal_used_queue(TX_QUEUE);
        }
        done
    }

    fn send_frame(
        &mut self,
        mem: &GuestMemoryMmap,
        chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>,
    ) {
        let mut reader = match Reader::new(mem, chain) {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, "virtio-net tx with bad buffers dropped");
                self.stats.tx_dropped += 1;
                return;
            }
        };
        let len = reader.available_bytes();
        if !(VNET_HDR_LEN..=MAX_FRAME).contains(&len) {
            tracing::debug!(len, "virtio-net tx frame of invalid size dropped");
            self.stats.tx_dropped += 1;
            return;
        }
        if reader.read_exact(&mut self.tx_buf[..len]).is_err() {
            self.stats.tx_dropped += 1;
            return;
        }
        match self.tap.write_frame(&self.tx_buf[..len]) {
            Ok(_) => {
                self.stats.tx_frames += 1;
                add(&self.counters.tx_packets, 1);
                add(&self.counters.tx_bytes, (len - VNET_HDR_LEN) as u64);
            }
            Err(e) => {
                tracing::debug!(error = %e, tap = self.tap.name(), "tap write failed: frame dropped");
                self.stats.tx_dropped += 1;
            }
        }
    }

    /// Moves frames from the tap into guest receive buffers until either runs out.
    pub fn process_rx(&mut self) -> usize {
        let Some(mem) = self.common.mem.clone() else {
            return 0;
        };
        let mut done = 0;
        // A frame the limiter refused waits, and the tap is not read, until its timer fires.
        while !self.rx_limiter.is_blocked() {
            let len = match self.rx_pending {
                Some(len) => len,
                None => match self.tap.read_frame(&mut self.rx_buf) {
                    Ok(n) if n >= VNET_HDR_LEN => n,
                    Ok(_) => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        tracing::warn!(error = %e, tap = self.tap.name(), "tap read failed");
                        break;
                    }
                },
            };
            self.rx_pending = Some(len);
            let Some(chain) = self.common.pop_chain(RX_QUEUE, &mem) else {
                // No guest buffer: keep this one frame, the tap keeps the rest.
                break;
            };
            if !self.rx_limiter.is_unlimited()
                && !self
                    .rx_limiter
                    .consume(1, (len - VNET_HDR_LEN) as u64, Instant::now())
            {
                self.common.undo_pop(RX_QUEUE);
                add(&self.counters.rx_throttled, 1);
                break;
            }
            let head = chain.head_index();
            self.rx_pending = None;
            // virtio_net_hdr_v1.num_buffers: one buffer per frame (no MRG_RXBUF).
            self.rx_buf[10..12].copy_from_slice(&1u16.to_le_bytes());
            let used = match Writer::new(&mem, chain) {
                Ok(mut w) if w.available_bytes() >= len => match w.write_all(&self.rx_buf[..len]) {
                    Ok(()) => {
                        self.stats.rx_frames += 1;
                        add(&self.counters.rx_packets, 1);
                        add(&self.counters.rx_bytes, (len - VNET_HDR_LEN) as u64);
                        len as u32
                    }
                    Err(_) => 0,
                },
                _ => {
                    tracing::debug!(
                        len,
                        "virtio-net rx buffer missing or too small: frame dropped"
                    );
                    self.stats.rx_dropped += 1;
                    0
                }
            };
            if let Err(e) = self.common.queues[RX_QUEUE].add_used(&mem, head, used) {
                tracing::warn!(error = %e, "virtio-net cannot return an rx buffer");
                break;
            }
            done += 1;
        }
        if done > 0 {
            self.common.signal_used_queue(RX_QUEUE);
        }
        done
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }
    fn common(&self) -> &DeviceCommon {
        &self.common
    }
    fn common_mut(&mut self) -> &mut DeviceCommon {
        &mut self.common
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_net_config starts with `u8 mac[6]`.
        read_config_bytes(&self.mac.unwrap_or_default(), offset, data);
    }
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: std::sync::Arc<Interrupt>,
    ) -> Result<(), ActivateError> {
        self.common.activate(mem, interrupt)?;
        self.process_tx();
        self.process_rx();
        Ok(())
    }
    fn reset(&mut self) {
        self.common.reset();
        self.rx_pending = None;
        self.rx_limiter.unblock();
        self.tx_limiter.unblock();
    }
}

impl MutEventSubscriber for Net {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.tap.as_raw_fd() {
            self.process_rx();
        } else if fd == self.common.queue_evts[RX_QUEUE].as_raw_fd() {
            let _ = self.common.queue_evts[RX_QUEUE].read();
            self.process_rx();
        } else if fd == self.common.queue_evts[TX_QUEUE].as_raw_fd() {
            let _ = self.common.queue_evts[TX_QUEUE].read();
            self.process_tx();
        } else if self.rx_limiter.owns_fd(fd) {
            self.rx_limiter.timer_fired();
            self.process_rx();
        } else if self.tx_limiter.owns_fd(fd) {
            self.tx_limiter.timer_fired();
            self.process_tx();
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        self.common.watch_queues(ops, "virtio-net");
        if let Err(e) = ops.add(Events::new(
            &self.tap,
            EventSet::IN | EventSet::EDGE_TRIGGERED,
        )) {
            tracing::error!(error = ?e, "cannot watch the tap");
        }
        for timer in [self.rx_limiter.timer_fd(), self.tx_limiter.timer_fd()]
            .into_iter()
            .flatten()
        {
            if let Err(e) = ops.add(Events::new(timer, EventSet::IN)) {
                tracing::error!(error = ?e, "cannot watch a virtio-net rate limiter timer");
            }
        }
    }
}

#[cfg(test)]
mod tests;
