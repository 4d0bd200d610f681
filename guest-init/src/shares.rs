//! virtio-fs shares (StartSession's `mounts`): host directories the VM has
//! a virtio-fs device for, mounted by tag before the repository is cloned.
//!
//! The host names each share's tag, mount point and whether it is
//! read-only; [`plan`] checks them (a tag the device could have, an
//! absolute mount point that hides nothing the guest needs: not `/`,
//! `/proc`, `/sys`, `/dev` or what lies under them, nor the workspace or
//! guest-init's state directory or anything holding them) and [`apply`]
//! mounts them `nosuid,nodev` (and `ro`). Mounting is the machine's: only
//! guest-init as PID 1 does it (see [`crate::agent::Config::own_machine`]).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use proto::guest::Mount;

/// Longest tag: the device's configuration field holds 36 bytes.
pub const MAX_TAG_LEN: usize = 36;

/// Most shares a session may mount.
pub const MAX_MOUNTS: usize = 16;

/// The file system type of a virtio-fs share.
pub const FSTYPE: &str = "virtiofs";

/// Trees a share may not be mounted on or in.
const RESERVED: [&str; 3] = ["/proc", "/sys", "/dev"];

/// Why the shares could not be mounted.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    /// More shares than [`MAX_MOUNTS`].
    #[error("{0} shares asked for; at most {MAX_MOUNTS}")]
    TooMany(usize),
    /// A tag no virtio-fs device can have.
    #[error("share tag {0:?} must be 1 to 36 bytes of letters, digits, '_', '.' or '-'")]
    BadTag(String),
    /// Two shares with one tag.
    #[error("share tag {0:?} is given twice")]
    DuplicateTag(String),
    /// A mount point that is not a plain absolute path.
    #[error("share {tag:?}: mount path {path:?} must be absolute, without '.' or '..' parts")]
    BadPath {
        /// The share's tag.
        tag: String,
        /// The path as given.
        path: String,
    },
    /// A mount point that would hide something the guest needs.
    #[error("share {tag:?}: mount path {path} may not be {what}")]
    Reserved {
        /// The share's tag.
        tag: String,
        /// The mount point.
        path: String,
        /// What it would hide.
        what: String,
    },
    /// Two shares on one mount point.
    #[error("shares {first:?} and {second:?} are both mounted on {path}")]
    SamePath {
        /// The first share's tag.
        first: String,
        /// The second share's tag.
        second: String,
        /// The mount point.
        path: String,
    },
    /// The mount point could not be made.
    #[error("share {tag:?}: cannot create mount point {path}: {source}")]
    MountPoint {
        /// The share's tag.
        tag: String,
        /// The mount point.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// mount(2) failed (its errno in `source`).
    #[error("share {tag:?}: mount -t virtiofs on {path} failed: {source} (is the VM's virtio-fs device for this tag there?)")]
    Mount {
        /// The share's tag.
        tag: String,
        /// The mount point.
        path: String,
        /// The OS error (errno).
        #[source]
        source: std::io::Error,
    },
}

/// One mount to make: `mount(source, target, "virtiofs", flags, NULL)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedMount {
    /// The device's tag (mount's source).
    pub tag: String,
    /// The mount point.
    pub target: PathBuf,
    /// MS_NOSUID | MS_NODEV, and MS_RDONLY for a read-only share.
    pub flags: libc::c_ulong,
}

/// Whether `tag` is a tag a virtio-fs device can have.
pub fn valid_tag(tag: &str) -> bool {
    (1..=MAX_TAG_LEN).contains(&tag.len())
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// Checks `mounts` and returns the mounts to make, in order. `keep` are
/// directories a share may not be mounted on, in, or above (the workspace
/// and guest-init's state directory).
pub fn plan(mounts: &[Mount], keep: &[&Path]) -> Result<Vec<PlannedMount>, ShareError> {
    if mounts.len() > MAX_MOUNTS {
        return Err(ShareError::TooMany(mounts.len()));
    }
    let mut out: Vec<PlannedMount> = Vec::with_capacity(mounts.len());
    for m in mounts {
        if !valid_tag(&m.tag) {
            return Err(ShareError::BadTag(m.tag.clone()));
        }
        if out.iter().any(|p| p.tag == m.tag) {
            return Err(ShareError::DuplicateTag(m.tag.clone()));
        }
        let target = mount_point(&m.tag, &m.path, keep)?;
        if let Some(other) = out.iter().find(|p| p.target == target) {
            return Err(ShareError::SamePath {
                first: other.tag.clone(),
                second: m.tag.clone(),
                path: target.display().to_string(),
            });
        }
        let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
        if m.read_only {
            flags |= libc::MS_RDONLY;
        }
        out.push(PlannedMount {
            tag: m.tag.clone(),
            target,
            flags,
        });
    }
    Ok(out)
}

/// Checks share `tag`'s mount point `path`.
fn mount_point(tag: &str, path: &str, keep: &[&Path]) -> Result<PathBuf, ShareError> {
    let p = Path::new(path);
    // Textually too: components() quietly drops a "." in the middle.
    let plain = p.is_absolute()
        && !path.contains('\0')
        && !path.split('/').any(|c| c == "." || c == "..")
        && p.components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    if !plain {
        return Err(ShareError::BadPath {
            tag: tag.into(),
            path: path.into(),
        });
    }
    // Components, so that "/a//b/" and "/a/b" are one path.
    let p: PathBuf = p.components().collect();
    let reserved = |what: String| ShareError::Reserved {
        tag: tag.into(),
        path: p.display().to_string(),
        what,
    };
    if p == Path::new("/") {
        return Err(reserved("/ (the root file system)".into()));
    }
    if let Some(r) = RESERVED.iter().find(|r| p.starts_with(r)) {
        return Err(reserved(format!("{r} or under it")));
    }
    for k in keep {
        if p.starts_with(k) || k.starts_with(&p) {
            return Err(reserved(format!(
                "{}, in it or above it (guest-init needs it)",
                k.display()
            )));
        }
    }
    Ok(p)
}

/// Makes the mounts of `plan`, in order: each mount point is created (with
/// its parents) and the tag mounted there. Stops at the first failure,
/// naming the share and the error; the mounts made before it stay.
pub fn apply(plan: &[PlannedMount]) -> Result<(), ShareError> {
    for m in plan {
        let path = || m.target.display().to_string();
        std::fs::create_dir_all(&m.target).map_err(|source| ShareError::MountPoint {
            tag: m.tag.clone(),
            path: path(),
            source,
        })?;
        mount(m).map_err(|source| ShareError::Mount {
            tag: m.tag.clone(),
            path: path(),
            source,
        })?;
    }
    Ok(())
}

/// mount(2) for one planned share.
fn mount(m: &PlannedMount) -> std::io::Result<()> {
    let bad = |_| std::io::Error::from(std::io::ErrorKind::InvalidInput);
    let source = CString::new(m.tag.as_str()).map_err(bad)?;
    let target = CString::new(m.target.as_os_str().as_bytes()).map_err(bad)?;
    let fstype = CString::new(FSTYPE).map_err(bad)?;
    // SAFETY: the three pointers are NUL-terminated strings that live until
    // the call returns; the data argument is NULL, which mount(2) accepts
    // for virtiofs. No memory is written.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            m.flags,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// What [`plan`] will mount, for the audit log: `tag on path (ro)`, ...
pub fn describe(plan: &[PlannedMount]) -> String {
    plan.iter()
        .map(|m| {
            let mode = if m.flags & libc::MS_RDONLY != 0 {
                "ro"
            } else {
                "rw"
            };
            format!("{} on {} ({mode})", m.tag, m.target.display())
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(tag: &str, path: &str, read_only: bool) -> Mount {
        Mount {
            tag: tag.into(),
            path: path.into(),
            read_only,
        }
    }

    const KEEP: [&str; 2] = ["/workspace", "/var/lib/guest-init"];

    fn planned(mounts: &[Mount]) -> Result<Vec<PlannedMount>, ShareError> {
        let keep: Vec<&Path> = KEEP.iter().map(Path::new).collect();
        plan(mounts, &keep)
    }

    #[test]
    fn the_plan_mounts_each_tag_nosuid_nodev_and_read_only_when_asked() {
        let p = planned(&[
            m("cargo-registry", "/mnt/cargo-registry", true),
            m("scratch", "/home/agent//scratch/", false),
        ])
        .unwrap();
        assert_eq!(
            p,
            vec![
                PlannedMount {
                    tag: "cargo-registry".into(),
                    target: "/mnt/cargo-registry".into(),
                    flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_RDONLY,
                },
                PlannedMount {
                    tag: "scratch".into(),
                    target: "/home/agent/scratch".into(),
                    flags: libc::MS_NOSUID | libc::MS_NODEV,
                },
            ]
        );
        assert_eq!(
            describe(&p),
            "cargo-registry on /mnt/cargo-registry (ro), scratch on /home/agent/scratch (rw)"
        );
        assert_eq!(planned(&[]).unwrap(), vec![]);
    }

    #[test]
    fn bad_shares_are_refused_naming_the_tag() {
        let err = |mounts: &[Mount]| planned(mounts).unwrap_err().to_string();
        assert!(err(&[m("", "/mnt/x", false)]).contains("share tag \"\""));
        assert!(err(&[m("a b", "/mnt/x", false)]).contains("\"a b\""));
        assert!(err(&[m(&"x".repeat(37), "/mnt/x", false)]).contains("1 to 36 bytes"));
        assert!(err(&[m("a", "/mnt/a", false), m("a", "/mnt/b", false)]).contains("given twice"));
        for path in ["mnt/x", "", "/mnt/../etc", "/mnt/./x"] {
            let e = err(&[m("t", path, false)]);
            assert!(e.contains("must be absolute"), "{path}: {e}");
        }
        for (path, what) in [
            ("/", "the root file system"),
            ("/proc", "/proc"),
            ("/sys/fs/x", "/sys"),
            ("/dev/shm", "/dev"),
            ("/workspace", "/workspace"),
            ("/workspace/vendor", "/workspace"),
            ("/var/lib", "/var/lib/guest-init"),
        ] {
            let e = err(&[m("t", path, false)]);
            assert!(e.starts_with("share \"t\": mount path"), "{path}: {e}");
            assert!(e.contains(what), "{path}: {e}");
        }
        // Not a reserved tree, only a name that starts alike.
        assert!(planned(&[m("t", "/device", false)]).is_ok());
        assert!(planned(&[m("t", "/workspaces", false)]).is_ok());
        let e = err(&[m("a", "/mnt/x", false), m("b", "/mnt/x/", true)]);
        assert_eq!(e, "shares \"a\" and \"b\" are both mounted on /mnt/x");
        let many: Vec<Mount> = (0..=MAX_MOUNTS)
            .map(|i| m(&format!("t{i}"), &format!("/mnt/{i}"), true))
            .collect();
        assert!(err(&many).contains("at most 16"));
    }

    #[test]
    fn a_failed_mount_names_the_tag_and_the_errno() {
        // Not root, or no such device here: either way an OS error that
        // names the share (a host test never has a virtio-fs tag "nope").
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("share");
        let p = vec![PlannedMount {
            tag: "nope".into(),
            target: target.clone(),
            flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_RDONLY,
        }];
        let e = apply(&p).unwrap_err();
        assert!(matches!(e, ShareError::Mount { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.starts_with("share \"nope\": mount -t virtiofs on "),
            "{text}"
        );
        assert!(text.contains("os error"), "{text}");
        assert!(target.is_dir(), "the mount point was made first");
    }
}
