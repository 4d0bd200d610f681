//! Which process serves a Unix socket: a jailed vmm owns the directory its
//! sockets are in and could put a link to some other socket of the host
//! there, so host-side clients can require the VM's own vmm as the peer.

use std::os::fd::AsRawFd;
use std::path::Path;

use crate::error::ControlError;

/// The pid of the process at the other end of the connected Unix socket `fd`
/// (`SO_PEERCRED`: the process that created the listening socket's peer).
pub fn peer_pid(fd: &impl AsRawFd) -> std::io::Result<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a properly
    // sized and aligned ucred owned by this frame; `len` is updated in place.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.pid)
}

/// Checks that the socket `fd` (connected to `path`) is served by `expected`;
/// `None` accepts any peer.
pub fn check(
    fd: &impl AsRawFd,
    expected: Option<u32>,
    what: &'static str,
    path: &Path,
) -> Result<(), ControlError> {
    let Some(expected) = expected else {
        return Ok(());
    };
    let found = peer_pid(fd).ok();
    if found != i32::try_from(expected).ok() {
        return Err(ControlError::WrongPeer {
            what,
            path: path.to_path_buf(),
            found,
            expected,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::{UnixListener, UnixStream};

    #[test]
    fn a_socket_served_by_another_process_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("control.sock");
        let _listener = UnixListener::bind(&path).unwrap();
        // A jailed vmm could leave a link to some other socket in its directory.
        let link = t.path().join("planted.sock");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let stream = UnixStream::connect(&link).unwrap();
        let me = std::process::id();
        assert!(check(&stream, Some(me), "control socket", &link).is_ok());
        assert!(check(&stream, None, "control socket", &link).is_ok());
        let err = check(&stream, Some(me + 1), "control socket", &link).unwrap_err();
        assert!(err.to_string().contains("not by the VM's vmm"), "{err}");
    }
}
