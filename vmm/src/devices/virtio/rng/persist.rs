//! Snapshot state of a virtio-rng device.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::Rng;
use crate::devices::virtio::persist::{CommonState, VirtioPersistError};
use crate::devices::virtio::{Interrupt, VirtioDevice};
use crate::memory::GuestMemoryMmap;
use crate::persist::Persist;

/// What a virtio-rng device saves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    /// Features and queues.
    pub common: CommonState,
}

/// What restoring a virtio-rng device needs.
pub struct RngConstructorArgs {
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// The device's interrupt.
    pub interrupt: Arc<Interrupt>,
}

impl Persist for Rng {
    type State = RngState;
    type ConstructorArgs = RngConstructorArgs;
    type Error = VirtioPersistError;

    fn save(&self) -> Result<RngState, VirtioPersistError> {
        Ok(RngState {
            common: self.common.save_state(),
        })
    }

    fn restore(args: RngConstructorArgs, state: &RngState) -> Result<Self, VirtioPersistError> {
        let mut rng =
            Rng::new().map_err(|super::RngError::Eventfd(e)| VirtioPersistError::Create(e))?;
        rng.common.restore_state(&state.common, &args.mem)?;
        if state.common.activated {
            rng.activate(args.mem, args.interrupt)?;
        }
        Ok(rng)
    }
}
