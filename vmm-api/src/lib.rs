//! The one way to talk to a `vmm` process: its control protocol (shared with
//! the vmm's own server, so the two cannot drift), a typed blocking client
//! and, with the `tokio` feature, an async one; the vsock `CONNECT`
//! handshake used to reach guest ports; and the builder of `vmm run`,
//! `vmm restore` and `vmm jail` command lines with a handle on the process.
//!
//! Everything here treats the other end as untrusted: answers are parsed
//! into typed replies, lines are bounded, and a socket can be required to be
//! served by a given process ([`peer`]).

#![warn(missing_docs)]

#[cfg(feature = "tokio")]
pub mod async_client;
pub mod client;
pub mod command;
pub mod error;
pub mod peer;
pub mod process;
pub mod protocol;
pub mod rate_limit;
pub mod timing;
pub mod vsock;

pub use client::Client;
pub use command::{
    DiskSpec, FsSpec, JailSpec, NetSpec, RestoreSpec, RunSpec, Serial, StandbySpec, VmmCommand,
    VsockSpec,
};
pub use error::ControlError;
pub use protocol::{
    BlkCounters, ChecksumReply, NetCounters, Request, SnapshotKind, SnapshotReply, StatusReply,
    VmState,
};
pub use rate_limit::{IoLimit, NetLimits, RateLimit, SpecError};
