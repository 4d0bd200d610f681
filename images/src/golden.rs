//! The golden snapshot: boot the kernel and a private copy of the root
//! filesystem under vmm with vsock and rng, wait until guest-init answers the
//! Hello exchange on vsock port 700 (it is idle, waiting for a session),
//! pause, take a full snapshot, stop.
//!
//! The output directory holds `snapshot/` (vmm's state, memory, manifest),
//! `rootfs.ext4` (the disk exactly as the snapshotted guest saw it: each
//! session restores with its own copy of it), `console.log` and the
//! manifest. Cached: the same kernel, rootfs, vmm and settings give the same
//! input hash, and a second run returns at once.

use std::path::{Path, PathBuf};
use std::time::Duration;

use vmm_api::command::{DiskSpec, RunSpec, Serial, VsockSpec};

use crate::cache::{Built, Entry, Outcome};
use crate::capture::{capture, Capture, Ready};
use crate::error::{Error, IoContext, Result};
use crate::hash;
use crate::manifest::Inputs;
use crate::progress::{self, Echo};
use crate::RECIPE_VERSION;

/// Guest CID of the golden guest.
pub const GUEST_CID: u32 = 3;
/// Kernel command line of the golden boot (vmm adds the virtio-mmio devices).
///
/// No bare words the kernel does not know (such as vmm's default
/// `nomodule`): the kernel hands those to init as arguments, and guest-init
/// as PID 1 takes no arguments.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=1 i8042.noaux i8042.nomux i8042.dumbkbd root=/dev/vda rw rootfstype=ext4 init=/sbin/init";
/// How long the guest gets to close the Hello connection before the pause.
const SETTLE: Duration = Duration::from_millis(500);

/// What to snapshot.
#[derive(Debug, Clone)]
pub struct GoldenOptions {
    /// vmlinux.
    pub kernel: PathBuf,
    /// rootfs.ext4 (copied, never written).
    pub rootfs: PathBuf,
    /// Output directory.
    pub out: PathBuf,
    /// vmm binary (`None`: beside this program, or in PATH).
    pub vmm: Option<PathBuf>,
    /// Guest memory.
    pub mem_mib: u64,
    /// vCPUs.
    pub vcpus: u64,
    /// Kernel command line.
    pub cmdline: String,
    /// How long the boot may take until guest-init answers.
    pub boot_timeout: Duration,
    /// A tap interface for a virtio-net device (`TAP[,mac=..]`). The device
    /// set is part of the snapshot: sessions that need the network must be
    /// restored from a golden snapshot that has it.
    pub net: Option<String>,
}

/// A private directory for sockets (short paths: a Unix socket path is
/// limited to 107 bytes), removed when dropped.
pub struct RunDir(PathBuf);

impl RunDir {
    /// Creates `/tmp/images-<pid>-<nanos>`.
    pub fn new() -> Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("images-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).at(&p, "create a socket directory")?;
        Ok(Self(p))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        // Best effort: only sockets live here.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Copies a disk image keeping holes (and sharing blocks where the file
/// system can).
pub fn copy_disk(from: &Path, to: &Path) -> Result<()> {
    progress::run(
        "copy disk",
        std::process::Command::new("cp")
            .args(["--sparse=always", "--reflink=auto"])
            .arg(from)
            .arg(to),
        Echo::Lines,
        to,
    )?;
    Ok(())
}

fn golden_error(message: impl Into<String>) -> Error {
    Error::Golden {
        message: message.into(),
    }
}

/// The vmm binary: `explicit`, else `vmm` beside this program (cargo puts
/// workspace binaries together), else `vmm` in `PATH`.
pub fn locate_vmm(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return vmm_api::process::locate(Some(p)).ok_or_else(|| Error::BadArtifact {
            path: p.to_path_buf(),
            message: "no vmm binary here".into(),
        });
    }
    vmm_api::process::locate(None).ok_or_else(|| Error::MissingTools {
        step: "golden snapshot".into(),
        missing: vec![crate::error::MissingTool {
            tool: "vmm".into(),
            package: "this repository's vmm: cargo build --release -p vmm, then pass --vmm target/release/vmm".into(),
        }],
    })
}

/// Builds (or finds) the golden snapshot.
pub fn build(opts: &GoldenOptions) -> Result<Outcome> {
    let step = "golden";
    let vmm = locate_vmm(opts.vmm.as_deref())?;
    let mut inputs = Inputs::default();
    inputs
        .set("recipe", RECIPE_VERSION)
        .set("kernel_sha256", hash::file_sha256(&opts.kernel)?)
        .set("rootfs_sha256", hash::file_sha256(&opts.rootfs)?)
        .set("vmm_sha256", hash::file_sha256(&vmm)?)
        .set("mem_mib", opts.mem_mib.to_string())
        .set("vcpus", opts.vcpus.to_string())
        .set("cmdline", opts.cmdline.clone())
        .set("guest_cid", GUEST_CID.to_string())
        .set("net", opts.net.clone().unwrap_or_default());
    let entry = Entry::at(crate::cache::absolute(&opts.out)?, "golden", inputs);
    entry.get_or_build(step, |out| {
        let disk = out.join("rootfs.ext4");
        copy_disk(&opts.rootfs, &disk)?;
        let run = RunDir::new()?;
        let uds = run.path().join("vsock.sock");
        let ctl = run.path().join("control.sock");
        let mut boot = RunSpec::new(&opts.kernel);
        boot.mem_mib = opts.mem_mib;
        boot.vcpus = opts.vcpus;
        boot.cmdline = Some(opts.cmdline.clone());
        boot.devices.serial = Serial::File(out.join("console.log"));
        boot.devices.control_socket = Some(ctl);
        boot.devices.disks.push(DiskSpec::rw(&disk));
        boot.devices.vsock = Some(VsockSpec {
            cid: GUEST_CID,
            uds: uds.clone(),
        });
        boot.devices.rng = true;
        boot.devices.net =
            opts.net
                .as_deref()
                .map(str::parse)
                .transpose()
                .map_err(|e: vmm_api::SpecError| Error::Golden {
                    message: format!("invalid --net: {e}"),
                })?;
        progress::note(
            step,
            &format!("booting: {} {}", vmm.display(), boot.args().join(" ")),
        );
        let snap = out.join("snapshot");
        let captured = capture(
            &Capture {
                vmm: vmm.clone(),
                boot,
                ready: Ready::GuestInit {
                    uds,
                    port: proto::guest::DEFAULT_VSOCK_PORT,
                    served_by_vmm: true,
                    settle: SETTLE,
                    software: concat!("images/", env!("CARGO_PKG_VERSION")).into(),
                },
                snapshot_dir: snap.clone(),
                boot_timeout: opts.boot_timeout,
                vmm_log: None,
                netns: None,
            },
            &mut |line| progress::note(step, line),
        )
        .map_err(|e| golden_error(e.to_string()))?;
        progress::note(
            step,
            &format!(
                "snapshot written: {} bytes of memory in {:.0} ms",
                captured.snapshot.memory_bytes_written, captured.snapshot.ms
            ),
        );
        let mut outputs = vec!["rootfs.ext4".to_string()];
        for name in ["state", "memory", "manifest"] {
            let p = snap.join(name);
            if !p.exists() {
                return Err(golden_error(format!("the snapshot has no {}", p.display())));
            }
            outputs.push(format!("snapshot/{name}"));
        }
        Ok(Built {
            outputs,
            packages: Default::default(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kernel parameters 6.12 with our config understands, or passes on as
    /// module parameters (with a dot) or environment (with `=`).
    #[test]
    fn the_command_line_hands_init_no_arguments() {
        let known_bare = ["rw", "ro", "quiet"];
        for word in DEFAULT_CMDLINE.split_whitespace() {
            assert!(
                word.contains('=') || word.contains('.') || known_bare.contains(&word),
                "`{word}` would reach guest-init as an argument"
            );
        }
        assert!(DEFAULT_CMDLINE.contains("root=/dev/vda"));
        assert!(DEFAULT_CMDLINE.contains("init=/sbin/init"));
    }

    #[test]
    fn the_run_directory_is_short_and_removed() {
        let p = {
            let d = RunDir::new().unwrap();
            let sock = d.path().join("vsock.sock");
            assert!(sock.as_os_str().len() < 100, "{}", sock.display());
            d.path().to_path_buf()
        };
        assert!(!p.exists());
    }
}
