//! A blocking handle on a vmm process (the images CLI and tests), and where
//! to find the vmm binary. host-agent supervises its vmm processes with
//! tokio and pidfds instead, from the same command lines ([`crate::command`]).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The vmm binary: `explicit` when given, else `vmm` beside the running
/// program (cargo puts a workspace's binaries together, tests one level
/// below), else `vmm` in `PATH`. `None` when there is none.
pub fn locate(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return p.is_file().then(|| p.to_path_buf());
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf))
        .into_iter()
        .flat_map(|d| [d.join("vmm"), d.join("../vmm")]);
    let in_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("vmm"));
    beside.chain(in_path).find(|p| p.is_file())
}

/// A running vmm, killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub struct VmmChild {
    child: Child,
}

impl VmmChild {
    /// Starts `vmm` with `args`: stdin from /dev/null, stdout discarded,
    /// stderr inherited (the vmm's own log lines reach the caller's terminal).
    pub fn spawn(vmm: &Path, args: &[String]) -> std::io::Result<Self> {
        Self::spawn_with(vmm, args, Stdio::null(), Stdio::inherit())
    }

    /// Starts `vmm` with `args` and the given stdout and stderr.
    pub fn spawn_with(
        vmm: &Path,
        args: &[String],
        stdout: Stdio,
        stderr: Stdio,
    ) -> std::io::Result<Self> {
        let child = Command::new(vmm)
            .args(args)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()?;
        Ok(Self { child })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The child, for its pipes.
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// `Some(exit description)` once the process has ended.
    pub fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(status.to_string()),
            Ok(None) => None,
            Err(e) => Some(format!("unknown ({e})")),
        }
    }

    /// Waits up to `timeout` for the process to end by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the process (if still running) and reaps it.
    pub fn kill(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            // Best effort: the process may have exited in between.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Drop for VmmChild {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The last `lines` lines of a text file (a console log), empty if unreadable.
pub fn file_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_are_waited_for_and_killed_on_drop() {
        let mut quick =
            VmmChild::spawn(Path::new("/bin/sh"), &["-c".into(), "exit 3".into()]).unwrap();
        let status = quick.wait_exit(Duration::from_secs(10)).unwrap();
        assert!(status.contains('3'), "{status}");
        let slow = VmmChild::spawn(Path::new("/bin/sleep"), &["30".into()]).unwrap();
        let pid = slow.pid();
        drop(slow);
        // Reaped: the pid no longer names a process of ours.
        assert!(
            !Path::new(&format!("/proc/{pid}/cmdline")).exists() || {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .unwrap_or_default()
                    .is_empty()
            }
        );
    }

    #[test]
    fn locate_prefers_an_explicit_path_and_refuses_a_missing_one() {
        assert_eq!(
            locate(Some(Path::new("/bin/sh"))),
            Some(PathBuf::from("/bin/sh"))
        );
        assert_eq!(locate(Some(Path::new("/nonexistent/vmm"))), None);
    }

    #[test]
    fn tails_are_the_last_lines() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("c.log");
        std::fs::write(&f, "a\nb\nc\n").unwrap();
        assert_eq!(file_tail(&f, 2), "b\nc");
        assert_eq!(file_tail(&d.path().join("none"), 2), "");
    }
}
