//! The harness's error type: every variant says what failed and what to do about it.

use std::path::PathBuf;

/// Errors from running a benchmark.
#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    /// The VMM binary to benchmark does not exist.
    #[error(
        "no vmm binary at {0}: build it with `cargo build -p vmm` (same profile as perf, e.g. \
         `--release`) or pass --vmm PATH"
    )]
    VmmNotFound(PathBuf),
    /// A binary or image given on the command line does not exist.
    #[error("no {what} at {path}: check the path given to {flag}")]
    BinaryNotFound {
        /// What the file is (`Firecracker binary`, `kernel image`).
        what: &'static str,
        /// The path given.
        path: PathBuf,
        /// The flag it came from.
        flag: &'static str,
    },
    /// A test guest image is missing.
    #[error("test guest {name:?} is not built ({detail}): run `cargo build -p test-guests`")]
    GuestMissing {
        /// Guest name.
        name: String,
        /// Why it is missing.
        detail: String,
    },
    /// A child process could not be started.
    #[error("cannot start {path}: {source}")]
    Spawn {
        /// The program.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A VMM process ended before the harness saw what it waited for.
    #[error("{what} ended ({status}) while waiting for {waiting_for}; stderr: {stderr:?}; serial output: {output:?}")]
    EarlyExit {
        /// Which process.
        what: String,
        /// How it ended.
        status: String,
        /// What the harness waited for.
        waiting_for: String,
        /// The end of its stderr.
        stderr: String,
        /// The end of its serial output.
        output: String,
    },
    /// A VMM process did not do something in time.
    #[error("{what}: timed out after {secs} s waiting for {waiting_for} (raise --timeout-secs if the machine is slow); stderr: {stderr:?}; serial output: {output:?}")]
    Timeout {
        /// Which process.
        what: String,
        /// Seconds waited.
        secs: u64,
        /// What the harness waited for.
        waiting_for: String,
        /// The end of its stderr.
        stderr: String,
        /// The end of its serial output.
        output: String,
    },
    /// A VMM process exited with a failure status.
    #[error("{what} exited with {status} instead of 0; stderr: {stderr:?}")]
    BadExit {
        /// Which process.
        what: String,
        /// How it ended.
        status: String,
        /// The end of its stderr.
        stderr: String,
    },
    /// Talking to a control or API socket failed.
    #[error("socket {path}: {action}: {source}")]
    Socket {
        /// The socket path.
        path: PathBuf,
        /// What was being done.
        action: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The vmm's control socket could not be reached, or the vmm refused a
    /// request or answered it with something that is not a reply.
    #[error("talking to the vmm: {0}")]
    Control(#[from] vmm_api::ControlError),
    /// Firecracker's API answered with an error.
    #[error("Firecracker API {method} {path} answered HTTP {status}: {body}")]
    FirecrackerApi {
        /// HTTP method.
        method: &'static str,
        /// Request path.
        path: String,
        /// HTTP status code (0 if the response could not be parsed).
        status: u16,
        /// The response body.
        body: String,
    },
    /// A guest printed something the harness did not expect.
    #[error("{0}")]
    Guest(String),
    /// A file could not be read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A network operation of the network scenarios failed (namespace,
    /// tap, raw socket).
    #[error("network: {action}: {source}")]
    Network {
        /// What was being done.
        action: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Frames did not go through as the network scenarios expect (lost,
    /// cut, or not answered in time).
    #[error("network measurement: {0}")]
    Net(String),
    /// host-agent's network code (making, updating or removing a VM's
    /// network) failed.
    #[error("host-agent network: {0}")]
    HostNetwork(#[source] host_agent::error::Error),
    /// The host-agent process of the session scenarios did not start, or
    /// a session did not do what was asked of it in time.
    #[error("host-agent: {0}")]
    HostAgent(String),
    /// A gRPC call to that host-agent failed.
    #[error("host-agent {call} answered {code_name} ({code}): {message}")]
    Rpc {
        /// The call (`PauseSession`).
        call: &'static str,
        /// The gRPC status code (12 is UNIMPLEMENTED).
        code: i32,
        /// The status code's name (`Unimplemented`).
        code_name: String,
        /// The status message.
        message: String,
    },
    /// Results could not be serialized.
    #[error("cannot serialize results: {0}")]
    Json(#[from] serde_json::Error),
    /// Bad combination of options.
    #[error("{0}")]
    Usage(String),
}

impl PerfError {
    /// An [`PerfError::Io`] for `action` on `path`.
    pub fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| PerfError::Io {
            action,
            path,
            source,
        }
    }
}

/// Result type of the harness.
pub type Result<T, E = PerfError> = std::result::Result<T, E>;
