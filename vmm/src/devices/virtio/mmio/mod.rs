//! The virtio-mmio transport, version 2 (virtio 1.x "modern"): the register
//! file a driver uses to find a device, negotiate features, configure queues
//! and drive the device status machine.

pub mod persist;

use std::sync::{Arc, Mutex, MutexGuard};

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
};
use virtio_queue::QueueT;

use super::{Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::devices::bus::BusDevice;
use crate::memory::GuestMemoryMmap;

/// Size of one device's register window.
pub const MMIO_WINDOW: u64 = 0x1000;
/// "virt" in little endian.
pub const MMIO_MAGIC: u32 = 0x7472_6976;
/// The modern transport version.
pub const MMIO_VERSION: u32 = 2;
/// Vendor ID reported to the driver ("VMMR").
pub const VENDOR_ID: u32 = 0x524d_4d56;
/// Offset of QueueNotify, where KVM ioeventfds are registered.
pub const QUEUE_NOTIFY_OFFSET: u64 = 0x50;
/// Offset of the device configuration space.
pub const CONFIG_OFFSET: u64 = 0x100;

const MAGIC: u64 = 0x00;
const VERSION: u64 = 0x04;
const DEVICE_ID: u64 = 0x08;
const VENDOR: u64 = 0x0c;
const DEVICE_FEATURES: u64 = 0x10;
const DEVICE_FEATURES_SEL: u64 = 0x14;
const DRIVER_FEATURES: u64 = 0x20;
const DRIVER_FEATURES_SEL: u64 = 0x24;
const QUEUE_SEL: u64 = 0x30;
const QUEUE_NUM_MAX: u64 = 0x34;
const QUEUE_NUM: u64 = 0x38;
const QUEUE_READY: u64 = 0x44;
const INTERRUPT_STATUS: u64 = 0x60;
const INTERRUPT_ACK: u64 = 0x64;
const STATUS: u64 = 0x70;
const QUEUE_DESC_LOW: u64 = 0x80;
const QUEUE_DESC_HIGH: u64 = 0x84;
const QUEUE_DRIVER_LOW: u64 = 0x90;
const QUEUE_DRIVER_HIGH: u64 = 0x94;
const QUEUE_DEVICE_LOW: u64 = 0xa0;
const QUEUE_DEVICE_HIGH: u64 = 0xa4;
const SHM_LEN_LOW: u64 = 0xb0;
const SHM_LEN_HIGH: u64 = 0xb4;
const SHM_BASE_LOW: u64 = 0xb8;
const SHM_BASE_HIGH: u64 = 0xbc;
const CONFIG_GENERATION: u64 = 0xfc;
/// What SHMLen and SHMBase read as for a region that does not exist (every
/// region: no device here has shared memory). Not 0: Linux's virtio-fs
/// driver, built with DAX, takes a zero length at address 0 for a region,
/// fails to reserve it and gives up on the device.
pub const SHM_ABSENT: u32 = 0xffff_ffff;

const S_ACK: u32 = VIRTIO_CONFIG_S_ACKNOWLEDGE;
const S_DRIVER: u32 = VIRTIO_CONFIG_S_DRIVER;
const S_FEATURES_OK: u32 = VIRTIO_CONFIG_S_FEATURES_OK;
const S_DRIVER_OK: u32 = VIRTIO_CONFIG_S_DRIVER_OK;
const S_FAILED: u32 = VIRTIO_CONFIG_S_FAILED;
const S_NEEDS_RESET: u32 = VIRTIO_CONFIG_S_NEEDS_RESET;

/// A shared virtio device.
pub type SharedVirtioDevice = Arc<Mutex<dyn VirtioDevice>>;

/// One virtio-mmio device window on the MMIO bus.
pub struct MmioTransport {
    device: SharedVirtioDevice,
    mem: GuestMemoryMmap,
    interrupt: Arc<Interrupt>,
    device_status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    queue_sel: u32,
    config_generation: u32,
    /// Queues whose last QueueNum write was refused (not a power of two, zero or
    /// above the maximum): they cannot be made ready until a valid size is written.
    size_refused: Vec<bool>,
}

fn lock(dev: &SharedVirtioDevice) -> MutexGuard<'_, dyn VirtioDevice + 'static> {
    dev.lock().unwrap_or_else(|p| p.into_inner())
}

impl MmioTransport {
    /// A transport for `device`, raising `interrupt`, with access to `mem` for activation.
    pub fn new(
        device: SharedVirtioDevice,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
    ) -> Self {
        let queues = lock(&device).common().queues.len();
        MmioTransport {
            device,
            mem,
            interrupt,
            device_status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            queue_sel: 0,
            config_generation: 0,
            size_refused: vec![false; queues],
        }
    }

    /// The device behind this transport.
    pub fn device(&self) -> &SharedVirtioDevice {
        &self.device
    }

    /// The interrupt of this device.
    pub fn interrupt(&self) -> &Arc<Interrupt> {
        &self.interrupt
    }

    /// The device status register.
    pub fn device_status(&self) -> u32 {
        self.device_status
    }

    fn has(&self, bits: u32) -> bool {
        self.device_status & bits == bits
    }

    /// Queue registers may be written after FEATURES_OK and before DRIVER_OK.
    fn queue_config_allowed(&self) -> bool {
        self.has(S_ACK | S_DRIVER | S_FEATURES_OK) && !self.has(S_DRIVER_OK) && !self.failed()
    }

    fn failed(&self) -> bool {
        self.device_status & (S_FAILED | S_NEEDS_RESET) != 0
    }

    fn reset(&mut self) {
        lock(&self.device).reset();
        self.device_status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.queue_sel = 0;
        self.interrupt.set_status(0);
        self.size_refused.fill(false);
    }

    fn set_status(&mut self, new: u32) {
        if new == 0 {
            self.reset();
            return;
        }
        let old = self.device_status;
        // Bits may only be added, and FAILED may be set at any time.
        if new & old != old {
            tracing::debug!(old, new, "virtio status write clears bits: ignored");
            return;
        }
        let added = new & !old;
        if added & S_FAILED != 0 {
            self.device_status |= S_FAILED;
            return;
        }
        let allowed = match added {
            S_ACK => old == 0,
            S_DRIVER => old == S_ACK,
            S_FEATURES_OK => old == S_ACK | S_DRIVER,
            S_DRIVER_OK => old == S_ACK | S_DRIVER | S_FEATURES_OK,
            _ => false,
        };
        if !allowed {
            tracing::debug!(old, new, "virtio status transition out of order: ignored");
            return;
        }
        match added {
            S_FEATURES_OK => {
                let dev = lock(&self.device);
                let acked = dev.common().acked_features;
                if acked & VIRTIO_F_VERSION_1 == 0 {
                    tracing::debug!("virtio driver did not accept VERSION_1: FEATURES_OK refused");
                    return;
                }
                drop(dev);
                self.device_status = new;
            }
            S_DRIVER_OK => {
                let mut dev = lock(&self.device);
                match dev.activate(self.mem.clone(), self.interrupt.clone()) {
                    Ok(()) => {
                        drop(dev);
                        self.device_status = new;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "virtio device activation failed");
                        drop(dev);
                        self.device_status |= S_NEEDS_RESET;
                        self.interrupt.signal_config();
                    }
                }
            }
            _ => self.device_status = new,
        }
    }

    fn read_reg(&self, offset: u64) -> u32 {
        let dev = lock(&self.device);
        let common = dev.common();
        let queue = common.queues.get(self.queue_sel as usize);
        match offset {
            MAGIC => MMIO_MAGIC,
            VERSION => MMIO_VERSION,
            DEVICE_ID => dev.device_type(),
            VENDOR => VENDOR_ID,
            DEVICE_FEATURES => match self.device_features_sel {
                0 => common.avail_features as u32,
                1 => (common.avail_features >> 32) as u32,
                _ => 0,
            },
            QUEUE_NUM_MAX => queue.map_or(0, |q| u32::from(q.max_size())),
            QUEUE_READY => queue.map_or(0, |q| u32::from(q.ready())),
            INTERRUPT_STATUS => self.interrupt.status(),
            STATUS => self.device_status,
            CONFIG_GENERATION => self.config_generation,
            SHM_LEN_LOW | SHM_LEN_HIGH | SHM_BASE_LOW | SHM_BASE_HIGH => SHM_ABSENT,
            _ => {
                tracing::debug!(offset, "read of unknown or write-only virtio-mmio register");
                0
            }
        }
    }

    fn write_reg(&mut self, offset: u64, value: u32) {
        match offset {
            DEVICE_FEATURES_SEL => self.device_features_sel = value,
            DRIVER_FEATURES_SEL => self.driver_features_sel = value,
            DRIVER_FEATURES => {
                if !self.has(S_ACK | S_DRIVER) || self.has(S_FEATURES_OK) || self.failed() {
                    tracing::debug!("virtio driver features written outside negotiation: ignored");
                    return;
                }
                let mut dev = lock(&self.device);
                let common = dev.common_mut();
                let shift = match self.driver_features_sel {
                    0 => 0,
                    1 => 32,
                    _ => return,
                };
                let mask = 0xffff_ffffu64 << shift;
                // Features the device did not offer are dropped.
                let wanted = (u64::from(value) << shift) & common.avail_features;
                common.acked_features = (common.acked_features & !mask) | wanted;
            }
            QUEUE_SEL => self.queue_sel = value,
            INTERRUPT_ACK => self.interrupt.ack(value),
            STATUS => self.set_status(value),
            QUEUE_NUM | QUEUE_READY | QUEUE_DESC_LOW | QUEUE_DESC_HIGH | QUEUE_DRIVER_LOW
            | QUEUE_DRIVER_HIGH | QUEUE_DEVICE_LOW | QUEUE_DEVICE_HIGH => {
                self.write_queue_reg(offset, value)
            }
            QUEUE_NOTIFY_OFFSET => {
                // Reached only when KVM did not take the write through the ioeventfd.
                tracing::debug!(queue = value, "QueueNotify handled in userspace");
                let dev = lock(&self.device);
                if let Some(evt) = dev.common().queue_evts.get(value as usize) {
                    if let Err(e) = evt.write(1) {
                        tracing::warn!(error = %e, "cannot signal a virtio queue event");
                    }
                }
            }
            _ => tracing::debug!(
                offset,
                value,
                "write to unknown or read-only virtio-mmio register"
            ),
        }
    }

    fn write_queue_reg(&mut self, offset: u64, value: u32) {
        if !self.queue_config_allowed() {
            tracing::debug!(
                offset,
                "virtio queue register written outside setup: ignored"
            );
            return;
        }
        let sel = self.queue_sel as usize;
        let mut dev = lock(&self.device);
        let Some(q) = dev.common_mut().queues.get_mut(sel) else {
            tracing::debug!(
                sel,
                "virtio queue register written for a queue that does not exist"
            );
            return;
        };
        if offset != QUEUE_READY && q.ready() {
            tracing::debug!(sel, "virtio queue reconfigured while ready: ignored");
            return;
        }
        match offset {
            QUEUE_NUM => {
                let valid = u16::try_from(value)
                    .ok()
                    .filter(|&n| n != 0 && n.is_power_of_two() && n <= q.max_size());
                match valid {
                    Some(n) => {
                        q.set_size(n);
                        self.size_refused[sel] = false;
                    }
                    None => {
                        tracing::debug!(sel, value, "virtio queue size refused");
                        self.size_refused[sel] = true;
                    }
                }
            }
            QUEUE_READY => {
                let ready = value == 1 && !self.size_refused[sel];
                q.set_ready(ready);
            }
            QUEUE_DESC_LOW => q.set_desc_table_address(Some(value), None),
            QUEUE_DESC_HIGH => q.set_desc_table_address(None, Some(value)),
            QUEUE_DRIVER_LOW => q.set_avail_ring_address(Some(value), None),
            QUEUE_DRIVER_HIGH => q.set_avail_ring_address(None, Some(value)),
            QUEUE_DEVICE_LOW => q.set_used_ring_address(Some(value), None),
            QUEUE_DEVICE_HIGH => q.set_used_ring_address(None, Some(value)),
            _ => {}
        }
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_OFFSET {
            lock(&self.device).read_config(offset - CONFIG_OFFSET, data);
            return;
        }
        if data.len() != 4 || offset % 4 != 0 {
            tracing::debug!(
                offset,
                len = data.len(),
                "unaligned virtio-mmio register read"
            );
            data.fill(0);
            return;
        }
        data.copy_from_slice(&self.read_reg(offset).to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_OFFSET {
            if self.has(S_DRIVER) && !self.failed() {
                lock(&self.device).write_config(offset - CONFIG_OFFSET, data);
                self.config_generation = self.config_generation.wrapping_add(1);
            }
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            tracing::debug!(
                offset,
                len = data.len(),
                "non 32-bit virtio-mmio register write"
            );
            return;
        };
        if offset % 4 != 0 {
            return;
        }
        self.write_reg(offset, u32::from_le_bytes(bytes));
    }
}

#[cfg(test)]
mod tests;
