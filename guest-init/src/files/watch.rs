//! Watching a directory (and, recursively, those below it) with inotify.
//!
//! Each directory is opened beneath the workspace (never through a link)
//! and watched through its descriptor (`/proc/self/fd/N`), so a watch is on
//! exactly the directory that was checked. New directories are watched as
//! they appear (their contents created before that are not reported).
//! A move inside the watched tree is one RENAMED change; a move out is
//! REMOVED, a move in CREATED. A kernel queue overflow is OVERFLOW.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use proto::guest::{file_change::Kind, FileChange, FileInfo};

use super::ops::{open_subdir, stat};
use super::path::{RelPath, Workspace};
use super::{FileError, Result};
use proto::guest::file_error::Code;

/// Most directories one watch follows.
pub const MAX_WATCHED_DIRS: usize = 8192;

const MASK: u32 = libc::IN_CREATE
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_CLOSE_WRITE
    | libc::IN_ONLYDIR;

/// An inotify instance watching a tree.
pub struct Watcher {
    inotify: OwnedFd,
    /// Watch descriptor -> (the directory's path, its descriptor).
    dirs: HashMap<i32, (RelPath, OwnedFd)>,
    recursive: bool,
    root: FileInfo,
}

impl Watcher {
    /// Watches the directory `rel` (and below it with `recursive`).
    pub fn new(ws: &Workspace, rel: &RelPath, recursive: bool) -> Result<Self> {
        let root = stat(ws, rel, "path")?;
        let dir = ws.open_at(rel, "path", libc::O_RDONLY | libc::O_DIRECTORY, "watch")?;
        // SAFETY: inotify_init1 takes flags only; the result is checked.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        if fd < 0 {
            return Err(FileError::os(
                "path",
                &rel.shown(),
                "watch",
                std::io::Error::last_os_error(),
            ));
        }
        let mut w = Self {
            // SAFETY: a fresh descriptor, owned by nobody else.
            inotify: unsafe { OwnedFd::from_raw_fd(fd) },
            dirs: HashMap::new(),
            recursive,
            root,
        };
        w.add_tree(dir, rel.clone())
            .map_err(|e| FileError::os("path", &rel.shown(), "watch", e))?;
        Ok(w)
    }

    /// The watched directory.
    pub fn root(&self) -> &FileInfo {
        &self.root
    }

    fn add(&mut self, dir: OwnedFd, rel: RelPath) -> std::io::Result<()> {
        if self.dirs.len() >= MAX_WATCHED_DIRS {
            return Err(std::io::Error::other(format!(
                "more than {MAX_WATCHED_DIRS} directories to watch"
            )));
        }
        let via = CString::new(format!("/proc/self/fd/{}", dir.as_raw_fd()))
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: the inotify descriptor is open and `via` NUL-terminated.
        let wd = unsafe { libc::inotify_add_watch(self.inotify.as_raw_fd(), via.as_ptr(), MASK) };
        if wd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        self.dirs.insert(wd, (rel, dir));
        Ok(())
    }

    fn add_tree(&mut self, dir: OwnedFd, rel: RelPath) -> std::io::Result<()> {
        let subdirs = if self.recursive {
            super::ops::subdirs(&dir)?
        } else {
            Vec::new()
        };
        for name in subdirs {
            if let Ok(sub) = open_subdir(&dir, &name) {
                self.add_tree(sub, rel.join(&name))?;
            }
        }
        self.add(dir, rel)
    }

    /// Reports changes to `emit` until `stop` is readable or closed at the
    /// other end, or `emit` returns false.
    pub fn run(mut self, stop: &OwnedFd, mut emit: impl FnMut(FileChange) -> bool) {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let mut fds = [
                libc::pollfd {
                    fd: self.inotify.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: stop.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: `fds` is a valid array of two pollfd for the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if n < 0 {
                if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return;
            }
            if fds[1].revents != 0 {
                return;
            }
            // SAFETY: `buf` is writable for its length.
            let len =
                unsafe { libc::read(self.inotify.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if len <= 0 {
                continue;
            }
            for c in self.parse(&buf[..len as usize]) {
                if !emit(c) {
                    return;
                }
            }
        }
    }

    fn parse(&mut self, mut b: &[u8]) -> Vec<FileChange> {
        const HEAD: usize = std::mem::size_of::<libc::inotify_event>();
        let mut out = Vec::new();
        let mut moved: HashMap<u32, usize> = HashMap::new();
        while b.len() >= HEAD {
            let word = |i: usize| u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
            let (wd, mask, cookie, nlen) = (word(0) as i32, word(4), word(8), word(12) as usize);
            let end = (HEAD + nlen).min(b.len());
            let raw = &b[HEAD..end];
            let name =
                String::from_utf8_lossy(raw.split(|c| *c == 0).next().unwrap_or(&[])).into_owned();
            b = &b[end..];
            if mask & libc::IN_Q_OVERFLOW != 0 {
                out.push(change(Kind::Overflow, String::new(), false));
                continue;
            }
            if mask & libc::IN_IGNORED != 0 {
                self.dirs.remove(&wd);
                continue;
            }
            let Some((dir_rel, _)) = self.dirs.get(&wd) else {
                continue;
            };
            let path = dir_rel.join(&name);
            let is_dir = mask & libc::IN_ISDIR != 0;
            let kind = if mask & libc::IN_CREATE != 0 {
                Kind::Created
            } else if mask & libc::IN_DELETE != 0 {
                Kind::Removed
            } else if mask & libc::IN_CLOSE_WRITE != 0 {
                Kind::Modified
            } else if mask & libc::IN_MOVED_FROM != 0 {
                moved.insert(cookie, out.len());
                Kind::Removed
            } else if mask & libc::IN_MOVED_TO != 0 {
                if let Some(i) = moved.remove(&cookie) {
                    out[i].kind = Kind::Renamed as i32;
                    out[i].to = path.shown();
                    self.renamed(&out[i].path.clone(), &path);
                    continue;
                }
                Kind::Created
            } else {
                continue;
            };
            if kind == Kind::Created && is_dir && self.recursive {
                self.watch_new(wd, &name, path.clone());
            }
            out.push(change(kind, path.shown(), is_dir));
        }
        out
    }

    fn watch_new(&mut self, parent_wd: i32, name: &str, rel: RelPath) {
        let Some((_, parent)) = self.dirs.get(&parent_wd) else {
            return;
        };
        if let Ok(fd) = open_subdir(parent, name) {
            if let Err(e) = self.add_tree(fd, rel) {
                tracing::debug!(error = %e, "a new directory is not watched");
            }
        }
    }

    /// A directory moved inside the tree: its watches carry the new path.
    fn renamed(&mut self, from: &str, to: &RelPath) {
        for (rel, _) in self.dirs.values_mut() {
            let shown = rel.shown();
            if shown == from {
                *rel = to.clone();
            } else if let Some(rest) = shown.strip_prefix(&format!("{from}/")) {
                *rel = to.join(rest);
            }
        }
    }
}

fn change(kind: Kind, path: String, is_dir: bool) -> FileChange {
    FileChange {
        kind: kind as i32,
        path,
        to: String::new(),
        is_dir,
    }
}

/// A pipe whose write end, dropped, stops [`Watcher::run`].
pub fn stop_pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(FileError::new(
            Code::Internal,
            "",
            format!("cannot make a pipe: {}", std::io::Error::last_os_error()),
        ));
    }
    // SAFETY: both descriptors are fresh and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}
