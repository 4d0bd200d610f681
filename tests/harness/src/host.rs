//! What this machine lets a test do; a test that cannot run here prints
//! why and returns early (it passes, as a skip).

use std::path::Path;

/// Whether the test runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
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
