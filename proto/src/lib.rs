//! Protocol definitions shared by host-agent, guest-init and clients.
//!
//! * [`guest`]: the guest <-> host session protocol (`proto/guest.proto`).
//! * [`framing`]: the length-prefixed frames those messages travel in.
//! * [`hello`]: the Hello exchange that opens a guest channel.
//! * `hostagent` (feature `grpc`): the host-agent gRPC API
//!   (`proto/hostagent.proto`), tonic clients and servers.
//!
//! The `.proto` files are compiled at build time by protox, in pure Rust.

pub mod framing;
pub mod hello;

/// The guest <-> host session protocol, package `guest.v1`.
pub mod guest {
    #![allow(missing_docs, clippy::doc_lazy_continuation)]
    include!(concat!(env!("OUT_DIR"), "/guest.v1.rs"));

    /// The protocol version this crate speaks, exchanged in [`Hello`].
    pub const PROTOCOL_VERSION: u32 = 1;

    /// The vsock port guest-init listens on by default. It is below 1024,
    /// so only a privileged process in the guest (guest-init) can listen on
    /// it, never one of the agent's commands.
    pub const DEFAULT_VSOCK_PORT: u32 = 700;
}

/// The host-agent gRPC API, package `hostagent.v1` (feature `grpc`).
#[cfg(feature = "grpc")]
pub mod hostagent {
    #![allow(
        missing_docs,
        clippy::doc_lazy_continuation,
        clippy::large_enum_variant
    )]
    include!(concat!(env!("OUT_DIR"), "/hostagent.v1.rs"));

    /// Encoded `FileDescriptorSet` of every .proto file, for gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/descriptor.bin"));

    /// A plain pause (in memory) of the session `call` names: PauseSession
    /// took a `SessionCall` before it could persist.
    impl From<SessionCall> for PauseSessionRequest {
        fn from(call: SessionCall) -> Self {
            PauseSessionRequest {
                session_id: call.session_id,
                idempotency_key: call.idempotency_key,
                persist: false,
            }
        }
    }
}

pub use prost::Message;
