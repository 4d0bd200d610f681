//! Typed `vmm` command lines: `vmm [globals] run ...`, `vmm [globals]
//! restore ...` and `vmm jail ... -- <vmm args>`, so callers never spell a
//! flag themselves. Paths are passed as text (`Path::display`); the vmm's
//! own paths (sockets, snapshots, disks) are created by this project and are
//! UTF-8.

mod devices;
mod fs;
mod jail;

use std::path::PathBuf;

pub use devices::{parse_mac, DiskSpec, NetSpec};
pub use fs::{check_tag, FsSpec, MAX_TAG_LEN};
pub use jail::{jail_id, Bind, JailSpec};

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
    /// virtio-net.
    pub net: Option<NetSpec>,
    /// virtio-rng.
    pub rng: bool,
    /// virtio-fs shares, in device order (after every other device). Any
    /// share makes the vmm map guest memory shared (memfd), as a
    /// vhost-user daemon needs; a restore takes the same tags in the same
    /// order as the snapshotted VM had.
    pub fs: Vec<FsSpec>,
    /// Guest memory backing, `--memory private|shared|shared-hugepages`
    /// (`None`: the vmm's default, shared with fs shares, else private).
    pub memory: Option<String>,
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
            args.extend(["--net".into(), n.to_string()]);
        }
        if self.rng {
            args.push("--rng".into());
        }
        for f in &self.fs {
            args.extend(["--fs".into(), f.arg()]);
        }
        if let Some(m) = &self.memory {
            args.extend(["--memory".into(), m.clone()]);
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

/// `vmm restore --standby`: a vmm started ahead of its session, with its KVM
/// VM (and, with `mem_mib`, its memory slots and vCPUs) created, that waits on its control socket (required in
/// `devices`) for a `restore` request naming the snapshot
/// ([`crate::Client::restore`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StandbySpec {
    /// Global options.
    pub globals: Globals,
    /// vCPUs to create ahead: the snapshot restored must have this many.
    pub vcpus: u8,
    /// Guest memory to reserve ahead, MiB (`--mem-mib`): memory slots,
    /// irqchip, PIT and vCPUs are then set up ahead too; the snapshot must
    /// have this size. Only with the `file` backend and private memory.
    pub mem_mib: Option<u64>,
    /// `file` (private mapping) or `uffd` (`None`: the vmm's default).
    pub memory_backend: Option<String>,
    /// Devices: the same set as the snapshots to be restored have.
    pub devices: Devices,
}

impl StandbySpec {
    /// A standby vmm for snapshots of `vcpus` vCPUs, answering on `control_socket`.
    pub fn new(vcpus: u8, control_socket: impl Into<PathBuf>) -> Self {
        Self {
            vcpus,
            devices: Devices {
                control_socket: Some(control_socket.into()),
                ..Devices::default()
            },
            ..Self::default()
        }
    }

    /// The vmm's arguments (without the program).
    pub fn args(&self) -> Vec<String> {
        let mut a = Vec::new();
        self.globals.push(&mut a);
        a.push("restore".into());
        a.extend(["--standby".into(), "--vcpus".into(), self.vcpus.to_string()]);
        if let Some(mib) = self.mem_mib {
            a.extend(["--mem-mib".into(), mib.to_string()]);
        }
        if let Some(b) = &self.memory_backend {
            a.extend(["--memory-backend".into(), b.clone()]);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate_limit::RateLimit;
    use std::path::Path;

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
            disks: vec![DiskSpec::rw("/d/root.ext4"), DiskSpec::ro("/d/ro.img")],
            vsock: Some(VsockSpec {
                cid: 3,
                uds: "/run/v.sock".into(),
            }),
            net: Some(NetSpec::with_mac("tap0", "02:00:00:00:00:01").unwrap()),
            rng: true,
            fs: vec![
                FsSpec::new("cache", "/run/fs/0.sock").unwrap(),
                FsSpec::new("data", "/run/fs/1.sock").unwrap(),
            ],
            memory: Some("shared-hugepages".into()),
        };
        assert_eq!(
            spec.args().join(" "),
            "--log-max-bytes 4096 run --kernel /k/vmlinux --initrd /k/initrd \
             --cmdline console=ttyS0 panic=1 --mem-mib 256 --vcpus 2 --acpi off \
             --serial file:/run/serial.log --control-socket /run/control.sock \
             --disk /d/root.ext4 --disk /d/ro.img,ro --vsock 3:/run/v.sock \
             --net tap0,mac=02:00:00:00:00:01 --rng --fs cache:/run/fs/0.sock \
             --fs data:/run/fs/1.sock --memory shared-hugepages"
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
        let mut share = FsSpec::new("cache", "/fs/0.sock").unwrap();
        share.queues = Some(1);
        spec.devices.fs.push(share);
        assert_eq!(
            spec.args().join(" "),
            "--log-format json --log-level warn,vmm::acpi=info restore --snapshot /s/golden \
             --memory-backend uffd --paused --serial none --fs cache:/fs/0.sock,queues=1"
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
            cpu_max: Some((50000, 100000)),
            netns: None,
        };
        assert_eq!(
            jail.wrap(vec![
                "restore".into(),
                "--snapshot".into(),
                "/golden".into()
            ])
            .join(" "),
            "jail --id vm1 --root /v/jail --uid 2000000001 --gid 2000000001 \
             --bind /s/golden:/golden:ro --tap tap1 --memory-max 300M --cpu-max 50000/100000 -- \
             restore --snapshot /golden"
        );
    }

    #[test]
    fn net_options_parse_and_print_back() {
        let n: NetSpec =
            "tap0,mac=02:00:00:00:00:0A,rx_bw=10M,tx_bw=1M/100+4M,rx_ops=1000,tx_ops=50/10"
                .parse()
                .unwrap();
        assert_eq!(n.tap, "tap0");
        assert_eq!(n.mac, Some([2, 0, 0, 0, 0, 10]));
        assert_eq!(n.limits.rx.bandwidth, Some(RateLimit::per_second(10 << 20)));
        assert_eq!(
            n.limits.tx.bandwidth,
            Some(RateLimit {
                size: 1 << 20,
                burst: 4 << 20,
                refill_ms: 100
            })
        );
        assert_eq!(n.limits.rx.ops, Some(RateLimit::per_second(1000)));
        assert_eq!(n.limits.tx.ops.unwrap().refill_ms, 10);
        assert_eq!(n.to_string().parse::<NetSpec>(), Ok(n.clone()));
        assert_eq!(
            n.to_string(),
            "tap0,mac=02:00:00:00:00:0a,rx_bw=10485760,tx_bw=1048576/100+4194304,\
             rx_ops=1000,tx_ops=50/10"
        );
        let plain: NetSpec = "tap1".parse().unwrap();
        assert_eq!(plain, NetSpec::tap("tap1"));
        assert_eq!(plain.to_string(), "tap1");
        // The order of the fields after the tap does not matter.
        assert_eq!(
            "t,tx_ops=5,mac=02:00:00:00:00:01".parse::<NetSpec>(),
            "t,mac=02:00:00:00:00:01,tx_ops=5".parse::<NetSpec>()
        );
    }

    #[test]
    fn bad_net_options_say_which_field_and_what_form() {
        let err = |s: &str| s.parse::<NetSpec>().unwrap_err().to_string();
        assert!(err("").starts_with("invalid tap"), "{}", err(""));
        assert!(err("a-name-longer-than-15").starts_with("invalid tap"));
        assert!(err("rx_bw=1M").starts_with("invalid tap"));
        assert!(err("tap0,mac=02:00").starts_with("invalid mac \"02:00\""));
        assert!(err("tap0,speed=1").starts_with("unknown field \"speed=1\""));
        assert!(err("tap0,rx_bw").starts_with("unknown field \"rx_bw\""));
        assert!(err("tap0,rx_bw=fast").starts_with("invalid rx_bw \"fast\": expected BYTES"));
        assert!(err("tap0,tx_ops=1K").starts_with("invalid tx_ops \"1K\": expected COUNT"));
        assert_eq!(
            err("tap0,rx_bw=1M,rx_bw=2M"),
            "field rx_bw is given more than once"
        );
        assert_eq!(
            err("tap0,mac=02:00:00:00:00:01,mac=02:00:00:00:00:02"),
            "field mac is given more than once"
        );
    }

    #[test]
    fn disk_options_parse_and_print_back() {
        let d: DiskSpec = "/img,ro,bw=4M+1M,iops=100/100".parse().unwrap();
        assert_eq!(d.path, PathBuf::from("/img"));
        assert!(d.read_only);
        assert_eq!(
            d.limits.bandwidth,
            Some(RateLimit {
                size: 4 << 20,
                burst: 1 << 20,
                refill_ms: 1000
            })
        );
        assert_eq!(d.limits.ops.unwrap().size, 100);
        assert_eq!(d.to_string().parse::<DiskSpec>(), Ok(d));
        assert_eq!("/img".parse::<DiskSpec>(), Ok(DiskSpec::rw("/img")));
        assert_eq!("/img,rw".parse::<DiskSpec>(), Ok(DiskSpec::rw("/img")));
        assert_eq!("/img,ro".parse::<DiskSpec>(), Ok(DiskSpec::ro("/img")));
        assert_eq!(DiskSpec::ro("/img").to_string(), "/img,ro");
        let err = |s: &str| s.parse::<DiskSpec>().unwrap_err().to_string();
        assert!(err(",ro").starts_with("invalid path"));
        assert!(err("/a,b").starts_with("unknown field \"b\""));
        assert!(err("/a,ro,rw").contains("more than once"));
        assert!(err("/a,iops=0").starts_with("invalid iops \"0\""));
        assert!(err("/a,bw=1M/0").starts_with("invalid bw \"1M/0\""));
        assert!(err("/a,bw=1M,bw=1M").contains("more than once"));
    }

    #[test]
    fn limits_reach_the_command_line() {
        let mut spec = RunSpec::new("/k");
        let mut net = NetSpec::tap("tap0");
        net.limits.rx.bandwidth = Some(RateLimit::per_second(1000));
        net.limits.tx.ops = Some(RateLimit {
            size: 10,
            burst: 5,
            refill_ms: 100,
        });
        spec.devices.net = Some(net);
        let mut disk = DiskSpec::rw("/d");
        disk.limits.ops = Some(RateLimit::per_second(50));
        spec.devices.disks.push(disk);
        let line = spec.args().join(" ");
        assert!(
            line.ends_with("--disk /d,iops=50 --net tap0,rx_bw=1000,tx_ops=10/100+5"),
            "{line}"
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
