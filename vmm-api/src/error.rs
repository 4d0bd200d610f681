//! Errors of the vmm clients.

use std::path::PathBuf;
use std::time::Duration;

/// Errors talking to a vmm's control socket or vsock socket.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The socket could not be reached or failed mid-request.
    #[error("{what} {path}: {source}")]
    Io {
        /// Which socket ("control socket", "vsock socket").
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The vmm refused the request (`{"ok":false}`).
    #[error("vmm refused {op}: {message}")]
    Refused {
        /// The request's op.
        op: &'static str,
        /// The vmm's message.
        message: String,
    },
    /// The answer was not the reply the protocol expects.
    #[error("vmm answered {op} with something that is not a reply: {message}")]
    BadAnswer {
        /// The request's op.
        op: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// The vmm closed the socket before answering.
    #[error("the vmm closed the control socket without answering {op}")]
    Closed {
        /// The request's op.
        op: &'static str,
    },
    /// No answer in time.
    #[error("the vmm did not answer {op} within {after:?}")]
    Timeout {
        /// The request's op (or "connect").
        op: &'static str,
        /// The limit.
        after: Duration,
    },
    /// The socket is served by another process than the VM's vmm.
    #[error("{what} {path} is served by pid {found:?}, not by the VM's vmm (pid {expected}); refusing it")]
    WrongPeer {
        /// Which socket.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// The peer's pid, if the kernel told it.
        found: Option<i32>,
        /// The vmm's pid.
        expected: u32,
    },
    /// The vmm refused a vsock `CONNECT` (nobody listens on that guest port yet).
    #[error("vsock CONNECT {port} refused: {reply:?} (is the guest listening on that port?)")]
    ConnectRefused {
        /// The guest port.
        port: u32,
        /// What came back instead of `OK <port>`.
        reply: String,
    },
}

impl ControlError {
    /// True when the vmm is there but said no (as opposed to an I/O failure).
    pub fn is_refusal(&self) -> bool {
        matches!(self, ControlError::Refused { .. })
    }
}
