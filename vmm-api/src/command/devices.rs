//! The device specs of a vmm command line that carry options: a disk
//! (`--disk`) and a network device (`--net`), with their rate limits,
//! written and parsed by the same code the vmm uses.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::rate_limit::{set_once, IoLimit, NetLimits, SpecError, TokenUnit};

/// A virtio-blk disk: `PATH[,ro][,bw=RATE][,iops=RATE]` on the command line
/// (see [`crate::rate_limit`] for `RATE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskSpec {
    /// The raw image.
    pub path: PathBuf,
    /// Attach read-only.
    pub read_only: bool,
    /// Bandwidth (bytes of data moved) and IOPS (requests) limits.
    pub limits: IoLimit,
}

/// The fields `--disk` takes after the path.
const DISK_FIELDS: &str = "ro, rw, bw=RATE or iops=RATE after PATH (PATH without commas)";

impl DiskSpec {
    /// A writable disk without limits.
    pub fn rw(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            read_only: false,
            limits: IoLimit::default(),
        }
    }

    /// A read-only disk without limits.
    pub fn ro(path: impl Into<PathBuf>) -> Self {
        Self {
            read_only: true,
            ..Self::rw(path)
        }
    }

    /// The `--disk` value.
    pub(super) fn arg(&self) -> String {
        self.to_string()
    }
}

/// The `--disk` option's text.
impl fmt::Display for DiskSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path.display())?;
        if self.read_only {
            f.write_str(",ro")?;
        }
        if let Some(bw) = &self.limits.bandwidth {
            write!(f, ",bw={bw}")?;
        }
        if let Some(ops) = &self.limits.ops {
            write!(f, ",iops={ops}")?;
        }
        Ok(())
    }
}

/// Parses `PATH[,ro|,rw][,bw=RATE][,iops=RATE]`.
impl FromStr for DiskSpec {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, SpecError> {
        let mut parts = s.split(',');
        let path = parts.next().unwrap_or_default();
        if path.is_empty() {
            return Err(SpecError::Invalid {
                field: "path".into(),
                value: s.into(),
                expected: "PATH[,ro][,bw=RATE][,iops=RATE] with a non-empty PATH",
            });
        }
        let mut spec = DiskSpec::rw(path);
        let mut mode_given = false;
        for part in parts {
            match part.split_once('=') {
                None if part == "ro" || part == "rw" => {
                    if mode_given {
                        return Err(SpecError::Repeated {
                            field: "ro/rw".into(),
                        });
                    }
                    mode_given = true;
                    spec.read_only = part == "ro";
                }
                Some(("bw", v)) => set_once(&mut spec.limits.bandwidth, "bw", v, TokenUnit::Bytes)?,
                Some(("iops", v)) => set_once(&mut spec.limits.ops, "iops", v, TokenUnit::Ops)?,
                _ => {
                    return Err(SpecError::Unknown {
                        field: part.into(),
                        known: DISK_FIELDS,
                    })
                }
            }
        }
        Ok(spec)
    }
}

/// A virtio-net device: `TAP[,mac=MAC][,rx_bw=RATE][,tx_bw=RATE][,rx_ops=RATE][,tx_ops=RATE]`
/// on the command line (see [`crate::rate_limit`] for `RATE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetSpec {
    /// The tap interface (opened, or created if absent), at most 15 characters.
    pub tap: String,
    /// The MAC offered to the guest; `None` lets the guest pick one.
    pub mac: Option<[u8; 6]>,
    /// Receive and transmit limits.
    pub limits: NetLimits,
}

/// The fields `--net` takes after the tap.
const NET_FIELDS: &str = "mac=aa:bb:cc:dd:ee:ff, rx_bw=RATE, tx_bw=RATE, rx_ops=RATE or \
     tx_ops=RATE after TAP";

impl NetSpec {
    /// A device on `tap` without a MAC or limits.
    pub fn tap(tap: impl Into<String>) -> Self {
        Self {
            tap: tap.into(),
            mac: None,
            limits: NetLimits::default(),
        }
    }

    /// A device on `tap` offering `mac` (`aa:bb:cc:dd:ee:ff`) to the guest.
    pub fn with_mac(tap: impl Into<String>, mac: &str) -> Result<Self, SpecError> {
        Ok(Self {
            mac: Some(parse_mac(mac)?),
            ..Self::tap(tap)
        })
    }
}

/// Parses a MAC address `aa:bb:cc:dd:ee:ff` (hex digits, either case).
pub fn parse_mac(text: &str) -> Result<[u8; 6], SpecError> {
    let invalid = || SpecError::Invalid {
        field: "mac".into(),
        value: text.into(),
        expected: "six two-digit hex bytes separated by colons, e.g. 02:00:00:00:00:01",
    };
    let bytes: Vec<u8> = text
        .split(':')
        .map(|b| {
            if b.len() == 2 {
                u8::from_str_radix(b, 16).ok()
            } else {
                None
            }
        })
        .collect::<Option<_>>()
        .ok_or_else(invalid)?;
    <[u8; 6]>::try_from(bytes).map_err(|_| invalid())
}

/// The `--net` option's text.
impl fmt::Display for NetSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.tap)?;
        if let Some(m) = &self.mac {
            write!(
                f,
                ",mac={:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
                m[0], m[1], m[2], m[3], m[4], m[5]
            )?;
        }
        let fields = [
            ("rx_bw", &self.limits.rx.bandwidth),
            ("tx_bw", &self.limits.tx.bandwidth),
            ("rx_ops", &self.limits.rx.ops),
            ("tx_ops", &self.limits.tx.ops),
        ];
        for (name, limit) in fields {
            if let Some(l) = limit {
                write!(f, ",{name}={l}")?;
            }
        }
        Ok(())
    }
}

/// Parses `TAP[,mac=MAC][,rx_bw=RATE][,tx_bw=RATE][,rx_ops=RATE][,tx_ops=RATE]`.
impl FromStr for NetSpec {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, SpecError> {
        let mut parts = s.split(',');
        let tap = parts.next().unwrap_or_default();
        // IFNAMSIZ is 16 including the NUL.
        if tap.is_empty() || tap.len() > 15 || tap.contains('/') || tap.contains('=') {
            return Err(SpecError::Invalid {
                field: "tap".into(),
                value: tap.into(),
                expected: "an interface name of 1 to 15 characters without '/' or '=', first",
            });
        }
        let mut spec = NetSpec::tap(tap);
        for part in parts {
            let l = &mut spec.limits;
            match part.split_once('=') {
                Some(("mac", v)) => {
                    if spec.mac.is_some() {
                        return Err(SpecError::Repeated {
                            field: "mac".into(),
                        });
                    }
                    spec.mac = Some(parse_mac(v)?);
                }
                Some((f @ "rx_bw", v)) => set_once(&mut l.rx.bandwidth, f, v, TokenUnit::Bytes)?,
                Some((f @ "tx_bw", v)) => set_once(&mut l.tx.bandwidth, f, v, TokenUnit::Bytes)?,
                Some((f @ "rx_ops", v)) => set_once(&mut l.rx.ops, f, v, TokenUnit::Ops)?,
                Some((f @ "tx_ops", v)) => set_once(&mut l.tx.ops, f, v, TokenUnit::Ops)?,
                _ => {
                    return Err(SpecError::Unknown {
                        field: part.into(),
                        known: NET_FIELDS,
                    })
                }
            }
        }
        Ok(spec)
    }
}
