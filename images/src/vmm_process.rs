//! Starting and stopping a vmm process, and finding the vmm binary.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// The vmm binary: `explicit`, else `vmm` beside this program (cargo puts
/// workspace binaries together), else `vmm` in `PATH`.
pub fn locate(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return if p.exists() {
            Ok(p.to_path_buf())
        } else {
            Err(Error::BadArtifact {
                path: p.to_path_buf(),
                message: "no vmm binary here".into(),
            })
        };
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.to_path_buf()))
        .into_iter()
        .flat_map(|d| [d.join("vmm"), d.join("../vmm")]);
    beside
        .chain(crate::tools::find_program("vmm"))
        .find(|p| p.is_file())
        .ok_or_else(|| Error::MissingTools {
            step: "golden snapshot".into(),
            missing: vec![crate::error::MissingTool {
                tool: "vmm".into(),
                package: "this repository's vmm: cargo build --release -p vmm, then pass --vmm target/release/vmm".into(),
            }],
        })
}

/// A running vmm, stopped (SIGKILL) and reaped when dropped.
pub struct VmmProcess {
    child: Child,
    console: PathBuf,
}

impl VmmProcess {
    /// Starts `vmm` with `args`; the guest console goes to `console`.
    pub fn spawn(vmm: &Path, args: &[String], console: &Path) -> Result<Self> {
        let child = Command::new(vmm)
            .args(args)
            .arg("--serial")
            .arg(format!("file:{}", console.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|source| Error::Spawn {
                step: "start the vmm".into(),
                program: vmm.display().to_string(),
                source,
            })?;
        Ok(Self {
            child,
            console: console.to_path_buf(),
        })
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
        while Instant::now() < deadline {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// The last `lines` lines of the guest console.
    pub fn console_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.console).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for VmmProcess {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            // Best effort: the process may have exited in between.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
