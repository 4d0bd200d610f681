//! Host paths named in API requests (an image's kernel, rootfs and initrd, a
//! session's repository) are accepted only under roots the operator
//! configured (`allowed_image_roots`, `allowed_repository_roots`).
//!
//! A path is resolved first (`canonicalize`: every symlink and `..`
//! followed), then compared with the roots component by component, then
//! opened, and the opened object's own path (`/proc/self/fd`) is checked
//! again, so a link swapped in between the two steps is caught. The resolved
//! path is what host-agent stores and uses. Roots should be directories only
//! the operator can write: a path is used again later (the golden build reads
//! the image files, Stop fetches into the repository), and only the golden
//! build checks the image files again.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// Longest accepted path in a request.
const MAX_PATH: usize = 4096;

/// What a path must name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A regular file (image files).
    File,
    /// A directory (repositories).
    Dir,
}

/// The roots one kind of request path must lie under.
#[derive(Debug, Clone)]
pub struct PathRoots {
    /// The config setting, named in refusals.
    setting: &'static str,
    /// The command-line flag for the same setting.
    flag: &'static str,
    /// Resolved roots.
    roots: Vec<PathBuf>,
}

/// `path` with `.` and `..` taken away lexically (no file system access).
fn lexical(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

impl PathRoots {
    /// Roots for `setting` (`--flag`); each must exist (it is resolved now).
    pub fn new(setting: &'static str, flag: &'static str, roots: &[PathBuf]) -> Result<PathRoots> {
        let roots = roots
            .iter()
            .map(|r| {
                std::fs::canonicalize(r).map_err(|e| {
                    Error::invalid(format!(
                        "{setting}: root {} cannot be resolved ({e}); create it or remove it \
                         from {setting}",
                        r.display()
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PathRoots {
            setting,
            flag,
            roots,
        })
    }

    /// The resolved roots.
    pub fn roots(&self) -> &[PathBuf] {
        &self.roots
    }

    fn under(&self, p: &Path) -> bool {
        // Path::starts_with compares whole components: /a/bc is not under /a/b.
        self.roots.iter().any(|r| p.starts_with(r))
    }

    fn refused(&self, field: &str, path: &str, resolved: Option<&Path>) -> Error {
        let roots: Vec<String> = self.roots.iter().map(|r| r.display().to_string()).collect();
        let to = resolved
            .map(|r| format!(" (it resolves to {})", r.display()))
            .unwrap_or_default();
        Error::PermissionDenied(format!(
            "{field} {path:?}{to} is not under {} [{}]; an operator can add a root to {} in \
             the config file (or --{})",
            self.setting,
            roots.join(", "),
            self.setting,
            self.flag
        ))
    }

    /// Resolves `path` (a request's `field`) and checks that it lies under a
    /// root and names a `kind`; returns the resolved path.
    pub fn check(&self, field: &str, path: &str, kind: Kind) -> Result<PathBuf> {
        if path.len() > MAX_PATH {
            return Err(Error::invalid(format!(
                "{field} is longer than {MAX_PATH} bytes"
            )));
        }
        let p = Path::new(path);
        if !p.is_absolute() || path.contains('\0') {
            return Err(Error::invalid(format!(
                "{field} must be an absolute path, got {path:?}"
            )));
        }
        let resolved = match std::fs::canonicalize(p) {
            Ok(r) => r,
            // Say "missing" only inside the roots: outside them, whether a
            // path exists is not the caller's business.
            Err(_) if self.under(&lexical(p)) => {
                return Err(Error::invalid(format!(
                    "{field} {path:?} does not exist on this node"
                )))
            }
            Err(_) => return Err(self.refused(field, path, None)),
        };
        if !self.under(&resolved) {
            return Err(self.refused(field, path, Some(&resolved)));
        }
        let file = open(&resolved, kind).map_err(|e| {
            Error::invalid(format!(
                "{field} {path:?} is not a readable {} on this node: {e}",
                match kind {
                    Kind::File => "file",
                    Kind::Dir => "directory",
                }
            ))
        })?;
        // What was opened, wherever the name pointed by then.
        let opened = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .map_err(|e| Error::io(format!("checking what {} opened", resolved.display()), e))?;
        if !self.under(&opened) {
            return Err(self.refused(field, path, Some(&opened)));
        }
        Ok(opened)
    }
}

/// Opens `p` read-only as `kind` without following a link in its last
/// component or blocking on a FIFO.
fn open(p: &Path, kind: Kind) -> std::io::Result<File> {
    let mut flags = libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    if kind == Kind::Dir {
        flags |= libc::O_DIRECTORY;
    }
    let f = OpenOptions::new().read(true).custom_flags(flags).open(p)?;
    let meta = f.metadata()?;
    let ok = match kind {
        Kind::File => meta.is_file(),
        Kind::Dir => meta.is_dir(),
    };
    if !ok {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "wrong file type",
        ));
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn setup() -> (tempfile::TempDir, PathRoots) {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("images");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::write(root.join("sub/rootfs.ext4"), b"disk").unwrap();
        std::fs::write(t.path().join("outside"), b"secret").unwrap();
        std::fs::create_dir(t.path().join("images-evil")).unwrap();
        std::fs::write(t.path().join("images-evil/f"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc/shadow", root.join("shadow-link")).unwrap();
        std::os::unix::fs::symlink(t.path().join("outside"), root.join("out-link")).unwrap();
        std::os::unix::fs::symlink(t.path(), root.join("dir-link")).unwrap();
        std::os::unix::fs::symlink(root.join("sub/rootfs.ext4"), root.join("good-link")).unwrap();
        let roots = PathRoots::new("allowed_image_roots", "allowed-image-root", &[root]).unwrap();
        (t, roots)
    }

    fn denied(r: Result<PathBuf>) -> String {
        match r {
            Err(Error::PermissionDenied(m)) => m,
            other => panic!("expected PermissionDenied, got {other:?}"),
        }
    }

    #[test]
    fn paths_outside_the_roots_are_refused_after_resolving() {
        let (t, roots) = setup();
        let root = t.path().join("images");
        let s = |p: PathBuf| p.display().to_string();
        for p in [
            "/etc/shadow".to_string(),
            s(root.join("shadow-link")),
            s(root.join("out-link")),
            s(root.join("dir-link/outside")),
            s(root.join("../outside")),
            s(root.join("sub/../../outside")),
            s(t.path().join("images-evil/f")),
            "/nonexistent/file".to_string(),
        ] {
            let m = denied(roots.check("rootfs_path", &p, Kind::File));
            assert!(m.contains("allowed_image_roots"), "{p}: {m}");
        }
    }

    #[test]
    fn paths_inside_the_roots_resolve() {
        let (t, roots) = setup();
        let root = std::fs::canonicalize(t.path().join("images")).unwrap();
        let want = root.join("sub/rootfs.ext4");
        for p in ["sub/rootfs.ext4", "good-link", "sub/../sub/./rootfs.ext4"] {
            let got = roots
                .check(
                    "rootfs_path",
                    &root.join(p).display().to_string(),
                    Kind::File,
                )
                .unwrap();
            assert_eq!(got, want, "{p}");
        }
        let dir = roots
            .check(
                "repository_path",
                &root.join("sub").display().to_string(),
                Kind::Dir,
            )
            .unwrap();
        assert_eq!(dir, root.join("sub"));
        // Inside a root: missing files and wrong kinds are invalid arguments.
        for (p, kind) in [
            ("missing", Kind::File),
            ("sub", Kind::File),
            ("sub/rootfs.ext4", Kind::Dir),
        ] {
            let r = roots.check("f", &root.join(p).display().to_string(), kind);
            assert!(matches!(r, Err(Error::InvalidArgument(_))), "{p}: {r:?}");
        }
        assert!(matches!(
            roots.check("f", "relative/path", Kind::File),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn a_missing_root_is_refused_at_start() {
        let err = PathRoots::new(
            "allowed_repository_roots",
            "x",
            &["/nonexistent-root".into()],
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("allowed_repository_roots"),
            "{err}"
        );
    }
}
