//! Snapshot state of a virtio-blk device. Rate limits and counters are not
//! device state: limits come from the restore's own `--disk` option,
//! counters start again from zero.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vmm_api::rate_limit::IoLimit;

use super::Block;
use crate::devices::virtio::persist::{CommonState, VirtioPersistError};
use crate::devices::virtio::{Interrupt, VirtioDevice};
use crate::memory::GuestMemoryMmap;
use crate::persist::Persist;

/// What a virtio-blk device saves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    /// Features and queues.
    pub common: CommonState,
    /// Disk size the guest saw, in sectors.
    pub sectors: u64,
    /// Whether the disk was read-only.
    pub read_only: bool,
}

/// What restoring a virtio-blk device needs.
pub struct BlockConstructorArgs {
    /// The disk image (must have the size it had at snapshot time).
    pub path: PathBuf,
    /// Read-only flag from the configuration (must match the snapshot).
    pub read_only: bool,
    /// Rate limits (the restore's, not the snapshotted VM's).
    pub limits: IoLimit,
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// The device's interrupt.
    pub interrupt: Arc<Interrupt>,
}

impl Persist for Block {
    type State = BlockState;
    type ConstructorArgs = BlockConstructorArgs;
    type Error = VirtioPersistError;

    fn save(&self) -> Result<BlockState, VirtioPersistError> {
        Ok(BlockState {
            common: self.common.save_state(),
            sectors: self.disk.sectors,
            read_only: self.disk.read_only,
        })
    }

    fn restore(args: BlockConstructorArgs, state: &BlockState) -> Result<Self, VirtioPersistError> {
        let mut block = Block::new(&args.path, args.read_only)
            .map_err(|e| VirtioPersistError::Mismatch(e.to_string()))?;
        block
            .set_limits(&args.limits)
            .map_err(|e| VirtioPersistError::Mismatch(e.to_string()))?;
        // A disk grown since the snapshot (a session given a larger root
        // disk) is served at its new size, and the guest is told below; one
        // that shrank would lose what the guest has written at its end.
        if block.disk.sectors < state.sectors {
            return Err(VirtioPersistError::Mismatch(format!(
                "disk {} has {} sectors, fewer than the snapshot's {}",
                args.path.display(),
                block.disk.sectors,
                state.sectors
            )));
        }
        let grown = block.disk.sectors > state.sectors;
        if block.disk.read_only != state.read_only {
            return Err(VirtioPersistError::Mismatch(format!(
                "disk {} read-only flag differs from the snapshot",
                args.path.display()
            )));
        }
        block.common.restore_state(&state.common, &args.mem)?;
        if state.common.activated {
            block.activate(args.mem, args.interrupt.clone())?;
        }
        if grown {
            tracing::info!(
                disk = %args.path.display(),
                from_sectors = state.sectors,
                to_sectors = block.disk.sectors,
                "the disk is larger than at the snapshot; the guest is told its new capacity"
            );
            // A configuration change: the driver reads the capacity again.
            // Raised before the VM runs, it is held in the interrupt status
            // and raised again on the first run (`resend_pending`).
            args.interrupt.signal_config();
        }
        Ok(block)
    }
}
