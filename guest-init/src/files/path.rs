//! Paths from the host, checked and resolved beneath the workspace.
//!
//! A path must be UTF-8, free of NUL and not empty; it is relative to the
//! workspace root or absolute inside it (`.` is the root). It is first
//! normalised lexically (`.` dropped, `a/..` removed), and a `..` that would
//! climb above the root is refused before the file system is touched. The
//! rest is resolved by the kernel with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_MAGICLINKS)` relative to a descriptor of the workspace root:
//! a symbolic link leading out (absolute, or with enough `..`), swapped in
//! at any moment, is refused by the kernel rather than by a check that
//! could race with it. Operations on an entry itself (stat, create, remove,
//! rename) resolve its parent that way and act on the last name with the
//! `*at` calls, never following a link there.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use super::{FileError, Result};
use proto::guest::file_error::Code;

/// The workspace root, held open as a directory descriptor.
pub struct Workspace {
    root: OwnedFd,
    /// Absolute spellings of the root a host path may start with.
    prefixes: Vec<PathBuf>,
}

/// A path checked lexically: relative to the root, no `.` or `..` left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelPath(PathBuf);

impl RelPath {
    /// True for the workspace root itself.
    pub fn is_root(&self) -> bool {
        self.0.as_os_str().is_empty()
    }

    /// The path as shown to the host (`.` for the root).
    pub fn shown(&self) -> String {
        if self.is_root() {
            ".".to_string()
        } else {
            self.0.to_string_lossy().into_owned()
        }
    }

    /// The path for `*at` calls relative to the root (`.` for the root).
    pub fn as_path(&self) -> &Path {
        if self.is_root() {
            Path::new(".")
        } else {
            &self.0
        }
    }

    /// This path with `name` appended.
    pub fn join(&self, name: &str) -> RelPath {
        RelPath(self.0.join(name))
    }

    /// The parent (the root for a top-level entry) and the last name; None for the root.
    pub fn split(&self) -> Option<(RelPath, &str)> {
        let name = self.0.file_name()?.to_str()?;
        let parent = self.0.parent().unwrap_or(Path::new("")).to_path_buf();
        Some((RelPath(parent), name))
    }
}

/// Checks a path field sent by the host and normalises it lexically.
pub fn check(workspace: &Path, field: &'static str, raw: &[u8]) -> Result<RelPath> {
    if raw.is_empty() {
        return Err(FileError::invalid(
            field,
            "is empty; use `.` for the workspace root",
        ));
    }
    let text = std::str::from_utf8(raw).map_err(|_| {
        FileError::invalid(
            field,
            format!(
                "is not valid UTF-8 ({:?})",
                String::from_utf8_lossy(raw).into_owned()
            ),
        )
    })?;
    if text.contains('\0') {
        return Err(FileError::invalid(
            field,
            format!("{:?} contains a NUL byte", text.replace('\0', "\\0")),
        ));
    }
    if text.len() > libc::PATH_MAX as usize {
        return Err(FileError::invalid(
            field,
            format!("is {} bytes; at most {}", text.len(), libc::PATH_MAX),
        ));
    }
    let escapes = || {
        FileError::invalid(
            field,
            format!("{text:?} is outside the workspace {}", workspace.display()),
        )
    };
    let requested = Path::new(text);
    let relative = if requested.is_absolute() {
        let canonical = workspace.canonicalize().ok();
        requested
            .strip_prefix(workspace)
            .ok()
            .or_else(|| {
                canonical
                    .as_deref()
                    .and_then(|c| requested.strip_prefix(c).ok())
            })
            .ok_or_else(escapes)?
    } else {
        requested
    };
    let mut out = PathBuf::new();
    for c in relative.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return Err(escapes());
                }
            }
            Component::RootDir | Component::Prefix(_) => return Err(escapes()),
        }
    }
    Ok(RelPath(out))
}

fn cstring(p: &Path) -> Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| FileError::invalid("path", "contains a NUL byte"))
}

/// The kernel's `struct open_how` (linux/openat2.h).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
const RESOLVE_BENEATH: u64 = 0x08;

/// `openat2(dir, path, how)` with the beneath rules; retried on EAGAIN
/// (a rename raced with the lookup).
pub fn openat2(dir: &OwnedFd, path: &Path, flags: i32, mode: u32) -> std::io::Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u64,
        mode: if flags & (libc::O_CREAT | libc::O_TMPFILE) != 0 {
            u64::from(mode)
        } else {
            0
        },
        resolve: RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS,
    };
    for _ in 0..16 {
        // SAFETY: `c` is a valid NUL-terminated string and `how` a valid
        // open_how of the size passed; both outlive the call. The returned
        // descriptor, when non-negative, is new and owned by nobody else.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir.as_raw_fd(),
                c.as_ptr(),
                &how as *const OpenHow,
                std::mem::size_of::<OpenHow>(),
            )
        };
        if fd >= 0 {
            // SAFETY: a fresh descriptor from openat2, owned by nobody else.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) });
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) => continue,
            Some(libc::ENOSYS) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::Unsupported,
                    "this kernel has no openat2 (Linux 5.6 or later is needed); \
                     file operations cannot be checked and are refused",
                ))
            }
            _ => return Err(e),
        }
    }
    Err(std::io::Error::from_raw_os_error(libc::EAGAIN))
}

impl Workspace {
    /// Opens the workspace root (with the caller's own credentials: its
    /// parent directories need not be searchable by the agent).
    pub fn open(dir: &Path) -> Result<Self> {
        let c = cstring(dir)?;
        // SAFETY: `c` is a valid NUL-terminated path; the flags open a
        // descriptor only, which is checked below.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(FileError::new(
                Code::Internal,
                "path",
                format!(
                    "cannot open the workspace {}: {}",
                    dir.display(),
                    std::io::Error::last_os_error()
                ),
            ));
        }
        let mut prefixes = vec![dir.to_path_buf()];
        if let Ok(c) = dir.canonicalize() {
            prefixes.push(c);
        }
        // SAFETY: a fresh descriptor from open(2), owned by nobody else.
        let root = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self { root, prefixes })
    }

    /// Checks a path field (see [`check`]).
    pub fn check(&self, field: &'static str, raw: &[u8]) -> Result<RelPath> {
        let mut last = None;
        for p in &self.prefixes {
            match check(p, field, raw) {
                Ok(r) => return Ok(r),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| FileError::invalid(field, "no workspace")))
    }

    /// Opens `rel` beneath the root with `flags` (a link inside the
    /// workspace is followed; one leading out is refused).
    pub fn open_at(
        &self,
        rel: &RelPath,
        field: &'static str,
        flags: i32,
        what: &str,
    ) -> Result<OwnedFd> {
        openat2(&self.root, rel.as_path(), flags, 0)
            .map_err(|e| FileError::os(field, &rel.shown(), what, e))
    }

    /// The parent directory of `rel` (opened beneath the root) and its last
    /// name. The root itself has none: FAILED_PRECONDITION naming `field`.
    pub fn parent_of<'a>(
        &self,
        rel: &'a RelPath,
        field: &'static str,
    ) -> Result<(OwnedFd, &'a str)> {
        let (parent, name) = rel.split().ok_or_else(|| {
            FileError::new(
                Code::FailedPrecondition,
                field,
                "the workspace root itself cannot be used here",
            )
        })?;
        let fd = self.open_at(
            &parent,
            field,
            libc::O_PATH | libc::O_DIRECTORY,
            "open the directory of",
        )?;
        Ok((fd, name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(ws: &Path, raw: &[u8]) -> Result<String> {
        check(ws, "path", raw).map(|r| r.shown())
    }

    #[test]
    fn lexical_rules() {
        let ws = Path::new("/work/ws");
        assert_eq!(rel(ws, b".").unwrap(), ".");
        assert_eq!(rel(ws, b"a/./b/../c").unwrap(), "a/c");
        assert_eq!(rel(ws, b"/work/ws/a").unwrap(), "a");
        assert_eq!(rel(ws, b"/work/ws").unwrap(), ".");
        for bad in [
            &b""[..],
            b"..",
            b"a/../..",
            b"/etc/passwd",
            b"/work/wsx/a",
            b"\xff",
            b"a\0b",
        ] {
            let e = rel(ws, bad).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument, "{bad:?}");
            assert_eq!(e.field, "path");
        }
        let e = check(ws, "to", b"../x").unwrap_err();
        assert_eq!(e.field, "to");
        assert!(e.to_string().starts_with("to: "), "{e}");
    }

    #[test]
    fn resolution_stays_beneath_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path().join("ws");
        std::fs::create_dir_all(ws.join("sub")).unwrap();
        std::fs::write(ws.join("sub/f"), b"x").unwrap();
        std::fs::write(dir.path().join("secret"), b"s").unwrap();
        std::os::unix::fs::symlink("../secret", ws.join("up")).unwrap();
        std::os::unix::fs::symlink("/etc", ws.join("abs")).unwrap();
        std::os::unix::fs::symlink("sub", ws.join("inside")).unwrap();
        let w = Workspace::open(&ws).unwrap();
        let open = |p: &[u8]| {
            let r = w.check("path", p)?;
            w.open_at(&r, "path", libc::O_RDONLY, "open")
        };
        assert!(open(b"sub/f").is_ok());
        assert!(open(b"inside/f").is_ok(), "a link inside is followed");
        for escaping in [&b"up"[..], b"abs/passwd", b"abs"] {
            let e = open(escaping).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument, "{escaping:?}: {e}");
            assert!(e.message.contains("out of the workspace"), "{e}");
        }
        assert_eq!(open(b"missing").unwrap_err().code, Code::NotFound);
        // A parent swapped for a link pointing out is refused too.
        std::fs::rename(ws.join("sub"), dir.path().join("moved")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("moved"), ws.join("sub")).unwrap();
        let r = w.check("path", b"sub/f").unwrap();
        assert_eq!(
            w.parent_of(&r, "path").unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(
            w.parent_of(&w.check("path", b".").unwrap(), "path")
                .unwrap_err()
                .code,
            Code::FailedPrecondition
        );
    }
}
