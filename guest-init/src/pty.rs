//! Pseudo-terminals for commands started with `Exec.pty`.
//!
//! [`open`] makes a master/slave pair of the requested size. The slave
//! becomes the command's stdin, stdout, stderr and controlling terminal
//! ([`crate::exec::spawn_on`]); guest-init
//! keeps the master, reads everything the command writes from it and writes
//! the command's input to it, both without blocking a thread ([`Master`]
//! implements tokio's `AsyncRead` and `AsyncWrite`). Once every process has
//! closed the slave, reading the master fails with EIO, which is the end of
//! the output.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Largest number of rows or columns accepted for a terminal.
pub const MAX_DIMENSION: u32 = 4096;

/// The terminal's end-of-file character (^D in the default line discipline).
pub const EOF_CHAR: u8 = 0x04;

/// A terminal size that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PtyError {
    /// rows or cols out of range.
    #[error("{field} is {value}; a terminal has 1 to {MAX_DIMENSION} {field}")]
    BadSize {
        /// "rows" or "cols".
        field: &'static str,
        /// What was asked for.
        value: u32,
    },
    /// A system call failed.
    #[error("{what}: {source}")]
    Os {
        /// The call and what it was for.
        what: &'static str,
        /// The OS error.
        source: io::Error,
    },
}

/// Checks a terminal size: rows and cols 1..=[`MAX_DIMENSION`].
pub fn check_size(rows: u32, cols: u32) -> Result<libc::winsize, PtyError> {
    for (field, value) in [("rows", rows), ("cols", cols)] {
        if value == 0 || value > MAX_DIMENSION {
            return Err(PtyError::BadSize { field, value });
        }
    }
    // Both fit: at most MAX_DIMENSION, which is below u16::MAX.
    Ok(libc::winsize {
        ws_row: rows as u16,
        ws_col: cols as u16,
        ws_xpixel: 0,
        ws_ypixel: 0,
    })
}

fn os(what: &'static str) -> PtyError {
    PtyError::Os {
        what,
        source: io::Error::last_os_error(),
    }
}

/// Opens a terminal pair of `rows` x `cols`: (master, slave). Both are
/// close-on-exec; the master is non-blocking.
pub fn open(rows: u32, cols: u32) -> Result<(Master, OwnedFd), PtyError> {
    let size = check_size(rows, cols)?;
    let mut master: libc::c_int = -1;
    let mut slave: libc::c_int = -1;
    // SAFETY: openpty writes two descriptors into the given ints; the name
    // and termios pointers may be null; `size` is a valid winsize that
    // outlives the call.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &size,
        )
    };
    if rc < 0 {
        return Err(os("openpty"));
    }
    // SAFETY: openpty succeeded, so both are open descriptors that nothing
    // else owns.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    for fd in [&master, &slave] {
        set_flags(
            fd.as_raw_fd(),
            libc::F_GETFD,
            libc::F_SETFD,
            libc::FD_CLOEXEC,
        )
        .map_err(|source| PtyError::Os {
            what: "setting close-on-exec on the terminal",
            source,
        })?;
    }
    set_flags(
        master.as_raw_fd(),
        libc::F_GETFL,
        libc::F_SETFL,
        libc::O_NONBLOCK,
    )
    .map_err(|source| PtyError::Os {
        what: "making the terminal master non-blocking",
        source,
    })?;
    // SAFETY: an OwnedFd's descriptor is open and stays the same until the
    // OwnedFd, owned by the AsyncFd from here, is dropped.
    let fd = unsafe { AsyncFd::register(master) }.map_err(|e| PtyError::Os {
        what: "registering the terminal master",
        source: io::Error::from(e),
    })?;
    Ok((Master { fd }, slave))
}

fn set_flags(fd: i32, get: i32, set: i32, flag: i32) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own, with integer arguments only.
    let cur = unsafe { libc::fcntl(fd, get) };
    if cur < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, set, cur | flag) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The master side of a command's terminal.
pub struct Master {
    fd: AsyncFd<OwnedFd>,
}

impl Master {
    /// Sets the terminal size; the kernel sends SIGWINCH to its foreground
    /// process group.
    pub fn resize(&self, rows: u32, cols: u32) -> Result<(), PtyError> {
        let size = check_size(rows, cols)?;
        // SAFETY: TIOCSWINSZ reads a winsize from the valid pointer given.
        let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), libc::TIOCSWINSZ, &size) };
        if rc < 0 {
            return Err(os("setting the terminal size (TIOCSWINSZ)"));
        }
        Ok(())
    }

    /// The terminal's foreground process group, if it has one.
    pub fn foreground_group(&self) -> Option<u32> {
        // SAFETY: tcgetpgrp takes a descriptor and returns an integer.
        let pgrp = unsafe { libc::tcgetpgrp(self.fd.as_raw_fd()) };
        u32::try_from(pgrp).ok().filter(|p| *p > 0)
    }

    fn read_some(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: read into the valid, writable buffer of the given length.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            // EIO: every process closed the slave; that is the end.
            if e.raw_os_error() == Some(libc::EIO) {
                return Ok(0);
            }
            return Err(e);
        }
        Ok(n as usize)
    }

    fn write_some(&self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: write from the valid buffer of the given length.
        let n = unsafe { libc::write(self.fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

impl AsyncRead for &Master {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|_| self.read_some(unfilled)) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for &Master {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            match guard.try_io(|_| self.write_some(buf)) {
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// A shared handle to a [`Master`] that reads and writes (for tasks that
/// need an owned `AsyncRead`/`AsyncWrite`).
#[derive(Clone)]
pub struct Shared(pub std::sync::Arc<Master>);

impl AsyncRead for Shared {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut &*self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Shared {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut &*self.0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn sizes_are_checked() {
        assert!(check_size(24, 80).is_ok());
        assert!(check_size(MAX_DIMENSION, MAX_DIMENSION).is_ok());
        for (r, c, field) in [(0, 80, "rows"), (24, 0, "cols"), (5000, 80, "rows")] {
            let e = check_size(r, c).unwrap_err();
            assert!(e.to_string().contains(field), "{e}");
        }
    }

    #[tokio::test]
    async fn the_master_reads_what_the_slave_writes_and_ends_with_eio() {
        let (master, slave) = open(24, 80).unwrap();
        let mut slave = std::fs::File::from(slave);
        use std::io::Write;
        slave.write_all(b"hello\n").unwrap();
        drop(slave);
        let mut out = Vec::new();
        let mut r = &master;
        tokio::time::timeout(std::time::Duration::from_secs(10), r.read_to_end(&mut out))
            .await
            .expect("EOF in time")
            .unwrap();
        // The line discipline turns \n into \r\n.
        assert_eq!(out, b"hello\r\n");
    }

    #[tokio::test]
    async fn input_and_resize_reach_the_slave() {
        let (master, slave) = open(24, 80).unwrap();
        master.resize(30, 100).unwrap();
        let mut ws = libc::winsize {
            ws_row: 0,
            ws_col: 0,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCGWINSZ writes a winsize to the valid pointer.
        let rc = unsafe { libc::ioctl(slave.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) };
        assert_eq!(rc, 0);
        assert_eq!((ws.ws_row, ws.ws_col), (30, 100));
        assert!(master.resize(0, 10).is_err());
        let mut w = &master;
        w.write_all(b"typed\n").await.unwrap();
        let mut slave = tokio::fs::File::from_std(std::fs::File::from(slave));
        let mut buf = [0u8; 6];
        slave.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"typed\n");
    }
}
