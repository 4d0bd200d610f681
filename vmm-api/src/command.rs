//! Typed `vmm` command lines: `vmm [globals] run ...`, `vmm [globals]
//! restore ...` and `vmm jail ... -- <vmm args>`, so callers never spell a
//! flag themselves. Paths are passed as text (`Path::display`); the vmm's
//! own paths (sockets, snapshots, disks) are created by this project and are
//! UTF-8.

use std::path::{Path, PathBuf};

/// Where the guest's serial console goes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Serial {
    /// The vmm's standard output.
    #[default]
    Stdout,
    /// Discarded.
    None,
    /// A file, bounded and rotated by the vmm (`--log-max-bytes`).
    File(PathBuf),
}

impl Serial {
    fn arg(&self) -> String {
        match self {
            Serial::Stdout => "stdout".into(),
            Serial::None => "none".into(),
            Serial::File(p) => format!("file:{}", p.display()),
        }
    }
}

/// A virtio-vsock device: the guest's CID and the host Unix socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockSpec {
    /// Guest context id (3 or more).
    pub cid: u32,
    /// The Unix socket the vmm listens on for host-initiated connections.
    pub uds: PathBuf,
}

impl VsockSpec {
    /// `CID:UDS_PATH`, as `--vsock` takes it.
    pub fn arg(&self) -> String {
        format!("{}:{}", self.cid, self.uds.display())
    }
}

/// A virtio-blk disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskSpec {
    /// The raw image.
    pub path: PathBuf,
    /// Attach read-only.
    pub read_only: bool,
}

impl DiskSpec {
    /// A writable disk.
    pub fn rw(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            read_only: false,
        }
    }

    fn arg(&self) -> String {
        if self.read_only {
            format!("{},ro", self.path.display())
        } else {
            self.path.display().to_string()
        }
    }
}

/// Options every vmm subcommand takes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Globals {
    /// Bound of the serial file and of the vmm's own log file, bytes.
    pub log_max_bytes: Option<u64>,
    /// Log as JSON lines instead of text.
    pub log_json: bool,
    /// Log filter (tracing EnvFilter syntax).
    pub log_level: Option<String>,
}

impl Globals {
    fn push(&self, args: &mut Vec<String>) {
        if let Some(b) = self.log_max_bytes {
            args.extend(["--log-max-bytes".into(), b.to_string()]);
        }
        if self.log_json {
            args.extend(["--log-format".into(), "json".into()]);
        }
        if let Some(l) = &self.log_level {
            args.extend(["--log-level".into(), l.clone()]);
        }
    }
}

/// Devices and sockets common to `run` and `restore`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Devices {
    /// Serial console.
    pub serial: Serial,
    /// JSON-lines control socket.
    pub control_socket: Option<PathBuf>,
    /// virtio-blk disks, in device order.
    pub disks: Vec<DiskSpec>,
    /// virtio-vsock.
    pub vsock: Option<VsockSpec>,
    /// virtio-net: `TAP[,mac=MAC]`.
    pub net: Option<String>,
    /// virtio-rng.
    pub rng: bool,
}

impl Devices {
    fn push(&self, args: &mut Vec<String>) {
        args.extend(["--serial".into(), self.serial.arg()]);
        if let Some(c) = &self.control_socket {
            args.extend(["--control-socket".into(), c.display().to_string()]);
        }
        for d in &self.disks {
            args.extend(["--disk".into(), d.arg()]);
        }
        if let Some(v) = &self.vsock {
            args.extend(["--vsock".into(), v.arg()]);
        }
        if let Some(n) = &self.net {
            args.extend(["--net".into(), n.clone()]);
        }
        if self.rng {
            args.push("--rng".into());
        }
    }
}

/// `vmm run`: boot a kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunSpec {
    /// Global options.
    pub globals: Globals,
    /// vmlinux (ELF) or bzImage.
    pub kernel: PathBuf,
    /// Initial ramdisk.
    pub initrd: Option<PathBuf>,
    /// Kernel command line (`None`: the vmm's default).
    pub cmdline: Option<String>,
    /// Guest memory, MiB.
    pub mem_mib: u64,
    /// vCPUs.
    pub vcpus: u64,
    /// ACPI tables (`None`: the vmm's default, on).
    pub acpi: Option<bool>,
    /// Devices.
    pub devices: Devices,
}

impl RunSpec {
    /// A 128 MiB, one-vCPU boot of `kernel` with the vmm's defaults.
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        Self {
            globals: Globals::default(),
            kernel: kernel.into(),
            initrd: None,
            cmdline: None,
            mem_mib: 128,
            vcpus: 1,
            acpi: None,
            devices: Devices::default(),
        }
    }

    /// The vmm's arguments (without the program).
    pub fn args(&self) -> Vec<String> {
        let mut a = Vec::new();
        self.globals.push(&mut a);
        a.push("run".into());
        a.extend(["--kernel".into(), self.kernel.display().to_string()]);
        if let Some(i) = &self.initrd {
            a.extend(["--initrd".into(), i.display().to_string()]);
        }
        if let Some(c) = &self.cmdline {
            a.extend(["--cmdline".into(), c.clone()]);
        }
        a.extend(["--mem-mib".into(), self.mem_mib.to_string()]);
        a.extend(["--vcpus".into(), self.vcpus.to_string()]);
        if let Some(on) = self.acpi {
            a.extend(["--acpi".into(), if on { "on" } else { "off" }.into()]);
        }
        self.devices.push(&mut a);
        a
    }
}

/// `vmm restore`: a VM from a snapshot, in a new process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreSpec {
    /// Global options.
    pub globals: Globals,
    /// The snapshot directory.
    pub snapshot: PathBuf,
    /// `file` (private mapping) or `uffd` (`None`: the vmm's default).
    pub memory_backend: Option<String>,
    /// Leave the vCPUs paused.
    pub paused: bool,
    /// Devices: the same set as the snapshotted VM had.
    pub devices: Devices,
}

impl RestoreSpec {
    /// A restore of `snapshot` with the vmm's defaults.
    pub fn new(snapshot: impl Into<PathBuf>) -> Self {
        Self {
            globals: Globals::default(),
            snapshot: snapshot.into(),
            memory_backend: None,
            paused: false,
            devices: Devices::default(),
        }
    }

    /// The vmm's arguments (without the program).
    pub fn args(&self) -> Vec<String> {
        let mut a = Vec::new();
        self.globals.push(&mut a);
        a.push("restore".into());
        a.extend(["--snapshot".into(), self.snapshot.display().to_string()]);
        if let Some(b) = &self.memory_backend {
            a.extend(["--memory-backend".into(), b.clone()]);
        }
        if self.paused {
            a.push("--paused".into());
        }
        self.devices.push(&mut a);
        a
    }
}

/// A vmm to start: a boot or a restore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmmCommand {
    /// `vmm run`.
    Run(RunSpec),
    /// `vmm restore`.
    Restore(RestoreSpec),
}

impl VmmCommand {
    /// The devices and sockets, to fill in what the launcher owns (the
    /// control socket's path, say).
    pub fn devices_mut(&mut self) -> &mut Devices {
        match self {
            VmmCommand::Run(r) => &mut r.devices,
            VmmCommand::Restore(r) => &mut r.devices,
        }
    }

    /// The vmm's arguments (without the program).
    pub fn args(&self) -> Vec<String> {
        match self {
            VmmCommand::Run(r) => r.args(),
            VmmCommand::Restore(r) => r.args(),
        }
    }
}

impl From<RunSpec> for VmmCommand {
    fn from(spec: RunSpec) -> Self {
        VmmCommand::Run(spec)
    }
}

impl From<RestoreSpec> for VmmCommand {
    fn from(spec: RestoreSpec) -> Self {
        VmmCommand::Restore(spec)
    }
}

/// A host path brought into a jail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bind {
    /// The host path.
    pub host: PathBuf,
    /// Where it appears inside the jail (absolute).
    pub jail: String,
    /// Read-only.
    pub read_only: bool,
}

/// `vmm jail`: confine a vmm (namespaces, its own root, cgroup, uid/gid).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailSpec {
    /// The jail's name: cgroup `agentvm/<id>` and hostname.
    pub id: String,
    /// The jail's root directory on the host.
    pub root: PathBuf,
    /// uid the vmm runs as.
    pub uid: u32,
    /// gid the vmm runs as.
    pub gid: u32,
    /// Host files and directories made visible inside.
    pub binds: Vec<Bind>,
    /// Tap interfaces moved into (or created in) the jail's namespace.
    pub taps: Vec<String>,
    /// Device nodes (empty: the vmm's default, kvm and urandom).
    pub devices: Vec<String>,
    /// Memory limit of the VM's cgroup, MiB.
    pub memory_max_mib: Option<u64>,
    /// A network namespace to join (the VM's, made by the caller with its
    /// tap) instead of a new, empty one.
    pub netns: Option<PathBuf>,
}

impl JailSpec {
    /// `vmm jail <options> -- <inner>`: `inner` is the jailed vmm's
    /// arguments, whose paths are paths inside the jail.
    pub fn wrap(&self, inner: Vec<String>) -> Vec<String> {
        let mut a = vec![
            "jail".into(),
            "--id".into(),
            self.id.clone(),
            "--root".into(),
            self.root.display().to_string(),
            "--uid".into(),
            self.uid.to_string(),
            "--gid".into(),
            self.gid.to_string(),
        ];
        for b in &self.binds {
            let ro = if b.read_only { ":ro" } else { "" };
            a.extend([
                "--bind".into(),
                format!("{}:{}{ro}", b.host.display(), b.jail),
            ]);
        }
        for t in &self.taps {
            a.extend(["--tap".into(), t.clone()]);
        }
        for d in &self.devices {
            a.extend(["--device".into(), d.clone()]);
        }
        if let Some(m) = self.memory_max_mib {
            a.extend(["--memory-max".into(), format!("{m}M")]);
        }
        if let Some(n) = &self.netns {
            a.extend(["--netns-path".into(), n.display().to_string()]);
        }
        a.push("--".into());
        a.extend(inner);
        a
    }
}

/// A jail name for the VM in `dir`: its directory name, limited to what
/// `vmm jail --id` accepts (`[A-Za-z0-9_-]`, at most 64).
pub fn jail_id(dir: &Path) -> String {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let id: String = name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .take(64)
        .collect();
    if id.is_empty() {
        "vm".to_string()
    } else {
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_lines_name_every_device() {
        let mut spec = RunSpec::new("/k/vmlinux");
        spec.globals.log_max_bytes = Some(4096);
        spec.initrd = Some("/k/initrd".into());
        spec.cmdline = Some("console=ttyS0 panic=1".into());
        spec.mem_mib = 256;
        spec.vcpus = 2;
        spec.acpi = Some(false);
        spec.devices = Devices {
            serial: Serial::File("/run/serial.log".into()),
            control_socket: Some("/run/control.sock".into()),
            disks: vec![
                DiskSpec::rw("/d/root.ext4"),
                DiskSpec {
                    path: "/d/ro.img".into(),
                    read_only: true,
                },
            ],
            vsock: Some(VsockSpec {
                cid: 3,
                uds: "/run/v.sock".into(),
            }),
            net: Some("tap0,mac=02:00:00:00:00:01".into()),
            rng: true,
        };
        assert_eq!(
            spec.args().join(" "),
            "--log-max-bytes 4096 run --kernel /k/vmlinux --initrd /k/initrd \
             --cmdline console=ttyS0 panic=1 --mem-mib 256 --vcpus 2 --acpi off \
             --serial file:/run/serial.log --control-socket /run/control.sock \
             --disk /d/root.ext4 --disk /d/ro.img,ro --vsock 3:/run/v.sock \
             --net tap0,mac=02:00:00:00:00:01 --rng"
        );
        assert_eq!(
            RunSpec::new("/k").args(),
            [
                "run",
                "--kernel",
                "/k",
                "--mem-mib",
                "128",
                "--vcpus",
                "1",
                "--serial",
                "stdout"
            ]
        );
    }

    #[test]
    fn restore_lines_and_jails() {
        let mut spec = RestoreSpec::new("/s/golden");
        spec.paused = true;
        spec.memory_backend = Some("uffd".into());
        spec.globals.log_json = true;
        spec.globals.log_level = Some("warn,vmm::acpi=info".into());
        spec.devices.serial = Serial::None;
        assert_eq!(
            spec.args().join(" "),
            "--log-format json --log-level warn,vmm::acpi=info restore --snapshot /s/golden \
             --memory-backend uffd --paused --serial none"
        );
        let jail = JailSpec {
            id: "vm1".into(),
            root: "/v/jail".into(),
            uid: 2000000001,
            gid: 2000000001,
            binds: vec![Bind {
                host: "/s/golden".into(),
                jail: "/golden".into(),
                read_only: true,
            }],
            taps: vec!["tap1".into()],
            devices: vec![],
            memory_max_mib: Some(300),
            netns: None,
        };
        assert_eq!(
            jail.wrap(vec!["restore".into(), "--snapshot".into(), "/golden".into()]).join(" "),
            "jail --id vm1 --root /v/jail --uid 2000000001 --gid 2000000001 \
             --bind /s/golden:/golden:ro --tap tap1 --memory-max 300M -- restore --snapshot /golden"
        );
    }

    #[test]
    fn jail_ids_are_what_vmm_jail_accepts() {
        assert_eq!(jail_id(Path::new("/s/0b5e-x_1")), "0b5e-x_1");
        assert_eq!(jail_id(Path::new("/s/a.b c")), "abc");
        assert_eq!(jail_id(Path::new("/")), "vm");
        assert_eq!(
            jail_id(Path::new(&format!("/s/{}", "x".repeat(80)))).len(),
            64
        );
    }
}
