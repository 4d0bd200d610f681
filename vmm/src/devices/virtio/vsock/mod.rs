//! virtio-vsock (placeholder until the device lands): refuses to start.

use std::path::Path;

/// Errors creating the device.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    /// Not built yet.
    #[error("virtio-vsock is not available in this build")]
    Unavailable,
}

/// The virtio-vsock device.
pub struct Vsock;

impl Vsock {
    /// Not available yet.
    pub fn new(_cid: u32, _uds: &Path) -> Result<DummyDevice, VsockError> {
        Err(VsockError::Unavailable)
    }
}

/// Never constructed.
pub type DummyDevice = super::rng::Rng;
