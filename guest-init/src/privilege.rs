//! The unprivileged identity agent commands run as.
//!
//! As root (always in a guest), commands run as the image's `agent` user
//! (from /etc/passwd; uid/gid 65534, `nobody`, when the image has none), with
//! no supplementary groups, no capabilities (dropped by the
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

/// The account agent commands run as in a guest image.
pub const AGENT_USER: &str = "agent";

/// The identity to run agent commands as: `requested` (or uid/gid 65534) when
/// root, None (no drop possible) otherwise.
pub fn agent_identity(requested: Option<Identity>) -> Option<Identity> {
    if !is_root() {
        tracing::warn!(
            "not running as root: agent commands run as the current user (privilege drop skipped)"
        );
        return None;
    }
    Some(requested.unwrap_or(Identity {
        uid: DEFAULT_AGENT_ID,
        gid: DEFAULT_AGENT_ID,
    }))
}

/// The uid and gid of `user` in a passwd file's text (`name:x:uid:gid:...`).
/// uid 0 is never returned: agent commands must not run as root.
pub fn lookup_user(passwd: &str, user: &str) -> Option<Identity> {
    passwd.lines().find_map(|line| {
        let mut f = line.split(':');
        if f.next()? != user {
            return None;
        }
        let _password = f.next()?;
        let uid = f.next()?.parse().ok()?;
        let gid = f.next()?.parse().ok()?;
        (uid != 0 && gid != 0).then_some(Identity { uid, gid })
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_are_found_in_passwd_text() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\nagent:x:1000:1001::/home/agent:/bin/bash\n";
        assert_eq!(
            lookup_user(passwd, "agent"),
            Some(Identity {
                uid: 1000,
                gid: 1001
            })
        );
        assert_eq!(lookup_user(passwd, "nobody"), None);
        assert_eq!(lookup_user(passwd, "root"), None, "never root");
        assert_eq!(lookup_user("agent:x:bad:1:", "agent"), None);
    }
}
