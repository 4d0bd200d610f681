//! Snapshot state of a virtio-vsock device. Connections are not saved: their
//! host sockets belong to the old process. After a restore the device sends
//! the transport-reset event, so the guest drops its connections (its
//! listeners stay) and host processes reconnect through the Unix socket.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::Vsock;
use crate::devices::virtio::persist::{CommonState, VirtioPersistError};
use crate::devices::virtio::{Interrupt, VirtioDevice};
use crate::memory::GuestMemoryMmap;
use crate::persist::Persist;

/// What a virtio-vsock device saves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    /// Features and queues.
    pub common: CommonState,
    /// The guest's CID.
    pub cid: u64,
}

/// What restoring a virtio-vsock device needs.
pub struct VsockConstructorArgs {
    /// The guest CID from the configuration (must match the snapshot's).
    pub cid: u32,
    /// The host Unix socket path.
    pub uds_path: PathBuf,
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// The device's interrupt.
    pub interrupt: Arc<Interrupt>,
}

impl Persist for Vsock {
    type State = VsockState;
    type ConstructorArgs = VsockConstructorArgs;
    type Error = VirtioPersistError;

    fn save(&self) -> Result<VsockState, VirtioPersistError> {
        Ok(VsockState {
            common: self.common.save_state(),
            cid: self.cid,
        })
    }

    fn restore(args: VsockConstructorArgs, state: &VsockState) -> Result<Self, VirtioPersistError> {
        if u64::from(args.cid) != state.cid {
            return Err(VirtioPersistError::Mismatch(format!(
                "vsock CID {} is configured but the snapshot's guest has CID {}",
                args.cid, state.cid
            )));
        }
        let mut vsock = Vsock::new(args.cid, &args.uds_path)
            .map_err(|e| VirtioPersistError::Mismatch(e.to_string()))?;
        vsock.common.restore_state(&state.common, &args.mem)?;
        if state.common.activated {
            // Delivered when the VM first runs, not now: until then a
            // restored VM's memory is the snapshot's.
            vsock.reset_event_owed = true;
            vsock.activate(args.mem, args.interrupt)?;
        }
        Ok(vsock)
    }
}
