//! The VM's teardown after the vmm's exit: a small keeper process holds a
//! copy of the KVM VM fd, so the kernel destroys the VM when the keeper
//! closes it, after the vmm's exit has been reported, not inside that exit.
//!
//! Why: closing a VM with an in-kernel irqchip unregisters each of its
//! devices from KVM's I/O bus, each time waiting for an SRCU grace period;
//! on this project's development machine that took 16 ms, where the rest
//! of a vmm's exit takes about 0.5 ms (perf/README.md, "The VM's teardown,
//! and the PIT"). Guest memory does not wait: KVM holds the vmm's address
//! space only by reference count, so it is freed at the vmm's exit as
//! before; only KVM's own structures go later.
//!
//! How: the keeper is forked before the VM exists and gets the VM fd over a
//! Unix socket (`SCM_RIGHTS`) right after KVM_CREATE_VM. It holds nothing
//! else: every other descriptor is closed at once, its name is
//! `vmm-keeper` and its command line is blanked (so that nothing looking
//! for vmm processes by command line takes it for one). When the vmm is
//! gone its end of the socket closes; the keeper then exits, which closes
//! the VM fd, but only once the vmm has exited entirely: its socket is
//! among its first descriptors, so it closes before the VM's and vCPUs' in
//! the vmm's exit, and a keeper that left at that end of file sometimes
//! closed its copy first and left the last close, and the teardown, to the
//! vmm's exit after all (its parent then waited 13-25 ms for the reap in one
//! restore of ten). So the vmm also sends the keeper a pidfd of itself, and
//! the keeper, at the end of file, waits until that pidfd says every thread
//! of the vmm is gone (their descriptors closed) before it exits. A jailed
//! vmm is init of its own PID namespace, whose exit
//! waits for every process in it, so its keeper is forked by the jailer,
//! outside the namespace, and the vmm finds its end of the socket in
//! [`INHERITED_ENV`]. No keeper, or one that died, only means the teardown
//! happens in the vmm's exit again: nothing here is fatal.
//!
//! No crate offers this; it is a fork, a socketpair and `SCM_RIGHTS`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

/// The environment variable through which a jailer passes the vmm its end
/// of the keeper's socket (a descriptor number).
pub const INHERITED_ENV: &str = "AGENTVM_VM_KEEPER_FD";

/// The keeper's process name.
pub const NAME: &str = "vmm-keeper";

/// This vmm's end of its keeper's socket, once there is a keeper.
static KEEPER: OnceLock<OwnedFd> = OnceLock::new();

/// Why a keeper could not be started.
#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    /// socketpair(2) failed.
    #[error("cannot make the VM keeper's socket: {0}")]
    Socket(#[source] std::io::Error),
    /// fork(2) failed.
    #[error("cannot fork the VM keeper: {0}")]
    Fork(#[source] std::io::Error),
}

/// Forks a keeper and returns this side's end of its socket (close-on-exec).
/// Call before this process has threads that hold locks a child could need:
/// the child makes only system calls, but the caller's state is copied.
/// `detached`: the keeper is not this process's child (an intermediate
/// process forks it and exits at once, and is reaped here), for a caller
/// whose children are looked at, like the jailer's.
pub fn spawn(detached: bool) -> Result<OwnedFd, KeeperError> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: socketpair writes two descriptors into `fds`, which has room for two.
    let r = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if r != 0 {
        return Err(KeeperError::Socket(std::io::Error::last_os_error()));
    }
    // SAFETY: both descriptors were just created and are owned here alone.
    let (ours, theirs) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: fork has no preconditions; the children run only fork, _exit
    // and `keeper_main`, which makes system calls and writes its own stack
    // and argument memory, and never returns.
    match unsafe { libc::fork() } {
        -1 => Err(KeeperError::Fork(std::io::Error::last_os_error())),
        0 if !detached => keeper_main(theirs.as_raw_fd()),
        // SAFETY: as above.
        0 => unsafe {
            if libc::fork() == 0 {
                keeper_main(theirs.as_raw_fd());
            }
            libc::_exit(0)
        },
        child => {
            if detached {
                // SAFETY: waitpid on the intermediate child forked above.
                unsafe { libc::waitpid(child, std::ptr::null_mut(), 0) };
            }
            Ok(ours)
        }
    }
}

/// Gives this vmm a keeper: the jailer's (its socket end named by
/// [`INHERITED_ENV`]) or a new one. On failure the vmm runs without one
/// (its VM is then torn down in its exit) and says so.
pub fn start() {
    let inherited = std::env::var(INHERITED_ENV)
        .ok()
        .map(|v| v.parse::<RawFd>().ok().filter(|&fd| is_socket(fd)).ok_or(v));
    let fd = match inherited {
        Some(Ok(fd)) => {
            // SAFETY: the jailer passed this descriptor to this process for
            // this use alone, and it is a socket; nothing else owns it.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // Not for the vmm's own children (virtiofsd is not one, but be sure).
            // SAFETY: fcntl on a descriptor this process owns.
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
            fd
        }
        Some(Err(value)) => {
            tracing::warn!(
                value,
                "{INHERITED_ENV} does not name a socket; the VM will be torn down in the vmm's exit"
            );
            return;
        }
        // Init of its own PID namespace (a jail that gave it no keeper): a
        // keeper would be waited for at this process's exit, so none.
        // SAFETY: getpid has no preconditions.
        None if unsafe { libc::getpid() } == 1 => return,
        None => match spawn(false) {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!("{e}; the VM will be torn down in the vmm's exit");
                return;
            }
        },
    };
    // The keeper waits on this for the vmm's whole exit (see above); a
    // kernel without pidfds (before 5.3) leaves it the end of file alone.
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0) };
    if let Ok(pidfd) = RawFd::try_from(pidfd) {
        if pidfd >= 0 {
            // SAFETY: pidfd_open just returned this descriptor; it is owned here alone.
            let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
            if let Err(e) = send_fd(fd.as_raw_fd(), pidfd.as_raw_fd(), PIDFD_TAG) {
                tracing::debug!("cannot send the keeper the vmm's pidfd: {e}");
            }
        }
    }
    let _ = KEEPER.set(fd);
}

/// The byte sent with the vmm's pidfd; anything else is a descriptor to hold.
const PIDFD_TAG: u8 = b'p';
/// The byte sent with a descriptor to hold.
const HOLD_TAG: u8 = b'h';
/// How long a keeper waits, after the end of file, for the vmm's exit to
/// finish (a bound, in case a thread of it hangs in the kernel).
const EXIT_WAIT_MS: libc::c_int = 30_000;

/// Hands a copy of the VM fd to the keeper, if there is one. A keeper that
/// is gone is logged; the VM runs on either way.
pub fn hand_over(vm_fd: RawFd) {
    let Some(sock) = KEEPER.get() else {
        return;
    };
    if let Err(e) = send_fd(sock.as_raw_fd(), vm_fd, HOLD_TAG) {
        tracing::warn!(
            "cannot hand the VM fd to its keeper ({e}); it will be torn down in the vmm's exit"
        );
    }
}

fn is_socket(fd: RawFd) -> bool {
    // SAFETY: fstat writes into a zeroed stat of the right type.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above; an invalid fd makes fstat fail, which is checked.
    unsafe { libc::fstat(fd, &mut st) == 0 && (st.st_mode & libc::S_IFMT) == libc::S_IFSOCK }
}

/// Control-message space for one descriptor (CMSG_SPACE of one int, 8-byte aligned).
#[repr(C, align(8))]
struct FdCmsg([u8; 24]);

/// Sends `fd` over `sock` with the one-byte `tag`.
fn send_fd(sock: RawFd, fd: RawFd, tag: u8) -> std::io::Result<()> {
    let mut byte = [tag];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut space = FdCmsg([0; 24]);
    // SAFETY: a zeroed msghdr is valid; the pointers set below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.0.as_mut_ptr().cast();
    // (`as _`: the field is a usize with glibc, a u32 with musl.)
    // SAFETY: CMSG_SPACE only computes a size.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as _;
    // SAFETY: msg_control points at `space`, large enough for one header and
    // one int (checked by the assertion in the tests), so CMSG_FIRSTHDR is
    // non-null and CMSG_DATA is inside it.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
    }
    // SAFETY: msg and everything it points to are valid for the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The keeper: holds what it is sent until the other end is gone, then exits.
fn keeper_main(sock: RawFd) -> ! {
    // SAFETY: each call below is a plain system call on this process's own
    // descriptors, name and memory; none allocates or takes a lock.
    unsafe {
        // Nothing of the vmm's but the socket: no pipe of the caller's stays
        // open, no file or socket of the VM's.
        if sock > 0 {
            libc::syscall(libc::SYS_close_range, 0u32, (sock - 1) as u32, 0u32);
        }
        libc::syscall(libc::SYS_close_range, (sock + 1) as u32, u32::MAX, 0u32);
        libc::prctl(libc::PR_SET_NAME, c"vmm-keeper".as_ptr(), 0, 0, 0);
        blank_command_line();
        let mut byte = [0u8; 1];
        let mut space = FdCmsg([0; 24]);
        let mut vmm_pidfd: Option<RawFd> = None;
        loop {
            let mut iov = libc::iovec {
                iov_base: byte.as_mut_ptr().cast(),
                iov_len: 1,
            };
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = space.0.as_mut_ptr().cast();
            msg.msg_controllen = space.0.len() as _;
            // Descriptors received are simply kept; they close at the exit.
            let n = libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC);
            if n == 0 || (n < 0 && *libc::__errno_location() != libc::EINTR) {
                break;
            }
            if n == 1 && byte[0] == PIDFD_TAG {
                vmm_pidfd = received_fd(&msg).or(vmm_pidfd);
            }
        }
        // The vmm's end closed, which happens early in its exit: wait until
        // all of it is gone, so that this process's close of the VM fd is
        // the last one and the VM's teardown happens here.
        if let Some(pidfd) = vmm_pidfd {
            let mut pfd = libc::pollfd {
                fd: pidfd,
                events: libc::POLLIN,
                revents: 0,
            };
            while libc::poll(&mut pfd, 1, EXIT_WAIT_MS) < 0
                && *libc::__errno_location() == libc::EINTR
            {}
        }
        libc::_exit(0)
    }
}

/// The descriptor an `SCM_RIGHTS` message received into `msg` carries.
///
/// # Safety
///
/// `msg` must be the header `recvmsg` just filled, its control buffer still alive.
unsafe fn received_fd(msg: &libc::msghdr) -> Option<RawFd> {
    // SAFETY: the caller's contract: CMSG_FIRSTHDR reads the header's control
    // fields, and returns null when no control message fits.
    let cmsg = unsafe { libc::CMSG_FIRSTHDR(msg) };
    if cmsg.is_null() {
        return None;
    }
    // SAFETY: non-null, so a whole cmsghdr lies inside the control buffer.
    let (level, kind, len) = unsafe { ((*cmsg).cmsg_level, (*cmsg).cmsg_type, (*cmsg).cmsg_len) };
    // SAFETY: CMSG_LEN only computes a size.
    let one = u64::from(unsafe { libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) });
    // (`as u64`: the length is a usize with glibc, a u32 with musl.)
    if level != libc::SOL_SOCKET || kind != libc::SCM_RIGHTS || (len as u64) < one {
        return None;
    }
    // SAFETY: the message's length covers one descriptor after the header.
    Some(unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>()) })
}

/// Overwrites this process's argument strings with [`NAME`] and zeros, so
/// /proc/PID/cmdline no longer reads as the vmm's (or jailer's) command line.
///
/// # Safety
///
/// Only in the keeper: nothing in it reads its arguments again.
unsafe fn blank_command_line() {
    let Some((start, end)) = arg_area() else {
        return;
    };
    if end <= start {
        return;
    }
    let len = end - start;
    // SAFETY: [start, end) is this process's argument area, mapped and
    // writable (the initial stack), as the kernel reported it.
    let area = unsafe { std::slice::from_raw_parts_mut(start as *mut u8, len) };
    area.fill(0);
    let name = NAME.as_bytes();
    let n = name.len().min(len.saturating_sub(1));
    area[..n].copy_from_slice(&name[..n]);
}

/// arg_start and arg_end of /proc/self/stat (fields 48 and 49), read into a
/// stack buffer (no allocation: this runs in a forked child).
fn arg_area() -> Option<(usize, usize)> {
    let mut buf = [0u8; 1024];
    // SAFETY: open/read/close on a path literal and a stack buffer.
    let len = unsafe {
        let fd = libc::open(
            c"/proc/self/stat".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        );
        if fd < 0 {
            return None;
        }
        let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
        libc::close(fd);
        usize::try_from(n).ok()?
    };
    parse_arg_area(&buf[..len])
}

/// The argument area's bounds from the text of /proc/PID/stat: the fields
/// after the command name, which ends at the last `)`, start at field 3.
fn parse_arg_area(stat: &[u8]) -> Option<(usize, usize)> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(stat.get(close + 2..)?).ok()?;
    let mut fields = rest.split(' ').skip(48 - 3);
    let start = fields.next()?.parse().ok()?;
    let end = fields.next()?.trim_end().parse().ok()?;
    Some((start, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_descriptor_fits_the_control_space() {
        // SAFETY: CMSG_SPACE only computes a size.
        let need = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        assert!(need <= std::mem::size_of::<FdCmsg>());
    }

    #[test]
    fn the_argument_area_is_read_from_stat() {
        // A command name with spaces and a parenthesis, as a process may choose.
        let mut stat = String::from("4242 (a b) c) S");
        for field in 4..=47 {
            stat.push_str(&format!(" {field}"));
        }
        stat.push_str(" 140737488347000 140737488347100 140737488347100 140737488348000 0\n");
        assert_eq!(
            parse_arg_area(stat.as_bytes()),
            Some((140737488347000, 140737488347100))
        );
        assert_eq!(parse_arg_area(b"4242 (x) S 1 2"), None);
        let own = std::fs::read("/proc/self/stat").unwrap();
        let (start, end) = parse_arg_area(&own).unwrap();
        assert!(start > 0 && end > start, "{start:#x}..{end:#x}");
    }

    #[test]
    fn a_keeper_holds_what_it_is_sent_until_the_other_end_closes() {
        let sock = spawn(false).unwrap();
        let (r, w) = {
            let mut p = [0; 2];
            // SAFETY: pipe2 writes two descriptors into `p`.
            assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
            // SAFETY: both were just created and are owned here alone.
            unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) }
        };
        send_fd(sock.as_raw_fd(), w.as_raw_fd(), HOLD_TAG).unwrap();
        drop(w);
        // The keeper holds the write end: no end of file yet.
        let mut pfd = libc::pollfd {
            fd: r.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one valid pollfd.
        assert_eq!(
            unsafe { libc::poll(&mut pfd, 1, 200) },
            0,
            "the keeper let go early"
        );
        drop(sock);
        // SAFETY: as above; the keeper exits and closes it.
        assert_eq!(
            unsafe { libc::poll(&mut pfd, 1, 10_000) },
            1,
            "the keeper kept it"
        );
        assert_ne!(pfd.revents & libc::POLLHUP, 0);
        // Reap it (it is this test process's child).
        // SAFETY: waitpid on any child, without options.
        unsafe { libc::waitpid(-1, std::ptr::null_mut(), 0) };
    }
}

#[cfg(test)]
mod pidfd_tests {
    use super::*;

    fn pipe() -> (OwnedFd, OwnedFd) {
        let (r, w) = std::io::pipe().unwrap();
        (r.into(), w.into())
    }

    /// Whether `fd` has its end of file (or an error) within `ms`.
    fn hung_up(fd: &OwnedFd, ms: libc::c_int) -> bool {
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, ms) == 1 && pfd.revents & libc::POLLHUP != 0 }
    }

    #[test]
    fn after_the_end_of_file_a_keeper_waits_for_the_process_of_its_pidfd() {
        // The process standing for the vmm: a child that waits on a pipe.
        let (release_r, release_w) = pipe();
        let mut stand_in = std::process::Command::new("sh")
            .args(["-c", "read _"])
            .stdin(std::process::Stdio::from(release_r))
            .spawn()
            .unwrap();
        // SAFETY: pidfd_open of a child of this process, which it has not reaped.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, stand_in.id(), 0) };
        assert!(
            pidfd >= 0,
            "pidfd_open: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: just returned, owned here alone.
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };

        let sock = spawn(false).unwrap();
        let (held_r, held_w) = pipe();
        send_fd(sock.as_raw_fd(), pidfd.as_raw_fd(), PIDFD_TAG).unwrap();
        send_fd(sock.as_raw_fd(), held_w.as_raw_fd(), HOLD_TAG).unwrap();
        drop((held_w, pidfd));
        drop(sock);
        // The end of file came, but the stand-in still runs: the keeper
        // still holds the write end.
        assert!(
            !hung_up(&held_r, 300),
            "the keeper left before the process it waits for"
        );
        drop(release_w);
        stand_in.wait().unwrap();
        assert!(
            hung_up(&held_r, 10_000),
            "the keeper did not leave once the process was gone"
        );
        // Reap the keeper (this test process's child).
        // SAFETY: waitpid on any child, without options.
        unsafe { libc::waitpid(-1, std::ptr::null_mut(), 0) };
    }
}

#[cfg(test)]
mod detached_tests {
    use super::*;

    #[test]
    fn a_detached_keeper_is_not_a_child() {
        let sock = spawn(true).unwrap();
        let me = std::process::id().to_string();
        // Any process whose parent is this one (field 4 of stat).
        let children: Vec<String> = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
            .filter(|stat| {
                let rest = stat.rsplit_once(") ").map_or("", |(_, r)| r);
                rest.split(' ').nth(1) == Some(me.as_str())
            })
            .collect();
        assert!(children.is_empty(), "children: {children:?}");
        // It is there all the same, holding its end: a message goes through.
        // (Not `sock` itself: a keeper holding both ends would never let go.)
        let null = std::fs::File::open("/dev/null").unwrap();
        send_fd(sock.as_raw_fd(), null.as_raw_fd(), HOLD_TAG).unwrap();
    }
}
