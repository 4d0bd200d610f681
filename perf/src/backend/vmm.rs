//! Our vmm, driven through its command line (`vmm run`, `vmm restore`) and
//! its JSON-lines control socket.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use super::control_socket::ControlClient;
use super::{Backend, BootSpec, Handle, SnapshotKind, Subject, Vm};
use crate::error::{PerfError, Result};
use crate::process::VmProcess;

/// The message scenarios report when the vmm cannot restore.
pub const NO_RESTORE: &str = "skipped: vmm has no restore";
/// Log target of the vmm's "ACPI tables written" event (field `build_us`).
pub const ACPI_TIMING_TARGET: &str = "vmm::acpi";
/// Log target of the vmm's "MP table written" event (field `build_us`).
pub const MPTABLE_TIMING_TARGET: &str = "vmm::mptable";

/// The `build_us` field of the first JSON log line with `target` in the
/// vmm's stderr: a setup step the vmm timed itself, in microseconds.
pub fn logged_build_us(stderr: &str, target: &str) -> Option<f64> {
    stderr
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .find(|event| event["target"] == target)
        .and_then(|event| event["fields"]["build_us"].as_f64())
}

/// Our vmm binary.
pub struct VmmBackend {
    binary: PathBuf,
    memory_backend: Option<String>,
    has_restore: bool,
}

impl VmmBackend {
    /// A backend for the vmm at `binary`; `memory_backend` is passed to
    /// `vmm restore --memory-backend` when set. Probes once whether the
    /// binary has the `restore` subcommand.
    pub fn new(binary: PathBuf, memory_backend: Option<String>) -> Self {
        let has_restore = Command::new(&binary)
            .args(["restore", "--help"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        VmmBackend {
            binary,
            memory_backend,
            has_restore,
        }
    }

    fn client(vm: &mut Vm) -> Result<&mut ControlClient> {
        match &mut vm.handle {
            Handle::Vmm(Some(client)) => Ok(client),
            _ => Err(PerfError::Usage(
                "internal: this vmm was started without a control socket".into(),
            )),
        }
    }

    fn connect(process: VmProcess, socket: Option<PathBuf>, timeout: Duration) -> Result<Vm> {
        let client = match socket {
            Some(path) => Some(ControlClient::connect(&path, timeout).map_err(|e| {
                // Prefer the vmm's own complaint when it died during start-up.
                match process.stderr_tail() {
                    s if s.is_empty() => e,
                    stderr => PerfError::Guest(format!("{e}; vmm stderr: {stderr:?}")),
                }
            })?),
            None => None,
        };
        Ok(Vm {
            process,
            handle: Handle::Vmm(client),
        })
    }
}

impl Backend for VmmBackend {
    fn subject(&self) -> Subject {
        Subject::Vmm
    }

    fn restore_unsupported(&self) -> Option<String> {
        (!self.has_restore).then(|| NO_RESTORE.to_string())
    }

    fn boot(&self, spec: &BootSpec, dir: &Path, timeout: Duration) -> Result<Vm> {
        let socket = spec.control.then(|| dir.join("control.sock"));
        let mut args: Vec<String> = vec![
            "run".into(),
            "--kernel".into(),
            spec.kernel.display().to_string(),
            "--mem-mib".into(),
            spec.mem_mib.to_string(),
            "--vcpus".into(),
            "1".into(),
            "--serial".into(),
            "stdout".into(),
            "--cmdline".into(),
            spec.cmdline.clone(),
        ];
        if let Some(s) = &socket {
            args.push("--control-socket".into());
            args.push(s.display().to_string());
        }
        if spec.setup_timings {
            // Only the timing events are logged at info: two short JSON lines.
            args.extend(["--log-format".into(), "json".into(), "--log-level".into()]);
            args.push(format!(
                "warn,{ACPI_TIMING_TARGET}=info,{MPTABLE_TIMING_TARGET}=info"
            ));
        }
        let process = VmProcess::spawn("vmm run", &self.binary, &args)?;
        Self::connect(process, socket, timeout)
    }

    fn restore(&self, snapshot: &Path, dir: &Path, control: bool, timeout: Duration) -> Result<Vm> {
        let socket = control.then(|| dir.join("control.sock"));
        let mut args: Vec<String> = vec![
            "restore".into(),
            "--snapshot".into(),
            snapshot.display().to_string(),
            "--serial".into(),
            "stdout".into(),
        ];
        if let Some(backend) = &self.memory_backend {
            args.push("--memory-backend".into());
            args.push(backend.clone());
        }
        if let Some(s) = &socket {
            args.push("--control-socket".into());
            args.push(s.display().to_string());
        }
        let process = VmProcess::spawn("vmm restore", &self.binary, &args)?;
        Self::connect(process, socket, timeout)
    }

    fn pause(&self, vm: &mut Vm) -> Result<()> {
        Self::client(vm)?
            .request(&json!({"op": "pause"}))
            .map(|_| ())
    }

    fn resume(&self, vm: &mut Vm) -> Result<()> {
        Self::client(vm)?
            .request(&json!({"op": "resume"}))
            .map(|_| ())
    }

    fn snapshot(&self, vm: &mut Vm, dir: &Path, kind: SnapshotKind) -> Result<Duration> {
        let kind = match kind {
            SnapshotKind::Full => "full",
            SnapshotKind::Diff => "diff",
        };
        let request = json!({"op": "snapshot", "dir": dir.display().to_string(), "kind": kind});
        let client = Self::client(vm)?;
        let start = Instant::now();
        client.request(&request)?;
        Ok(start.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_are_read_from_the_json_log_lines_of_their_target() {
        let stderr = concat!(
            "not json\n",
            r#"{"timestamp":"t","level":"INFO","fields":{"message":"ACPI tables written","build_us":21.5,"bytes":716},"target":"vmm::acpi"}"#,
            "\n",
            r#"{"timestamp":"t","level":"INFO","fields":{"message":"MP table written","build_us":1.2},"target":"vmm::mptable"}"#,
            "\n",
        );
        assert_eq!(logged_build_us(stderr, ACPI_TIMING_TARGET), Some(21.5));
        assert_eq!(logged_build_us(stderr, MPTABLE_TIMING_TARGET), Some(1.2));
        assert_eq!(logged_build_us(stderr, "vmm::other"), None);
        assert_eq!(logged_build_us("", ACPI_TIMING_TARGET), None);
    }
}
