//! Typed errors of host-agent and their gRPC status codes.

use tonic::Code;

/// Everything that can go wrong while serving a call or running a session.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request field is missing or out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The named image, session or ask does not exist.
    #[error("{kind} {id:?} not found")]
    NotFound {
        /// What was looked up ("image", "session", ...).
        kind: &'static str,
        /// The id asked for.
        id: String,
    },
    /// The object exists already (e.g. an image id registered twice).
    #[error("{0}")]
    AlreadyExists(String),
    /// The caller may not do this (e.g. a host path outside the configured
    /// roots).
    #[error("{0}")]
    PermissionDenied(String),
    /// The call is valid but not in the object's current state.
    #[error("{0}")]
    FailedPrecondition(String),
    /// A node limit (max sessions, memory, vCPUs) refuses the call.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The vmm or guest did not answer in time.
    #[error("{0}")]
    Timeout(String),
    /// A vmm process failed to start or answered with an error.
    #[error("vmm: {0}")]
    Vmm(String),
    /// The guest channel failed.
    #[error("guest: {0}")]
    Guest(String),
    /// The guest (or the vsock under it) closed its channel: guest-init
    /// exited, or its VM went away.
    #[error("guest: {0}")]
    GuestGone(String),
    /// A share's virtiofsd could not be started (or died before its VM
    /// could connect to it).
    #[error("virtiofsd: {0}")]
    Virtiofsd(String),
    /// Making, changing or reading a VM's network failed.
    #[error("network: {0}")]
    Network(String),
    /// A snapshot layer is missing, damaged or cannot be taken in.
    #[error("snapshot: {0}")]
    Snapshot(String),
    /// A stored schedule does not decode (a database changed by hand or by
    /// a newer host-agent).
    #[error("schedule: {0}")]
    Schedule(String),
    /// The fleet's shared services (NATS JetStream, the image object
    /// store) could not be reached or refused a request.
    #[error("fleet: {0}")]
    Fleet(String),
    /// What the fleet's object store returned is damaged or incomplete (a
    /// chunk whose SHA-256 is not its name, a manifest that does not parse).
    #[error("fleet object store: {0}")]
    Corrupt(String),
    /// The state database failed.
    #[error("database: {0}")]
    Store(#[from] rusqlite::Error),
    /// A file operation on the node failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, with the path.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// host-agent is shutting down.
    #[error("host-agent is shutting down")]
    ShuttingDown,
}

impl Error {
    /// Builds an [`Error::Io`] with `context` (say what and which path).
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// Shorthand for [`Error::NotFound`].
    pub fn not_found(kind: &'static str, id: impl Into<String>) -> Self {
        Error::NotFound {
            kind,
            id: id.into(),
        }
    }

    /// The gRPC status code this error maps to.
    pub fn code(&self) -> Code {
        match self {
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::NotFound { .. } => Code::NotFound,
            Error::AlreadyExists(_) => Code::AlreadyExists,
            Error::PermissionDenied(_) => Code::PermissionDenied,
            Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::ResourceExhausted(_) => Code::ResourceExhausted,
            Error::Timeout(_) => Code::DeadlineExceeded,
            Error::Vmm(_)
            | Error::Guest(_)
            | Error::GuestGone(_)
            | Error::Network(_)
            | Error::Fleet(_)
            | Error::Virtiofsd(_) => Code::Unavailable,
            Error::Corrupt(_) => Code::DataLoss,
            Error::Store(_) | Error::Io { .. } | Error::Snapshot(_) | Error::Schedule(_) => {
                Code::Internal
            }
            Error::ShuttingDown => Code::Unavailable,
        }
    }
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
