//! A VMM child process under measurement: spawned with its serial console
//! (stdout) on a pipe whose chunks are timestamped as they arrive, reaped
//! with `wait4` so its CPU time is known, and killed if dropped while alive.

use std::ffi::OsStr;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{PerfError, Result};

/// Output kept per process; beyond this, further bytes are counted but dropped.
const MAX_KEPT_OUTPUT: usize = 8 << 20;
/// Stderr kept per process, for error messages.
const MAX_KEPT_STDERR: usize = 64 << 10;
/// Characters of output or stderr quoted in an error message.
const QUOTED_TAIL: usize = 600;

#[derive(Default)]
struct Output {
    data: Vec<u8>,
    /// `(end offset, arrival)` of each chunk read from the pipe.
    chunks: Vec<(usize, Instant)>,
    eof: bool,
}

#[derive(Default)]
struct Shared {
    output: Mutex<Output>,
    changed: Condvar,
    stderr: Mutex<Vec<u8>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A reader thread that panicked leaves consistent data behind (plain appends).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How a reaped child ended, with its resource usage.
#[derive(Debug, Clone, Copy)]
pub struct Exit {
    /// When `wait4` returned.
    pub at: Instant,
    /// Raw wait status.
    pub status: i32,
    /// User + system CPU time of the child and all its threads.
    pub cpu: Duration,
    /// Peak resident set size, in KiB.
    pub max_rss_kib: u64,
}

impl Exit {
    /// Whether the child exited normally with code 0.
    pub fn success(&self) -> bool {
        libc::WIFEXITED(self.status) && libc::WEXITSTATUS(self.status) == 0
    }

    /// A human description of the status.
    pub fn describe(&self) -> String {
        describe_status(self.status)
    }
}

fn describe_status(status: i32) -> String {
    if libc::WIFEXITED(status) {
        format!("exit code {}", libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        format!("signal {}", libc::WTERMSIG(status))
    } else {
        format!("wait status {status:#x}")
    }
}

/// A running (or exited but not yet reaped) VMM process.
pub struct VmProcess {
    what: String,
    pid: libc::pid_t,
    started: Instant,
    /// `started` as CLOCK_MONOTONIC ns, for the vmm's own phase marks.
    started_ns: u64,
    shared: Arc<Shared>,
    exit: Option<Exit>,
}

impl VmProcess {
    /// Spawns `program` with `args`, stdin from /dev/null, stdout and stderr
    /// on pipes. `started` is taken immediately before the spawn.
    pub fn spawn<I, S>(what: impl Into<String>, program: &Path, args: I) -> Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let started = Instant::now();
        let started_ns = crate::phases::now_ns();
        let mut child = cmd.spawn().map_err(|source| PerfError::Spawn {
            path: program.to_path_buf(),
            source,
        })?;
        let pid = child.id() as libc::pid_t;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        // The child is reaped with wait4, never through `Child`, whose drop
        // neither waits nor kills; from here on `VmProcess`'s drop kills it.
        drop(child);
        let process = VmProcess {
            what: what.into(),
            pid,
            started,
            started_ns,
            shared: Arc::new(Shared::default()),
            exit: None,
        };
        let thread_err = |source| PerfError::Io {
            action: "cannot start an output reader thread for",
            path: program.to_path_buf(),
            source,
        };
        if let Some(stdout) = stdout {
            let shared = process.shared.clone();
            std::thread::Builder::new()
                .name("vmm-stdout".into())
                .spawn(move || read_output(stdout, &shared))
                .map_err(thread_err)?;
        }
        if let Some(stderr) = stderr {
            let shared = process.shared.clone();
            std::thread::Builder::new()
                .name("vmm-stderr".into())
                .spawn(move || read_stderr(stderr, &shared))
                .map_err(thread_err)?;
        }
        Ok(process)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    /// CLOCK_MONOTONIC ns read just before `fork`.
    pub fn started_ns(&self) -> u64 {
        self.started_ns
    }

    /// `at` (an instant after the spawn) as CLOCK_MONOTONIC ns.
    pub fn monotonic_ns(&self, at: Instant) -> u64 {
        crate::phases::instant_ns(self.started, self.started_ns, at)
    }

    /// The instant immediately before the spawn.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// What this process is, for messages.
    pub fn what(&self) -> &str {
        &self.what
    }

    /// The stderr seen so far (its first 64 KiB).
    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&lock(&self.shared.stderr)).into_owned()
    }

    /// The end of the stderr seen so far.
    pub fn stderr_tail(&self) -> String {
        tail(&lock(&self.shared.stderr))
    }

    /// The end of the serial output seen so far.
    pub fn output_tail(&self) -> String {
        tail(&lock(&self.shared.output).data)
    }

    /// A copy of all serial output kept so far.
    pub fn output(&self) -> Vec<u8> {
        lock(&self.shared.output).data.clone()
    }

    /// Length of the serial output so far: pass it as `from` to wait for
    /// output that arrives after this point.
    pub fn output_len(&self) -> usize {
        lock(&self.shared.output).data.len()
    }

    /// Waits until `pattern` appears in the serial output at or after byte
    /// `from`; returns when the chunk completing it arrived and the offset
    /// just past it. An empty pattern matches the first byte after `from`.
    pub fn wait_for(
        &mut self,
        pattern: &str,
        from: usize,
        timeout: Duration,
    ) -> Result<(Instant, usize)> {
        let deadline = Instant::now() + timeout;
        let pat = pattern.as_bytes();
        let mut out = lock(&self.shared.output);
        loop {
            let found = if pat.is_empty() {
                (out.data.len() > from).then_some(from + 1)
            } else {
                out.data
                    .get(from..)
                    .and_then(|hay| hay.windows(pat.len()).position(|w| w == pat))
                    .map(|pos| from + pos + pat.len())
            };
            if let Some(end) = found {
                let at = out
                    .chunks
                    .iter()
                    .find(|(chunk_end, _)| *chunk_end >= end)
                    .map(|(_, at)| *at)
                    // Invariant: every kept byte belongs to a recorded chunk.
                    .unwrap_or_else(Instant::now);
                return Ok((at, end));
            }
            let waiting_for = if pat.is_empty() {
                "guest output".to_string()
            } else {
                format!("guest output {pattern:?}")
            };
            if out.eof {
                drop(out);
                // The output closes as the process exits: reap it for its status.
                let status = match self.wait_exit(Duration::from_secs(5)) {
                    Ok(exit) => exit.describe(),
                    Err(_) => "closed its output".into(),
                };
                return Err(PerfError::EarlyExit {
                    what: self.what.clone(),
                    status,
                    waiting_for,
                    stderr: self.stderr_tail(),
                    output: self.output_tail(),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                drop(out);
                return Err(self.timeout(timeout, waiting_for));
            }
            out = self
                .shared
                .changed
                .wait_timeout(out, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn timeout(&self, timeout: Duration, waiting_for: String) -> PerfError {
        PerfError::Timeout {
            what: self.what.clone(),
            secs: timeout.as_secs(),
            waiting_for,
            stderr: self.stderr_tail(),
            output: self.output_tail(),
        }
    }

    /// Waits for the process to exit on its own (its output closes), then
    /// reaps it. On timeout the process is killed and an error returned.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<Exit> {
        if let Some(exit) = self.exit {
            return Ok(exit);
        }
        let deadline = Instant::now() + timeout;
        {
            let mut out = lock(&self.shared.output);
            while !out.eof {
                let now = Instant::now();
                if now >= deadline {
                    drop(out);
                    let err = self.timeout(timeout, "the process to exit".into());
                    self.kill();
                    return Err(err);
                }
                out = self
                    .shared
                    .changed
                    .wait_timeout(out, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        self.reap()
    }

    /// Blocks in `wait4` until the child is gone; records and returns how it ended.
    fn reap(&mut self) -> Result<Exit> {
        if let Some(exit) = self.exit {
            return Ok(exit);
        }
        let mut status = 0;
        // SAFETY: an all-zero rusage is a valid value of this plain C struct.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: `pid` is our child and not yet reaped (`exit` is None);
            // the pointers are to live locals.
            let r = unsafe { libc::wait4(self.pid, &mut status, 0, &mut usage) };
            if r == self.pid {
                break;
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(PerfError::Io {
                    action: "cannot wait for",
                    path: PathBuf::from(format!("pid {}", self.pid)),
                    source: err,
                });
            }
        }
        let at = Instant::now();
        let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
        let exit = Exit {
            at,
            status,
            cpu: tv(usage.ru_utime) + tv(usage.ru_stime),
            max_rss_kib: usage.ru_maxrss as u64,
        };
        self.exit = Some(exit);
        Ok(exit)
    }

    /// Kills the process (SIGKILL) if it has not been reaped, and reaps it.
    pub fn kill(&mut self) -> Option<Exit> {
        if self.exit.is_none() {
            // SAFETY: the pid is our unreaped child, so it cannot have been recycled.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
        }
        self.reap().ok()
    }

    /// Fails with [`PerfError::BadExit`] unless `exit` is a clean exit.
    pub fn check_success(&self, exit: &Exit) -> Result<()> {
        if exit.success() {
            Ok(())
        } else {
            Err(PerfError::BadExit {
                what: self.what.clone(),
                status: exit.describe(),
                stderr: self.stderr_tail(),
            })
        }
    }
}

impl Drop for VmProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Reads the child's serial output until EOF, timestamping each chunk.
fn read_output(mut stdout: impl Read, shared: &Shared) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match stdout.read(&mut buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Ok(0) | Err(_) => 0,
            Ok(n) => n,
        };
        let now = Instant::now();
        let mut out = lock(&shared.output);
        if n == 0 {
            out.eof = true;
            shared.changed.notify_all();
            return;
        }
        if out.data.len() + n <= MAX_KEPT_OUTPUT {
            out.data.extend_from_slice(&buf[..n]);
            let end = out.data.len();
            out.chunks.push((end, now));
        }
        shared.changed.notify_all();
    }
}

/// Keeps the start of the child's stderr for error messages.
fn read_stderr(mut stderr: impl Read, shared: &Shared) {
    let mut buf = [0u8; 4096];
    loop {
        match stderr.read(&mut buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let mut err = lock(&shared.stderr);
                if err.len() + n <= MAX_KEPT_STDERR {
                    err.extend_from_slice(&buf[..n]);
                }
            }
        }
    }
}

fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let chars: Vec<char> = text.chars().collect();
    let start = chars.len().saturating_sub(QUOTED_TAIL);
    chars[start..].iter().collect::<String>().trim().to_string()
}

/// Waits until `path` exists (a socket the child creates), up to `timeout`.
pub fn wait_for_path(proc_: &VmProcess, path: &Path, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !path.exists() {
        if lock(&proc_.shared.output).eof {
            return Err(PerfError::EarlyExit {
                what: proc_.what.clone(),
                status: "closed its output".into(),
                waiting_for: format!("socket {}", path.display()),
                stderr: proc_.stderr_tail(),
                output: proc_.output_tail(),
            });
        }
        if Instant::now() >= deadline {
            return Err(proc_.timeout(timeout, format!("socket {}", path.display())));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}
