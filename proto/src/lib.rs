//! Protocol definitions shared by host-agent, guest-init and clients.
//!
//! * [`guest`]: the guest <-> host session protocol (`proto/guest.proto`).
//! * [`framing`]: the length-prefixed frames those messages travel in.
//!
//! The `.proto` files are compiled at build time by protox, in pure Rust.

pub mod framing;

/// The guest <-> host session protocol, package `guest.v1`.
pub mod guest {
    #![allow(missing_docs, clippy::doc_lazy_continuation)]
    include!(concat!(env!("OUT_DIR"), "/guest.v1.rs"));

    /// The protocol version this crate speaks, exchanged in [`Hello`].
    pub const PROTOCOL_VERSION: u32 = 1;

    /// The vsock port guest-init listens on by default.
    pub const DEFAULT_VSOCK_PORT: u32 = 1024;
}

pub use prost::Message;
