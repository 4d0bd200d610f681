//! What this machine lets a test do; a test that cannot run here prints
//! why and returns early (it passes, as a skip).

use std::path::Path;

/// Whether the test runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `CAP_NET_BIND_SERVICE`: binding ports below 1024.
pub const CAP_NET_BIND_SERVICE: u32 = 10;
/// `CAP_NET_ADMIN`: creating taps, configuring interfaces.
pub const CAP_NET_ADMIN: u32 = 12;

/// Whether capability `bit` (`CAP_*` above) is in this process's effective
/// set, read from /proc/self/status's `CapEff` mask; where that cannot be
/// read, root counts as having it.
pub fn has_capability(bit: u32) -> bool {
    let effective = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let mask = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
            u64::from_str_radix(mask.trim(), 16).ok()
        });
    match effective {
        Some(mask) => bit < 64 && mask & (1 << bit) != 0,
        None => is_root(),
    }
}

/// Whether `vmm jail` can run here: root (namespaces, device nodes,
/// cgroups) and cgroup v2, or v1 `cpu` and `memory` hierarchies, at
/// /sys/fs/cgroup. Prints why not.
pub fn jail_supported() -> bool {
    if !is_root() {
        println!("skipped: jailed vmm processes need root (namespaces, device nodes, cgroups)");
        return false;
    }
    let cg = Path::new("/sys/fs/cgroup");
    let v1 = ["cpu", "memory"]
        .iter()
        .all(|c| cg.join(c).join("cgroup.procs").exists());
    if !cg.join("cgroup.controllers").exists() && !v1 {
        println!("skipped: no cgroup v2 or v1 cpu and memory hierarchies at /sys/fs/cgroup");
        return false;
    }
    true
}
