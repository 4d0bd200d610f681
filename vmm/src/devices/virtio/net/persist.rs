//! Snapshot state of a virtio-net device. A frame waiting in the host-side
//! buffer is not saved: networks drop frames, and the guest's stack retries.
//! Rate limits and counters are not device state either: limits come from
//! the restore's own `--net` option, counters start again from zero.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vmm_api::rate_limit::NetLimits;

use super::Net;
use crate::devices::virtio::persist::{CommonState, VirtioPersistError};
use crate::devices::virtio::{Interrupt, VirtioDevice};
use crate::memory::GuestMemoryMmap;
use crate::persist::Persist;

/// What a virtio-net device saves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    /// Features and queues.
    pub common: CommonState,
    /// The MAC offered to the guest.
    pub mac: Option<[u8; 6]>,
}

/// What restoring a virtio-net device needs.
pub struct NetConstructorArgs {
    /// The tap to attach to.
    pub tap: String,
    /// Rate limits (the restore's, not the snapshotted VM's).
    pub limits: NetLimits,
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// The device's interrupt.
    pub interrupt: Arc<Interrupt>,
}

impl Persist for Net {
    type State = NetState;
    type ConstructorArgs = NetConstructorArgs;
    type Error = VirtioPersistError;

    fn save(&self) -> Result<NetState, VirtioPersistError> {
        Ok(NetState {
            common: self.common.save_state(),
            mac: self.mac,
        })
    }

    fn restore(args: NetConstructorArgs, state: &NetState) -> Result<Self, VirtioPersistError> {
        // The MAC is part of the guest's view of the device, so it comes from the snapshot.
        let mut net = Net::new(&args.tap, state.mac)
            .map_err(|e| VirtioPersistError::Mismatch(e.to_string()))?;
        net.set_limits(&args.limits)
            .map_err(|e| VirtioPersistError::Mismatch(e.to_string()))?;
        net.common.restore_state(&state.common, &args.mem)?;
        if state.common.activated {
            net.activate(args.mem, args.interrupt)?;
        }
        Ok(net)
    }
}
