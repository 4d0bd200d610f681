//! The unprivileged identity agent commands run as.
//!
//! As root (always in a guest), commands run as uid/gid 65534 (`nobody`) by
//! default, with no supplementary groups, no capabilities (dropped by the
//! kernel on the setuid from root) and `no_new_privs` set, so setuid programs
//! such as `sudo` cannot regain them. Such a command cannot change the egress
//! rules, signal guest-init, read the state directory (secrets, audit log,
//! bundles; mode 0700, owned by root) or rewrite the audit log.
//!
//! When guest-init is not root (a developer running `serve`), there is no
//! identity to drop to: commands run as the current user, and this is logged.

/// uid and gid used for agent commands by default.
pub const DEFAULT_AGENT_ID: u32 = 65534;

/// A uid/gid pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

/// True when running with effective uid 0.
pub fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The identity to run agent commands as: `requested` (or the default) when
/// root, None (no drop possible) otherwise.
pub fn agent_identity(requested: Option<u32>) -> Option<Identity> {
    if !is_root() {
        tracing::warn!(
            "not running as root: agent commands run as the current user (privilege drop skipped)"
        );
        return None;
    }
    let id = requested.unwrap_or(DEFAULT_AGENT_ID);
    Some(Identity { uid: id, gid: id })
}

/// Gives `path` and everything below it to `id` (symlinks themselves, not
/// their targets).
pub fn chown_tree(path: &std::path::Path, id: Identity) -> std::io::Result<()> {
    std::os::unix::fs::lchown(path, Some(id.uid), Some(id.gid))?;
    let meta = std::fs::symlink_metadata(path)?;
    if meta.is_dir() {
        for entry in std::fs::read_dir(path)? {
            chown_tree(&entry?.path(), id)?;
        }
    }
    Ok(())
}
