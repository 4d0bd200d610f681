//! vmm processes: spawning (one per session or warm VM), the JSON-lines
//! control socket, and noticing exit at once.
//!
//! A vmm spawned by this host-agent is a child: its exit status comes from
//! `waitpid` (tokio's child reaper). A vmm re-attached after a host-agent
//! restart is no longer our child: its exit is noticed through a pidfd
//! (`pidfd_open`, readable when the process exits), without a status.
//!
//! vmm processes run in their own process group with stdin from /dev/null
//! and stdout/stderr to a log file in their directory, so they outlive a
//! host-agent that is killed and never write to a pipe nobody reads. Both
//! that log and the serial log are bounded by the vmm itself
//! (`--log-max-bytes`, from `logs.max_file_bytes`): the serial log rotates to
//! `serial.log.1`, the vmm's log stops at the bound with a line saying so.
//!
//! Sessions' and warm VMs' vmm processes run through `vmm jail` unless
//! host-agent runs with `--no-jail`: each with a uid and gid of its own
//! ([`crate::jail_uids`]) and its own network namespace.

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::sync::watch;
use vmm_api::async_client::AsyncClient;
use vmm_api::command::{JailSpec, VmmCommand};
use vmm_api::{ControlError, SnapshotKind, SnapshotReply, StatusReply, VmState};

use crate::accounting::{is_zombie, parent_pid, process_start_ticks};
use crate::error::{Error, Result};
use crate::shares::{Daemons, Started};

/// How a vmm process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// Exit code (0: guest reset or stop requested; 1: guest/VM failure;
    /// 2: bad input).
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
    /// Exited while not our child (after a re-attach): status unknown.
    Unknown,
}

impl std::fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitStatus::Code(c) => write!(f, "vmm exited with code {c}"),
            ExitStatus::Signal(s) => write!(f, "vmm killed by signal {s}"),
            ExitStatus::Unknown => write!(f, "vmm exited (status unknown: not our child)"),
        }
    }
}

/// A running (or exited) vmm process.
#[derive(Debug)]
pub struct VmmProcess {
    /// Process id.
    pub pid: u32,
    /// Start time in clock ticks since boot, to recognise the pid later.
    pub start_ticks: u64,
    /// The control socket.
    pub control: PathBuf,
    /// The process's directory (serial log, vmm log, sockets).
    pub dir: PathBuf,
    /// Started through `vmm jail`: `pid` is the jailer, the vmm is its child,
    /// and the sockets lie in `dir/jail/run`.
    pub jailed: bool,
    /// The uid (= gid) a jailed vmm runs as.
    pub jail_uid: Option<u32>,
    /// The virtiofsd processes serving its shares: killed when it exits or
    /// is killed.
    pub fs: std::sync::Arc<Daemons>,
    /// The jailed vmm's pid, once found (it lives exactly as long as its jailer).
    jailed_vmm: std::sync::Mutex<Option<u32>>,
    exited: watch::Receiver<Option<ExitStatus>>,
}

/// Where a VM keeps its control socket, vsock socket and serial log: the
/// directory as the host sees it and as the vmm sees it.
pub fn run_dirs(dir: &Path, jailed: bool) -> (PathBuf, PathBuf) {
    if jailed {
        (dir.join("jail/run"), PathBuf::from("/run"))
    } else {
        (dir.to_path_buf(), dir.to_path_buf())
    }
}

impl VmmProcess {
    /// Waits for the process to exit.
    pub async fn wait(&self) -> ExitStatus {
        let mut rx = self.exited.clone();
        loop {
            if let Some(s) = *rx.borrow_and_update() {
                return s;
            }
            if rx.changed().await.is_err() {
                // The waiter task ended without a status; only possible if
                // the runtime is shutting down.
                return ExitStatus::Unknown;
            }
        }
    }

    /// The exit status, if the process has exited.
    pub fn exit_status(&self) -> Option<ExitStatus> {
        *self.exited.borrow()
    }

    /// Sends SIGKILL (if it still runs), and kills its virtiofsd processes.
    pub fn kill(&self) {
        self.fs.end();
        if self.exit_status().is_none() && process_start_ticks(self.pid) == Some(self.start_ticks) {
            // SAFETY: kill(2) with a pid we started and verified by its start
            // time; no memory is involved.
            unsafe {
                libc::kill(self.pid as libc::pid_t, libc::SIGKILL);
            }
        }
    }

    /// The process whose threads and memory are the VM's: the vmm itself,
    /// which for a jailed VM is the jailer's only child.
    pub fn sample_pid(&self) -> Option<u32> {
        if !self.jailed {
            return Some(self.pid);
        }
        // The vmm dies with its jailer and the jailer exits with it, so the
        // pid found stays right while the jailer runs, as long as it is
        // still the jailer's child: a child seen before the vmm (a wrapper's
        // helper, say) is dropped once it is gone, and the search repeated.
        if self.exit_status().is_some() {
            return None;
        }
        let mut cached = self.jailed_vmm.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(pid) = *cached {
            if parent_pid(pid) == Some(self.pid) {
                return Some(pid);
            }
        }
        let pid = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", self.pid))
            .ok()?
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        *cached = Some(pid);
        Some(pid)
    }

    /// The same VM after its directory was renamed to `dest`.
    pub fn moved_to(mut self, dest: &Path) -> VmmProcess {
        self.control = run_dirs(dest, self.jailed).0.join("control.sock");
        self.dir = dest.to_path_buf();
        self
    }

    /// A client of this VM's control socket, bounded by `timeout`, that
    /// only accepts the socket from this VM's vmm process (a jailed vmm owns
    /// its run directory and could plant a link to another socket there).
    pub fn client(&self, timeout: Duration) -> Result<AsyncClient> {
        let peer = self.sample_pid().ok_or_else(|| {
            Error::Vmm(format!(
                "the jailed vmm under pid {} is not running yet",
                self.pid
            ))
        })?;
        Ok(AsyncClient::new(&self.control)
            .peer(Some(peer))
            .timeout(timeout))
    }

    /// The VM's state.
    pub async fn status(&self) -> Result<StatusReply> {
        self.client(CONTROL_TIMEOUT)?
            .status()
            .await
            .map_err(control_error)
    }

    /// Parks the vCPUs.
    pub async fn pause(&self) -> Result<StatusReply> {
        self.client(CONTROL_TIMEOUT)?
            .pause()
            .await
            .map_err(control_error)
    }

    /// Lets the vCPUs run.
    pub async fn resume(&self) -> Result<StatusReply> {
        self.client(CONTROL_TIMEOUT)?
            .resume()
            .await
            .map_err(control_error)
    }

    /// Asks the vmm to end the VM.
    pub async fn stop(&self) -> Result<StatusReply> {
        self.client(CONTROL_TIMEOUT)?
            .stop()
            .await
            .map_err(control_error)
    }

    /// Writes a snapshot of the paused VM to `dir` (a path as the vmm sees it).
    pub async fn snapshot(&self, dir: &Path, kind: SnapshotKind) -> Result<SnapshotReply> {
        self.client(CONTROL_TIMEOUT)?
            .snapshot(dir, kind)
            .await
            .map_err(control_error)
    }

    /// Last lines of the vmm's log, for error messages.
    pub fn log_tail(&self) -> String {
        log_tail(&self.dir.join("vmm.log"))
    }

    /// Last lines of the guest's console (its serial log), for the error of
    /// a guest that went away: a panic or an oops is printed there.
    pub fn console_tail(&self) -> String {
        let (host_run, _) = run_dirs(&self.dir, self.jailed);
        console_tail(&host_run.join("serial.log"))
    }
}

/// How many console lines an error carries, and how long each may be.
const CONSOLE_TAIL_LINES: usize = 6;
const CONSOLE_LINE_CHARS: usize = 160;

/// The last few non-empty lines of a guest console log, joined with " | ":
/// the guest wrote them, so control characters are dropped and each line
/// is cut to a bound (the file itself is bounded by the vmm's rotation).
pub fn console_tail(path: &Path) -> String {
    let Ok(bytes) = std::fs::read(path) else {
        return String::new();
    };
    // Only the end matters; a rotated log is at most `--log-max-bytes`.
    let from = bytes.len().saturating_sub(16 * 1024);
    let text = String::from_utf8_lossy(&bytes[from..]);
    let lines: Vec<String> = text
        .lines()
        .map(|l| {
            l.chars()
                .filter(|c| !c.is_control())
                .take(CONSOLE_LINE_CHARS)
                .collect::<String>()
        })
        .filter(|l| !l.trim().is_empty())
        .collect();
    let start = lines.len().saturating_sub(CONSOLE_TAIL_LINES);
    lines[start..].join(" | ")
}

/// The last few lines of a log file, joined with "; ".
pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(3);
    lines[start..].join("; ")
}

/// Kills vmm processes whose control socket (or, for a jailer, whose jail
/// root) lies under `sessions_dir` but that belong to no live session (`live`
/// pids): VMs a host-agent killed in the middle of a create had started but
/// not yet recorded. Returns how many.
pub fn kill_orphans(sessions_dir: &Path, live: &std::collections::HashSet<u32>) -> usize {
    let needle = format!("{}/", sessions_dir.display());
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut killed = 0;
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if live.contains(&pid) || pid == std::process::id() {
            continue;
        }
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        let ours = args
            .windows(2)
            .filter(|w| w[0] == b"--control-socket" || w[0] == b"--root")
            .any(|w| String::from_utf8_lossy(w[1]).starts_with(&needle));
        if ours {
            tracing::warn!(
                pid,
                "killing a vmm that belongs to no session (left by an interrupted create)"
            );
            // SAFETY: kill(2) has no memory-safety preconditions; the pid's command line
            // names a control socket in this host-agent's own sessions directory.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
            killed += 1;
        }
    }
    killed
}

/// Spawns the vmm `command` in `dir` (created if needed), with its log in
/// `dir/vmm.log` and its control socket in its run directory ([`run_dirs`]).
/// With `jail`, through `vmm jail` (its root is normally `dir/jail`); paths
/// in `command` are then paths inside the jail.
///
/// With `netns` and no jail, the vmm runs in that network namespace
/// (`ip netns exec`, which execs the vmm in the same process); a jailed vmm
/// joins its namespace through [`JailSpec::netns`].
///
/// `fs` are the virtiofsd processes serving the devices of `command`'s
/// `--fs` (started first: the vmm connects to them as it starts); they
/// become the vmm's, ended with it (killed if the vmm cannot be started).
pub fn spawn(
    vmm: &Path,
    dir: &Path,
    mut command: VmmCommand,
    jail: Option<&JailSpec>,
    netns: Option<&str>,
    fs: Started,
) -> Result<VmmProcess> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let (run_host, run_inside) = run_dirs(dir, jail.is_some());
    let control = run_host.join("control.sock");
    let _ = std::fs::remove_file(&control);
    let log_path = dir.join("vmm.log");
    let log = std::fs::File::create(&log_path)
        .map_err(|e| Error::io(format!("creating {}", log_path.display()), e))?;
    let log2 = log
        .try_clone()
        .map_err(|e| Error::io(format!("duplicating {}", log_path.display()), e))?;
    command.devices_mut().control_socket = Some(run_inside.join("control.sock"));
    let args = match jail {
        Some(j) => j.wrap(command.args()),
        None => command.args(),
    };
    let mut cmd = match (jail, netns) {
        (None, Some(ns)) => {
            let mut c = tokio::process::Command::new("ip");
            c.args(["netns", "exec", ns]).arg(vmm);
            c
        }
        _ => tokio::process::Command::new(vmm),
    };
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log2))
        .process_group(0)
        .kill_on_drop(false);
    let mut child = cmd.spawn().map_err(|e| {
        Error::Vmm(format!(
            "cannot start {}: {e} (set --vmm to the vmm binary)",
            vmm.display()
        ))
    })?;
    let pid = child
        .id()
        .ok_or_else(|| Error::Vmm("vmm exited before its pid was read".into()))?;
    let start_ticks = process_start_ticks(pid).unwrap_or(0);
    let daemons = std::sync::Arc::new(Daemons::default());
    daemons.adopt(fs);
    let (tx, rx) = watch::channel(None);
    let ended = daemons.clone();
    tokio::spawn(async move {
        let status = match child.wait().await {
            Ok(s) => {
                use std::os::unix::process::ExitStatusExt;
                match (s.code(), s.signal()) {
                    (Some(c), _) => ExitStatus::Code(c),
                    (None, Some(sig)) => ExitStatus::Signal(sig),
                    _ => ExitStatus::Unknown,
                }
            }
            Err(_) => ExitStatus::Unknown,
        };
        // Its daemons go first, so whoever sees the exit sees them gone.
        ended.end();
        let _ = tx.send(Some(status));
    });
    Ok(VmmProcess {
        pid,
        start_ticks,
        control,
        dir: dir.to_path_buf(),
        jailed: jail.is_some(),
        jail_uid: jail.map(|j| j.uid),
        fs: daemons,
        jailed_vmm: std::sync::Mutex::new(None),
        exited: rx,
    })
}

/// Re-attaches to a vmm this host-agent (an earlier run of it) started:
/// checks the pid still names the same process (start time) and watches it
/// through a pidfd. `None` if the process is gone. Its virtiofsd processes
/// (recorded as [`Daemons::encode`] wrote them) are taken back with it.
pub fn attach(pid: u32, start_ticks: u64, dir: &Path, fs_daemons: &str) -> Option<VmmProcess> {
    if pid == 0 || process_start_ticks(pid) != Some(start_ticks) || is_zombie(pid) {
        return None;
    }
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1;
    // no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is a fresh descriptor returned by pidfd_open, owned by
    // nothing else.
    let owned = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // The pid could have been reused between the check and pidfd_open;
    // check again now that the pidfd pins the process.
    if process_start_ticks(pid) != Some(start_ticks) {
        return None;
    }
    // SAFETY: `owned` is an OwnedFd: its descriptor is valid, open, and
    // stays the same until the AsyncFd (which owns it) is dropped.
    let afd =
        unsafe { AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE) }.ok()?;
    let daemons = std::sync::Arc::new(Daemons::default());
    daemons.attach_recorded(fs_daemons);
    let ended = daemons.clone();
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        // A pidfd becomes readable when the process exits.
        let _ = afd.readable().await;
        ended.end();
        let _ = tx.send(Some(ExitStatus::Unknown));
    });
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let jailed = args.get(1) == Some(&&b"jail"[..]);
    // The jailer's own options come before `--`.
    let jail_uid = args
        .iter()
        .take_while(|a| **a != b"--")
        .collect::<Vec<_>>()
        .windows(2)
        .find(|w| *w[0] == b"--uid")
        .and_then(|w| std::str::from_utf8(w[1]).ok()?.parse().ok())
        .filter(|_| jailed);
    Some(VmmProcess {
        pid,
        start_ticks,
        control: run_dirs(dir, jailed).0.join("control.sock"),
        dir: dir.to_path_buf(),
        jailed,
        jail_uid,
        fs: daemons,
        jailed_vmm: std::sync::Mutex::new(None),
        exited: rx,
    })
}

/// How long a control request may take (a snapshot of a large guest
/// takes seconds).
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(30);

/// A control-socket failure as host-agent reports it.
pub fn control_error(e: ControlError) -> Error {
    match e {
        ControlError::Timeout { .. } => Error::Timeout(e.to_string()),
        other => Error::Vmm(other.to_string()),
    }
}

/// Waits until the vmm answers `status` with `want` (e.g. "running"), or
/// fails if it exits or `timeout` passes.
pub async fn wait_for_state(vmm: &VmmProcess, want: VmState, timeout: Duration) -> Result<()> {
    let started = tokio::time::Instant::now();
    let deadline = started + timeout;
    // Short steps: a restore is done in tens of ms, and each extra ms of
    // sleep past it is a ms more before the session is RUNNING (with steps
    // doubling to 100 ms, a restore done at 35 ms was seen at about 62 ms).
    let mut delay = Duration::from_millis(1);
    loop {
        if let Some(status) = vmm.exit_status() {
            return Err(Error::Vmm(format!("{status}: {}", vmm.log_tail())));
        }
        if let Ok(client) = vmm.client(Duration::from_secs(5)) {
            if client.status().await.is_ok_and(|s| s.state == want) {
                return Ok(());
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Timeout(format!(
                "vmm (pid {}) not {} after {timeout:?}: {}",
                vmm.pid,
                want.as_str(),
                vmm.log_tail()
            )));
        }
        tokio::time::sleep(delay).await;
        // Most waits end within a few hundred ms; a longer one polls less.
        let cap = if started.elapsed() < Duration::from_millis(500) {
            Duration::from_millis(4)
        } else {
            Duration::from_millis(50)
        };
        delay = (delay * 2).min(cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_console_tail_is_the_last_lines_cleaned_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("serial.log");
        let mut text = String::new();
        for i in 0..20 {
            text.push_str(&format!("line {i}\r\n"));
        }
        text.push_str("\x1b[31mKernel panic - not syncing: Attempted to kill init!\r\n\n");
        text.push_str(&"x".repeat(1000));
        std::fs::write(&log, &text).unwrap();
        let tail = console_tail(&log);
        let lines: Vec<&str> = tail.split(" | ").collect();
        assert_eq!(lines.len(), CONSOLE_TAIL_LINES, "{tail}");
        assert_eq!(lines[0], "line 16");
        assert_eq!(
            lines[4], "[31mKernel panic - not syncing: Attempted to kill init!",
            "the escape character is dropped"
        );
        assert_eq!(lines[5].len(), CONSOLE_LINE_CHARS);
        assert_eq!(console_tail(&dir.path().join("absent")), "");
    }

    #[tokio::test]
    async fn the_jailed_vmm_is_whichever_child_the_jailer_has_now() {
        // A stand-in jailer whose first child is gone before its second
        // (the one to be found) starts.
        let mut jailer = tokio::process::Command::new("sh")
            .args(["-c", "sleep 0.3; sleep 30"])
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let pid = jailer.id().unwrap();
        let (_tx, rx) = watch::channel(None);
        let vm = VmmProcess {
            pid,
            start_ticks: 0,
            control: PathBuf::new(),
            dir: PathBuf::new(),
            jailed: true,
            jail_uid: None,
            fs: Default::default(),
            jailed_vmm: std::sync::Mutex::new(None),
            exited: rx,
        };
        let children = || {
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
                .collect::<Vec<_>>()
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while children().is_empty() {
            assert!(std::time::Instant::now() < deadline, "no first child");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let first = vm.sample_pid().unwrap();
        let second = loop {
            match children().first() {
                Some(&c) if c != first => break c,
                _ => {
                    assert!(std::time::Instant::now() < deadline, "no second child");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        assert_eq!(vm.sample_pid(), Some(second), "not the first child, gone");
        // SAFETY: kill(2) on the process group this test started.
        unsafe { libc::kill(-(pid as libc::pid_t), libc::SIGKILL) };
        let _ = jailer.wait().await;
    }
}
