//! The harness shared by the workspace's integration tests (each crate's
//! `tests/` and the cross-crate suites under `tests/`), kept once here
//! instead of in per-crate `tests/common` copies:
//!
//! * [`bin`]: the workspace root and the vmm, guest-init and host-agent
//!   binaries (built on first use when missing);
//! * [`guests`]: the vmm's tiny test guests (feature `guests`);
//! * [`process`]: child processes: deadlines, waiting for a socket, killing;
//! * [`host`]: what this machine lets a test do (root, `vmm jail`);
//! * [`git`]: git with a fixed identity and throwaway repositories;
//! * [`files`]: which files of a test hold a byte string;
//! * [`vsock_shim`]: the host side of a vmm's vsock socket (`CONNECT
//!   <port>`), played by a test (feature `vsock-shim`);
//! * [`nats`]: a `nats-server -js` on a loopback port, for the fleet tests;
//! * [`agent`]: a host-agent process on a loopback port, with its gRPC
//!   clients (feature `agent`).
//!
//! Everything panics on unexpected failures: it is test code, and a panic
//! with the cause is the most useful report.

#![warn(missing_docs)]

#[cfg(feature = "agent")]
pub mod agent;
pub mod bin;
pub mod files;
pub mod git;
#[cfg(feature = "guests")]
pub mod guests;
pub mod host;
pub mod nats;
pub mod process;
#[cfg(feature = "vsock-shim")]
pub mod vsock_shim;
