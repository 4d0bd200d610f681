//! Starting agent commands.
//!
//! A command starts in a new session (`setsid`, so its process group can be
//! signalled as a whole), joins its turn's cgroup if there is one, sets
//! `no_new_privs`, drops to the agent identity, and gets a clean environment:
//! a fixed base, then the session's env, the Exec's env, and the secrets it
//! may see. All of this happens between fork and exec, with async-signal-safe
//! system calls only.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::process::Stdio;

use tokio::process::{Child, Command};

use crate::privilege::Identity;

/// PATH given to every command.
pub const BASE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What to start.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Working directory (already checked to be inside the workspace).
    pub cwd: PathBuf,
    /// Complete environment beyond the base (PATH, HOME, LANG).
    pub env: BTreeMap<String, String>,
    /// Home directory given in HOME.
    pub home: PathBuf,
    /// Identity to drop to, if running as root.
    pub identity: Option<Identity>,
    /// `cgroup.procs` of the turn's cgroup, if any.
    pub cgroup_procs: Option<PathBuf>,
}

/// A command that could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// argv was empty.
    #[error("argv is empty")]
    EmptyArgv,
    /// An argument, env name or value holds a NUL byte, or a name holds `=`.
    #[error("{0} cannot be passed to a program (contains NUL or '=' in a name)")]
    BadString(String),
    /// spawn failed.
    #[error("cannot start {program:?}: {source}")]
    Spawn {
        /// `argv[0]`.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Starts `spec` with piped stdio, registered with the reaper (see
/// [`crate::reaper::spawn`]) so the orphan reaper never takes its status.
pub fn spawn(spec: &Spec) -> Result<Child, ExecError> {
    spawn_on(spec, None)
}

/// Starts `spec` like [`spawn`]; with `terminal` (the slave of a
/// [`crate::pty`] pair), that terminal is its stdin, stdout, stderr and
/// controlling terminal instead of pipes.
pub fn spawn_on(spec: &Spec, terminal: Option<OwnedFd>) -> Result<Child, ExecError> {
    let program = spec.argv.first().ok_or(ExecError::EmptyArgv)?;
    for a in &spec.argv {
        if a.contains('\0') {
            return Err(ExecError::BadString("an argument".into()));
        }
    }
    for (k, v) in &spec.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ExecError::BadString(format!("environment variable {k:?}")));
        }
    }
    let mut cmd = Command::new(program);
    cmd.args(&spec.argv[1..])
        .current_dir(&spec.cwd)
        .env_clear()
        .env("PATH", BASE_PATH)
        .env("HOME", &spec.home)
        .env("LANG", "C.UTF-8")
        .envs(&spec.env)
        .kill_on_drop(false);
    let controlling_tty = terminal.is_some();
    match terminal {
        Some(slave) => {
            let dup = |fd: &OwnedFd| {
                fd.try_clone().map_err(|source| ExecError::Spawn {
                    program: program.clone(),
                    source,
                })
            };
            cmd.stdin(Stdio::from(dup(&slave)?))
                .stdout(Stdio::from(dup(&slave)?))
                .stderr(Stdio::from(slave));
        }
        None => {
            cmd.stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
        }
    }
    let cgroup = match &spec.cgroup_procs {
        Some(p) => Some(
            CString::new(p.as_os_str().as_bytes())
                .map_err(|_| ExecError::BadString("cgroup path".into()))?,
        ),
        None => None,
    };
    let identity = spec.identity;
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls (setsid, ioctl, open, write, close,
    // prctl, setgroups, setgid, setuid) on data prepared before the fork; it
    // does not allocate or take locks.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // stdin is the terminal's slave by now: make it the new
            // session's controlling terminal.
            if controlling_tty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(path) = &cgroup {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let rc = libc::write(fd, b"0\n".as_ptr().cast(), 2);
                libc::close(fd);
                if rc < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(id) = identity {
                if libc::setgroups(0, std::ptr::null()) < 0
                    || libc::setgid(id.gid) < 0
                    || libc::setuid(id.uid) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    crate::reaper::spawn(&mut cmd).map_err(|source| ExecError::Spawn {
        program: program.clone(),
        source,
    })
}

/// Sends `signal` to the process group led by `pid` (each command leads its own).
pub fn signal_group(pid: u32, signal: i32) -> std::io::Result<()> {
    // SAFETY: kill(2) with a negative pid (a process group); no pointers.
    if unsafe { libc::kill(-(pid as libc::pid_t), signal) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
