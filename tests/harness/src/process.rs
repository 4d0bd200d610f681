//! Child processes of a test: started so they die with it, waited for
//! with a deadline, killed by pid or by the directory they use.

use std::ffi::OsStr;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A command for `program` with stdin from /dev/null that gets SIGKILL when
/// the thread that spawned it ends, so a failing assertion never leaves it
/// (a VM, say) running.
pub fn command(program: impl AsRef<OsStr>) -> Command {
    let mut cmd = Command::new(program);
    cmd.stdin(Stdio::null());
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets a flag on the child between
    // fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// Waits for `child` to exit within `limit` and returns its output;
/// kills it and panics with what it printed otherwise.
pub fn wait_with_deadline(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    let pid = child.id();
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            return child.wait_with_output().expect("collect output");
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect output");
            panic!(
                "process {pid} did not exit within {limit:?}\nstdout: {}\nstderr: {}",
                stdout(&out),
                stderr(&out)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until `path` exists (a socket a child creates); panics after
/// `limit`.
pub fn wait_for_path(path: &Path, limit: Duration) {
    let start = Instant::now();
    while !path.exists() {
        assert!(start.elapsed() < limit, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Whether a Unix socket bound at `path` is listening (in this network
/// namespace's `/proc/net/unix`, flagged `__SO_ACCEPTCON`). A socket file
/// appears at bind(), before listen(): a client connecting in between is
/// refused, and probing with a connection would be taken by a server that
/// serves only its first client (virtiofsd).
pub fn unix_socket_listening(path: &Path) -> bool {
    const ACCEPTING: u32 = 0x0001_0000;
    let Some(want) = path.to_str() else {
        return false;
    };
    std::fs::read_to_string("/proc/net/unix")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .any(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags = fields
                .get(3)
                .and_then(|f| u32::from_str_radix(f, 16).ok())
                .unwrap_or(0);
            flags & ACCEPTING != 0 && fields.get(7) == Some(&want)
        })
}

/// A process's stdout as text.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A process's stderr as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `cmd` and returns whether it succeeded, with its stdout and stderr
/// together.
pub fn sh(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    let mut text = stdout(&out);
    text.push_str(&stderr(&out));
    (out.status.success(), text)
}

/// Sends SIGKILL to `pid`.
pub fn sigkill(pid: u32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid as i32, libc::SIGKILL);
    }
}

/// Whether process `pid` has exited: gone from /proc, or dead and not yet
/// reaped by whoever inherited it.
pub fn is_gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
        s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z'))
    })
}

/// The children of `pid` (of any of its threads), with their names.
pub fn children(pid: u32) -> Vec<(u32, String)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten();
    tasks
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .map(|c| {
            let comm = std::fs::read_to_string(format!("/proc/{c}/comm")).unwrap_or_default();
            (c, comm.trim().to_string())
        })
        .collect()
}

/// SIGKILLs every process whose command line mentions `dir` (the vmm
/// processes of a test's state directory, which outlive a killed parent).
pub fn kill_processes_under(dir: &Path) {
    let needle = dir.display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            if String::from_utf8_lossy(&cmd).contains(&needle) {
                sigkill(pid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_is_listed_and_gone_once_it_exits() {
        let mut child = command("sleep").arg("30").spawn().unwrap();
        let me = std::process::id();
        let listed = children(me);
        assert!(
            listed
                .iter()
                .any(|(p, comm)| *p == child.id() && comm == "sleep"),
            "{listed:?}"
        );
        assert!(!is_gone(child.id()));
        sigkill(child.id());
        // Dead but not yet reaped counts as gone.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !is_gone(child.id()) {
            assert!(Instant::now() < deadline, "SIGKILL did not end it");
            std::thread::sleep(Duration::from_millis(5));
        }
        child.wait().unwrap();
        assert!(is_gone(child.id()));
    }

    #[test]
    fn a_quick_child_is_collected_and_a_slow_one_killed() {
        let out = wait_with_deadline(
            command("sh")
                .args(["-c", "echo out; echo err >&2"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
            Duration::from_secs(20),
        );
        assert_eq!(
            (stdout(&out).as_str(), stderr(&out).as_str()),
            ("out\n", "err\n")
        );
        let slow = command("sleep")
            .arg("30")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let e = std::panic::catch_unwind(|| wait_with_deadline(slow, Duration::from_millis(50)))
            .unwrap_err();
        let msg = e.downcast_ref::<String>().unwrap();
        assert!(msg.contains("did not exit within"), "{msg}");
    }

    #[test]
    fn processes_naming_a_directory_are_killed() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("log");
        std::fs::write(&file, "").unwrap();
        let mut child = Command::new("tail").arg("-f").arg(&file).spawn().unwrap();
        // Until the child has exec'ed, its command line is this test's and
        // names no directory: wait for tail's own.
        let cmdline = format!("/proc/{}/cmdline", child.id());
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read(&cmdline)
            .map(|c| String::from_utf8_lossy(&c).contains(&*dir.path().to_string_lossy()))
            .unwrap_or(false)
        {
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("tail never showed its command line");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        kill_processes_under(dir.path());
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
    }

    #[test]
    fn sh_joins_both_streams() {
        let (ok, text) = sh(Command::new("sh").args(["-c", "echo a; echo b >&2; exit 3"]));
        assert!(!ok);
        assert_eq!(text, "a\nb\n");
    }
}

#[cfg(test)]
mod listening_tests {
    use super::*;

    #[test]
    fn a_bound_socket_listens_only_after_listen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        assert!(!unix_socket_listening(&path));
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        assert!(unix_socket_listening(&path));
        drop(listener);
        assert!(!unix_socket_listening(&path));
    }
}
