//! Everything the outer VM needs, built on the host and cached outside the
//! repository (default `~/.cache/agentvm/real-guest`), keyed by the inputs'
//! versions and hashes, so a second run starts in seconds: Debian's kernels
//! with their modules, the initramfs images, the test disk, the guests'
//! tools (vsock, file-system measurements), virtiofsd, and the project's
//! root filesystem (through the `images` recipe, only for the groups that
//! serve it).

pub mod initramfs;
pub mod kernels;
pub mod virtiofsd;

use std::path::{Path, PathBuf};
use std::process::Command;

use images::cache::{Built, Entry};
use images::error::IoContext;
use images::manifest::Inputs;

use crate::env::{GuestKernel, InnerEnv, NodeImage};
use kernels::KernelPackage;

/// Errors preparing the outer VM's inputs.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// A step failed (a download, a program, the cache, the rootfs recipe).
    #[error(transparent)]
    Images(#[from] images::Error),
    /// Something the harness expected is not there.
    #[error("{0}")]
    Missing(String),
}

/// Result of a preparation step.
pub type Result<T> = std::result::Result<T, PrepareError>;

/// Modules the probe initramfs loads: the virtio transport and devices
/// (virtio-fs with FUSE under it: Debian builds both as modules).
const PROBE_MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_blk",
    "virtio_net",
    "virtio-rng",
    "vmw_vsock_virtio_transport",
    "virtiofs",
];
/// Modules the boot initramfs loads before guest-init takes over: the
/// probe's, plus what guest-init's nftables egress rules use.
const ROOTFS_MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_blk",
    "virtio_net",
    "virtio-rng",
    "vmw_vsock_virtio_transport",
    "virtiofs",
    "nf_tables",
    // `counter name X` (guest-init's denied counter); built into nf_tables
    // since Linux 6.2, a module of its own in Debian's 6.1.
    "nft_objref",
    "nft_ct",
    "nft_log",
    "nf_log_syslog",
    "nft_reject_inet",
];
/// Modules the outer VM loads: KVM for AMD, 9p for the host's files, tun for
/// taps, and for host-agent's sessions' networks (group `network`) veth pairs
/// and the nftables parts its rules use (NAT, conntrack, named counters,
/// TCP resets).
/// Each failed insmod is printed on the outer VM's console (`L1: insmod`).
pub const L1_MODULES: &[&str] = &[
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "kvm-amd",
    "tun",
    "veth",
    // libcrc32c's crypto (a soft dependency, which modules.dep leaves out).
    "crc32c_generic",
    "nf_tables",
    "nft_ct",
    "nft_chain_nat",
    "nft_nat",
    "nft_masq",
    "nft_objref",
    // `reject with tcp reset` (a fork's copies of its source's connections).
    "nft_reject_ipv4",
    "nft_reject_ipv6",
];

/// What `prepare` produced.
pub struct Prepared {
    /// The outer VM's kernel (Debian's generic bzImage).
    pub l1_kernel: PathBuf,
    /// The outer VM's initramfs.
    pub l1_initrd: PathBuf,
    /// The runner's environment.
    pub env: InnerEnv,
}

/// Options for `prepare`.
pub struct PrepareOptions {
    /// Cache root.
    pub cache: PathBuf,
    /// The workspace's build directory holding vmm, host-agent and real-guest.
    pub bin_dir: PathBuf,
    /// Scratch directory shared read-write with the outer VM.
    pub work: PathBuf,
    /// A kernel with its drivers built in for the node scenarios (the
    /// `images kernel` output); `None` uses Debian's cloud kernel with the
    /// boot initramfs.
    pub node_kernel: Option<PathBuf>,
    /// Whether to prepare the node image (its root filesystem is built
    /// with debootstrap the first time): only the groups that serve it
    /// need it.
    pub node_image: bool,
}

/// The workspace root (this crate lives in `tests/real-guest`).
pub fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.ancestors().nth(2).unwrap_or(here).to_path_buf()
}

fn note(message: &str) {
    eprintln!("[real-guest prepare] {message}");
}

/// Builds or finds everything.
pub fn prepare(opts: &PrepareOptions) -> Result<Prepared> {
    let t0 = std::time::Instant::now();
    for bin in ["vmm", "host-agent", "guest-init", "real-guest"] {
        if !opts.bin_dir.join(bin).is_file() {
            return Err(PrepareError::Missing(format!(
                "{} is not built; run tests/real-guest/run (it builds the workspace first)",
                opts.bin_dir.join(bin).display()
            )));
        }
    }
    let cloud_pkg = kernels::cloud_package()?;
    let generic_pkg = kernels::generic_package_for(&cloud_pkg)?;
    let cloud = kernels::fetch(&opts.cache, &cloud_pkg)?;
    let generic = kernels::fetch(&opts.cache, &generic_pkg)?;
    let cloud_vmlinux = kernels::cloud_vmlinux(&opts.cache, &cloud)?;
    let vsockcat = build_static_tool(
        &opts.cache,
        "vsockcat",
        include_bytes!("../../guest/vsockcat.c"),
    )?;
    let fsbench = build_static_tool(
        &opts.cache,
        "fsbench",
        include_bytes!("../../guest/fsbench.c"),
    )?;
    let virtiofsd = virtiofsd::ensure()?;

    let probe = |k: &KernelPackage| {
        initramfs::build(
            &opts.cache,
            &initramfs::Spec {
                name: "probe",
                init: include_bytes!("../../guest/probe-init.sh"),
                kernel: Some(k),
                modules: PROBE_MODULES,
                files: vec![
                    (vsockcat.clone(), "mods/vsockcat".into()),
                    (fsbench.clone(), "mods/fsbench".into()),
                ],
            },
        )
    };
    let cloud_probe = probe(&cloud)?;
    let generic_probe = probe(&generic)?;
    let l1_initrd = initramfs::build(
        &opts.cache,
        &initramfs::Spec {
            name: "l1",
            init: include_bytes!("../../l1/init.sh"),
            kernel: Some(&generic),
            modules: L1_MODULES,
            files: Vec::new(),
        },
    )?;
    let node_image = if opts.node_image {
        Some(node_image(opts, &cloud, &cloud_vmlinux)?)
    } else {
        None
    };
    let test_disk = build_test_disk(&opts.cache)?;
    note(&format!("ready in {:.1} s", t0.elapsed().as_secs_f64()));
    Ok(Prepared {
        l1_kernel: generic.vmlinuz(),
        l1_initrd,
        env: InnerEnv {
            vmm: opts.bin_dir.join("vmm"),
            host_agent: opts.bin_dir.join("host-agent"),
            cloud: GuestKernel {
                version: cloud.to_string(),
                vmlinux: Some(cloud_vmlinux),
                bzimage: cloud.vmlinuz(),
                probe_initrd: cloud_probe,
            },
            generic: GuestKernel {
                version: generic.to_string(),
                vmlinux: None,
                bzimage: generic.vmlinuz(),
                probe_initrd: generic_probe,
            },
            node_image,
            virtiofsd,
            test_disk,
            work: opts.work.clone(),
        },
    })
}

/// The node image: the project's root filesystem, booted by the given
/// kernel or by the cloud kernel through the module-loading initramfs.
fn node_image(
    opts: &PrepareOptions,
    cloud: &KernelPackage,
    cloud_vmlinux: &Path,
) -> Result<NodeImage> {
    let rootfs = build_rootfs()?;
    Ok(match &opts.node_kernel {
        Some(k) => NodeImage {
            kernel: k.clone(),
            initrd: None,
            rootfs,
            kernel_origin: format!("{} (drivers built in)", k.display()),
        },
        None => NodeImage {
            kernel: cloud_vmlinux.to_path_buf(),
            initrd: Some(initramfs::build(
                &opts.cache,
                &initramfs::Spec {
                    name: "boot-rootfs",
                    init: include_bytes!("../../guest/rootfs-init.sh"),
                    kernel: Some(cloud),
                    modules: ROOTFS_MODULES,
                    files: Vec::new(),
                },
            )?),
            rootfs,
            kernel_origin: format!("{} with a module-loading initramfs", cloud.package),
        },
    })
}

/// Runs `cmd` for `step` (its output kept quiet unless it fails) and
/// returns its stdout; `dir` is where it writes, for the full-disk error.
pub fn run(step: &str, cmd: &mut Command, dir: &Path) -> images::Result<String> {
    images::progress::run(step, cmd, images::progress::Echo::Quiet, dir)
}

/// A static tool the probe guests run (`guest/<name>.c`), built with gcc.
fn build_static_tool(cache: &Path, name: &str, source: &[u8]) -> Result<PathBuf> {
    let mut inputs = Inputs::default();
    inputs
        .set("source", images::hash::bytes_sha256(source))
        .set(
            "gcc",
            run(name, Command::new("gcc").arg("--version"), cache)?,
        );
    let out = Entry::in_cache(cache, name, inputs).get_or_build(name, |dir| {
        let src = dir.join(format!("{name}.c"));
        std::fs::write(&src, source).at(&src, "write the tool's source")?;
        run(
            name,
            Command::new("gcc")
                .args(["-static", "-O2", "-Wall", "-o"])
                .arg(dir.join(name))
                .arg(&src),
            dir,
        )?;
        Ok(Built {
            outputs: vec![name.into()],
            ..Default::default()
        })
    })?;
    Ok(out.path(name))
}

/// A 64 MiB ext4 image holding `hello.txt`.
fn build_test_disk(cache: &Path) -> Result<PathBuf> {
    const HELLO: &str = "hello from an ext4 image made on the host\n";
    let mut inputs = Inputs::default();
    inputs.set("hello", HELLO).set("size", "64M");
    let out = Entry::in_cache(cache, "test-disk", inputs).get_or_build("test disk", |dir| {
        let root = dir.join("root");
        std::fs::create_dir_all(&root).at(&root, "create the test disk tree")?;
        std::fs::write(root.join("hello.txt"), HELLO).at(&root, "write hello.txt")?;
        let image = dir.join("disk.ext4");
        run(
            "test disk",
            Command::new("mkfs.ext4")
                .args(["-q", "-L", "rgdisk", "-d"])
                .arg(&root)
                .arg(&image)
                .arg("64M"),
            dir,
        )?;
        let _ = std::fs::remove_dir_all(&root);
        Ok(Built {
            outputs: vec!["disk.ext4".into()],
            ..Default::default()
        })
    })?;
    Ok(out.path("disk.ext4"))
}

/// The project's root filesystem: the same recipe and cache as
/// `images rootfs --guest-init-profile dev` (and its test), so CI builds it once.
fn build_rootfs() -> Result<PathBuf> {
    use images::rootfs::{base::BaseOptions, guest_init::Profile, RootfsOptions};
    let out = images::rootfs::build(&RootfsOptions {
        cache_dir: workspace_root().join("target/images"),
        size_mib: images::rootfs::DEFAULT_SIZE_MIB,
        guest_init: None,
        guest_init_profile: Profile::Dev,
        base: BaseOptions {
            suite: "bookworm".into(),
            mirror: "http://deb.debian.org/debian".into(),
        },
    })?;
    Ok(out.path("rootfs.ext4"))
}
