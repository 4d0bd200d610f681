//! The machine state stored in a snapshot's `state` file, and its encoding
//! (postcard inside the checksummed container of `format`).

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::format::{self, FormatError, MAX_PAYLOAD_LEN};
use super::manifest::STATE_FILE;
use crate::arch::x86_64::mptable::MAX_CPUS;
use crate::devices::legacy::serial::persist::SerialSnapshot;
use crate::devices::virtio::setup::VirtioState;
use crate::vcpu::persist::VcpuState;
use crate::vm::persist::VmState;

/// Everything but guest memory.
#[derive(Debug, Serialize, Deserialize)]
pub struct MachineState {
    /// Guest memory size in MiB when the snapshot was taken.
    pub mem_mib: u64,
    /// VM-wide KVM state.
    pub vm: VmState,
    /// One entry per vCPU, in index order.
    pub vcpus: Vec<VcpuState>,
    /// The serial console.
    pub serial: SerialSnapshot,
    /// Every virtio device and its transport, in slot order.
    pub virtio: VirtioState,
}

/// Errors reading or decoding the state file.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The file cannot be read.
    #[error("cannot read snapshot state {path}: {source}")]
    Unreadable {
        /// The state file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The container is damaged or from an unsupported version.
    #[error("snapshot state {path}: {source}")]
    Format {
        /// The state file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: FormatError,
    },
    /// The payload does not decode or holds impossible values.
    #[error("snapshot state {path} is invalid: {reason}")]
    Invalid {
        /// The state file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// Why state-file bytes were refused.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The container is damaged or from an unsupported version.
    #[error(transparent)]
    Format(FormatError),
    /// The payload does not decode or holds impossible values.
    #[error("invalid payload: {0}")]
    Invalid(String),
}

impl MachineState {
    /// Serialises the state into a complete state file.
    pub fn encode(&self) -> Result<Vec<u8>, postcard::Error> {
        Ok(format::encode(&postcard::to_stdvec(self)?))
    }

    /// Checks counts and indices that come from disk.
    pub fn validate(&self) -> Result<(), String> {
        let n = self.vcpus.len();
        if n == 0 || n > usize::from(MAX_CPUS) {
            return Err(format!("{n} vCPUs (1 to {MAX_CPUS} expected)"));
        }
        for (i, v) in self.vcpus.iter().enumerate() {
            if usize::from(v.index) != i {
                return Err(format!("vCPU {i} is stored with index {}", v.index));
            }
        }
        Ok(())
    }

    /// Checks and decodes the bytes of a state file (untrusted input).
    pub fn decode(bytes: &[u8]) -> Result<MachineState, DecodeError> {
        let payload = format::decode(bytes).map_err(DecodeError::Format)?;
        let state: MachineState =
            postcard::from_bytes(payload).map_err(|e| DecodeError::Invalid(e.to_string()))?;
        state.validate().map_err(DecodeError::Invalid)?;
        Ok(state)
    }

    /// Reads, checks and decodes `dir/state`.
    pub fn load(dir: &Path) -> Result<MachineState, StateError> {
        let path = dir.join(STATE_FILE);
        let unreadable = |source| StateError::Unreadable {
            path: path.clone(),
            source,
        };
        let file = std::fs::File::open(&path).map_err(unreadable)?;
        // Never read more than a valid file can hold.
        let mut bytes = Vec::new();
        file.take(MAX_PAYLOAD_LEN + 64)
            .read_to_end(&mut bytes)
            .map_err(unreadable)?;
        MachineState::decode(&bytes).map_err(|e| match e {
            DecodeError::Format(source) => StateError::Format { path, source },
            DecodeError::Invalid(reason) => StateError::Invalid { path, reason },
        })
    }
}
