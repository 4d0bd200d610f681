//! One vmm process running a real guest, from the scenario runner: its
//! console (the vmm's stdout) captured line by line to a file and kept for
//! waits, its stdin for serial input, its control socket, and a watchdog:
//! a guest that does not get where a scenario waits for within the time
//! given is recorded (see [`super::hang`]) and killed, and the scenario fails.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use images::vmm_control::VmmControl;
use serde_json::Value;

use super::{Check, Ctx, INFRA_MARK};

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
    /// Its RAM, when the arguments say (`--mem-mib`; a restore takes the snapshot's).
    ram_bytes: Option<u64>,
}

/// Console silence after which a wait checks for the outer VM's emulation
/// stall (`hang::emulation_stall`), and again after each further stretch.
const QUIET_CHECK: Duration = Duration::from_secs(40);

impl Guest {
    /// Starts `vmm <args>` with the console on stdout (captured) and a
    /// control socket at `<scratch>/<name>.ctl` unless `args` has one.
    pub fn start(ctx: &Ctx, name: &str, args: &[String]) -> Result<Guest, String> {
        let run_dir = ctx.scratch.clone();
        let vmm = &ctx.env.vmm;
        std::fs::create_dir_all(&run_dir).map_err(|e| format!("{}: {e}", run_dir.display()))?;
        let control_path = run_dir.join(format!("{name}.ctl"));
        let _ = std::fs::remove_file(&control_path);
        let stderr_path = run_dir.join(format!("{name}.stderr"));
        let stderr = std::fs::File::create(&stderr_path)
            .map_err(|e| format!("{}: {e}", stderr_path.display()))?;
        let mut cmd = Command::new(vmm);
        cmd.args(args);
        if !args.iter().any(|a| a == "--control-socket") {
            cmd.arg("--control-socket").arg(&control_path);
        }
        if !args.iter().any(|a| a == "--serial") {
            cmd.args(["--serial", "stdout"]);
        }
        let mut child = cmd
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
        let ram_bytes = args
            .iter()
            .position(|a| a == "--mem-mib")
            .and_then(|i| args.get(i + 1))
            .and_then(|m| m.parse::<u64>().ok())
            .map(|mib| mib << 20);
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
    pub fn control(&self) -> Result<VmmControl, String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match VmmControl::connect(&self.control_path, Duration::from_secs(300)) {
                Ok(c) => return Ok(c),
                Err(e) if Instant::now() >= deadline => {
                    return Err(format!(
                        "control socket {}: {e}",
                        self.control_path.display()
                    ))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// One control request; the answer when it says `ok:true`.
    pub fn request(&self, request: Value) -> Result<Value, String> {
        self.control()?.request(&request).map_err(|e| e.to_string())
    }

    /// The guest memory checksum (`memory_checksum`).
    pub fn checksum(&self) -> Result<String, String> {
        let v = self.request(serde_json::json!({"op": "memory_checksum"}))?;
        v.get("crc64")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| format!("memory_checksum answered {v}"))
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
