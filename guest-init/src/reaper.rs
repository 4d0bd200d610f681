//! Reaping orphans without stealing exit statuses.
//!
//! guest-init is PID 1 in a guest and a child subreaper in `serve` mode, so
//! every orphaned process is re-parented to it and must be waited for. The
//! children it spawned itself are waited for by tokio, so a blanket
//! `waitpid(-1)` would steal their exit status. Instead the reaper looks for
//! zombie children in /proc and waits for each one by pid, skipping those
//! [`Managed`] lists. Spawning happens with the [`Managed`] lock held, so a
//! child cannot turn into a zombie before it is registered.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// Pids of children someone else waits for.
#[derive(Clone, Default)]
pub struct Managed(Arc<Mutex<HashSet<u32>>>);

/// The process-wide set: every child guest-init spawns must be in it while
/// it is waited for elsewhere (use [`spawn`] or [`output`]).
pub fn managed() -> Managed {
    static MANAGED: OnceLock<Managed> = OnceLock::new();
    MANAGED.get_or_init(Managed::default).clone()
}

/// Spawns `cmd` registered in [`managed`]; call [`release`] after waiting.
pub fn spawn(cmd: &mut tokio::process::Command) -> std::io::Result<tokio::process::Child> {
    let m = managed();
    let mut guard = m.lock();
    let child = cmd.spawn()?;
    if let Some(pid) = child.id() {
        guard.insert(pid);
    }
    Ok(child)
}

/// Forgets `pid` once its exit status was collected.
pub fn release(pid: Option<u32>) {
    if let Some(pid) = pid {
        managed().lock().remove(&pid);
    }
}

/// Runs `cmd` to completion (registered in [`managed`]) and collects its output.
pub async fn output(cmd: &mut tokio::process::Command) -> std::io::Result<std::process::Output> {
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = spawn(cmd)?;
    let pid = child.id();
    let out = child.wait_with_output().await;
    release(pid);
    out
}

impl Managed {
    /// Locks the set (hold it across a spawn, then insert the new pid).
    pub fn lock(&self) -> MutexGuard<'_, HashSet<u32>> {
        // A poisoned lock only means a panic elsewhere; the set is still valid.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One process as /proc/<pid>/stat describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcStat {
    /// Process id.
    pub pid: u32,
    /// Parent process id.
    pub ppid: u32,
    /// Process group id.
    pub pgrp: u32,
    /// State letter (R, S, Z, ...).
    pub state: char,
    /// Start time in clock ticks after boot.
    pub start: u64,
}

/// Reads /proc/<pid>/stat.
pub fn stat(pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces or ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(ProcStat {
        pid,
        state: f.first()?.chars().next()?,
        ppid: f.get(1)?.parse().ok()?,
        pgrp: f.get(2)?.parse().ok()?,
        start: f.get(19)?.parse().ok()?,
    })
}

/// Every process visible in /proc.
pub fn all_processes() -> Vec<ProcStat> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(stat)
        .collect()
}

/// The command line of `pid`, space-separated, for reports.
pub fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .split('\0')
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// This process's pid.
pub fn self_pid() -> u32 {
    std::process::id()
}

/// Reaps zombie children not in [`managed`]; returns how many were reaped.
pub fn reap_orphans() -> usize {
    let me = self_pid();
    let m = managed();
    let guard = m.lock();
    let mut reaped = 0;
    for p in all_processes() {
        if p.ppid == me && p.state == 'Z' && !guard.contains(&p.pid) {
            let mut status = 0;
            // SAFETY: waitpid(2) on a specific zombie child, WNOHANG; `status` is a valid out pointer.
            let rc = unsafe { libc::waitpid(p.pid as libc::pid_t, &mut status, libc::WNOHANG) };
            if rc > 0 {
                reaped += 1;
            }
        }
    }
    reaped
}

/// Makes this process the reaper of its orphaned descendants (no-op for PID 1).
pub fn become_subreaper() -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) takes no pointers.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Runs the reaper until the runtime stops: on every SIGCHLD, and once a
/// second in case signals were coalesced.
pub async fn run() {
    let mut sigchld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()).ok();
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        match &mut sigchld {
            Some(s) => {
                tokio::select! {
                    _ = s.recv() => {}
                    _ = tick.tick() => {}
                }
            }
            None => {
                tick.tick().await;
            }
        }
        let n = tokio::task::spawn_blocking(reap_orphans).await.unwrap_or(0);
        if n > 0 {
            tracing::debug!(reaped = n, "reaped orphans");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_stat() {
        let me = stat(self_pid()).unwrap();
        assert_eq!(me.pid, self_pid());
        assert!(me.start > 0);
        assert!(cmdline(self_pid()).contains("guest_init"));
    }
}
