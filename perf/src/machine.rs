//! A description of the host and of the binaries measured, recorded with
//! every result so numbers are never read without their context.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// The host and the binaries measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MachineInfo {
    /// `model name` from /proc/cpuinfo.
    pub cpu_model: String,
    /// Online CPUs.
    pub cores: usize,
    /// `uname -r`.
    pub kernel: String,
    /// Whether the CPU advertises vmx or svm (hardware KVM rather than an
    /// emulating one such as PVM).
    pub hardware_virtualization: bool,
    /// Total RAM, MiB.
    pub mem_total_mib: u64,
    /// The vmm measured.
    pub vmm: BinaryInfo,
    /// The Firecracker measured, when compared.
    pub firecracker: Option<BinaryInfo>,
    /// Git commit of the source tree perf was built from (`-dirty` when it had
    /// uncommitted changes); the default vmm is built from the same tree.
    pub source_commit: Option<String>,
}

/// A binary and what it says its version is.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BinaryInfo {
    /// Path used.
    pub path: String,
    /// First line of `--version`.
    pub version: Option<String>,
}

impl BinaryInfo {
    /// Describes the binary at `path` by running `path --version`.
    pub fn probe(path: &Path) -> Self {
        let version = Command::new(path)
            .arg("--version")
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .next()
                    .map(|l| l.trim().to_string())
            });
        BinaryInfo {
            path: path.display().to_string(),
            version,
        }
    }
}

impl MachineInfo {
    /// Reads /proc and probes the binaries.
    pub fn probe(vmm: &Path, firecracker: Option<&Path>) -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        let hardware_virtualization = cpuinfo
            .lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into());
        let mem_total_mib = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find(|l| l.starts_with("MemTotal:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|kib| kib.parse::<u64>().ok())
            })
            .map(|kib| kib / 1024)
            .unwrap_or(0);
        MachineInfo {
            cpu_model,
            cores: cores(),
            kernel,
            hardware_virtualization,
            mem_total_mib,
            vmm: BinaryInfo::probe(vmm),
            firecracker: firecracker.map(BinaryInfo::probe),
            source_commit: source_commit(),
        }
    }
}

/// Number of CPUs this process may run on.
pub fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn source_commit() -> Option<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "HEAD"])?;
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
        .map(|s| !s.is_empty())
        .unwrap_or(false);
    Some(if dirty {
        format!("{commit}-dirty")
    } else {
        commit
    })
}

/// The current time as RFC 3339 UTC (`2026-11-29T09:30:00Z`).
pub fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    rfc3339(secs)
}

/// Formats seconds since the Unix epoch as RFC 3339 UTC.
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_formats_known_dates() {
        assert_eq!(super::rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(super::rfc3339(1_798_530_600), "2026-12-29T07:50:00Z");
    }
}
