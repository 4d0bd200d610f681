//! Doing one thing inside a VM's network namespace: making a socket there.
//!
//! A socket belongs to the namespace it was made in for its whole life, so
//! host-agent makes the sockets it needs in a VM's namespace (the DNS
//! resolver's, exposed ports' connections to the guest) on a short-lived
//! thread that joins the namespace, makes them and ends. `setns` changes
//! only the calling thread's namespace; a thread of tokio's pools must never
//! call it (the pool would keep the thread, in the wrong namespace).

use std::fs::File;
use std::os::fd::AsRawFd;

use crate::error::{Error, Result};

/// Runs `f` on a new thread inside namespace `netns` (a name under
/// `/run/netns`) and returns what it returns; `what` names the job in errors.
pub async fn in_netns<T: Send + 'static>(
    netns: &str,
    what: &str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let path = format!("/run/netns/{netns}");
    let what = what.to_string();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let context = what.clone();
    std::thread::Builder::new()
        .name("in-netns".into())
        .spawn(move || {
            let _ = tx.send(join(&path, &context).and_then(|()| f()));
        })
        .map_err(|e| Error::io(format!("{what}: starting a thread"), e))?;
    rx.await
        .map_err(|_| Error::Network(format!("{what}: its thread died")))?
}

/// Moves the calling thread into the namespace at `path`.
fn join(path: &str, what: &str) -> Result<()> {
    let ns = File::open(path).map_err(|e| {
        Error::io(
            format!("{what}: opening the VM's network namespace {path} (was its network made?)"),
            e,
        )
    })?;
    // SAFETY: `ns` is an open namespace file for the call's duration; setns
    // changes only this thread's network namespace, and the thread ends
    // when its job is done.
    let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(Error::io(
            format!("{what}: joining the network namespace {path} (setns needs CAP_SYS_ADMIN)"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missing_namespace_is_named_in_the_error() {
        let err = in_netns("agentvm-no-such-namespace", "testing", || Ok(()))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("testing") && err.contains("/run/netns/agentvm-no-such-namespace"),
            "{err}"
        );
    }
}
