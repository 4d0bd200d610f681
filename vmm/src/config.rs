//! The validated VM configuration, built from CLI flags and an optional
//! JSON config file with the same fields (flags win over the file).

use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::Deserialize;
use vmm_api::command::{DiskSpec, FsSpec, NetSpec};
use vmm_api::rate_limit::{IoLimit, NetLimits, SpecError};

use crate::arch::x86_64::cpuid_cache;
use crate::arch::x86_64::layout::MAX_DEVICES;
use crate::arch::x86_64::mptable::MAX_CPUS;
pub use crate::memory::MemoryMode;

/// Guest memory when none is given, in MiB.
pub const DEFAULT_MEM_MIB: u64 = 128;
/// vCPUs when none are given.
pub const DEFAULT_VCPUS: u8 = 1;
/// Kernel command line when none is given: serial console, reset through the
/// i8042, no PCI, and an i8042 driver that does not probe for a mouse.
pub const DEFAULT_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=1 pci=off i8042.noaux i8042.nomux i8042.dumbkbd";

/// Where the guest's serial output goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SerialConfig {
    /// The vmm's standard output (and standard input to the guest).
    Stdout,
    /// Discarded.
    None,
    /// Appended to a file.
    File(PathBuf),
}

impl FromStr for SerialConfig {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "stdout" => Ok(SerialConfig::Stdout),
            "none" => Ok(SerialConfig::None),
            _ => match s.strip_prefix("file:") {
                Some(path) if !path.is_empty() => Ok(SerialConfig::File(path.into())),
                _ => Err(ConfigError::Serial(s.to_string())),
            },
        }
    }
}

/// The virtio devices of a VM and their host back ends. A restore takes the
/// same device set as the snapshotted VM, with back ends that may differ (a
/// per-session disk copy, another socket path).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceConfig {
    /// virtio-blk disks.
    pub disks: Vec<DiskConfig>,
    /// virtio-vsock.
    pub vsock: Option<VsockConfig>,
    /// virtio-net.
    pub net: Option<NetConfig>,
    /// virtio-rng.
    pub rng: bool,
    /// virtio-fs devices served by vhost-user backends, after the others.
    pub fs: Vec<FsConfig>,
}

impl DeviceConfig {
    /// How many virtio devices this configures.
    pub fn count(&self) -> usize {
        self.disks.len()
            + usize::from(self.vsock.is_some())
            + usize::from(self.net.is_some())
            + usize::from(self.rng)
            + self.fs.len()
    }

    /// Parses the CLI / config-file forms of every device.
    pub fn parse(
        disks: &[String],
        vsock: Option<&str>,
        net: Option<&str>,
        rng: bool,
        fs: &[String],
    ) -> Result<DeviceConfig, ConfigError> {
        let fs = fs
            .iter()
            .map(|f| f.parse())
            .collect::<Result<Vec<FsConfig>, _>>()?;
        for (i, f) in fs.iter().enumerate() {
            if fs[..i].iter().any(|g| g.tag == f.tag) {
                return Err(ConfigError::FsDuplicateTag(f.tag.clone()));
            }
        }
        Ok(DeviceConfig {
            disks: disks
                .iter()
                .map(|d| d.parse())
                .collect::<Result<Vec<DiskConfig>, _>>()?,
            vsock: vsock.map(str::parse).transpose()?,
            net: net.map(str::parse).transpose()?,
            rng,
            fs,
        })
    }

    /// The guest memory these devices need: `requested`, or shared memory
    /// when a vhost-user device is configured and nothing was asked for.
    pub fn memory_mode(&self, requested: Option<MemoryMode>) -> Result<MemoryMode, ConfigError> {
        match requested {
            Some(MemoryMode::Private) if !self.fs.is_empty() => Err(ConfigError::FsNeedsShared),
            Some(mode) => Ok(mode),
            None if !self.fs.is_empty() => Ok(MemoryMode::Shared),
            None => Ok(MemoryMode::Private),
        }
    }
}

/// Longest virtio-fs tag: the device's `tag` configuration field is 36 bytes.
pub const FS_TAG_MAX: usize = vmm_api::command::MAX_TAG_LEN;

/// A virtio-fs device: `TAG:SOCKET[,queues=N]` (the syntax is
/// `vmm_api::command::FsSpec`'s). TAG (1..=36 bytes of `[A-Za-z0-9_.-]`) is
/// what the guest mounts (`mount -t virtiofs TAG`); SOCKET is the listening
/// vhost-user socket of its backend (virtiofsd); N request queues (1..=16,
/// default 1) besides the high-priority queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsConfig {
    /// The mount tag.
    pub tag: String,
    /// The backend's vhost-user socket.
    pub socket: PathBuf,
    /// Request queues.
    pub queues: u16,
}

impl FromStr for FsConfig {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let spec: FsSpec = s.parse().map_err(|source| ConfigError::Fs {
            input: s.to_string(),
            source,
        })?;
        Ok(FsConfig {
            tag: spec.tag,
            socket: spec.socket,
            queues: spec.queues.unwrap_or(1),
        })
    }
}

/// A virtio-blk disk: `PATH[,ro][,bw=RATE][,iops=RATE]` (the syntax is
/// `vmm_api::command::DiskSpec`'s, so clients build exactly what is parsed here).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskConfig {
    /// Raw disk image.
    pub path: PathBuf,
    /// Guest writes fail with an I/O error status.
    pub read_only: bool,
    /// Bandwidth and IOPS limits.
    pub limits: IoLimit,
}

impl FromStr for DiskConfig {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let spec: DiskSpec = s.parse().map_err(|source| ConfigError::Disk {
            input: s.to_string(),
            source,
        })?;
        Ok(DiskConfig {
            path: spec.path,
            read_only: spec.read_only,
            limits: spec.limits,
        })
    }
}

/// The virtio-vsock device: `CID:UDS_PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockConfig {
    /// The guest's context ID (3 or more).
    pub cid: u32,
    /// Host Unix socket: host processes connect here; guest connections to
    /// host port P go to `UDS_PATH_P`.
    pub uds_path: PathBuf,
}

impl FromStr for VsockConfig {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ConfigError::Vsock(s.to_string());
        let (cid, path) = s.split_once(':').ok_or_else(bad)?;
        let cid: u32 = cid.parse().map_err(|_| bad())?;
        if cid < 3 || cid == u32::MAX || path.is_empty() {
            return Err(bad());
        }
        Ok(VsockConfig {
            cid,
            uds_path: path.into(),
        })
    }
}

/// The virtio-net device:
/// `TAP[,mac=aa:bb:cc:dd:ee:ff][,rx_bw=RATE][,tx_bw=RATE][,rx_ops=RATE][,tx_ops=RATE]`
/// (the syntax is `vmm_api::command::NetSpec`'s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    /// Tap interface name (opened, or created if absent).
    pub tap: String,
    /// The guest's MAC address; none lets the guest pick one.
    pub mac: Option<[u8; 6]>,
    /// Receive and transmit limits.
    pub limits: NetLimits,
}

impl FromStr for NetConfig {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let spec: NetSpec = s.parse().map_err(|source| ConfigError::Net {
            input: s.to_string(),
            source,
        })?;
        Ok(NetConfig {
            tap: spec.tap,
            mac: spec.mac,
            limits: spec.limits,
        })
    }
}

/// Errors in the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// No kernel was given.
    #[error("no kernel given: pass --kernel PATH or set \"kernel\" in the config file")]
    NoKernel,
    /// The serial setting is not one of the accepted forms.
    #[error("invalid serial output {0:?}: expected stdout, none or file:PATH")]
    Serial(String),
    /// A disk is not `PATH[,ro][,bw=RATE][,iops=RATE]`.
    #[error("invalid disk {input:?}: {source} (the form is PATH[,ro][,bw=RATE][,iops=RATE])")]
    Disk {
        /// The option as given.
        input: String,
        /// What is wrong with it.
        #[source]
        source: SpecError,
    },
    /// The vsock setting is not `CID:UDS_PATH`.
    #[error("invalid vsock {0:?}: expected CID:UDS_PATH with a CID of 3 or more")]
    Vsock(String),
    /// The net setting is not `TAP[,mac=..][,rx_bw=..]...`.
    #[error(
        "invalid net {input:?}: {source} (the form is \
         TAP[,mac=MAC][,rx_bw=RATE][,tx_bw=RATE][,rx_ops=RATE][,tx_ops=RATE])"
    )]
    Net {
        /// The option as given.
        input: String,
        /// What is wrong with it.
        #[source]
        source: SpecError,
    },
    /// A virtio-fs device is not `TAG:SOCKET[,queues=N]`.
    #[error("invalid fs {input:?}: {source} (the form is TAG:SOCKET[,queues=N])")]
    Fs {
        /// The option as given.
        input: String,
        /// What is wrong with it.
        #[source]
        source: SpecError,
    },
    /// Two virtio-fs devices with one tag.
    #[error("two --fs devices have the tag {0:?}: each tag names one share")]
    FsDuplicateTag(String),
    /// Private memory asked for together with a vhost-user device.
    #[error("--memory private cannot be used with --fs: its backend maps guest memory, which must be shared (--memory shared or shared-hugepages)")]
    FsNeedsShared,
    /// The memory mode is not one of the accepted forms.
    #[error("invalid memory mode: {0}")]
    Memory(String),
    /// vCPU count out of range.
    #[error("{0} vCPUs requested: the VM needs between 1 and {MAX_CPUS} vCPUs")]
    VcpuCount(u64),
    /// More virtio devices than interrupt lines (and DSDT entries) for them.
    #[error(
        "{0} virtio devices configured: at most {MAX_DEVICES} fit (one IOAPIC interrupt line each)"
    )]
    TooManyDevices(usize),
    /// The ACPI setting is not `on` or `off`.
    #[error("invalid ACPI setting {0:?}: expected on or off")]
    Acpi(String),
    /// The PIT setting is not `on` or `off`.
    #[error("invalid PIT setting {0:?}: expected on or off")]
    Pit(String),
    /// The CPUID cache setting is empty.
    #[error("invalid CPUID cache setting \"\": expected a file path or none")]
    CpuidCache,
    /// The config file cannot be read.
    #[error("cannot read config file {path}: {source}")]
    FileUnreadable {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The config file is not valid.
    #[error("invalid config file {path}: {source}")]
    FileInvalid {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
}

/// The config file: a JSON object with the CLI's fields, all optional.
#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Kernel image.
    pub kernel: Option<PathBuf>,
    /// Initial ramdisk.
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: Option<String>,
    /// Guest memory in MiB.
    pub mem_mib: Option<u64>,
    /// vCPU count.
    pub vcpus: Option<u64>,
    /// `stdout`, `none` or `file:PATH`.
    pub serial: Option<String>,
    /// Control socket path.
    pub control_socket: Option<PathBuf>,
    /// virtio-blk disks, each `PATH[,ro][,bw=RATE][,iops=RATE]`.
    pub disk: Option<Vec<String>>,
    /// virtio-vsock, `CID:UDS_PATH`.
    pub vsock: Option<String>,
    /// virtio-net, `TAP[,mac=..][,rx_bw=RATE]...`.
    pub net: Option<String>,
    /// virtio-rng.
    pub rng: Option<bool>,
    /// virtio-fs devices, each `TAG:SOCKET[,queues=N]`.
    pub fs: Option<Vec<String>>,
    /// Guest memory backing: `private`, `shared` or `shared-hugepages`
    /// (default: shared with fs devices, else private).
    pub memory: Option<String>,
    /// ACPI tables (default true); false keeps the MP table and
    /// `virtio_mmio.device=` command-line entries only, for kernels without ACPI.
    pub acpi: Option<bool>,
    /// An in-kernel i8254 PIT (default true).
    pub pit: Option<bool>,
    /// Where the host's supported CPUID is cached between vmm processes, or
    /// `none` (default: /run/agentvm/kvm-supported-cpuid).
    pub cpuid_cache: Option<String>,
}

impl ConfigFile {
    /// Reads and parses a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::FileUnreadable {
            path: path.into(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| ConfigError::FileInvalid {
            path: path.into(),
            source,
        })
    }

    /// Fields set in `overrides` replace this file's.
    pub fn overridden_by(self, overrides: ConfigFile) -> ConfigFile {
        ConfigFile {
            kernel: overrides.kernel.or(self.kernel),
            initrd: overrides.initrd.or(self.initrd),
            cmdline: overrides.cmdline.or(self.cmdline),
            mem_mib: overrides.mem_mib.or(self.mem_mib),
            vcpus: overrides.vcpus.or(self.vcpus),
            serial: overrides.serial.or(self.serial),
            control_socket: overrides.control_socket.or(self.control_socket),
            disk: overrides.disk.or(self.disk),
            vsock: overrides.vsock.or(self.vsock),
            net: overrides.net.or(self.net),
            rng: overrides.rng.or(self.rng),
            fs: overrides.fs.or(self.fs),
            memory: overrides.memory.or(self.memory),
            acpi: overrides.acpi.or(self.acpi),
            pit: overrides.pit.or(self.pit),
            cpuid_cache: overrides.cpuid_cache.or(self.cpuid_cache),
        }
    }
}

/// A complete, validated VM configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmConfig {
    /// Kernel image (ELF vmlinux or bzImage).
    pub kernel: PathBuf,
    /// Optional initrd.
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: String,
    /// Guest memory in MiB (size checks against the host happen at allocation).
    pub mem_mib: u64,
    /// How guest memory is backed.
    pub memory: MemoryMode,
    /// vCPU count, 1..=MAX_CPUS (the KVM limit is checked when the VM is built).
    pub vcpus: u8,
    /// Serial output.
    pub serial: SerialConfig,
    /// Control socket path.
    pub control_socket: Option<PathBuf>,
    /// The virtio devices and their back ends.
    pub devices: DeviceConfig,
    /// ACPI tables, VMGenID and the ACPI power device; when false the
    /// virtio devices are announced on the kernel command line instead.
    pub acpi: bool,
    /// An in-kernel i8254 PIT (`KVM_CREATE_PIT2`), on by default. Off, the
    /// ACPI machine (hardware-reduced, so without a legacy timer) boots
    /// Linux fine, timing with kvmclock and the LAPIC; the MP table's legacy
    /// PC does not (Linux verifies its LAPIC timer against the PIT, and
    /// without one boots with no timer). Off is not the default: it did not
    /// make the vmm faster (see `vm`), and guests have always had one.
    pub pit: bool,
    /// The file caching KVM_GET_SUPPORTED_CPUID between vmm processes
    /// (`arch::x86_64::cpuid_cache`), None to ask KVM every time.
    pub cpuid_cache: Option<PathBuf>,
}

/// Parses the CLI form of the ACPI setting: `on` or `off`.
pub fn parse_acpi(s: &str) -> Result<bool, ConfigError> {
    on_off(s).ok_or_else(|| ConfigError::Acpi(s.to_string()))
}

/// Parses the CLI form of the PIT setting: `on` or `off`.
pub fn parse_pit(s: &str) -> Result<bool, ConfigError> {
    on_off(s).ok_or_else(|| ConfigError::Pit(s.to_string()))
}

fn on_off(s: &str) -> Option<bool> {
    match s {
        "on" => Some(true),
        "off" => Some(false),
        _ => None,
    }
}

impl TryFrom<ConfigFile> for VmConfig {
    type Error = ConfigError;

    fn try_from(f: ConfigFile) -> Result<Self, ConfigError> {
        let kernel = f.kernel.ok_or(ConfigError::NoKernel)?;
        let vcpus = f.vcpus.unwrap_or(u64::from(DEFAULT_VCPUS));
        let vcpus = u8::try_from(vcpus)
            .ok()
            .filter(|v| (1..=MAX_CPUS).contains(v))
            .ok_or(ConfigError::VcpuCount(vcpus))?;
        let serial = match f.serial {
            Some(s) => s.parse()?,
            None => SerialConfig::Stdout,
        };
        let devices = DeviceConfig::parse(
            &f.disk.unwrap_or_default(),
            f.vsock.as_deref(),
            f.net.as_deref(),
            f.rng.unwrap_or(false),
            &f.fs.unwrap_or_default(),
        )?;
        if devices.count() > MAX_DEVICES {
            return Err(ConfigError::TooManyDevices(devices.count()));
        }
        let requested = f
            .memory
            .as_deref()
            .map(str::parse::<MemoryMode>)
            .transpose()
            .map_err(ConfigError::Memory)?;
        let memory = devices.memory_mode(requested)?;
        let cpuid_cache = match f.cpuid_cache.as_deref() {
            None => Some(PathBuf::from(cpuid_cache::DEFAULT_PATH)),
            Some("") => return Err(ConfigError::CpuidCache),
            Some("none") => None,
            Some(path) => Some(PathBuf::from(path)),
        };
        Ok(VmConfig {
            kernel,
            initrd: f.initrd,
            cmdline: f.cmdline.unwrap_or_else(|| DEFAULT_CMDLINE.to_string()),
            mem_mib: f.mem_mib.unwrap_or(DEFAULT_MEM_MIB),
            memory,
            vcpus,
            serial,
            control_socket: f.control_socket,
            devices,
            acpi: f.acpi.unwrap_or(true),
            pit: f.pit.unwrap_or(true),
            cpuid_cache,
        })
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
