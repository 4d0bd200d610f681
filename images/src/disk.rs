//! Free-space checks made before a step that writes a lot.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::error::{Error, Result};

/// Free MiB (for an unprivileged user) on the file system holding `path`,
/// or its nearest existing ancestor.
pub fn free_mib(path: &Path) -> Result<u64> {
    let mut p = path;
    while !p.exists() {
        match p.parent() {
            Some(parent) => p = parent,
            None => break,
        }
    }
    let c = CString::new(p.as_os_str().as_bytes()).map_err(|_| Error::Io {
        path: p.to_path_buf(),
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })?;
    // SAFETY: statvfs is plain data; all-zero is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a valid out pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(Error::Io {
            path: p.to_path_buf(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64) >> 20)
}

/// Fails with [`Error::NotEnoughSpace`] when fewer than `needed_mib` MiB are
/// free where `path` lives.
pub fn ensure_free(path: &Path, needed_mib: u64, step: &str) -> Result<()> {
    let available_mib = free_mib(path)?;
    if available_mib < needed_mib {
        return Err(Error::NotEnoughSpace {
            path: path.to_path_buf(),
            available_mib,
            needed_mib,
            step: step.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_free_space_and_refuses_impossible_requests() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_mib(&dir.path().join("not/yet/created")).unwrap();
        assert!(free > 0);
        ensure_free(dir.path(), 1, "test").unwrap();
        let e = ensure_free(dir.path(), u64::MAX >> 21, "build everything").unwrap_err();
        assert!(matches!(e, Error::NotEnoughSpace { .. }));
        assert!(e.to_string().contains("build everything"), "{e}");
    }
}
