//! Firecracker, driven through its API socket: `PUT /boot-source`,
//! `/machine-config`, `/network-interfaces/eth0` (a tap by name), `/actions`
//! (InstanceStart), `PATCH /vm` (pause and
//! resume), `PUT /snapshot/create` and `/snapshot/load`. The binary is the
//! operator's; nothing of Firecracker lives in this repository.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;

use super::http;
use super::{Backend, BootSpec, Handle, SnapshotKind, Subject, Vm};
use crate::error::{PerfError, Result};
use crate::process::{wait_for_path, VmProcess};

/// Name of the VM state file inside a Firecracker snapshot folder.
const STATE_FILE: &str = "vmstate";
/// Name of the guest memory file inside a Firecracker snapshot folder.
const MEMORY_FILE: &str = "memory";

/// A Firecracker binary.
pub struct FirecrackerBackend {
    binary: PathBuf,
}

impl FirecrackerBackend {
    /// A backend for the Firecracker binary at `binary`.
    pub fn new(binary: PathBuf) -> Self {
        FirecrackerBackend { binary }
    }

    /// Starts Firecracker with its API socket and its log in `dir` (so that
    /// nothing but the guest's serial console reaches stdout), and waits
    /// for the socket.
    fn spawn(&self, what: &str, dir: &Path, timeout: Duration) -> Result<(VmProcess, PathBuf)> {
        let api = dir.join("api.sock");
        let log = dir.join("firecracker.log");
        let _ = std::fs::remove_file(&api);
        std::fs::write(&log, b"").map_err(PerfError::io("cannot create", &log))?;
        let args = [
            "--api-sock".to_string(),
            api.display().to_string(),
            "--log-path".into(),
            log.display().to_string(),
            "--level".into(),
            "Error".into(),
        ];
        let process = VmProcess::spawn(what, &self.binary, args)?;
        wait_for_path(&process, &api, timeout)?;
        // The socket file appears at bind(), before listen(): wait until it accepts.
        let deadline = Instant::now() + timeout;
        while let Err(source) = UnixStream::connect(&api) {
            if Instant::now() >= deadline {
                return Err(PerfError::Socket {
                    path: api,
                    action: "Firecracker's API socket never accepted a connection".into(),
                    source,
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok((process, api))
    }

    fn api(vm: &Vm) -> Result<&Path> {
        match &vm.handle {
            Handle::Firecracker(api) => Ok(api),
            Handle::Vmm(_) => Err(PerfError::Usage(
                "internal: a vmm VM was handed to the Firecracker backend".into(),
            )),
        }
    }
}

impl Backend for FirecrackerBackend {
    fn subject(&self) -> Subject {
        Subject::Firecracker
    }

    fn restore_unsupported(&self) -> Option<String> {
        None
    }

    fn boot(&self, spec: &BootSpec, dir: &Path, timeout: Duration) -> Result<Vm> {
        let (process, api) = self.spawn("firecracker", dir, timeout)?;
        let boot_source = json!({
            "kernel_image_path": spec.kernel.display().to_string(),
            "boot_args": spec.cmdline,
        });
        http::request(&api, "PUT", "/boot-source", &boot_source.to_string())?;
        let machine = json!({
            "vcpu_count": 1,
            "mem_size_mib": spec.mem_mib,
            "track_dirty_pages": spec.control,
        });
        http::request(&api, "PUT", "/machine-config", &machine.to_string())?;
        if let Some(net) = &spec.net {
            let iface = json!({
                "iface_id": "eth0",
                "host_dev_name": net.tap,
                "guest_mac": net.mac_text(),
            });
            http::request(&api, "PUT", "/network-interfaces/eth0", &iface.to_string())?;
        }
        let start = json!({"action_type": "InstanceStart"}).to_string();
        match http::request(&api, "PUT", "/actions", &start) {
            Ok(()) => {}
            // A guest that resets at once can end Firecracker before it
            // answers; its output, or its absence, then says what happened.
            Err(PerfError::FirecrackerApi { status: 0, .. } | PerfError::Socket { .. }) => {}
            Err(e) => return Err(e),
        }
        Ok(Vm {
            process,
            handle: Handle::Firecracker(api),
        })
    }

    fn restore(
        &self,
        snapshot: &Path,
        dir: &Path,
        _control: bool,
        timeout: Duration,
    ) -> Result<Vm> {
        let (process, api) = self.spawn("firecracker (restore)", dir, timeout)?;
        http::request(&api, "PUT", "/snapshot/load", &load_body(snapshot))?;
        Ok(Vm {
            process,
            handle: Handle::Firecracker(api),
        })
    }

    fn prestart(&self, dir: &Path, _mem_mib: u64, timeout: Duration) -> Result<Option<Vm>> {
        let (process, api) = self.spawn("firecracker (pre-started)", dir, timeout)?;
        Ok(Some(Vm {
            process,
            handle: Handle::Firecracker(api),
        }))
    }

    fn load_prestarted(&self, vm: &mut Vm, snapshot: &Path) -> Result<()> {
        http::request(
            Self::api(vm)?,
            "PUT",
            "/snapshot/load",
            &load_body(snapshot),
        )
    }

    fn pause(&self, vm: &mut Vm) -> Result<()> {
        http::request(Self::api(vm)?, "PATCH", "/vm", r#"{"state":"Paused"}"#)
    }

    fn resume(&self, vm: &mut Vm) -> Result<()> {
        http::request(Self::api(vm)?, "PATCH", "/vm", r#"{"state":"Resumed"}"#)
    }

    fn snapshot(&self, vm: &mut Vm, dir: &Path, kind: SnapshotKind) -> Result<Duration> {
        std::fs::create_dir_all(dir).map_err(PerfError::io("cannot create", dir))?;
        let body = json!({
            "snapshot_type": match kind {
                SnapshotKind::Full => "Full",
                SnapshotKind::Diff => "Diff",
            },
            "snapshot_path": dir.join(STATE_FILE).display().to_string(),
            "mem_file_path": dir.join(MEMORY_FILE).display().to_string(),
        })
        .to_string();
        let api = Self::api(vm)?;
        let start = Instant::now();
        http::request(api, "PUT", "/snapshot/create", &body)?;
        Ok(start.elapsed())
    }
}

/// `PUT /snapshot/load` of `snapshot` (state and memory file), resumed at once.
fn load_body(snapshot: &Path) -> String {
    json!({
        "snapshot_path": snapshot.join(STATE_FILE).display().to_string(),
        "mem_backend": {
            "backend_type": "File",
            "backend_path": snapshot.join(MEMORY_FILE).display().to_string(),
        },
        "resume_vm": true,
    })
    .to_string()
}
