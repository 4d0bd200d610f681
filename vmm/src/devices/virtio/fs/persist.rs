//! Snapshot state of a virtio-fs device: features, queue positions (where
//! the backend stopped, from `GET_VRING_BASE`), the tag and queue count the
//! restore must match, and the backend's own state for the new backend.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::backend::MAX_DEVICE_STATE;
use super::{Fs, FsError, Rings};
use crate::devices::virtio::persist::{CommonState, VirtioPersistError};
use crate::devices::virtio::Interrupt;
use crate::memory::{GuestMemoryMmap, MemoryReady};
use crate::persist::Persist;

/// What a virtio-fs device saves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsState {
    /// Features and queues.
    pub common: CommonState,
    /// The mount tag.
    pub tag: String,
    /// Request queues.
    pub request_queues: u16,
    /// The backend had failed: the restored device answers with EIO too.
    pub failed: bool,
    /// The backend's state (`SET_DEVICE_STATE_FD`), when it was running.
    pub backend_state: Option<Vec<u8>>,
}

/// What restoring a virtio-fs device needs.
pub struct FsConstructorArgs {
    /// The tag given to the restore (must be the snapshot's).
    pub tag: String,
    /// The new backend's socket.
    pub socket: PathBuf,
    /// Request queues given to the restore (must be the snapshot's).
    pub request_queues: u16,
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// When guest memory is complete (the backend waits for it).
    pub memory_ready: MemoryReady,
    /// The device's interrupt.
    pub interrupt: Arc<Interrupt>,
}

impl Persist for Fs {
    type State = FsState;
    type ConstructorArgs = FsConstructorArgs;
    type Error = VirtioPersistError;

    /// Call between `stop_for_snapshot` and `resume_after_snapshot` for a
    /// running device: the backend's state is the one saved there.
    fn save(&self) -> Result<FsState, VirtioPersistError> {
        let backend_state = match (&self.rings, &self.saved_state) {
            (Rings::Stopped, Some(Ok(state))) => Some(state.clone()),
            (Rings::Stopped, Some(Err(why))) => {
                return Err(VirtioPersistError::Mismatch(format!(
                    "virtio-fs {:?} cannot be snapshotted: {why}",
                    self.tag
                )))
            }
            (Rings::Running, _) | (Rings::Stopped, None) => {
                return Err(VirtioPersistError::Mismatch(format!(
                    "virtio-fs {:?} was saved while its backend was running",
                    self.tag
                )))
            }
            // Restored, and the backend not started yet: its state is still
            // the one the restore brought.
            (Rings::WaitingForMemory, _) => self.restored_state.clone(),
            _ => None,
        };
        Ok(FsState {
            common: self.common.save_state(),
            tag: self.tag.clone(),
            request_queues: self.request_queues,
            failed: self.rings == Rings::Failed,
            backend_state,
        })
    }

    fn restore(args: FsConstructorArgs, state: &FsState) -> Result<Self, VirtioPersistError> {
        if state.tag != args.tag || state.request_queues != args.request_queues {
            return Err(VirtioPersistError::Mismatch(format!(
                "the snapshot's virtio-fs device is {:?} with {} request queues, the restore \
                 was given {:?} with {}: pass the snapshotted VM's --fs tags in its order",
                state.tag, state.request_queues, args.tag, args.request_queues
            )));
        }
        if state
            .backend_state
            .as_ref()
            .is_some_and(|s| s.len() > MAX_DEVICE_STATE)
        {
            return Err(VirtioPersistError::Mismatch(
                "the virtio-fs backend state in the snapshot is too large".into(),
            ));
        }
        let mut fs =
            Fs::new(&args.tag, &args.socket, args.request_queues).map_err(|e| match e {
                FsError::Eventfd { source, .. } => VirtioPersistError::Create(source),
                other => VirtioPersistError::Mismatch(other.to_string()),
            })?;
        fs.common.restore_state(&state.common, &args.mem)?;
        fs.memory_ready = args.memory_ready;
        if state.failed {
            fs.backend = None;
            fs.rings = Rings::Failed;
        }
        if state.common.activated {
            if !state.failed && fs.backend.as_ref().is_some_and(|b| !b.has_device_state()) {
                return Err(VirtioPersistError::Mismatch(format!(
                    "the virtio-fs backend at {} cannot take the snapshot's state (no \
                     VHOST_USER_PROTOCOL_F_DEVICE_STATE)",
                    args.socket.display()
                )));
            }
            // The state goes in now, whatever the memory: it needs none (the
            // backend opens the guest's files by path), so a backend that
            // cannot take it fails the restore on every memory backend, not
            // only where the memory is complete before the devices.
            // (A failed device has no backend.)
            if let (Some(backend), Some(saved)) = (&fs.backend, &state.backend_state) {
                backend
                    .load_state(saved)
                    .map_err(|e| VirtioPersistError::Mismatch(e.to_string()))?;
            }
            fs.restored_state = state.backend_state.clone();
            fs.common.activate(args.mem, args.interrupt)?;
            if fs.rings == Rings::Failed {
                super::failed::take_over(&mut fs.common);
                let _ = fs.failed_evt.write(1);
            } else if !fs.memory_ready.is_ready() {
                fs.rings = Rings::WaitingForMemory;
            } else {
                fs.start_backend()
                    .map_err(|e| VirtioPersistError::Mismatch(e.to_string()))?;
            }
        }
        Ok(fs)
    }
}
