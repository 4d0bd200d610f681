//! CPU and memory limits for a jailed vmm through cgroups: v2 where the host
//! has the unified hierarchy with the cpu and memory controllers, else v1
//! (the cpu and memory hierarchies), as on hosts that still run v1.

use std::path::{Path, PathBuf};

/// Limits for one jailed VM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupLimits {
    /// CPU bandwidth: `(quota_us, period_us)`.
    pub cpu_max: Option<(u64, u64)>,
    /// Memory limit in bytes.
    pub memory_max: Option<u64>,
}

/// Errors setting up the cgroup.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// Neither cgroup v2 with cpu+memory nor the v1 hierarchies are mounted.
    #[error("no usable cgroup hierarchy: need cgroup v2 with the cpu and memory controllers at {root}, or the v1 cpu and memory hierarchies under it")]
    NoHierarchy {
        /// The cgroup mount point looked at.
        root: PathBuf,
    },
    /// Creating a group or writing a limit failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Where the VM's cgroup lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cgroup {
    /// One directory in the unified hierarchy.
    V2(PathBuf),
    /// One directory per v1 controller (cpu, memory).
    V1 {
        /// The cpu controller's group.
        cpu: PathBuf,
        /// The memory controller's group.
        memory: PathBuf,
    },
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(path, value).map_err(|source| CgroupError::Write {
        path: path.into(),
        source,
    })
}

fn create(path: &Path) -> Result<(), CgroupError> {
    std::fs::create_dir_all(path).map_err(|source| CgroupError::Write {
        path: path.into(),
        source,
    })
}

fn v2_has_controllers(root: &Path) -> bool {
    std::fs::read_to_string(root.join("cgroup.controllers"))
        .map(|c| {
            let c: Vec<&str> = c.split_whitespace().collect();
            c.contains(&"cpu") && c.contains(&"memory")
        })
        .unwrap_or(false)
}

/// Makes `group` hand cpu and memory down to its children (its
/// `cgroup.subtree_control`), unless it already does. On the root group
/// systemd does this at boot; under a minimal init (a container, an
/// initramfs, the real-guest harness's outer VM) nothing does, and enabling
/// the controllers one level down then fails with ENOENT.
fn delegate_cpu_and_memory(group: &Path) -> Result<(), CgroupError> {
    let control = group.join("cgroup.subtree_control");
    let enabled = std::fs::read_to_string(&control).unwrap_or_default();
    let enabled: Vec<&str> = enabled.split_whitespace().collect();
    if enabled.contains(&"cpu") && enabled.contains(&"memory") {
        return Ok(());
    }
    write(&control, "+cpu +memory")
}

/// Groups of VMs that ended without removing theirs (a SIGKILLed jailer)
/// are removed once older than this; younger ones may belong to a jailer that
/// has created its group but not yet moved its vmm in.
const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// Removes the old, empty groups under `parent` other than `keep`. A group
/// that still has processes cannot be removed (EBUSY), so live VMs keep theirs.
fn sweep_stale(parent: &Path, keep: &str) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    // The directory type comes with the entry; only groups are stat'ed.
    for e in entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
    {
        let old = e
            .metadata()
            .ok()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > STALE_AFTER);
        if old && e.file_name() != keep && std::fs::remove_dir(e.path()).is_ok() {
            tracing::info!(group = %e.path().display(), "removed a stale VM cgroup");
        }
    }
}

impl Cgroup {
    /// Creates the group `agentvm/<id>` under `root` (normally /sys/fs/cgroup) and
    /// applies `limits`. Old empty groups of VMs that ended uncleanly are
    /// removed on the way.
    pub fn create(root: &Path, id: &str, limits: &CgroupLimits) -> Result<Cgroup, CgroupError> {
        if v2_has_controllers(root) {
            delegate_cpu_and_memory(root)?;
            let parent = root.join("agentvm");
            create(&parent)?;
            sweep_stale(&parent, id);
            // Let the parent group hand cpu and memory down to the VM groups.
            write(&parent.join("cgroup.subtree_control"), "+cpu +memory")?;
            let dir = parent.join(id);
            create(&dir)?;
            if let Some((quota, period)) = limits.cpu_max {
                write(&dir.join("cpu.max"), &format!("{quota} {period}"))?;
            }
            if let Some(bytes) = limits.memory_max {
                write(&dir.join("memory.max"), &bytes.to_string())?;
            }
            return Ok(Cgroup::V2(dir));
        }
        let (cpu_root, mem_root) = (root.join("cpu"), root.join("memory"));
        if !cpu_root.join("cgroup.procs").exists() || !mem_root.join("cgroup.procs").exists() {
            return Err(CgroupError::NoHierarchy { root: root.into() });
        }
        let cpu = cpu_root.join("agentvm").join(id);
        let memory = mem_root.join("agentvm").join(id);
        for parent in [cpu_root.join("agentvm"), mem_root.join("agentvm")] {
            sweep_stale(&parent, id);
        }
        create(&cpu)?;
        create(&memory)?;
        if let Some((quota, period)) = limits.cpu_max {
            write(&cpu.join("cpu.cfs_period_us"), &period.to_string())?;
            write(&cpu.join("cpu.cfs_quota_us"), &quota.to_string())?;
        }
        if let Some(bytes) = limits.memory_max {
            write(&memory.join("memory.limit_in_bytes"), &bytes.to_string())?;
        }
        Ok(Cgroup::V1 { cpu, memory })
    }

    /// The `cgroup.procs` files a process writes to join the group.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        match self {
            Cgroup::V2(dir) => vec![dir.join("cgroup.procs")],
            Cgroup::V1 { cpu, memory } => {
                vec![cpu.join("cgroup.procs"), memory.join("cgroup.procs")]
            }
        }
    }

    /// Removes the (empty) group directories.
    pub fn remove(&self) {
        match self {
            Cgroup::V2(dir) => {
                let _ = std::fs::remove_dir(dir);
            }
            Cgroup::V1 { cpu, memory } => {
                let _ = std::fs::remove_dir(cpu);
                let _ = std::fs::remove_dir(memory);
            }
        }
    }
}

/// Parses `QUOTA/PERIOD` (microseconds), e.g. `50000/100000` for half a CPU.
pub fn parse_cpu_max(s: &str) -> Result<(u64, u64), String> {
    let (q, p) = s
        .split_once('/')
        .ok_or_else(|| format!("invalid CPU limit {s:?}: expected QUOTA_US/PERIOD_US"))?;
    let q: u64 = q.parse().map_err(|_| format!("invalid CPU quota {q:?}"))?;
    let p: u64 = p.parse().map_err(|_| format!("invalid CPU period {p:?}"))?;
    if q < 1000 || !(1000..=1_000_000).contains(&p) {
        return Err(format!(
            "CPU limit {s:?} out of range: quota at least 1000 us, period 1000 to 1000000 us"
        ));
    }
    Ok((q, p))
}

/// Parses a memory size: bytes, or with a K, M or G suffix (binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let (digits, shift) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected bytes or a K/M/G suffix"))?;
    n.checked_shl(shift)
        .filter(|v| v >> shift == n && *v > 0)
        .ok_or_else(|| format!("size {s:?} is zero or too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_parse() {
        assert_eq!(parse_cpu_max("50000/100000"), Ok((50000, 100000)));
        assert!(parse_cpu_max("50000").is_err());
        assert!(parse_cpu_max("10/100000").is_err());
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("0").is_err());
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999G").is_err());
    }

    #[test]
    fn a_v2_root_that_does_not_delegate_cpu_and_memory_is_made_to() {
        // A fake v2 hierarchy as a minimal init leaves it: the controllers
        // exist, the root hands none down (a real guest's outer VM without
        // systemd; the jail failed there with ENOENT on agentvm's
        // cgroup.subtree_control).
        let t = tempfile::tempdir().unwrap();
        std::fs::write(
            t.path().join("cgroup.controllers"),
            "cpuset cpu io memory pids\n",
        )
        .unwrap();
        std::fs::write(t.path().join("cgroup.subtree_control"), "\n").unwrap();
        let limits = CgroupLimits {
            cpu_max: None,
            memory_max: Some(1 << 30),
        };
        let cg = Cgroup::create(t.path(), "vm1", &limits).unwrap();
        assert!(matches!(&cg, Cgroup::V2(dir) if dir.ends_with("agentvm/vm1")));
        assert_eq!(
            std::fs::read_to_string(t.path().join("cgroup.subtree_control")).unwrap(),
            "+cpu +memory"
        );
        // A root that already delegates them (systemd) is not written.
        std::fs::write(t.path().join("cgroup.subtree_control"), "cpu io memory\n").unwrap();
        Cgroup::create(t.path(), "vm2", &limits).unwrap();
        assert_eq!(
            std::fs::read_to_string(t.path().join("cgroup.subtree_control")).unwrap(),
            "cpu io memory\n"
        );
    }

    #[test]
    fn a_fake_v1_hierarchy_gets_groups_and_limits() {
        let t = tempfile::tempdir().unwrap();
        for c in ["cpu", "memory"] {
            std::fs::create_dir_all(t.path().join(c)).unwrap();
            std::fs::write(t.path().join(c).join("cgroup.procs"), "").unwrap();
        }
        let limits = CgroupLimits {
            cpu_max: Some((20000, 100000)),
            memory_max: Some(1 << 30),
        };
        let cg = Cgroup::create(t.path(), "vm1", &limits).unwrap();
        let Cgroup::V1 { cpu, memory } = &cg else {
            panic!("expected v1, got {cg:?}")
        };
        assert_eq!(
            std::fs::read_to_string(cpu.join("cpu.cfs_quota_us")).unwrap(),
            "20000"
        );
        assert_eq!(
            std::fs::read_to_string(memory.join("memory.limit_in_bytes")).unwrap(),
            (1u64 << 30).to_string()
        );
        // An old empty group (a SIGKILLed jailer's) goes; a young one and the
        // group being created stay.
        let parent = t.path().join("cpu/agentvm");
        let stale = parent.join("gone");
        let young = parent.join("young");
        std::fs::create_dir(&stale).unwrap();
        std::fs::create_dir(&young).unwrap();
        let long_ago = std::time::SystemTime::now() - 2 * STALE_AFTER;
        std::fs::File::open(&stale)
            .unwrap()
            .set_modified(long_ago)
            .unwrap();
        Cgroup::create(t.path(), "vm1", &limits).unwrap();
        assert!(!stale.exists());
        assert!(young.exists() && cpu.exists());
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(
            Cgroup::create(empty.path(), "vm1", &limits),
            Err(CgroupError::NoHierarchy { .. })
        ));
    }
}
