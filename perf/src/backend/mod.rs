//! The VMMs under test, behind one interface: our `vmm` (command line plus
//! control socket) and, optionally, Firecracker (its HTTP API socket).
//! Scenarios drive a [`Backend`] and never know which one it is.

pub mod firecracker;
pub mod http;
pub mod vmm;

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::process::VmProcess;

/// Which VMM a measurement is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Subject {
    /// This repository's vmm.
    Vmm,
    /// The Firecracker binary given with `--vs-firecracker`.
    Firecracker,
}

impl fmt::Display for Subject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Subject::Vmm => "vmm",
            Subject::Firecracker => "firecracker",
        })
    }
}

/// Full or diff snapshot (the vmm's own type; Firecracker's backend maps it
/// onto its `snapshot_type`).
pub use vmm_api::SnapshotKind;

/// What to boot.
#[derive(Debug, Clone)]
pub struct BootSpec {
    /// Kernel or test guest image.
    pub kernel: PathBuf,
    /// Kernel command line.
    pub cmdline: String,
    /// Guest memory in MiB.
    pub mem_mib: u64,
    /// Whether the harness will pause, snapshot or stop the VM (needs the
    /// control socket; Firecracker always has its API socket).
    pub control: bool,
    /// Ask the VMM to log the setup steps it times itself (our vmm: the
    /// ACPI tables and the MP table, JSON on stderr; Firecracker: nothing).
    pub setup_timings: bool,
    /// A virtio-net device on an existing tap (our vmm: `--net`;
    /// Firecracker: `PUT /network-interfaces/eth0`).
    pub net: Option<NetDevice>,
}

/// A virtio-net device for the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetDevice {
    /// The tap the VMM attaches to, by name, in its network namespace.
    pub tap: String,
    /// The MAC offered to the guest.
    pub mac: [u8; 6],
}

impl NetDevice {
    /// The MAC as `02:00:00:00:00:07`.
    pub fn mac_text(&self) -> String {
        self.mac
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(":")
    }
}

/// Where a VM's control endpoint is.
pub enum Handle {
    /// Our vmm's JSON-lines control socket (absent when not asked for).
    Vmm(Option<vmm_api::Client>),
    /// Firecracker's API socket.
    Firecracker(PathBuf),
}

/// A VM being measured: its process and how to control it.
pub struct Vm {
    /// The VMM process; its `started()` is where boot and restore clocks start.
    pub process: VmProcess,
    /// The control endpoint.
    pub handle: Handle,
}

/// A VMM the harness can drive.
pub trait Backend: Sync {
    /// Which VMM this is.
    fn subject(&self) -> Subject;

    /// Why this VMM cannot restore snapshots, or `None` when it can.
    fn restore_unsupported(&self) -> Option<String>;

    /// Spawns the VMM and boots `spec`; returns once the guest has been told
    /// to start (the guest may not have printed anything yet). `dir` is an
    /// existing private folder for sockets and logs.
    fn boot(&self, spec: &BootSpec, dir: &Path, timeout: Duration) -> Result<Vm>;

    /// Spawns the VMM restoring `snapshot` (a folder written by
    /// [`Backend::snapshot`]) and lets the guest run.
    fn restore(&self, snapshot: &Path, dir: &Path, control: bool, timeout: Duration) -> Result<Vm>;

    /// Pauses every vCPU.
    fn pause(&self, vm: &mut Vm) -> Result<()>;

    /// Resumes a paused VM.
    fn resume(&self, vm: &mut Vm) -> Result<()>;

    /// As [`Backend::boot`], with the VMM logging its start-up phase marks
    /// (see [`crate::phases`]); `None` when this VMM has none (Firecracker).
    fn boot_with_phases(
        &self,
        _spec: &BootSpec,
        _dir: &Path,
        _timeout: Duration,
    ) -> Result<Option<Vm>> {
        Ok(None)
    }

    /// As [`Backend::restore`] (no control socket), with the VMM logging its
    /// start-up phase marks; `None` when this VMM has none (Firecracker).
    fn restore_with_phases(
        &self,
        _snapshot: &Path,
        _dir: &Path,
        _timeout: Duration,
    ) -> Result<Option<Vm>> {
        Ok(None)
    }

    /// Starts the VMM ahead of its snapshot, ready to load one: our vmm
    /// `restore --standby` (KVM VM and vCPUs created, waiting on its control
    /// socket), Firecracker spawned and answering on its API socket. Returns
    /// once it is ready; `None` when this VMM cannot be started ahead.
    /// `mem_mib` is the guest memory of the snapshots it will be sent (our
    /// vmm reserves it ahead with the `file` backend).
    fn prestart(&self, _dir: &Path, _mem_mib: u64, _timeout: Duration) -> Result<Option<Vm>> {
        Ok(None)
    }

    /// Has the pre-started `vm` (from [`Backend::prestart`]) load `snapshot`
    /// and run it; returns once the VMM answered the request.
    fn load_prestarted(&self, _vm: &mut Vm, _snapshot: &Path) -> Result<()> {
        Err(crate::error::PerfError::Usage(
            "internal: this VMM cannot be started ahead".into(),
        ))
    }

    /// Writes a snapshot of the paused `vm` into the new folder `dir` and
    /// returns the time from sending the request to receiving the answer.
    fn snapshot(&self, vm: &mut Vm, dir: &Path, kind: SnapshotKind) -> Result<Duration>;
}
