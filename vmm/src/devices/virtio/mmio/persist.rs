//! Snapshot state of the virtio-mmio transport registers.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{lock, MmioTransport, SharedVirtioDevice, S_ACK, S_DRIVER, S_DRIVER_OK, S_FAILED};
use super::{S_FEATURES_OK, S_NEEDS_RESET};
use crate::devices::virtio::persist::VirtioPersistError;
use crate::devices::virtio::Interrupt;
use crate::memory::GuestMemoryMmap;
use crate::persist::Persist;

/// The transport's registers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmioState {
    /// Device status register.
    pub device_status: u32,
    /// DeviceFeaturesSel.
    pub device_features_sel: u32,
    /// DriverFeaturesSel.
    pub driver_features_sel: u32,
    /// QueueSel.
    pub queue_sel: u32,
    /// ConfigGeneration.
    pub config_generation: u32,
    /// InterruptStatus.
    pub interrupt_status: u32,
    /// Queues whose size was refused.
    pub size_refused: Vec<bool>,
}

/// What restoring a transport needs: the restored device, memory and interrupt.
pub struct MmioConstructorArgs {
    /// The device, already restored.
    pub device: SharedVirtioDevice,
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// The device's interrupt (the same one the device was restored with).
    pub interrupt: Arc<Interrupt>,
}

const KNOWN_STATUS: u32 = S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK | S_FAILED | S_NEEDS_RESET;

impl Persist for MmioTransport {
    type State = MmioState;
    type ConstructorArgs = MmioConstructorArgs;
    type Error = VirtioPersistError;

    fn save(&self) -> Result<MmioState, VirtioPersistError> {
        Ok(MmioState {
            device_status: self.device_status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            queue_sel: self.queue_sel,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt.status(),
            size_refused: self.size_refused.clone(),
        })
    }

    fn restore(args: MmioConstructorArgs, state: &MmioState) -> Result<Self, VirtioPersistError> {
        let bad = |m: &str| Err(VirtioPersistError::Transport(m.to_string()));
        if state.device_status & !KNOWN_STATUS != 0 {
            return bad("unknown device status bits");
        }
        let activated = lock(&args.device).is_activated();
        let driver_ok = state.device_status & S_DRIVER_OK != 0;
        if driver_ok != activated {
            return bad("DRIVER_OK does not match whether the device is running");
        }
        let mut t = MmioTransport::new(args.device, args.mem, args.interrupt);
        if state.size_refused.len() != t.size_refused.len() {
            return bad("refused-size list does not match the queue count");
        }
        if state.interrupt_status
            & !(super::super::VIRTIO_MMIO_INT_VRING | super::super::VIRTIO_MMIO_INT_CONFIG)
            != 0
        {
            return bad("unknown interrupt status bits");
        }
        t.device_status = state.device_status;
        t.device_features_sel = state.device_features_sel;
        t.driver_features_sel = state.driver_features_sel;
        t.queue_sel = state.queue_sel;
        t.size_refused.clone_from(&state.size_refused);
        // The device was restored first, on the same interrupt, and may have
        // raised something already (a disk grown since the snapshot raises a
        // configuration change): kept with the snapshot's pending bits, not
        // overwritten by them, and a changed configuration is a new
        // generation for the driver.
        let raised = t.interrupt.status() & !state.interrupt_status;
        t.interrupt.set_status(state.interrupt_status | raised);
        let config_changed = raised & super::super::VIRTIO_MMIO_INT_CONFIG != 0;
        t.config_generation = state
            .config_generation
            .wrapping_add(u32::from(config_changed));
        Ok(t)
    }
}
