//! The vsock transport: an `AF_VSOCK` stream socket listening on a port
//! below 1024, taking connections from the host (CID 2) only. Guests listen
//! on [`proto::guest::DEFAULT_VSOCK_PORT`]; host-agent connects through the
//! vmm's vsock device, whose host side is a Unix socket (with a
//! Firecracker-style `CONNECT <port>\n` handshake).
//!
//! Both rules keep the channel with the host. Only a process with
//! `CAP_NET_BIND_SERVICE` (root in the guest, not the agent's commands) can
//! listen on a port below 1024, so no agent process can take the port over
//! if guest-init's listener were gone; and a connection from any other CID
//! (another process in the guest over the loopback transport, or a peer VM
//! where the host routes vsock between guests) is closed unanswered.

use std::future::Future;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::Pin;

use tokio::io::unix::AsyncFd;

use super::{Connection, Transport};

/// The only peer whose connections are accepted: the host.
pub const HOST_CID: u32 = libc::VMADDR_CID_HOST;
/// Ports at or above this can be bound by any process in the guest.
pub const FIRST_UNPRIVILEGED_PORT: u32 = 1024;
const _: () = assert!(
    proto::guest::DEFAULT_VSOCK_PORT < FIRST_UNPRIVILEGED_PORT,
    "the default channel port must be privileged"
);

/// Why a connection was closed without being served.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RefusedPeer {
    /// The peer is not the host.
    #[error("vsock connection from CID {cid} port {port} refused: only the host (CID 2) may open the session channel")]
    NotHost {
        /// The peer's context ID.
        cid: u32,
        /// The peer's port.
        port: u32,
    },
    /// accept(2) returned an address that is not a vsock address.
    #[error("vsock connection with a peer address of family {family} and length {len} refused")]
    BadAddress {
        /// The address family accept(2) reported.
        family: u16,
        /// The address length accept(2) reported.
        len: u32,
    },
}

/// Decides whether a connection whose peer address accept(2) returned
/// (`addr`, `len` bytes of it filled) may be served: only from the host.
pub fn admit_peer(addr: &libc::sockaddr_vm, len: libc::socklen_t) -> Result<(), RefusedPeer> {
    let family = addr.svm_family;
    if family != libc::AF_VSOCK as libc::sa_family_t
        || (len as usize) < std::mem::size_of::<libc::sockaddr_vm>()
    {
        return Err(RefusedPeer::BadAddress { family, len });
    }
    if addr.svm_cid != HOST_CID {
        return Err(RefusedPeer::NotHost {
            cid: addr.svm_cid,
            port: addr.svm_port,
        });
    }
    Ok(())
}

/// Listens on a vsock port.
pub struct VsockTransport {
    fd: AsyncFd<OwnedFd>,
    port: u32,
}

impl VsockTransport {
    /// Binds `port` on `VMADDR_CID_ANY` and listens. Fails for a port of
    /// 1024 or above (any guest process could bind it), and with the OS
    /// error (e.g. "Address family not supported") where the kernel has no
    /// vsock.
    pub fn bind(port: u32) -> std::io::Result<Self> {
        if port >= FIRST_UNPRIVILEGED_PORT {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "vsock port {port} is not below {FIRST_UNPRIVILEGED_PORT}: any process in the \
                     guest could listen on it; use a privileged port (default {})",
                    proto::guest::DEFAULT_VSOCK_PORT
                ),
            ));
        }
        // SAFETY: plain socket(2) call; the result is checked before use.
        let raw = unsafe {
            libc::socket(
                libc::AF_VSOCK,
                libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh, valid descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_vm is plain data; all-zero is a valid value.
        let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
        addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
        addr.svm_port = port;
        addr.svm_cid = libc::VMADDR_CID_ANY;
        // SAFETY: `addr` is a valid sockaddr_vm and the length matches it.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_vm).cast(),
                std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: listen(2) on a descriptor we own.
        if unsafe { libc::listen(fd.as_raw_fd(), 16) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the OwnedFd is valid and open, and AsyncFd owns it from here
        // on, so it stays the same open socket for the AsyncFd's lifetime.
        let fd = unsafe { AsyncFd::register(fd) }.map_err(std::io::Error::from)?;
        Ok(Self { fd, port })
    }
}

impl Transport for VsockTransport {
    fn accept(&mut self) -> Pin<Box<dyn Future<Output = std::io::Result<Connection>> + Send + '_>> {
        Box::pin(async move {
            loop {
                let mut guard = self.fd.readable().await?;
                let res = guard.try_io(|fd| {
                    // SAFETY: sockaddr_vm is plain data; all-zero is a valid value.
                    let mut peer: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
                    let mut len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
                    // SAFETY: accept4(2) on our listening socket; `peer` and
                    // `len` are valid for writes and `len` holds peer's size.
                    let c = unsafe {
                        libc::accept4(
                            fd.as_raw_fd(),
                            (&mut peer as *mut libc::sockaddr_vm).cast(),
                            &mut len,
                            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                        )
                    };
                    if c < 0 {
                        Err(std::io::Error::last_os_error())
                    } else {
                        // SAFETY: `c` is a fresh connected socket nobody else owns.
                        Ok((unsafe { OwnedFd::from_raw_fd(c) }, peer, len))
                    }
                });
                match res {
                    Ok(Ok((conn, peer, len))) => {
                        if let Err(refused) = admit_peer(&peer, len) {
                            // Dropping `conn` closes it unanswered.
                            tracing::warn!("{refused}");
                            continue;
                        }
                        // UnixStream only uses read/write/recv/send/shutdown on
                        // the socket, which behave the same for AF_VSOCK stream
                        // sockets; its address methods are never called.
                        let std_stream = std::os::unix::net::UnixStream::from(conn);
                        let stream = tokio::net::UnixStream::from_std(std_stream)?;
                        return Ok(Box::new(stream) as Connection);
                    }
                    Ok(Err(e)) => return Err(e),
                    Err(_would_block) => continue,
                }
            }
        })
    }

    fn describe(&self) -> String {
        format!("vsock:{}", self.port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(family: i32, cid: u32, port: u32) -> libc::sockaddr_vm {
        // SAFETY: sockaddr_vm is plain data; all-zero is a valid value.
        let mut a: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
        a.svm_family = family as libc::sa_family_t;
        a.svm_cid = cid;
        a.svm_port = port;
        a
    }

    const LEN: libc::socklen_t = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;

    #[test]
    fn only_the_host_may_open_the_channel() {
        assert_eq!(admit_peer(&addr(libc::AF_VSOCK, 2, 1 << 30), LEN), Ok(()));
        // A process in the same guest over the loopback transport, the
        // guest's own CID, another VM, the hypervisor's reserved CID.
        for cid in [1, 3, 4, 0, libc::VMADDR_CID_ANY] {
            assert_eq!(
                admit_peer(&addr(libc::AF_VSOCK, cid, 5555), LEN),
                Err(RefusedPeer::NotHost { cid, port: 5555 }),
                "CID {cid}"
            );
        }
        let refused = admit_peer(&addr(libc::AF_VSOCK, 1, 5555), LEN).unwrap_err();
        assert!(refused.to_string().contains("only the host (CID 2)"));
    }

    #[test]
    fn a_peer_address_that_is_not_vsock_is_refused() {
        assert!(matches!(
            admit_peer(&addr(libc::AF_UNIX, 2, 1), LEN),
            Err(RefusedPeer::BadAddress { .. })
        ));
        assert!(matches!(
            admit_peer(&addr(libc::AF_VSOCK, 2, 1), 4),
            Err(RefusedPeer::BadAddress { len: 4, .. })
        ));
    }

    #[test]
    fn an_unprivileged_port_is_refused_before_binding() {
        for port in [1024, 8024, u32::MAX] {
            let err = VsockTransport::bind(port).err().expect("refused");
            assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "port {port}");
            assert!(err.to_string().contains("not below 1024"), "{err}");
        }
    }
}
