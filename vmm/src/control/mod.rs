//! The control socket: a Unix socket speaking JSON lines, one request object
//! per line and one response object per request. See the README for the
//! protocol.

pub mod protocol;
pub mod server;
pub mod standby;
