//! A virtiofsd serving one directory to one vmm, from the scenario runner:
//! started before the vmm (which connects to its socket when it starts),
//! its output kept in a log, killed when dropped. virtiofsd serves a single
//! frontend and exits when it disconnects, so every `vmm run` and every
//! `vmm restore` gets a fresh one.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use vmm_api::FsSpec;

use super::Ctx;

/// How long virtiofsd may take to listen on its socket.
const LISTEN_WAIT: Duration = Duration::from_secs(60);

/// virtiofsd's `--sandbox`. Its default (`namespace`: new mount, PID and
/// network namespaces and a pivot_root into the shared directory) works in
/// the outer VM, chrooted as the runner is into the host's tree.
const SANDBOX: &str = "namespace";

/// How a virtiofsd is started.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// `--readonly`: the guest may not change the directory.
    pub readonly: bool,
}

/// A running virtiofsd.
pub struct Virtiofsd {
    /// Name (file names, messages).
    pub name: String,
    child: Child,
    /// The vhost-user socket it listens on.
    pub socket: PathBuf,
    log: PathBuf,
    log_dir: PathBuf,
}

impl Virtiofsd {
    /// Starts virtiofsd on `shared` with its socket and log at
    /// `<scratch>/<name>.vfs.sock` and `.vfs.log`, and waits until it listens.
    pub fn start(ctx: &Ctx, name: &str, shared: &Path, opts: Options) -> Result<Virtiofsd, String> {
        let socket = ctx.scratch.join(format!("{name}.vfs.sock"));
        let log = ctx.scratch.join(format!("{name}.vfs.log"));
        let _ = std::fs::remove_file(&socket);
        let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out
            .try_clone()
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let mut cmd = Command::new(&ctx.env.virtiofsd);
        cmd.arg("--shared-dir")
            .arg(shared)
            .arg("--socket-path")
            .arg(&socket)
            .args(["--sandbox", SANDBOX, "--cache", "auto"])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        if opts.readonly {
            cmd.arg("--readonly");
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", ctx.env.virtiofsd.display()))?;
        let mut fs = Virtiofsd {
            name: name.to_string(),
            child,
            socket,
            log,
            log_dir: ctx.out.clone(),
        };
        let t0 = Instant::now();
        while !fs.socket.exists() {
            if let Some(status) = fs.child.try_wait().map_err(|e| e.to_string())? {
                return Err(format!(
                    "virtiofsd {name} exited ({status}) before listening: {}",
                    fs.log_tail()
                ));
            }
            if t0.elapsed() >= LISTEN_WAIT {
                return Err(format!(
                    "virtiofsd {name} made no socket {} within {} s: {}",
                    fs.socket.display(),
                    LISTEN_WAIT.as_secs(),
                    fs.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(fs)
    }

    /// The `--fs` device for this backend under `tag`.
    pub fn device(&self, tag: &str) -> Result<FsSpec, String> {
        FsSpec::new(tag, &self.socket).map_err(|e| e.to_string())
    }

    /// Its exit status, once it has exited (it does when its vmm goes),
    /// waiting up to `timeout`; `None` while it still runs.
    pub fn exited_within(&mut self, timeout: Duration) -> Option<ExitStatus> {
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

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        format!(
            "virtiofsd log: {}",
            lines[lines.len().saturating_sub(4)..].join(" | ")
        )
    }
}

impl Drop for Virtiofsd {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if let Some(file) = self.log.file_name() {
            let _ = std::fs::copy(&self.log, self.log_dir.join(file));
        }
    }
}
