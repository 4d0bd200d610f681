//! Running a file operation as the agent: on a thread of its own whose
//! file system uid and gid (per-thread on Linux: `setfsuid(2)`,
//! `setfsgid(2)`, and the raw `setgroups` syscall, which unlike glibc's
//! wrapper changes only the calling thread) are the agent's. Leaving uid 0
//! drops the file capabilities (CAP_DAC_OVERRIDE, CAP_FOWNER, ...) of that
//! thread, so the kernel checks permissions as for the agent's commands and
//! new files belong to the agent. The thread ends with the operation, so
//! nothing has to be restored.
//!
//! Without an identity (guest-init is not root, as with `serve` on a
//! developer's machine) the operation runs as the current user, as the
//! agent's commands do.

use crate::privilege::Identity;

use super::{FileError, Result};
use proto::guest::file_error::Code;

/// Switches the calling thread's file system identity to `id`.
fn become_agent(id: Identity) -> std::io::Result<()> {
    // SAFETY: setgroups with a count of 0 reads no memory; the raw syscall
    // affects only the calling thread.
    if unsafe { libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: setfsgid/setfsuid take plain integers and affect only the
    // calling thread; they report the previous id, so a second call shows
    // whether the change took.
    unsafe {
        libc::setfsgid(id.gid);
        libc::setfsuid(id.uid);
        if libc::setfsgid(id.gid) as u32 != id.gid || libc::setfsuid(id.uid) as u32 != id.uid {
            return Err(std::io::Error::from_raw_os_error(libc::EPERM));
        }
    }
    Ok(())
}

/// Runs `f` on a new thread as `identity` and returns its result.
pub async fn run_as<T, F>(identity: Option<Identity>, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T> + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    spawn_as(identity, move || {
        let _ = tx.send(f());
    })?;
    rx.await.unwrap_or_else(|_| {
        Err(FileError::new(
            Code::Internal,
            "",
            "the file operation's thread ended without an answer",
        ))
    })
}

/// Starts `f` on a new thread as `identity` (for operations that stream).
/// When the identity cannot be taken, `f` does not run.
pub fn spawn_as<F>(identity: Option<Identity>, f: F) -> Result<()>
where
    F: FnOnce() + Send + 'static,
{
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<std::io::Result<()>>(1);
    std::thread::Builder::new()
        .name("guest-init-file".into())
        .spawn(move || {
            let ok = identity.map_or(Ok(()), become_agent);
            let failed = ok.is_err();
            let _ = ready_tx.send(ok);
            if !failed {
                f();
            }
        })
        .map_err(|e| {
            FileError::new(
                Code::ResourceExhausted,
                "",
                format!("cannot start a thread for the file operation: {e}"),
            )
        })?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(FileError::new(
            Code::Internal,
            "",
            format!("cannot take the agent's identity for the file operation: {e}"),
        )),
        Err(_) => Err(FileError::new(
            Code::Internal,
            "",
            "the file operation's thread ended at start",
        )),
    }
}
