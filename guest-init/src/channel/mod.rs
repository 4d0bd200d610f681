//! The session channel to host-agent.
//!
//! * [`Transport`]: something that accepts byte-stream connections; served
//!   over vsock ([`vsock::VsockTransport`], port [`proto::guest::DEFAULT_VSOCK_PORT`]
//!   by default) in a guest, and over a Unix socket ([`unix::UnixTransport`])
//!   in tests and for debugging. The host side of a vsock is a Unix socket
//!   anyway.
//! * [`framed`]: protobuf messages in length-prefixed frames over a connection.

pub mod framed;
pub mod unix;
pub mod vsock;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::str::FromStr;

use tokio::io::{AsyncRead, AsyncWrite};

/// A bidirectional byte stream to the host.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

/// A boxed connection.
pub type Connection = Box<dyn Stream>;

/// Accepts connections from the host.
pub trait Transport: Send {
    /// Waits for the next connection.
    fn accept(&mut self) -> Pin<Box<dyn Future<Output = std::io::Result<Connection>> + Send + '_>>;
    /// Where this transport listens, for logs.
    fn describe(&self) -> String;
}

/// A `--listen` address: `unix:PATH` or `vsock:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A Unix stream socket at this path.
    Unix(PathBuf),
    /// A vsock port, on any CID.
    Vsock(u32),
}

/// A `--listen` value that is neither form.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("listen address {0:?} must be unix:PATH or vsock:PORT")]
pub struct BadListenAddr(pub String);

impl FromStr for ListenAddr {
    type Err = BadListenAddr;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(p) = s.strip_prefix("unix:") {
            if !p.is_empty() {
                return Ok(Self::Unix(PathBuf::from(p)));
            }
        } else if let Some(p) = s.strip_prefix("vsock:") {
            if let Ok(port) = p.parse() {
                return Ok(Self::Vsock(port));
            }
        }
        Err(BadListenAddr(s.to_string()))
    }
}

impl ListenAddr {
    /// Binds the transport for this address.
    pub fn bind(&self) -> std::io::Result<Box<dyn Transport>> {
        Ok(match self {
            Self::Unix(p) => Box::new(unix::UnixTransport::bind(p)?),
            Self::Vsock(port) => Box::new(vsock::VsockTransport::bind(*port)?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_listen() {
        assert_eq!("unix:/tmp/a".parse(), Ok(ListenAddr::Unix("/tmp/a".into())));
        assert_eq!("vsock:700".parse(), Ok(ListenAddr::Vsock(700)));
        assert!("vsock:x".parse::<ListenAddr>().is_err());
        assert!("tcp:1".parse::<ListenAddr>().is_err());
        assert!("unix:".parse::<ListenAddr>().is_err());
    }
}
