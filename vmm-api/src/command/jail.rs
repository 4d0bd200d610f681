//! `vmm jail ... -- <vmm args>`: the jail a vmm runs in, and the jail name
//! of a VM's directory.

use std::path::{Path, PathBuf};

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
    /// CPU bandwidth of the VM's cgroup: `(quota_us, period_us)` (cpu.max).
    pub cpu_max: Option<(u64, u64)>,
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
        if let Some((quota, period)) = self.cpu_max {
            a.extend(["--cpu-max".into(), format!("{quota}/{period}")]);
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
