//! The vsock transport: an `AF_VSOCK` stream socket listening on a port for
//! any CID. Guests listen on [`proto::guest::DEFAULT_VSOCK_PORT`] (1024);
//! host-agent connects through the vmm's vsock device, whose host side is a
//! Unix socket (`CONNECT 1024\n` in the Firecracker-style handshake).

use std::future::Future;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::Pin;

use tokio::io::unix::AsyncFd;

use super::{Connection, Transport};

/// Listens on a vsock port.
pub struct VsockTransport {
    fd: AsyncFd<OwnedFd>,
    port: u32,
}

impl VsockTransport {
    /// Binds `port` on `VMADDR_CID_ANY` and listens. Fails with the OS error
    /// (e.g. "Address family not supported") where the kernel has no vsock.
    pub fn bind(port: u32) -> std::io::Result<Self> {
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
                    // SAFETY: accept4(2) on our listening socket; peer address not requested.
                    let c = unsafe {
                        libc::accept4(
                            fd.as_raw_fd(),
                            std::ptr::null_mut(),
                            std::ptr::null_mut(),
                            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                        )
                    };
                    if c < 0 {
                        Err(std::io::Error::last_os_error())
                    } else {
                        Ok(c)
                    }
                });
                match res {
                    Ok(Ok(c)) => {
                        // SAFETY: `c` is a fresh connected stream socket we own.
                        // UnixStream only uses read/write/recv/send/shutdown on it,
                        // which behave the same for AF_VSOCK stream sockets; its
                        // address methods are never called.
                        let std_stream = unsafe { std::os::unix::net::UnixStream::from_raw_fd(c) };
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
