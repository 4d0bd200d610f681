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
use std::time::{Duration, Instant};

use crate::cache::{Built, Entry, Outcome};
use crate::error::{Error, IoContext, Result};
use crate::guest_channel::GuestChannel;
use crate::hash;
use crate::manifest::Inputs;
use crate::progress::{self, Echo};
use crate::vmm_control::VmmControl;
use crate::vmm_process::{self, VmmProcess};
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

/// Waits until guest-init completes the Hello exchange on `uds`.
pub fn wait_for_guest_init(vm: &mut VmmProcess, uds: &Path, timeout: Duration) -> Result<String> {
    let start = Instant::now();
    let mut last_error = String::from("the vmm has not created the vsock socket yet");
    let mut last_note = Instant::now();
    while start.elapsed() < timeout {
        if let Some(status) = vm.exited() {
            return Err(golden_error(format!(
                "the vmm exited ({status}) before guest-init answered; console tail:\n{}",
                vm.console_tail(30)
            )));
        }
        if uds.exists() {
            match GuestChannel::connect(
                uds,
                proto::guest::DEFAULT_VSOCK_PORT,
                Duration::from_secs(5),
            )
            .and_then(|mut c| {
                c.hello(
                    concat!("images/", env!("CARGO_PKG_VERSION")),
                    Duration::from_secs(10),
                )
            }) {
                Ok(h) => return Ok(h.software),
                Err(e) => last_error = e.to_string(),
            }
        }
        if last_note.elapsed() >= Duration::from_secs(10) {
            progress::note(
                "golden",
                &format!(
                    "waiting for guest-init ({}s; last: {last_error})",
                    start.elapsed().as_secs()
                ),
            );
            last_note = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(golden_error(format!(
        "guest-init did not answer on vsock port {} within {timeout:?} (last: {last_error}); console tail:\n{}",
        proto::guest::DEFAULT_VSOCK_PORT,
        vm.console_tail(30)
    )))
}

/// Builds (or finds) the golden snapshot.
pub fn build(opts: &GoldenOptions) -> Result<Outcome> {
    let step = "golden";
    let vmm = vmm_process::locate(opts.vmm.as_deref())?;
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
        let mut args = vec![
            "run".to_string(),
            "--kernel".into(),
            opts.kernel.display().to_string(),
            "--disk".into(),
            disk.display().to_string(),
            "--vsock".into(),
            format!("{GUEST_CID}:{}", uds.display()),
            "--rng".into(),
            "--mem-mib".into(),
            opts.mem_mib.to_string(),
            "--vcpus".into(),
            opts.vcpus.to_string(),
            "--cmdline".into(),
            opts.cmdline.clone(),
            "--control-socket".into(),
            ctl.display().to_string(),
        ];
        if let Some(net) = &opts.net {
            args.extend(["--net".to_string(), net.clone()]);
        }
        progress::note(
            step,
            &format!("booting: {} {}", vmm.display(), args.join(" ")),
        );
        let mut vm = VmmProcess::spawn(&vmm, &args, &out.join("console.log"))?;
        let booted = Instant::now();
        let software = wait_for_guest_init(&mut vm, &uds, opts.boot_timeout)?;
        progress::note(
            step,
            &format!(
                "guest-init ready after {:.1}s ({software})",
                booted.elapsed().as_secs_f64()
            ),
        );
        std::thread::sleep(SETTLE);
        let snap = out.join("snapshot");
        let mut control = VmmControl::connect(&ctl, Duration::from_secs(120))
            .map_err(|e| golden_error(e.to_string()))?;
        control.pause().map_err(|e| golden_error(e.to_string()))?;
        let answer = control
            .full_snapshot(&snap)
            .map_err(|e| golden_error(e.to_string()))?;
        progress::note(step, &format!("snapshot written: {answer}"));
        control.stop().map_err(|e| golden_error(e.to_string()))?;
        if vm.wait_exit(Duration::from_secs(10)).is_none() {
            progress::note(step, "the vmm did not exit within 10s of stop; killing it");
        }
        drop(vm);
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
