//! Our vmm, driven through its command line (`vmm run`, `vmm restore`,
//! built with [`vmm_api::command`]) and its JSON-lines control socket
//! ([`vmm_api::Client`]).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vmm_api::command::{Globals, NetSpec, Serial};
use vmm_api::{Client, RestoreSpec, RunSpec, StandbySpec};

#[cfg(test)]
use super::NetDevice;
use super::{Backend, BootSpec, Handle, SnapshotKind, Subject, Vm};
use crate::error::{PerfError, Result};
use crate::process::VmProcess;

/// The message scenarios report when the vmm cannot restore.
pub const NO_RESTORE: &str = "skipped: vmm has no restore";
/// Log target of the vmm's "ACPI tables written" event (field `build_us`).
pub const ACPI_TIMING_TARGET: &str = "vmm::acpi";
/// Log target of the vmm's "MP table written" event (field `build_us`).
pub const MPTABLE_TIMING_TARGET: &str = "vmm::mptable";
/// How long a control request may take to be answered: snapshots of large
/// guests take a while, but the harness never blocks forever.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(600);

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
    memory: Option<String>,
    has_restore: bool,
    /// `vmm restore --standby` exists (a vmm started ahead of its snapshot).
    has_standby: bool,
}

impl VmmBackend {
    /// A backend for the vmm at `binary`; `memory_backend` is passed to
    /// `vmm restore --memory-backend` when set. Probes once whether the
    /// binary has the `restore` subcommand, and its `--standby` option.
    pub fn new(binary: PathBuf, memory_backend: Option<String>) -> Self {
        Self::with_memory(binary, memory_backend, None)
    }

    /// As [`Self::new`], with guest memory backed as `memory` says
    /// (`vmm run|restore --memory`: private, shared, shared-hugepages).
    pub fn with_memory(
        binary: PathBuf,
        memory_backend: Option<String>,
        memory: Option<String>,
    ) -> Self {
        let help = Command::new(&binary)
            .args(["restore", "--help"])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()
            .filter(|out| out.status.success());
        let has_restore = help.is_some();
        let has_standby =
            help.is_some_and(|out| String::from_utf8_lossy(&out.stdout).contains("--standby"));
        VmmBackend {
            binary,
            memory_backend,
            memory,
            has_restore,
            has_standby,
        }
    }

    fn spawn_boot(
        &self,
        spec: &BootSpec,
        dir: &Path,
        timeout: Duration,
        phases: bool,
    ) -> Result<Vm> {
        let socket = spec.control.then(|| dir.join("control.sock"));
        let mut args = run_args(spec, socket.clone(), phases);
        if let Some(m) = &self.memory {
            args.extend(["--memory".into(), m.clone()]);
        }
        let process = VmProcess::spawn("vmm run", &self.binary, args)?;
        Self::connect(process, socket, timeout)
    }

    fn spawn_restore(
        &self,
        snapshot: &Path,
        dir: &Path,
        control: bool,
        timeout: Duration,
        phases: bool,
    ) -> Result<Vm> {
        let socket = control.then(|| dir.join("control.sock"));
        let mut args = restore_args(
            snapshot,
            self.memory_backend.clone(),
            socket.clone(),
            phases,
        );
        if let Some(m) = &self.memory {
            args.extend(["--memory".into(), m.clone()]);
        }
        let process = VmProcess::spawn("vmm restore", &self.binary, args)?;
        Self::connect(process, socket, timeout)
    }

    fn client(vm: &mut Vm) -> Result<&mut Client> {
        match &mut vm.handle {
            Handle::Vmm(Some(client)) => Ok(client),
            _ => Err(PerfError::Usage(
                "internal: this vmm was started without a control socket".into(),
            )),
        }
    }

    fn connect(process: VmProcess, socket: Option<PathBuf>, timeout: Duration) -> Result<Vm> {
        let client = match socket {
            // Retried while the vmm has not bound the socket yet.
            Some(path) => Some(
                Client::connect_retry(&path, timeout, ANSWER_TIMEOUT).map_err(|e| {
                    let e = PerfError::from(e);
                    // Prefer the vmm's own complaint when it died during start-up.
                    match process.stderr_tail() {
                        s if s.is_empty() => e,
                        stderr => PerfError::Guest(format!("{e}; vmm stderr: {stderr:?}")),
                    }
                })?,
            ),
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
        self.spawn_boot(spec, dir, timeout, false)
    }

    fn restore(&self, snapshot: &Path, dir: &Path, control: bool, timeout: Duration) -> Result<Vm> {
        self.spawn_restore(snapshot, dir, control, timeout, false)
    }

    fn boot_with_phases(
        &self,
        spec: &BootSpec,
        dir: &Path,
        timeout: Duration,
    ) -> Result<Option<Vm>> {
        self.spawn_boot(spec, dir, timeout, true).map(Some)
    }

    fn restore_with_phases(
        &self,
        snapshot: &Path,
        dir: &Path,
        timeout: Duration,
    ) -> Result<Option<Vm>> {
        self.spawn_restore(snapshot, dir, false, timeout, true)
            .map(Some)
    }

    fn prestart(&self, dir: &Path, mem_mib: u64, timeout: Duration) -> Result<Option<Vm>> {
        if !self.has_standby {
            return Ok(None);
        }
        let socket = dir.join("control.sock");
        let mut standby = StandbySpec::new(1, &socket);
        standby.memory_backend = self.memory_backend.clone();
        standby.devices.serial = Serial::Stdout;
        standby.devices.memory = self.memory.clone();
        // Memory slots, irqchip, PIT and vCPUs ahead: only for the file
        // backend over private memory (the vmm refuses --mem-mib otherwise).
        let file_backed = matches!(self.memory_backend.as_deref(), None | Some("file"));
        let private = matches!(self.memory.as_deref(), None | Some("private"));
        if file_backed && private {
            standby.mem_mib = Some(mem_mib);
        }
        let process = VmProcess::spawn("vmm restore --standby", &self.binary, standby.args())?;
        Self::connect(process, Some(socket), timeout).map(Some)
    }

    fn load_prestarted(&self, vm: &mut Vm, snapshot: &Path) -> Result<()> {
        Self::client(vm)?.restore(snapshot, false)?;
        Ok(())
    }

    fn pause(&self, vm: &mut Vm) -> Result<()> {
        Self::client(vm)?.pause()?;
        Ok(())
    }

    fn resume(&self, vm: &mut Vm) -> Result<()> {
        Self::client(vm)?.resume()?;
        Ok(())
    }

    fn snapshot(&self, vm: &mut Vm, dir: &Path, kind: SnapshotKind) -> Result<Duration> {
        let client = Self::client(vm)?;
        let start = Instant::now();
        client.snapshot(dir, kind)?;
        Ok(start.elapsed())
    }
}

/// The JSON log settings that log only the start-up phase marks.
fn phase_logging() -> Globals {
    Globals {
        log_json: true,
        log_level: Some(crate::phases::LOG_LEVEL.into()),
        ..Globals::default()
    }
}

/// `vmm run` for `spec`: one vCPU, the console on stdout, the control socket
/// when given, and JSON logs of the timed setup steps (or, with `phases`,
/// of the start-up phase marks) when asked for.
fn run_args(spec: &BootSpec, control_socket: Option<PathBuf>, phases: bool) -> Vec<String> {
    let mut run = RunSpec::new(&spec.kernel);
    run.cmdline = Some(spec.cmdline.clone());
    run.mem_mib = spec.mem_mib;
    run.vcpus = 1;
    run.devices.serial = Serial::Stdout;
    run.devices.control_socket = control_socket;
    run.devices.net = spec.net.as_ref().map(|net| {
        let mut device = NetSpec::tap(net.tap.clone());
        device.mac = Some(net.mac);
        device
    });
    if phases {
        run.globals = phase_logging();
    } else if spec.setup_timings {
        // Only the timing events are logged at info: two short JSON lines.
        run.globals = Globals {
            log_json: true,
            log_level: Some(format!(
                "warn,{ACPI_TIMING_TARGET}=info,{MPTABLE_TIMING_TARGET}=info"
            )),
            ..Globals::default()
        };
    }
    run.args()
}

/// `vmm restore` of `snapshot`, the console on stdout.
fn restore_args(
    snapshot: &Path,
    memory_backend: Option<String>,
    control_socket: Option<PathBuf>,
    phases: bool,
) -> Vec<String> {
    let mut restore = RestoreSpec::new(snapshot);
    if phases {
        restore.globals = phase_logging();
    }
    restore.memory_backend = memory_backend;
    restore.devices.serial = Serial::Stdout;
    restore.devices.control_socket = control_socket;
    restore.args()
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

    #[test]
    fn run_and_restore_lines_carry_the_harness_flags() {
        let mut spec = BootSpec {
            kernel: "/g/hello".into(),
            cmdline: "console=ttyS0".into(),
            mem_mib: 64,
            control: true,
            setup_timings: false,
            net: None,
        };
        assert_eq!(
            run_args(&spec, Some("/w/control.sock".into()), false).join(" "),
            "run --kernel /g/hello --cmdline console=ttyS0 --mem-mib 64 --vcpus 1 \
             --serial stdout --control-socket /w/control.sock"
        );
        spec.setup_timings = true;
        assert_eq!(
            run_args(&spec, None, false).join(" "),
            "--log-format json --log-level warn,vmm::acpi=info,vmm::mptable=info \
             run --kernel /g/hello --cmdline console=ttyS0 --mem-mib 64 --vcpus 1 --serial stdout"
        );
        spec.setup_timings = false;
        spec.net = Some(NetDevice {
            tap: "perf0".into(),
            mac: [2, 0, 0, 0, 0, 7],
        });
        assert_eq!(
            run_args(&spec, None, false).join(" "),
            "run --kernel /g/hello --cmdline console=ttyS0 --mem-mib 64 --vcpus 1 \
             --serial stdout --net perf0,mac=02:00:00:00:00:07"
        );
        assert_eq!(
            restore_args(
                Path::new("/s/1"),
                Some("uffd".into()),
                Some("/w/c.sock".into()),
                false
            )
            .join(" "),
            "restore --snapshot /s/1 --memory-backend uffd --serial stdout \
             --control-socket /w/c.sock"
        );
        assert_eq!(
            restore_args(Path::new("/s/1"), None, None, false).join(" "),
            "restore --snapshot /s/1 --serial stdout"
        );
        assert_eq!(
            restore_args(Path::new("/s/1"), None, None, true).join(" "),
            "--log-format json --log-level warn,vmm::timing=info \
             restore --snapshot /s/1 --serial stdout"
        );
        spec.net = None;
        spec.setup_timings = true;
        assert_eq!(
            run_args(&spec, None, true).join(" "),
            "--log-format json --log-level warn,vmm::timing=info \
             run --kernel /g/hello --cmdline console=ttyS0 --mem-mib 64 --vcpus 1 --serial stdout",
            "the phase marks replace the setup timings"
        );
    }
}
