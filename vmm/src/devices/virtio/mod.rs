//! virtio devices on the virtio-mmio transport (version 2): the transport in
//! `mmio`, one folder per device (`block`, `rng`, `net`, `vsock`, `fs`), each with
//! its `persist` module. Queues are split virtqueues from the virtio-queue
//! crate; device work runs on the event thread (`event_loop`), woken by the
//! queue eventfds that KVM signals when the guest writes QueueNotify.

pub mod block;
pub mod event_loop;
pub mod fs;
pub mod io_counters;
pub mod mmio;
pub mod net;
pub mod persist;
pub mod rate_limiter;
pub mod rng;
pub mod setup;
pub mod vsock;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_superio::Trigger;
use vmm_sys_util::eventfd::EventFd;

use crate::devices::irq::IrqLine;
use crate::memory::GuestMemoryMmap;

/// `VIRTIO_F_VERSION_1`: the modern (virtio 1.x) interface. Every device offers it
/// and the transport refuses a driver that does not accept it.
pub const VIRTIO_F_VERSION_1: u64 = 1 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;

/// `VIRTIO_F_RING_EVENT_IDX`: the driver and the device tell each other, through
/// `used_event` and `avail_event`, up to where they need no notification, so a
/// busy queue runs with few interrupts and few QueueNotify exits.
pub const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;

/// Interrupt status bit: a used ring was updated.
pub const VIRTIO_MMIO_INT_VRING: u32 = virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_VRING;
/// Interrupt status bit: the configuration changed.
pub const VIRTIO_MMIO_INT_CONFIG: u32 = virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_CONFIG;

/// Errors activating a device once the driver sets DRIVER_OK.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    /// A queue the device needs was not made ready by the driver.
    #[error("queue {0} is not ready or its rings are not inside guest memory")]
    QueueNotReady(usize),
    /// The device's backend refused to start.
    #[error("device backend failed to start: {0}")]
    Backend(String),
}

/// The interrupt of one virtio-mmio device: the InterruptStatus register and
/// the irqfd that raises its GSI.
#[derive(Debug)]
pub struct Interrupt {
    status: AtomicU32,
    irq: IrqLine,
}

impl Interrupt {
    /// Wraps the irq line of a device.
    pub fn new(irq: IrqLine) -> Self {
        Interrupt {
            status: AtomicU32::new(0),
            irq,
        }
    }

    /// The irq line, to register with KVM as an irqfd.
    pub fn irq(&self) -> &IrqLine {
        &self.irq
    }

    /// Tells the driver a used ring changed.
    pub fn signal_used_queue(&self) {
        self.signal(VIRTIO_MMIO_INT_VRING);
    }

    /// Tells the driver the configuration (or status) changed.
    pub fn signal_config(&self) {
        self.signal(VIRTIO_MMIO_INT_CONFIG);
    }

    fn signal(&self, bit: u32) {
        self.status.fetch_or(bit, Ordering::SeqCst);
        if let Err(e) = self.irq.trigger() {
            tracing::warn!(gsi = self.irq.gsi(), error = %e, "cannot raise the virtio interrupt");
        }
    }

    /// Raises the line again when InterruptStatus has bits the driver has
    /// not acknowledged. A restored VM's first run needs it: an interrupt
    /// raised just before the snapshot may still have been on its way
    /// through KVM's irqfd (injected from a work queue) when the interrupt
    /// controller's state was saved, and an edge lost there is never seen.
    /// Linux's handler reads the status, so a repeated edge costs nothing.
    pub fn resend_pending(&self) {
        if self.status() != 0 {
            if let Err(e) = self.irq.trigger() {
                tracing::warn!(gsi = self.irq.gsi(), error = %e, "cannot raise the virtio interrupt");
            }
        }
    }

    /// The InterruptStatus register.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// InterruptACK: clears the acknowledged bits.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// Sets the register to `value` (restore, reset).
    pub fn set_status(&self, value: u32) {
        self.status.store(value, Ordering::SeqCst);
    }
}

/// State every device has: features, queues, their notification eventfds and,
/// once activated, guest memory and the interrupt.
pub struct DeviceCommon {
    /// Features the device offers.
    pub avail_features: u64,
    /// Features the driver accepted.
    pub acked_features: u64,
    /// The queues, configured by the driver through the transport.
    pub queues: Vec<Queue>,
    /// One eventfd per queue, signalled on QueueNotify (by KVM's ioeventfd or by the transport).
    pub queue_evts: Vec<EventFd>,
    /// Guest memory, once activated.
    pub mem: Option<GuestMemoryMmap>,
    /// The interrupt, once activated.
    pub interrupt: Option<Arc<Interrupt>>,
}

impl DeviceCommon {
    /// Common state for a device with queues of the given maximum sizes.
    pub fn new(avail_features: u64, queue_max_sizes: &[u16]) -> std::io::Result<Self> {
        let mut queues = Vec::with_capacity(queue_max_sizes.len());
        let mut queue_evts = Vec::with_capacity(queue_max_sizes.len());
        for &max in queue_max_sizes {
            queues.push(Queue::new(max).map_err(|e| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
            })?);
            queue_evts.push(EventFd::new(libc::EFD_NONBLOCK)?);
        }
        Ok(DeviceCommon {
            avail_features: avail_features | VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX,
            acked_features: 0,
            queues,
            queue_evts,
            mem: None,
            interrupt: None,
        })
    }

    /// Checks every queue is ready and inside `mem`, then stores `mem` and `interrupt`.
    pub fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), ActivateError> {
        for (i, q) in self.queues.iter().enumerate() {
            if !q.ready() || !q.is_valid(&mem) {
                return Err(ActivateError::QueueNotReady(i));
            }
        }
        let event_idx = self.acked_features & VIRTIO_RING_F_EVENT_IDX != 0;
        for q in &mut self.queues {
            q.set_event_idx(event_idx);
        }
        self.mem = Some(mem);
        self.interrupt = Some(interrupt);
        Ok(())
    }

    /// Copies of the queue eventfds: writing one wakes the device's event
    /// thread exactly as the guest's QueueNotify does.
    pub fn queue_kickers(&self) -> std::io::Result<Vec<EventFd>> {
        self.queue_evts.iter().map(EventFd::try_clone).collect()
    }

    /// Back to the state before the driver touched the device.
    pub fn reset(&mut self) {
        self.acked_features = 0;
        for q in &mut self.queues {
            q.reset();
        }
        for evt in &self.queue_evts {
            let _ = evt.read();
        }
        self.mem = None;
        self.interrupt = None;
    }

    /// Registers every queue eventfd with the device's event loop; `device`
    /// names it in the error log.
    pub fn watch_queues(&self, ops: &mut event_manager::EventOps, device: &str) {
        for evt in &self.queue_evts {
            let events = event_manager::Events::new(evt, event_manager::EventSet::IN);
            if let Err(e) = ops.add(events) {
                tracing::error!(error = ?e, device, "cannot watch a virtio queue eventfd");
            }
        }
    }

    /// Raises the used-ring interrupt, when activated.
    pub fn signal_used(&self) {
        if let Some(irq) = &self.interrupt {
            irq.signal_used_queue();
        }
    }

    /// After returning buffers on queue `q`: raises the used-ring interrupt
    /// unless the driver (EVENT_IDX `used_event`) said it does not need one yet.
    pub fn signal_used_queue(&mut self, q: usize) {
        let needed = match (&self.mem, self.queues.get_mut(q)) {
            // A used_event that cannot be read counts as "interrupt".
            (Some(mem), Some(queue)) => queue.needs_notification(mem).unwrap_or(true),
            _ => true,
        };
        if needed {
            self.signal_used();
        }
    }

    /// Queue `q`'s available index as the driver last wrote it in guest
    /// memory (not the device's own position); `None` before activation or
    /// when the ring is outside memory.
    pub fn avail_idx(&self, q: usize) -> Option<u16> {
        use vm_memory::{Bytes, GuestAddress};
        let (mem, queue) = (self.mem.as_ref()?, self.queues.get(q)?);
        let at = queue.avail_ring().checked_add(2)?;
        mem.read_obj::<u16>(GuestAddress(at)).ok()
    }

    /// Asks the driver to notify queue `q` when it next adds a buffer, even
    /// though buffers are still available: with EVENT_IDX, `avail_event` is
    /// set to the driver's current `avail.idx`. (virtio-queue does this
    /// only for a queue it has emptied, so it is written here: the avail
    /// index at `avail_ring + 2`, `avail_event` after the used ring's
    /// `size` elements of 8 bytes and 4-byte header.) Without EVENT_IDX the
    /// driver notifies on every buffer anyway. Best effort: a queue whose
    /// rings are not in guest memory is left alone.
    pub fn notify_on_next_buffer(&mut self, q: usize) {
        let (Some(mem), Some(queue)) = (&self.mem, self.queues.get(q)) else {
            return;
        };
        if !queue.event_idx_enabled() {
            return;
        }
        use vm_memory::{Bytes, GuestAddress};
        let avail_idx = self.avail_idx(q);
        let avail_event_at = queue
            .used_ring()
            .checked_add(4 + 8 * u64::from(queue.size()));
        if let (Some(idx), Some(at)) = (avail_idx, avail_event_at) {
            std::sync::atomic::fence(Ordering::SeqCst);
            let _ = mem.write_obj(idx, GuestAddress(at));
        }
    }

    /// Puts back the chain last taken from queue `q` with [`Self::pop_chain`]:
    /// the next pop returns it again (a rate-limited device leaves it in the
    /// ring until it may serve it). Call at most once per pop.
    pub fn undo_pop(&mut self, q: usize) {
        if let Some(queue) = self.queues.get_mut(q) {
            virtio_queue::QueueOwnedT::go_to_previous_position(queue);
        }
    }

    /// Takes the next available chain of queue `q`. When the queue is empty it
    /// asks the driver to notify on the next buffer (EVENT_IDX: `avail_event`)
    /// and looks once more, so a buffer added in between is not missed.
    pub fn pop_chain<'m>(
        &mut self,
        q: usize,
        mem: &'m GuestMemoryMmap,
    ) -> Option<DescriptorChain<&'m GuestMemoryMmap>> {
        let queue = self.queues.get_mut(q)?;
        if let Some(chain) = queue.pop_descriptor_chain(mem) {
            return Some(chain);
        }
        match queue.enable_notification(mem) {
            Ok(true) => queue.pop_descriptor_chain(mem),
            _ => None,
        }
    }
}

/// A virtio device as the transport sees it.
pub trait VirtioDevice: Send {
    /// The virtio device ID (2 block, 1 net, 4 rng, 19 vsock).
    fn device_type(&self) -> u32;
    /// The common state.
    fn common(&self) -> &DeviceCommon;
    /// The common state, mutably.
    fn common_mut(&mut self) -> &mut DeviceCommon;
    /// Reads the device configuration space at `offset`; bytes past its end read as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes the device configuration space; ignored by default.
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        tracing::debug!(
            offset,
            len = data.len(),
            "write to read-only virtio config ignored"
        );
    }
    /// Starts the device once the driver set DRIVER_OK.
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), ActivateError> {
        self.common_mut().activate(mem, interrupt)
    }
    /// Stops the device and forgets the driver's configuration.
    fn reset(&mut self) {
        self.common_mut().reset();
    }
    /// Whether the device is running.
    fn is_activated(&self) -> bool {
        self.common().mem.is_some()
    }
}

/// Copies the part of `config` at `offset` into `data`, zero-filling past the end.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Ok(start) = usize::try_from(offset) else {
        return;
    };
    if start >= config.len() {
        return;
    }
    let end = config.len().min(start.saturating_add(data.len()));
    data[..end - start].copy_from_slice(&config[start..end]);
}

#[cfg(test)]
pub(crate) mod test_utils;

#[cfg(test)]
mod interrupt_tests {
    use super::*;

    #[test]
    fn a_pending_interrupt_is_raised_again_and_an_acknowledged_one_is_not() {
        let irq = crate::devices::virtio::test_utils::interrupt();
        irq.resend_pending();
        assert!(
            irq.irq().eventfd().read().is_err(),
            "nothing pending, nothing raised"
        );
        irq.set_status(VIRTIO_MMIO_INT_VRING);
        irq.resend_pending();
        assert_eq!(irq.irq().eventfd().read().unwrap(), 1);
        irq.ack(VIRTIO_MMIO_INT_VRING);
        irq.resend_pending();
        assert!(irq.irq().eventfd().read().is_err());
    }
}
