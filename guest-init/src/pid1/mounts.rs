//! The pseudo file systems PID 1 mounts.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// (file system type, mount point relative to the root, flags, options).
const MOUNTS: &[(&str, &str, libc::c_ulong, &str)] = &[
    (
        "proc",
        "proc",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "",
    ),
    (
        "sysfs",
        "sys",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "",
    ),
    ("devtmpfs", "dev", libc::MS_NOSUID, "mode=0755"),
    (
        "devpts",
        "dev/pts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        "mode=0620,ptmxmode=0666",
    ),
    (
        "tmpfs",
        "tmp",
        libc::MS_NOSUID | libc::MS_NODEV,
        "mode=1777",
    ),
    (
        "tmpfs",
        "run",
        libc::MS_NOSUID | libc::MS_NODEV,
        "mode=0755",
    ),
    (
        "cgroup2",
        "sys/fs/cgroup",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "",
    ),
];

/// A mount that failed.
#[derive(Debug, thiserror::Error)]
#[error("mounting {fstype} on {target}: {source}")]
pub struct MountError {
    /// File system type.
    pub fstype: String,
    /// Mount point.
    pub target: String,
    /// The OS error.
    pub source: std::io::Error,
}

/// Mounts everything under `root`; already-mounted targets are fine.
/// Returns the failures (boot goes on without them).
pub fn mount_all(root: &Path) -> Vec<MountError> {
    let mut errors = Vec::new();
    for (fstype, rel, flags, data) in MOUNTS {
        let target = root.join(rel);
        if let Err(source) = mount_one(fstype, &target, *flags, data) {
            errors.push(MountError {
                fstype: fstype.to_string(),
                target: target.display().to_string(),
                source,
            });
        }
    }
    errors
}

fn mount_one(fstype: &str, target: &Path, flags: libc::c_ulong, data: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(target)?;
    let bad = |_| std::io::Error::from(std::io::ErrorKind::InvalidInput);
    let src = CString::new(fstype).map_err(bad)?;
    let tgt = CString::new(target.as_os_str().as_bytes()).map_err(bad)?;
    let data = CString::new(data).map_err(bad)?;
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            src.as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EBUSY) {
            return Ok(());
        }
        return Err(e);
    }
    Ok(())
}
