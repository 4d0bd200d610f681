//! The validated VM configuration, built from CLI flags and an optional
//! JSON config file with the same fields (flags win over the file).

use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::Deserialize;

use crate::arch::x86_64::mptable::MAX_CPUS;

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

/// Errors in the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// No kernel was given.
    #[error("no kernel given: pass --kernel PATH or set \"kernel\" in the config file")]
    NoKernel,
    /// The serial setting is not one of the accepted forms.
    #[error("invalid serial output {0:?}: expected stdout, none or file:PATH")]
    Serial(String),
    /// vCPU count out of range.
    #[error("{0} vCPUs requested: the VM needs between 1 and {MAX_CPUS} vCPUs")]
    VcpuCount(u64),
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
    /// vCPU count, 1..=MAX_CPUS (the KVM limit is checked when the VM is built).
    pub vcpus: u8,
    /// Serial output.
    pub serial: SerialConfig,
    /// Control socket path.
    pub control_socket: Option<PathBuf>,
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
        Ok(VmConfig {
            kernel,
            initrd: f.initrd,
            cmdline: f.cmdline.unwrap_or_else(|| DEFAULT_CMDLINE.to_string()),
            mem_mib: f.mem_mib.unwrap_or(DEFAULT_MEM_MIB),
            vcpus,
            serial,
            control_socket: f.control_socket,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serial_forms_parse() {
        assert_eq!(
            "stdout".parse::<SerialConfig>().unwrap(),
            SerialConfig::Stdout
        );
        assert_eq!("none".parse::<SerialConfig>().unwrap(), SerialConfig::None);
        assert_eq!(
            "file:/tmp/x".parse::<SerialConfig>().unwrap(),
            SerialConfig::File("/tmp/x".into())
        );
        assert!("file:".parse::<SerialConfig>().is_err());
        assert!("tty".parse::<SerialConfig>().is_err());
    }

    #[test]
    fn flags_override_the_file_and_defaults_fill_the_rest() {
        let file: ConfigFile =
            serde_json::from_str(r#"{"kernel":"/k","mem_mib":512,"vcpus":2}"#).unwrap();
        let flags = ConfigFile {
            mem_mib: Some(64),
            ..Default::default()
        };
        let cfg = VmConfig::try_from(file.overridden_by(flags)).unwrap();
        assert_eq!(cfg.kernel, PathBuf::from("/k"));
        assert_eq!(cfg.mem_mib, 64);
        assert_eq!(cfg.vcpus, 2);
        assert_eq!(cfg.cmdline, DEFAULT_CMDLINE);
        assert_eq!(cfg.serial, SerialConfig::Stdout);
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(matches!(
            VmConfig::try_from(ConfigFile::default()),
            Err(ConfigError::NoKernel)
        ));
        let zero = ConfigFile {
            kernel: Some("/k".into()),
            vcpus: Some(0),
            ..Default::default()
        };
        assert!(matches!(
            VmConfig::try_from(zero),
            Err(ConfigError::VcpuCount(0))
        ));
        let many = ConfigFile {
            kernel: Some("/k".into()),
            vcpus: Some(300),
            ..Default::default()
        };
        assert!(matches!(
            VmConfig::try_from(many),
            Err(ConfigError::VcpuCount(300))
        ));
        assert!(serde_json::from_str::<ConfigFile>(r#"{"kernal":"/k"}"#).is_err());
    }
}
