//! One vmm process running a real guest, from the scenario runner: its
//! console (the vmm's stdout) captured line by line to a file and kept for
//! waits, its stdin for serial input, its control socket, and a watchdog:
//! a guest that does not get where a scenario waits for within the time
//! given is recorded (see [`super::hang`]) and killed, and the scenario fails.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use vmm_api::{Client, ControlError, SnapshotKind, SnapshotReply, StatusReply};

use super::{Check, Ctx, INFRA_MARK};

/// How a guest's vmm starts: `vmm run` or `vmm restore`.
pub use vmm_api::VmmCommand as Launch;

/// The guest's RAM when the command line says (a restore takes the
/// snapshot's).
fn ram_bytes(launch: &Launch) -> Option<u64> {
    match launch {
        Launch::Run(r) => Some(r.mem_mib << 20),
        Launch::Restore(_) => None,
    }
}

/// How long [`Guest::control`] waits for the control socket to appear.
const CONTROL_WAIT: Duration = Duration::from_secs(60);
/// How long a control request may take to be answered (a snapshot of a
/// guest under nested emulation takes a while).
const CONTROL_ANSWER: Duration = Duration::from_secs(300);

/// Console lines seen so far, and whether the stream has ended.
#[derive(Default)]
struct Console {
    lines: Mutex<(Vec<String>, bool)>,
    grew: Condvar,
}

/// A running vmm.
pub struct Guest {
    /// Name (file names, messages).
    pub name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    console: Arc<Console>,
    /// Control socket path (when the guest has one).
    pub control_path: PathBuf,
    /// Where its console, stderr and hang report are written while it runs
    /// (the outer VM's memory: the vmm never writes to the 9p share).
    pub run_dir: PathBuf,
    /// Where they are copied when it ends (the shared logs directory).
    pub log_dir: PathBuf,
    /// Its RAM, when the command line says (a restore takes the snapshot's).
    ram_bytes: Option<u64>,
}

/// Console silence after which a wait checks for the outer VM's emulation
/// stall (`hang::emulation_stall`), and again after each further stretch.
const QUIET_CHECK: Duration = Duration::from_secs(40);

impl Guest {
    /// Starts the vmm `launch` describes, with the console where its
    /// devices say (stdout, captured, unless set otherwise) and a control
    /// socket at `<scratch>/<name>.ctl` unless it names one.
    pub fn start(ctx: &Ctx, name: &str, launch: impl Into<Launch>) -> Result<Guest, String> {
        let mut launch = launch.into();
        let run_dir = ctx.scratch.clone();
        let vmm = &ctx.env.vmm;
        std::fs::create_dir_all(&run_dir).map_err(|e| format!("{}: {e}", run_dir.display()))?;
        let control_path = launch
            .devices_mut()
            .control_socket
            .get_or_insert_with(|| run_dir.join(format!("{name}.ctl")))
            .clone();
        let _ = std::fs::remove_file(&control_path);
        let stderr_path = run_dir.join(format!("{name}.stderr"));
        let stderr = std::fs::File::create(&stderr_path)
            .map_err(|e| format!("{}: {e}", stderr_path.display()))?;
        let mut child = Command::new(vmm)
            .args(launch.args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", vmm.display()))?;
        let console = Arc::new(Console::default());
        let log_path = run_dir.join(format!("{name}.console"));
        let mut log =
            std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
        if let Some(out) = child.stdout.take() {
            let console = console.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(out);
                let mut buf = Vec::new();
                loop {
                    buf.clear();
                    let n = reader.read_until(b'\n', &mut buf).unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    let _ = log.write_all(&buf);
                    let line = String::from_utf8_lossy(&buf)
                        .trim_end_matches(['\r', '\n'])
                        .to_string();
                    let mut g = console.lines.lock().unwrap_or_else(|p| p.into_inner());
                    g.0.push(line);
                    console.grew.notify_all();
                }
                let mut g = console.lines.lock().unwrap_or_else(|p| p.into_inner());
                g.1 = true;
                console.grew.notify_all();
            });
        }
        let stdin = child.stdin.take();
        let ram_bytes = ram_bytes(&launch);
        Ok(Guest {
            name: name.to_string(),
            child,
            stdin,
            console,
            control_path,
            run_dir,
            log_dir: ctx.out.clone(),
            ram_bytes,
        })
    }

    /// The vmm's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Console lines so far.
    pub fn lines(&self) -> Vec<String> {
        self.console
            .lines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .clone()
    }

    /// Console lines that contain `needle`.
    pub fn lines_with(&self, needle: &str) -> Vec<String> {
        self.lines()
            .into_iter()
            .filter(|l| l.contains(needle))
            .collect()
    }

    /// Waits for a console line at index `from` or later containing
    /// `needle`; returns it with its index. On timeout (or if the console
    /// ends first) the vmm is recorded and killed and the error says why.
    /// A console silent for [`QUIET_CHECK`] is checked for the outer VM's
    /// emulation stall, which fails the wait at once with [`INFRA_MARK`].
    pub fn wait_from(
        &mut self,
        from: usize,
        needle: &str,
        timeout: Duration,
    ) -> Result<(usize, String), String> {
        let deadline = Instant::now() + timeout;
        let mut g = self.console.lines.lock().unwrap_or_else(|p| p.into_inner());
        let (mut seen, mut quiet_since) = (g.0.len(), Instant::now());
        loop {
            if let Some((i, l)) =
                g.0.iter()
                    .enumerate()
                    .skip(from)
                    .find(|(_, l)| l.contains(needle))
            {
                return Ok((i, l.clone()));
            }
            let now = Instant::now();
            if g.1 || now >= deadline {
                let ended = g.1;
                drop(g);
                let why = if ended {
                    // The console ends when the vmm exits: let it be reaped first.
                    let _ = self.wait_exit_quietly(Duration::from_secs(5));
                    format!(
                        "the guest's console ended ({}) before {needle:?}",
                        self.status_text()
                    )
                } else {
                    format!("{needle:?} not seen within {} s", timeout.as_secs())
                };
                return Err(self.fail(&why));
            }
            if g.0.len() != seen {
                (seen, quiet_since) = (g.0.len(), now);
            } else if now - quiet_since >= QUIET_CHECK {
                drop(g);
                if let Some(why) = super::hang::emulation_stall(self.ram_bytes) {
                    return Err(
                        self.fail(&format!("{INFRA_MARK}{why} while waiting for {needle:?}"))
                    );
                }
                quiet_since = Instant::now();
                g = self.console.lines.lock().unwrap_or_else(|p| p.into_inner());
                continue;
            }
            let wake = deadline.min(quiet_since + QUIET_CHECK);
            g = self
                .console
                .grew
                .wait_timeout(g, wake.saturating_duration_since(now))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// [`Self::wait_from`] from the first line.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> Result<String, String> {
        self.wait_from(0, needle, timeout).map(|(_, l)| l)
    }

    /// Writes `text` to the guest's serial input.
    pub fn send(&mut self, text: &str) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or("the vmm's stdin is closed")?;
        stdin
            .write_all(text.as_bytes())
            .and_then(|_| stdin.flush())
            .map_err(|e| format!("writing to the vmm's stdin: {e}"))
    }

    /// Waits for the vmm to exit; on timeout it is recorded and killed.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus, String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait().map_err(|e| e.to_string())? {
                return Ok(s);
            }
            if Instant::now() >= deadline {
                return Err(self.fail(&format!(
                    "the vmm did not exit within {} s",
                    timeout.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn wait_exit_quietly(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the vmm to exit with status 0.
    pub fn expect_clean_exit(&mut self, timeout: Duration) -> Check {
        let s = self.wait_exit(timeout)?;
        if s.success() {
            Ok(String::new())
        } else {
            Err(format!("the vmm exited with {s}; {}", self.stderr_tail()))
        }
    }

    /// A connection to the control socket (retried while it appears).
    pub fn control(&self) -> Result<Client, String> {
        Client::connect_retry(&self.control_path, CONTROL_WAIT, CONTROL_ANSWER)
            .map_err(|e| e.to_string())
    }

    /// One request on a new connection to the control socket.
    fn with_control<T>(
        &self,
        request: impl FnOnce(&mut Client) -> Result<T, ControlError>,
    ) -> Result<T, String> {
        request(&mut self.control()?).map_err(|e| e.to_string())
    }

    /// The VM's state. An answer means the vmm is serving its VM (for a
    /// restore: the snapshot is loaded and the devices are set up).
    pub fn status(&self) -> Result<StatusReply, String> {
        self.with_control(Client::status)
    }

    /// Parks every vCPU.
    pub fn pause(&self) -> Result<StatusReply, String> {
        self.with_control(Client::pause)
    }

    /// Lets the parked vCPUs run.
    pub fn resume(&self) -> Result<StatusReply, String> {
        self.with_control(Client::resume)
    }

    /// Ends the VM (the vmm answers, then exits 0).
    pub fn stop(&self) -> Result<StatusReply, String> {
        self.with_control(Client::stop)
    }

    /// Writes a snapshot of the paused VM into `dir` (which must not exist).
    pub fn snapshot(&self, dir: &Path, kind: SnapshotKind) -> Result<SnapshotReply, String> {
        self.with_control(|c| c.snapshot(dir, kind))
    }

    /// The guest memory checksum (`memory_checksum`): its `crc64`.
    pub fn checksum(&self) -> Result<String, String> {
        self.with_control(Client::memory_checksum)
            .map(|reply| reply.crc64)
    }

    /// The last lines of the vmm's stderr.
    pub fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(self.run_dir.join(format!("{}.stderr", self.name)))
            .unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        format!(
            "vmm stderr: {}",
            lines[lines.len().saturating_sub(4)..].join(" | ")
        )
    }

    fn status_text(&mut self) -> String {
        match self.child.try_wait() {
            Ok(Some(s)) => format!("vmm {s}"),
            _ => "vmm still running".into(),
        }
    }

    /// Records what the vmm is doing, kills it, and returns `why` with the
    /// console's last lines and where the full report is.
    fn fail(&mut self, why: &str) -> String {
        let mut msg = why.to_string();
        if self.child.try_wait().ok().flatten().is_none() {
            let report = super::hang::report(self.pid());
            let path = self.log_dir.join(format!("{}.hang", self.name));
            let _ = std::fs::write(&path, &report);
            for l in report.lines() {
                println!("{}", crate::report::info_line(&self.name, l));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
            msg.push_str(&format!(
                "; vmm threads and KVM counters in {}",
                path.display()
            ));
        } else {
            msg.push_str(&format!("; {}", self.stderr_tail()));
        }
        let lines = self.lines();
        let tail = &lines[lines.len().saturating_sub(3)..];
        msg.push_str(&format!("; console tail: {}", tail.join(" | ")));
        msg
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        for ext in ["console", "stderr"] {
            let file = format!("{}.{ext}", self.name);
            let _ = std::fs::copy(self.run_dir.join(&file), self.log_dir.join(&file));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_api::{RestoreSpec, RunSpec};

    #[test]
    fn launches_give_their_command_lines_and_ram() {
        let mut run = Launch::from(RunSpec::new("/k/vmlinux"));
        run.devices_mut().control_socket = Some("/s/g.ctl".into());
        assert_eq!(
            run.args().join(" "),
            "run --kernel /k/vmlinux --mem-mib 128 --vcpus 1 --serial stdout \
             --control-socket /s/g.ctl"
        );
        assert_eq!(ram_bytes(&run), Some(128 << 20));
        let restore = Launch::from(RestoreSpec::new("/s/snap"));
        assert_eq!(
            restore.args().join(" "),
            "restore --snapshot /s/snap --serial stdout"
        );
        assert_eq!(ram_bytes(&restore), None);
    }
}
