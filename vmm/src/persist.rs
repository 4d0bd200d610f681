//! The `Persist` trait: how a component (vCPU, VM, device) turns its runtime
//! state into a serialisable value for a snapshot, and how it is rebuilt from
//! that value on restore. Each device implements it in its own folder
//! (`devices/.../persist.rs`).

use serde::{de::DeserializeOwned, Serialize};

/// A component whose state can be saved into and restored from a snapshot.
pub trait Persist: Sized {
    /// The serialisable state.
    type State: Serialize + DeserializeOwned;
    /// What restore needs besides the state (guest memory, irq lines, fds...).
    type ConstructorArgs;
    /// Errors while saving or restoring.
    type Error: std::error::Error;

    /// Captures the component's state. Called only while the VM is paused.
    fn save(&self) -> Result<Self::State, Self::Error>;

    /// Rebuilds the component from `state`. `state` comes from a file on disk and is
    /// untrusted: every index, length and address in it must be checked.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error>;
}
