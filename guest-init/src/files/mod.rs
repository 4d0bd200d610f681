//! File operations in the session workspace for the `Files` API: paths
//! checked and resolved beneath the workspace ([`path`]), the operations
//! themselves ([`ops`], [`write`]), directory watches ([`watch`]), and the
//! thread identity they run as ([`fsid`]).
//!
//! Everything here is blocking and runs on a thread of its own whose file
//! system uid/gid are the agent's ([`fsid::run_as`]), so the kernel checks
//! permissions exactly as for the agent's commands. The protocol glue
//! (requests, credit, audit) lives in `agent::files`.

pub mod fsid;
pub mod ops;
pub mod path;
pub mod watch;
pub mod write;

use proto::guest::file_error::Code;

/// Most entries one listing returns.
pub const MAX_LIST_ENTRIES: usize = 100_000;
/// Deepest listing or recursive removal.
pub const MAX_DEPTH: u32 = 64;
/// Largest file one write may produce (16 GiB).
pub const MAX_WRITE_BYTES: u64 = 16 << 30;
/// Size of the pieces a read is sent in.
pub const READ_CHUNK: usize = 256 * 1024;
/// Largest write chunk accepted from the host.
pub const MAX_CHUNK: usize = 1 << 20;

/// Why a file operation failed, with the request field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FileError {
    /// The protocol's error code.
    pub code: Code,
    /// The request field at fault (`path`, `offset`, ...).
    pub field: &'static str,
    /// What went wrong, for an operator.
    pub message: String,
}

impl FileError {
    /// A bad request field.
    pub fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, field, message)
    }

    /// An error of `code`.
    pub fn new(code: Code, field: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            field,
            message: message.into(),
        }
    }

    /// An OS error while doing `what` to the path in `field` (`shown`).
    pub fn os(field: &'static str, shown: &str, what: &str, e: std::io::Error) -> Self {
        let code = match e.raw_os_error() {
            Some(libc::ENOENT) => Code::NotFound,
            Some(libc::EEXIST) => Code::AlreadyExists,
            Some(libc::EACCES | libc::EPERM | libc::EROFS) => Code::PermissionDenied,
            Some(libc::EXDEV) => {
                return Self::invalid(
                    field,
                    format!(
                        "{shown:?} leads out of the workspace (through `..` or a symbolic link)"
                    ),
                )
            }
            Some(
                libc::ENOTDIR
                | libc::EISDIR
                | libc::ENOTEMPTY
                | libc::ELOOP
                | libc::EINVAL
                | libc::EBUSY
                | libc::ETXTBSY,
            ) => Code::FailedPrecondition,
            Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG | libc::EMFILE | libc::ENFILE) => {
                Code::ResourceExhausted
            }
            _ => Code::Internal,
        };
        Self::new(code, field, format!("cannot {what} {shown:?}: {e}"))
    }
}

/// Result of a file operation.
pub type Result<T> = std::result::Result<T, FileError>;

#[cfg(test)]
mod tests;
