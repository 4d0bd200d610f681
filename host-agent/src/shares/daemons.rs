//! The virtiofsd processes of a VM: the ones just started ([`Started`],
//! killed if dropped before a vmm takes them), and the ones a vmm holds
//! ([`Daemons`], killed when it ends). Also what a restarted host-agent
//! needs: the recorded form of a VM's daemons, and the orphans to kill.
//!
//! A virtiofsd runs in its own process group (so it outlives a host-agent
//! that is killed, as the vmm does) with its share's socket directory as
//! its working directory, which is how a restarted host-agent recognises
//! one: a process whose working directory lies in the state directory and
//! whose command line has `--shared-dir` and `--socket-path`. Its
//! sandboxed child (`--sandbox namespace`) dies with it.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Mutex;

use tokio::sync::watch;

use crate::accounting::process_start_ticks;

/// One virtiofsd process.
#[derive(Debug)]
pub struct Daemon {
    /// Process id (its process group's too).
    pub pid: u32,
    /// Start time in clock ticks since boot, to recognise the pid later.
    pub start_ticks: u64,
    /// The share it serves.
    pub tag: String,
    /// How it exited, once it has (`None` for one re-attached after a
    /// restart: not our child).
    pub(super) exited: Option<watch::Receiver<Option<String>>>,
}

impl Daemon {
    /// How it exited, if it has (always `None` for a re-attached one).
    pub fn exit_status(&self) -> Option<String> {
        self.exited.as_ref().and_then(|rx| rx.borrow().clone())
    }

    /// SIGKILLs its process group, if the process is still the one started.
    pub fn kill(&self) {
        if self.exit_status().is_some() {
            return;
        }
        if process_start_ticks(self.pid) == Some(self.start_ticks) {
            tracing::debug!(pid = self.pid, tag = %self.tag, "killing a virtiofsd");
            // SAFETY: kill(2) has no memory-safety preconditions. The pid was
            // checked by its start time to be the daemon started (the leader
            // of its own process group, so -pid is that group: it and its
            // sandboxed child).
            unsafe {
                libc::kill(-(self.pid as libc::pid_t), libc::SIGKILL);
            }
        }
    }
}

/// Daemons started for a VM whose vmm has not taken them yet: dropped, they
/// are killed (a launch that fails halfway leaves none behind).
#[derive(Debug, Default)]
pub struct Started {
    pub(super) list: Vec<Daemon>,
}

impl Started {
    /// How many daemons it holds.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Their pids.
    pub fn pids(&self) -> Vec<u32> {
        self.list.iter().map(|d| d.pid).collect()
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        for d in &self.list {
            d.kill();
        }
    }
}

/// The daemons of one vmm: they serve it for its whole life and are killed
/// when it ends ([`Daemons::end`]: its exit, or its kill).
#[derive(Debug, Default)]
pub struct Daemons {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    list: Vec<Daemon>,
    /// The vmm has ended: daemons adopted from now on are killed at once.
    ended: bool,
}

impl Daemons {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `started` as this vmm's (killed at once if the vmm has ended
    /// already).
    pub fn adopt(&self, mut started: Started) {
        let list = std::mem::take(&mut started.list);
        let mut s = self.lock();
        if s.ended {
            for d in &list {
                d.kill();
            }
        } else {
            s.list.extend(list);
        }
    }

    /// The vmm ended: kills every daemon (their exit is reaped by their
    /// waiters).
    pub fn end(&self) {
        let mut s = self.lock();
        s.ended = true;
        for d in s.list.drain(..) {
            d.kill();
        }
    }

    /// Their pids, in share order.
    pub fn pids(&self) -> Vec<u32> {
        self.lock().list.iter().map(|d| d.pid).collect()
    }

    /// The recorded form (`pid:start_ticks` comma-separated), kept with the
    /// session so a restarted host-agent can end them with its vmm.
    pub fn encode(&self) -> String {
        self.lock()
            .list
            .iter()
            .map(|d| format!("{}:{}", d.pid, d.start_ticks))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Takes back the daemons recorded as `recorded` ([`Daemons::encode`])
    /// that still run (each checked by its start time); returns their pids.
    pub fn attach_recorded(&self, recorded: &str) -> Vec<u32> {
        let found: Vec<Daemon> = recorded
            .split(',')
            .filter_map(|p| {
                let (pid, ticks) = p.split_once(':')?;
                Some((pid.parse::<u32>().ok()?, ticks.parse::<u64>().ok()?))
            })
            .filter(|&(pid, ticks)| pid != 0 && process_start_ticks(pid) == Some(ticks))
            .map(|(pid, start_ticks)| Daemon {
                pid,
                start_ticks,
                tag: String::new(),
                exited: None,
            })
            .collect();
        let pids = found.iter().map(|d| d.pid).collect();
        self.adopt(Started { list: found });
        pids
    }
}

/// Whether process `pid` looks like a virtiofsd this host-agent started
/// under `state_dir` (resolved): its working directory lies there and its
/// command line has `--shared-dir` and `--socket-path`.
fn is_ours(pid: u32, state_dir: &Path) -> bool {
    let Ok(cwd) = std::fs::read_link(format!("/proc/{pid}/cwd")) else {
        return false;
    };
    if !cwd.starts_with(state_dir) {
        return false;
    }
    let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
    args.contains(&&b"--shared-dir"[..]) && args.contains(&&b"--socket-path"[..])
}

/// The virtiofsd processes under `state_dir` (see [`is_ours`]).
pub fn find_under(state_dir: &Path) -> Vec<u32> {
    let Ok(state_dir) = std::fs::canonicalize(state_dir) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != std::process::id() && is_ours(pid, &state_dir))
        .collect()
}

/// Kills the virtiofsd processes under `state_dir` that are not in `keep`
/// (the daemons of the VMs re-attached): ones whose VM is gone, or that a
/// killed host-agent started and never recorded. Returns how many.
pub fn kill_orphans(state_dir: &Path, keep: &HashSet<u32>) -> usize {
    let mut killed = 0;
    for pid in find_under(state_dir) {
        if keep.contains(&pid) {
            continue;
        }
        tracing::warn!(pid, "killing a virtiofsd that belongs to no VM");
        // SAFETY: kill(2) has no memory-safety preconditions; the process's
        // working directory is in this host-agent's state directory and its
        // command line is a virtiofsd's (`is_ours`).
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
        }
        killed += 1;
    }
    killed
}

/// Socket inodes of the listening Unix sockets of this network namespace
/// (`/proc/net/unix` entries with `__SO_ACCEPTCON`).
fn listening_inodes() -> HashSet<u64> {
    const ACCEPTING: u32 = 0x0001_0000;
    let text = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let flags = u32::from_str_radix(f.get(3)?, 16).ok()?;
            let inode = f.get(6)?.parse::<u64>().ok()?;
            (flags & ACCEPTING != 0).then_some(inode)
        })
        .collect()
}

/// Socket inodes among process `pid`'s open files.
fn socket_inodes(pid: u32) -> Vec<u64> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    fds.flatten()
        .filter_map(|fd| {
            let target = std::fs::read_link(fd.path()).ok()?;
            let t = target.to_str()?;
            t.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

/// Whether process `pid` or one of its children (virtiofsd's sandboxed
/// process holds the socket) has a listening Unix socket.
pub fn listens(pid: u32) -> bool {
    let listening = listening_inodes();
    let children =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    std::iter::once(pid)
        .chain(children.split_whitespace().filter_map(|c| c.parse().ok()))
        .any(|p| socket_inodes(p).iter().any(|i| listening.contains(i)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_socket_is_seen_and_a_plain_process_is_not() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!listens(std::process::id()));
        let _l = std::os::unix::net::UnixListener::bind(dir.path().join("s.sock")).unwrap();
        assert!(listens(std::process::id()));
    }

    #[test]
    fn recorded_daemons_are_taken_back_only_while_they_run() {
        let me = std::process::id();
        let ticks = process_start_ticks(me).unwrap();
        let d = Daemons::default();
        let pids = d.attach_recorded(&format!("{me}:{ticks},{me}:{},0:0,junk", ticks + 1));
        assert_eq!(pids, vec![me]);
        assert_eq!(d.encode(), format!("{me}:{ticks}"));
        assert_eq!(Daemons::default().attach_recorded(""), Vec::<u32>::new());
    }

    #[tokio::test]
    async fn ended_daemons_are_killed_also_when_adopted_late() {
        let spawn = || {
            let mut child = tokio::process::Command::new("sleep")
                .arg("30")
                .process_group(0)
                .spawn()
                .unwrap();
            let pid = child.id().unwrap();
            let (tx, rx) = watch::channel(None);
            tokio::spawn(async move {
                let s = child.wait().await;
                let _ = tx.send(Some(format!("{s:?}")));
            });
            Daemon {
                pid,
                start_ticks: process_start_ticks(pid).unwrap(),
                tag: "t".into(),
                exited: Some(rx),
            }
        };
        let gone = |d: &Daemon| {
            let mut rx = d.exited.clone().unwrap();
            async move {
                tokio::time::timeout(
                    std::time::Duration::from_secs(10),
                    rx.wait_for(|s| s.is_some()),
                )
                .await
                .is_ok()
            }
        };
        // Dropped before a vmm takes it: killed.
        let a = spawn();
        let wait_a = gone(&a);
        drop(Started { list: vec![a] });
        assert!(wait_a.await, "a dropped launch's daemon is killed");
        // Adopted, then the vmm ends: killed.
        let daemons = Daemons::default();
        let b = spawn();
        let wait_b = gone(&b);
        daemons.adopt(Started { list: vec![b] });
        assert_eq!(daemons.pids().len(), 1);
        daemons.end();
        assert!(wait_b.await, "an ended vmm's daemon is killed");
        // Adopted after the vmm ended: killed at once.
        let c = spawn();
        let wait_c = gone(&c);
        daemons.adopt(Started { list: vec![c] });
        assert!(wait_c.await, "a daemon adopted by an ended vmm is killed");
        assert!(daemons.pids().is_empty());
    }
}
