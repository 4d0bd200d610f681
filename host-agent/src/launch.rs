//! Launching a VM from a snapshot: the vmm's restore command line and jail
//! ([`restore_launch`]), and the VM's own copy of its root disk
//! ([`prepare_disk`], [`copy_disk`]). Used for sessions and warm VMs alike.
//! A session whose devices are not its golden snapshot's (its shares)
//! boots the image instead ([`boot_launch`]).

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use vmm_api::command::{
    jail_id, Bind, Devices, DiskSpec, JailSpec, NetSpec, RestoreSpec, RunSpec, Serial,
};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::io_limits::IoLimits;
use crate::layers::{LayerRow, LAYERS_IN_JAIL};
use crate::network::addressing::{GUEST_MAC, TAP_NAME};
use crate::store::ImageRow;
use crate::supervisor::run_dirs;

/// How to start a restore of `image` for a VM in `dir`: the vmm's restore
/// (paths as the vmm sees them) and, for a VM jailed as `uid` (= gid), the
/// jail. The golden snapshot has a vsock device exactly when the VM gets one:
/// both follow [`Config::vsock_device`].
/// With `netns` (the VM's network namespace, for an image whose golden
/// snapshot has a network device), the VM gets its virtio-net device on the
/// namespace's tap: a jailed vmm joins the namespace.
pub fn restore_launch(
    cfg: &Config,
    image: &ImageRow,
    dir: &Path,
    paused: bool,
    from: Source<'_>,
    uid: Option<u32>,
    netns: Option<&str>,
) -> (RestoreSpec, Option<JailSpec>) {
    let (_, inside) = run_dirs(dir, uid.is_some());
    let (snapshot, binds) = match (from, uid.is_some()) {
        (Source::Golden, false) => (PathBuf::from(&image.golden_dir), vec![]),
        (Source::Golden, true) => (
            PathBuf::from(GOLDEN_IN_JAIL),
            vec![Bind {
                host: PathBuf::from(&image.golden_dir),
                jail: GOLDEN_IN_JAIL.into(),
                read_only: true,
            }],
        ),
        // The VM's own snapshots are in its run directory, inside the jail if any.
        (Source::Own(name), _) => (inside.join("snapshots").join(name), vec![]),
        // A chain of layers resolves in the layer store (a golden layer
        // through its link there) ...
        (Source::Chain(chain), false) => (
            chain
                .last()
                .map(|l| PathBuf::from(&l.dir))
                .unwrap_or_default(),
            vec![],
        ),
        // ... or, in a jail, with each layer bound read-only under /layers.
        (Source::Chain(chain), true) => (
            chain
                .last()
                .map(|l| Path::new(LAYERS_IN_JAIL).join(&l.id))
                .unwrap_or_default(),
            chain
                .iter()
                .map(|l| Bind {
                    host: PathBuf::from(&l.dir),
                    jail: format!("{LAYERS_IN_JAIL}/{}", l.id),
                    read_only: true,
                })
                .collect(),
        ),
    };
    let jail = jail_for(cfg, image, dir, uid, binds, netns);
    let mut spec = RestoreSpec::new(snapshot);
    spec.globals.log_max_bytes = Some(cfg.logs.max_file_bytes);
    spec.paused = paused;
    spec.devices = vm_devices(cfg, image, &inside, netns.is_some());
    (spec, jail)
}

/// How to boot `image` (its files resolved) for a session's VM in `dir`
/// instead of restoring a snapshot: the vmm's run (paths as the vmm sees
/// them: the kernel and initrd bound read-only into a jail) and, for a VM
/// jailed as `uid`, the jail. The devices are those of a restore (the
/// golden boot's): a copy of the root disk, rng and vsock for guest-init,
/// the network's tap with `netns` (its addresses on the kernel command
/// line, as the golden boot has them); the caller adds the shares.
pub fn boot_launch(
    cfg: &Config,
    image: &ImageRow,
    dir: &Path,
    uid: Option<u32>,
    netns: Option<&str>,
) -> (RunSpec, Option<JailSpec>) {
    let (_, inside) = run_dirs(dir, uid.is_some());
    let mut binds = Vec::new();
    let mut bound = |host: &str, jail: &str| match uid {
        Some(_) => {
            binds.push(Bind {
                host: PathBuf::from(host),
                jail: jail.into(),
                read_only: true,
            });
            PathBuf::from(jail)
        }
        None => PathBuf::from(host),
    };
    let kernel = bound(&image.kernel, KERNEL_IN_JAIL);
    let initrd = (!image.initrd.is_empty()).then(|| bound(&image.initrd, INITRD_IN_JAIL));
    let mut spec = RunSpec::new(kernel);
    spec.initrd = initrd;
    spec.globals.log_max_bytes = Some(cfg.logs.max_file_bytes);
    spec.mem_mib = u64::from(image.mem_mib);
    spec.vcpus = u64::from(image.vcpus);
    let mut cmdline = image.cmdline.clone();
    if netns.is_some() {
        cmdline = format!(
            "{cmdline} {} {}",
            crate::network::addressing::guest_kernel_ip_param(),
            crate::network::addressing::guest_kernel_ip6_param()
        )
        .trim()
        .to_string();
    }
    spec.cmdline = (!cmdline.is_empty()).then_some(cmdline);
    spec.devices = vm_devices(cfg, image, &inside, netns.is_some());
    let jail = jail_for(cfg, image, dir, uid, binds, netns);
    (spec, jail)
}

/// The jail of a VM of `image` in `dir` jailed as `uid` (= gid), with
/// `binds`, in network namespace `netns` if given (`None` unjailed).
fn jail_for(
    cfg: &Config,
    image: &ImageRow,
    dir: &Path,
    uid: Option<u32>,
    binds: Vec<Bind>,
    netns: Option<&str>,
) -> Option<JailSpec> {
    let overhead = cfg.jail.memory_overhead_mib;
    uid.map(|uid| JailSpec {
        id: jail_id(dir),
        root: dir.join("jail"),
        uid,
        gid: uid,
        binds,
        taps: vec![],
        // With a network, the tap needs /dev/net/tun besides the defaults.
        devices: match netns {
            Some(_) => ["kvm", "urandom", "tun"].map(String::from).to_vec(),
            None => vec![],
        },
        memory_max_mib: (overhead > 0).then(|| u64::from(image.mem_mib) + overhead),
        // A session's own CPU cap is set by its caller (`Resources::cpu_max`).
        cpu_max: None,
        netns: netns.map(|n| PathBuf::from("/run/netns").join(n)),
    })
}

/// The devices every VM of `image` has, as its golden boot had them (see
/// `sessions::golden`), with its run directory `inside` as the vmm sees it:
/// the serial log, its copy of the root disk, rng and vsock for guest-init,
/// the network device `with_net`; with the image's (the session's) limits.
fn vm_devices(cfg: &Config, image: &ImageRow, inside: &Path, with_net: bool) -> Devices {
    let limits = IoLimits::decode(&image.io_limits).unwrap_or_else(|e| {
        // Written by this host-agent after the same check: only a damaged
        // database gets here; the VM still starts, and the operator is told.
        tracing::error!(image = %image.id, error = %e, "the image's rate limits do not read back; none applied");
        IoLimits::default()
    });
    let mut devices = Devices {
        serial: Serial::File(inside.join("serial.log")),
        ..Devices::default()
    };
    if !image.rootfs.is_empty() {
        let mut disk = DiskSpec::rw(inside.join(VM_DISK));
        disk.limits = limits.disk;
        devices.disks.push(disk);
    }
    devices.rng = image.guest_init;
    devices.vsock = cfg.vsock_device(image.guest_init, inside);
    if with_net {
        let mut nic = guest_nic();
        nic.limits = limits.net;
        devices.net = Some(nic);
    }
    devices
}

/// The file in a golden snapshot directory that says the snapshot has a
/// virtio-net device (its VMs need a network to be restored).
pub const NETWORK_MARKER: &str = "network";

/// Whether `image`'s golden snapshot has a network device.
pub fn has_network(image: &ImageRow) -> bool {
    !image.golden_dir.is_empty() && Path::new(&image.golden_dir).join(NETWORK_MARKER).exists()
}

/// The vmm's `--net` value of every VM: the namespace's tap with the
/// clone-safe MAC.
pub fn guest_nic() -> NetSpec {
    // GUEST_MAC is a constant, well-formed MAC address; a malformed one
    // fails every VM launch at once (and the launch tests).
    NetSpec::with_mac(TAP_NAME, GUEST_MAC).expect("GUEST_MAC is a well-formed MAC address")
}

/// A VM's own copy of its image's root disk, in its run directory.
pub const VM_DISK: &str = "disk.ext4";

/// The root disk kept with a golden snapshot: the disk the image booted
/// with, in the state the snapshot's memory (page cache) expects.
pub const GOLDEN_DISK: &str = "rootfs.ext4";

/// Copies a disk image keeping holes, sharing blocks where the file system
/// can (reflink), owned by `owner` if given. Safe in a directory a jailed vmm
/// can write: see [`crate::safe_fs`].
pub async fn copy_disk(from: &Path, to: &Path, owner: Option<(u32, u32)>) -> Result<()> {
    let (src, dst) = (from.to_path_buf(), to.to_path_buf());
    tokio::task::spawn_blocking(move || crate::safe_fs::copy_file(&src, &dst, owner))
        .await
        .map_err(|e| Error::io("copying a disk", std::io::Error::other(e.to_string())))?
        .map_err(|e| {
            Error::io(
                format!("copying disk {} to {}", from.display(), to.display()),
                e,
            )
        })
}

/// Gives a VM in `dir` its own writable copy of the golden snapshot's root
/// disk (images with a rootfs only), owned by `uid` (and gid) for a VM jailed
/// as that uid, and `grow_to` bytes long when that is longer than the
/// golden disk (sparse: the vmm restores it larger and tells the guest).
pub async fn prepare_disk(
    image: &ImageRow,
    dir: &Path,
    uid: Option<u32>,
    grow_to: u64,
) -> Result<()> {
    prepare_disk_from(image, Path::new(&image.golden_dir), dir, uid, grow_to).await
}

/// [`prepare_disk`] from the disk kept in snapshot directory `snapshot`
/// (a golden snapshot, or a snapshot layer that has one).
pub async fn prepare_disk_from(
    image: &ImageRow,
    snapshot: &Path,
    dir: &Path,
    uid: Option<u32>,
    grow_to: u64,
) -> Result<()> {
    if image.rootfs.is_empty() {
        return Ok(());
    }
    let (run, _) = run_dirs(dir, uid.is_some());
    std::fs::create_dir_all(&run)
        .map_err(|e| Error::io(format!("creating {}", run.display()), e))?;
    let owner = uid.map(|u| (u, u));
    let disk = run.join(VM_DISK);
    copy_disk(&snapshot.join(GOLDEN_DISK), &disk, owner).await?;
    grow_disk(&disk, grow_to)
}

/// Makes the disk at `path` `size` bytes long if it is shorter; the new
/// part is a hole.
pub fn grow_disk(path: &Path, size: u64) -> Result<()> {
    let what = || format!("growing disk {} to {size} bytes", path.display());
    // Not through a link: the directory is one a jailed vmm can write.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| Error::io(what(), e))?;
    let len = f.metadata().map_err(|e| Error::io(what(), e))?.len();
    if size > len {
        f.set_len(size).map_err(|e| Error::io(what(), e))?;
    }
    Ok(())
}

/// Size in bytes of the root disk kept with `image`'s golden snapshot (0:
/// the image has none, or no golden snapshot yet).
pub fn golden_disk_bytes(image: &ImageRow) -> u64 {
    if image.rootfs.is_empty() || image.golden_dir.is_empty() {
        return 0;
    }
    std::fs::metadata(Path::new(&image.golden_dir).join(GOLDEN_DISK))
        .map(|m| m.len())
        .unwrap_or(0)
}

/// The snapshot a VM is restored from.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    /// The image's golden snapshot.
    Golden,
    /// One of the VM's own snapshots (SnapshotSession), by directory name.
    Own(&'a str),
    /// A chain of snapshot layers, its full base first (see
    /// [`crate::layers`]).
    Chain(&'a [LayerRow]),
}

/// Where a jailed VM sees its image's golden snapshot.
const GOLDEN_IN_JAIL: &str = "/golden";

/// Where a jailed VM booted for a session sees its image's kernel.
const KERNEL_IN_JAIL: &str = "/boot/kernel";

/// Where a jailed VM booted for a session sees its image's initrd.
const INITRD_IN_JAIL: &str = "/boot/initrd";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn image(guest_init: bool) -> ImageRow {
        ImageRow {
            id: "i".into(),
            kernel: "/k".into(),
            rootfs: String::new(),
            cmdline: String::new(),
            mem_mib: 64,
            vcpus: 1,
            guest_init,
            golden_dir: "/images/i/golden-1".into(),
            ..Default::default()
        }
    }

    #[test]
    fn guest_init_vms_get_a_vsock_device_at_their_own_socket() {
        let cfg = Config::default();
        let dir = Path::new("/state/sessions/s1");
        let (spec, jail) =
            restore_launch(&cfg, &image(true), dir, true, Source::Golden, None, None);
        assert_eq!(jail, None);
        assert_eq!(spec.globals.log_max_bytes, Some(16777216));
        let vsock = spec.devices.vsock.as_ref().expect("a vsock device");
        assert_eq!(vsock.arg(), "3:/state/sessions/s1/vsock.sock");
        assert!(spec.paused);
        assert_eq!(spec.snapshot, Path::new("/images/i/golden-1"));
        assert!(spec.devices.rng, "guest-init images get entropy");

        let (spec, _) = restore_launch(&cfg, &image(false), dir, false, Source::Golden, None, None);
        assert_eq!(spec.devices.vsock, None);
        assert!(!spec.devices.rng);

        let off = Config {
            vsock_device: false,
            ..Config::default()
        };
        assert_eq!(off.vsock_device(true, dir), None);
    }

    #[test]
    fn jailed_vms_see_their_golden_snapshot_and_run_directory_inside_the_jail() {
        let cfg = Config {
            jail: crate::config::JailSettings {
                memory_overhead_mib: 128,
                ..Default::default()
            },
            ..Config::default()
        };
        let dir = Path::new("/state/sessions/0b5e-s1");
        let (spec, jail) = restore_launch(
            &cfg,
            &image(true),
            dir,
            false,
            Source::Golden,
            Some(1000),
            None,
        );
        let jail = jail.expect("a jail");
        assert_eq!(jail.id, "0b5e-s1");
        assert_eq!(jail.root, dir.join("jail"));
        assert_eq!((jail.uid, jail.gid), (1000, 1000));
        assert_eq!(
            jail.binds,
            vec![Bind {
                host: PathBuf::from("/images/i/golden-1"),
                jail: "/golden".to_string(),
                read_only: true,
            }]
        );
        assert_eq!(jail.memory_max_mib, Some(64 + 128));
        assert_eq!(spec.snapshot, Path::new("/golden"));
        assert_eq!(spec.devices.serial, Serial::File("/run/serial.log".into()));
        let args = spec.args();
        assert!(args.contains(&"3:/run/vsock.sock".to_string()), "{args:?}");
        assert_eq!(
            run_dirs(dir, true).0,
            PathBuf::from("/state/sessions/0b5e-s1/jail/run")
        );
        // A session's own snapshot: in its run directory, nothing bound in.
        let (spec, jail) = restore_launch(
            &cfg,
            &image(true),
            dir,
            false,
            Source::Own("123-ab"),
            Some(1000),
            None,
        );
        assert_eq!(spec.snapshot, Path::new("/run/snapshots/123-ab"));
        assert!(jail.unwrap().binds.is_empty());
        let plain = Config::default();
        let (spec, _) = restore_launch(
            &plain,
            &image(false),
            dir,
            false,
            Source::Own("123-ab"),
            None,
            None,
        );
        assert_eq!(
            spec.snapshot,
            Path::new("/state/sessions/0b5e-s1/snapshots/123-ab")
        );
    }

    #[test]
    fn a_booted_vm_gets_the_image_kernel_bound_into_its_jail_and_the_restore_devices() {
        let cfg = Config::default();
        let dir = Path::new("/state/sessions/0b5e-s1");
        let img = ImageRow {
            initrd: "/k/initrd".into(),
            cmdline: "console=ttyS0".into(),
            rootfs: "/k/rootfs.ext4".into(),
            mem_mib: 256,
            vcpus: 2,
            ..image(true)
        };
        let (spec, jail) = boot_launch(&cfg, &img, dir, Some(1000), None);
        let jail = jail.expect("a jail");
        assert_eq!(
            jail.binds,
            vec![
                Bind {
                    host: PathBuf::from("/k"),
                    jail: "/boot/kernel".into(),
                    read_only: true,
                },
                Bind {
                    host: PathBuf::from("/k/initrd"),
                    jail: "/boot/initrd".into(),
                    read_only: true,
                },
            ]
        );
        assert_eq!(spec.kernel, Path::new("/boot/kernel"));
        assert_eq!(spec.initrd.as_deref(), Some(Path::new("/boot/initrd")));
        assert_eq!((spec.mem_mib, spec.vcpus), (256, 2));
        assert_eq!(spec.cmdline.as_deref(), Some("console=ttyS0"));
        let (restore, _) = restore_launch(&cfg, &img, dir, false, Source::Golden, Some(1000), None);
        assert_eq!(
            spec.devices, restore.devices,
            "the golden snapshot's devices"
        );
        assert_eq!(spec.devices.disks[0].path, Path::new("/run/disk.ext4"));
        // Unjailed: the files where they are; with a network, its addresses.
        let (spec, jail) = boot_launch(&cfg, &img, dir, None, Some("ns1"));
        assert_eq!(jail, None);
        assert_eq!(spec.kernel, Path::new("/k"));
        let cmdline = spec.cmdline.unwrap();
        assert!(cmdline.starts_with("console=ttyS0 ip="), "{cmdline}");
        assert!(spec.devices.net.is_some());
    }
}
