//! Snapshot state shared by every virtio device: negotiated features and
//! queue positions. Restore treats the state as untrusted and checks it
//! against the device being rebuilt.

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};

use super::DeviceCommon;
use crate::memory::GuestMemoryMmap;

/// Errors restoring a virtio device.
#[derive(Debug, thiserror::Error)]
pub enum VirtioPersistError {
    /// The snapshot has a different number of queues than the device.
    #[error("snapshot has {found} virtio queues but the device has {expected}")]
    QueueCount {
        /// Queues of the device.
        expected: usize,
        /// Queues in the snapshot.
        found: usize,
    },
    /// A queue's maximum size differs from the device's.
    #[error("snapshot queue {index} has maximum size {found}, the device {expected}")]
    QueueMaxSize {
        /// Queue index.
        index: usize,
        /// The device's maximum.
        expected: u16,
        /// The snapshot's.
        found: u16,
    },
    /// A queue's state is invalid (size, alignment).
    #[error("snapshot queue {index} is invalid: {source}")]
    Queue {
        /// Queue index.
        index: usize,
        /// Why.
        #[source]
        source: virtio_queue::Error,
    },
    /// A ready queue's rings are outside guest memory.
    #[error("snapshot queue {0} is ready but its rings are not inside guest memory")]
    QueueOutsideMemory(usize),
    /// The snapshot acknowledges features the device does not offer.
    #[error("snapshot acknowledges features {acked:#x} the device does not offer ({avail:#x})")]
    Features {
        /// Acknowledged.
        acked: u64,
        /// Offered.
        avail: u64,
    },
    /// The snapshot's device configuration does not match this device.
    #[error("snapshot does not match the configured device: {0}")]
    Mismatch(String),
    /// The transport state is invalid.
    #[error("invalid virtio-mmio transport state: {0}")]
    Transport(String),
    /// The device could not be started again.
    #[error("cannot reactivate the device: {0}")]
    Activate(#[from] super::ActivateError),
    /// The device could not be created.
    #[error("cannot create the device: {0}")]
    Create(#[source] std::io::Error),
}

/// The serialisable form of a virtio-queue `QueueState`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    /// Maximum size offered by the device.
    pub max_size: u16,
    /// Next available-ring entry the device reads.
    pub next_avail: u16,
    /// Next used-ring entry the device writes.
    pub next_used: u16,
    /// VIRTIO_F_RING_EVENT_IDX in use.
    pub event_idx_enabled: bool,
    /// Size chosen by the driver.
    pub size: u16,
    /// QueueReady.
    pub ready: bool,
    /// Descriptor table address.
    pub desc_table: u64,
    /// Available ring address.
    pub avail_ring: u64,
    /// Used ring address.
    pub used_ring: u64,
}

impl From<QueueState> for QueueSnapshot {
    fn from(s: QueueState) -> Self {
        QueueSnapshot {
            max_size: s.max_size,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx_enabled,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
        }
    }
}

impl From<QueueSnapshot> for QueueState {
    fn from(s: QueueSnapshot) -> Self {
        QueueState {
            max_size: s.max_size,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx_enabled,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
        }
    }
}

/// What every virtio device saves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommonState {
    /// Features the driver accepted.
    pub acked_features: u64,
    /// Queue configuration and positions.
    pub queues: Vec<QueueSnapshot>,
    /// Whether the device was running.
    pub activated: bool,
}

impl DeviceCommon {
    /// Captures features and queues.
    pub fn save_state(&self) -> CommonState {
        CommonState {
            acked_features: self.acked_features,
            queues: self.queues.iter().map(|q| q.state().into()).collect(),
            activated: self.mem.is_some(),
        }
    }

    /// Replaces features and queues with checked values from `state`. Does not
    /// activate: the device does that, so its own start-up runs too.
    pub fn restore_state(
        &mut self,
        state: &CommonState,
        mem: &GuestMemoryMmap,
    ) -> Result<(), VirtioPersistError> {
        if state.queues.len() != self.queues.len() {
            return Err(VirtioPersistError::QueueCount {
                expected: self.queues.len(),
                found: state.queues.len(),
            });
        }
        if state.acked_features & !self.avail_features != 0 {
            return Err(VirtioPersistError::Features {
                acked: state.acked_features,
                avail: self.avail_features,
            });
        }
        let mut queues = Vec::with_capacity(self.queues.len());
        for (index, (snap, current)) in state.queues.iter().zip(&self.queues).enumerate() {
            if snap.max_size != current.max_size() {
                return Err(VirtioPersistError::QueueMaxSize {
                    index,
                    expected: current.max_size(),
                    found: snap.max_size,
                });
            }
            let q = Queue::try_from(QueueState::from(*snap))
                .map_err(|source| VirtioPersistError::Queue { index, source })?;
            if q.ready() && !q.is_valid(mem) {
                return Err(VirtioPersistError::QueueOutsideMemory(index));
            }
            queues.push(q);
        }
        self.acked_features = state.acked_features;
        self.queues = queues;
        Ok(())
    }
}
