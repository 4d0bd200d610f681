//! The jail's file system and the child's steps into it.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{chown, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Child;

use super::cgroup::Cgroup;
use super::{path_cstring, JailConfig, JailError};

/// Devices a jail may hold: (name, path). The node in the jail gets the host
/// node's device number (misc devices such as userfaultfd have dynamic minors).
pub(super) const KNOWN_DEVICES: &[(&str, &str)] = &[
    ("kvm", "/dev/kvm"),
    ("tun", "/dev/net/tun"),
    ("urandom", "/dev/urandom"),
    ("userfaultfd", "/dev/userfaultfd"),
];

fn prep(path: &Path, what: &'static str) -> impl FnOnce(std::io::Error) -> JailError {
    let path = path.to_path_buf();
    move |source| JailError::Prepare { path, what, source }
}

/// Creates the jail root: the vmm binary, device nodes owned by the jail's
/// uid, mount points for the binds, and writable /run and /tmp.
pub(super) fn prepare_root(config: &JailConfig) -> Result<PathBuf, JailError> {
    let root = &config.root;
    std::fs::create_dir_all(root).map_err(prep(root, "creating the root"))?;
    let root = std::fs::canonicalize(root).map_err(prep(root, "resolving the root"))?;
    for dir in ["dev/net", "run", "tmp", "proc"] {
        let d = root.join(dir);
        std::fs::create_dir_all(&d).map_err(prep(&d, "creating a directory"))?;
    }
    for dir in ["run", "tmp"] {
        let d = root.join(dir);
        chown(&d, Some(config.uid), Some(config.gid)).map_err(prep(&d, "chown"))?;
    }
    // Mirror the host's /lib -> usr/lib style links so the dynamic loader is found.
    for dir in super::LIBRARY_DIRS {
        let host = Path::new(dir);
        if let Ok(target) = std::fs::read_link(host) {
            let link = root.join(dir.trim_start_matches('/'));
            if std::fs::symlink_metadata(&link).is_err() {
                std::os::unix::fs::symlink(&target, &link)
                    .map_err(prep(&link, "linking a library directory"))?;
            }
        }
    }
    let exe = std::fs::read_link("/proc/self/exe")
        .map_err(prep(Path::new("/proc/self/exe"), "finding the vmm binary"))?;
    let target = root.join("vmm");
    let _ = std::fs::remove_file(&target);
    // A hard link costs nothing where the jail is on the binary's file system.
    // (The link shares the host binary's inode: root's, and not writable by the jail's uid.)
    if std::fs::hard_link(&exe, &target).is_err() {
        std::fs::copy(&exe, &target).map_err(prep(&target, "copying the vmm binary"))?;
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755))
            .map_err(prep(&target, "chmod"))?;
    }
    for name in &config.devices {
        let Some((_, path)) = KNOWN_DEVICES.iter().find(|(n, ..)| n == name) else {
            continue;
        };
        let host =
            std::fs::metadata(path).map_err(prep(Path::new(path), "finding the host device"))?;
        if !host.file_type().is_char_device() {
            return Err(prep(Path::new(path), "checking the host device")(
                std::io::Error::other("not a character device"),
            ));
        }
        let node = root.join(path.trim_start_matches('/'));
        let _ = std::fs::remove_file(&node);
        let c = path_cstring(&node)?;
        // SAFETY: `c` is a NUL-terminated path inside the jail root; mknod creates one
        // character device node and touches nothing else.
        let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, host.rdev()) };
        if rc != 0 {
            return Err(prep(&node, "creating a device node")(
                std::io::Error::last_os_error(),
            ));
        }
        chown(&node, Some(config.uid), Some(config.gid)).map_err(prep(&node, "chown"))?;
    }
    for b in &config.binds {
        let meta =
            std::fs::metadata(&b.source).map_err(prep(&b.source, "reading a bind source"))?;
        let target = root.join(b.target.strip_prefix("/").unwrap_or(&b.target));
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(prep(parent, "creating a directory"))?;
        }
        if meta.is_dir() {
            std::fs::create_dir_all(&target).map_err(prep(&target, "creating a mount point"))?;
        } else if !target.exists() {
            File::create(&target).map_err(prep(&target, "creating a mount point"))?;
        }
    }
    Ok(root)
}

/// One bind mount, ready for the child.
struct PreparedBind {
    source: CString,
    target: CString,
    read_only: bool,
}

/// Everything the child needs, prepared before the fork so the pre-exec step
/// only makes system calls.
pub(super) struct ChildSetup {
    root: CString,
    old_root: CString,
    old_root_after: CString,
    proc_dir: CString,
    binds: Vec<PreparedBind>,
    hostname: CString,
    cgroup_procs: Vec<OwnedFd>,
    uid: u32,
    gid: u32,
    nofile: u64,
    fsize: Option<u64>,
    /// The ends of the jailer-alive pipe (see [`AlivePipe`]) as the child sees them.
    alive_read: RawFd,
    alive_write: RawFd,
}

/// A pipe whose write end only the jailer holds, so the jailed child can
/// tell whether its jailer is still alive: PR_SET_PDEATHSIG covers a jailer
/// that dies after the child set it, and this covers one that died before
/// (the read end then reports a hang-up). Both ends are close-on-exec.
pub(super) struct AlivePipe {
    read: OwnedFd,
    write: OwnedFd,
}

impl AlivePipe {
    /// Makes the pipe; keep it until the child has exited.
    pub(super) fn new() -> Result<Self, JailError> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two new descriptors into `fds`, which has room for them.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(JailError::Spawn(std::io::Error::last_os_error()));
        }
        // SAFETY: both descriptors were just created by pipe2 and are owned by nothing else.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok(AlivePipe { read, write })
    }
}

/// Whether every write end of the pipe whose read end is `fd` is closed
/// (without waiting). Only a system call: safe between fork and exec.
fn hung_up(fd: RawFd) -> std::io::Result<bool> {
    let mut poll = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `poll` is one valid pollfd; a zero timeout never blocks.
    if unsafe { libc::poll(&mut poll, 1, 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(poll.revents & libc::POLLHUP != 0)
}

fn check(rc: libc::c_int) -> std::io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl ChildSetup {
    pub(super) fn new(
        config: &JailConfig,
        root: &Path,
        cgroup: &Cgroup,
        alive: &AlivePipe,
    ) -> Result<Self, JailError> {
        let old = root.join("old_root");
        std::fs::create_dir_all(&old).map_err(prep(&old, "creating the old-root mount point"))?;
        let binds = config
            .binds
            .iter()
            .map(|b| {
                Ok(PreparedBind {
                    source: path_cstring(&b.source)?,
                    target: path_cstring(
                        &root.join(b.target.strip_prefix("/").unwrap_or(&b.target)),
                    )?,
                    read_only: b.read_only,
                })
            })
            .collect::<Result<Vec<_>, JailError>>()?;
        let mut cgroup_procs = Vec::new();
        for path in cgroup.procs_files() {
            let f = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(prep(&path, "opening cgroup.procs"))?;
            cgroup_procs.push(OwnedFd::from(f));
        }
        Ok(ChildSetup {
            root: path_cstring(root)?,
            old_root: path_cstring(&old)?,
            old_root_after: CString::from(c"/old_root"),
            proc_dir: path_cstring(&root.join("proc"))?,
            binds,
            hostname: CString::new(config.id.as_bytes())
                .map_err(|_| JailError::Invalid("jail id contains a NUL byte".into()))?,
            cgroup_procs,
            uid: config.uid,
            gid: config.gid,
            nofile: config.nofile,
            fsize: config.fsize,
            alive_read: alive.read.as_raw_fd(),
            alive_write: alive.write.as_raw_fd(),
        })
    }

    /// Runs in the child between fork and exec.
    pub(super) fn enter(&self) -> std::io::Result<()> {
        // SAFETY (whole block): each call is a plain system call on NUL-terminated strings
        // and integers prepared before the fork; nothing here allocates or locks.
        unsafe {
            // Join the cgroup first, so the vmm never runs outside its limits.
            for fd in &self.cgroup_procs {
                let zero = b"0";
                if libc::write(fd.as_raw_fd(), zero.as_ptr().cast(), zero.len()) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            let none = std::ptr::null();
            check(libc::mount(
                none,
                c"/".as_ptr(),
                none,
                libc::MS_REC | libc::MS_PRIVATE,
                none.cast(),
            ))?;
            check(libc::mount(
                self.root.as_ptr(),
                self.root.as_ptr(),
                none,
                libc::MS_BIND | libc::MS_REC,
                none.cast(),
            ))?;
            for b in &self.binds {
                check(libc::mount(
                    b.source.as_ptr(),
                    b.target.as_ptr(),
                    none,
                    libc::MS_BIND,
                    none.cast(),
                ))?;
                if b.read_only {
                    check(libc::mount(
                        none,
                        b.target.as_ptr(),
                        none,
                        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
                        none.cast(),
                    ))?;
                }
            }
            // A /proc of the new PID namespace: the vmm sees only itself.
            check(libc::mount(
                c"proc".as_ptr(),
                self.proc_dir.as_ptr(),
                c"proc".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                none.cast(),
            ))?;
            check(libc::chdir(self.root.as_ptr()))?;
            if libc::syscall(
                libc::SYS_pivot_root,
                self.root.as_ptr(),
                self.old_root.as_ptr(),
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            check(libc::chdir(c"/".as_ptr()))?;
            check(libc::umount2(
                self.old_root_after.as_ptr(),
                libc::MNT_DETACH,
            ))?;
            check(libc::rmdir(self.old_root_after.as_ptr()))?;
            check(libc::sethostname(
                self.hostname.as_ptr(),
                self.hostname.as_bytes().len(),
            ))?;
            let nofile = libc::rlimit {
                rlim_cur: self.nofile,
                rlim_max: self.nofile,
            };
            check(libc::setrlimit(libc::RLIMIT_NOFILE, &nofile))?;
            if let Some(fsize) = self.fsize {
                let l = libc::rlimit {
                    rlim_cur: fsize,
                    rlim_max: fsize,
                };
                check(libc::setrlimit(libc::RLIMIT_FSIZE, &l))?;
            }
            check(libc::setgroups(0, std::ptr::null()))?;
            check(libc::setresgid(self.gid, self.gid, self.gid))?;
            check(libc::setresuid(self.uid, self.uid, self.uid))?;
            // The vmm dies with its jailer (a SIGKILLed jailer cannot forward anything).
            // Set after the uid change, which clears it.
            check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0))?;
            // A jailer that died before that line sent no signal: then the
            // pipe's write end is closed everywhere once this copy is.
            check(libc::close(self.alive_write))?;
            if hung_up(self.alive_read)? {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
        }
        Ok(())
    }
}

static CHILD_PID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn forward(sig: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let pid = CHILD_PID.load(std::sync::atomic::Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill(2) is async-signal-safe; `pid` is our child.
        unsafe { libc::kill(pid, sig) };
    }
}

/// Waits for the jailed vmm, forwarding termination signals; returns its exit code
/// (128 + signal if it was killed).
pub(super) fn wait_forwarding_signals(mut child: Child) -> i32 {
    CHILD_PID.store(child.id() as i32, std::sync::atomic::Ordering::SeqCst);
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        if let Err(e) = vmm_sys_util::signal::register_signal_handler(sig, forward) {
            tracing::warn!(signal = sig, "cannot forward signal to the jailed vmm: {e}");
        }
    }
    loop {
        match child.wait() {
            Ok(status) => {
                use std::os::unix::process::ExitStatusExt;
                return status
                    .code()
                    .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!("waiting for the jailed vmm: {e}");
                return crate::exit::EXIT_VM_FAILURE;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alive_pipe_hangs_up_once_the_jailers_end_is_closed() {
        let pipe = AlivePipe::new().unwrap();
        assert!(!hung_up(pipe.read.as_raw_fd()).unwrap(), "jailer alive");
        let AlivePipe { read, write } = pipe;
        drop(write);
        assert!(hung_up(read.as_raw_fd()).unwrap(), "jailer gone");
    }
}
