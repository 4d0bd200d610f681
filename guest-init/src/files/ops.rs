//! The one-shot operations: stat, list, make a directory, remove, rename,
//! and opening a file for reading. All blocking; run them through
//! [`super::fsid`].

use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use proto::guest::{file_error::Code, file_info::Kind, FileInfo};

use super::path::{RelPath, Workspace};
use super::{FileError, Result, MAX_DEPTH, MAX_LIST_ENTRIES};

fn name_c(field: &'static str, name: &str) -> Result<CString> {
    CString::new(name).map_err(|_| FileError::invalid(field, "contains a NUL byte"))
}

/// `fstatat(dir, name)` without following a link (`name` "" is `dir` itself).
fn stat_at(dir: &OwnedFd, name: &str) -> std::io::Result<libc::stat> {
    let c = CString::new(name).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    let flags = libc::AT_SYMLINK_NOFOLLOW
        | if name.is_empty() {
            libc::AT_EMPTY_PATH
        } else {
            0
        };
    // SAFETY: zeroed memory is a valid `stat` (plain integers).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `dir` is an open descriptor, `c` NUL-terminated, `st` writable.
    if unsafe { libc::fstatat(dir.as_raw_fd(), c.as_ptr(), &mut st, flags) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

fn link_target(dir: &OwnedFd, name: &str) -> String {
    let Ok(c) = CString::new(name) else {
        return String::new();
    };
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: `buf` is writable for its length; readlinkat writes at most that.
    let n = unsafe {
        libc::readlinkat(
            dir.as_raw_fd(),
            c.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return String::new();
    }
    buf.truncate(n as usize);
    String::from_utf8_lossy(&buf).into_owned()
}

/// The protocol's description of an entry.
pub fn info_of(rel: &RelPath, st: &libc::stat, target: String) -> FileInfo {
    let kind = match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => Kind::File,
        libc::S_IFDIR => Kind::Directory,
        libc::S_IFLNK => Kind::Symlink,
        _ => Kind::Other,
    };
    FileInfo {
        path: rel.shown(),
        kind: kind as i32,
        size: st.st_size.max(0) as u64,
        permissions: st.st_mode & 0o7777,
        modified_unix_ns: st
            .st_mtime
            .saturating_mul(1_000_000_000)
            .saturating_add(st.st_mtime_nsec),
        link_target: target,
    }
}

fn info_at(dir: &OwnedFd, name: &str, rel: &RelPath) -> std::io::Result<FileInfo> {
    let st = stat_at(dir, name)?;
    let target = if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
        link_target(dir, name)
    } else {
        String::new()
    };
    Ok(info_of(rel, &st, target))
}

/// The entry at `rel` (a link is described, not followed).
pub fn stat(ws: &Workspace, rel: &RelPath, field: &'static str) -> Result<FileInfo> {
    if rel.is_root() {
        let fd = ws.open_at(rel, field, libc::O_PATH | libc::O_DIRECTORY, "open")?;
        return info_at(&fd, "", rel).map_err(|e| FileError::os(field, ".", "stat", e));
    }
    let (dir, name) = ws.parent_of(rel, field)?;
    info_at(&dir, name, rel).map_err(|e| FileError::os(field, &rel.shown(), "stat", e))
}

/// The names in the directory open at `dir`, sorted (no `.` or `..`).
fn read_names(dir: &OwnedFd) -> std::io::Result<Vec<String>> {
    // SAFETY: dup of an open descriptor; the copy is owned by the DIR below.
    let copy = unsafe { libc::dup(dir.as_raw_fd()) };
    if copy < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `copy` is an open directory descriptor we own; on success the
    // DIR takes it over and closedir closes it.
    let d = unsafe { libc::fdopendir(copy) };
    if d.is_null() {
        let e = std::io::Error::last_os_error();
        // SAFETY: fdopendir failed, so `copy` is still ours to close.
        unsafe { libc::close(copy) };
        return Err(e);
    }
    // SAFETY: `d` is a valid DIR; rewinding makes a reused descriptor read from the start.
    unsafe { libc::rewinddir(d) };
    let mut names = Vec::new();
    loop {
        // SAFETY: `d` is a valid DIR; the entry is read before the next call.
        let ent = unsafe { libc::readdir(d) };
        if ent.is_null() {
            break;
        }
        // SAFETY: d_name of a returned entry is NUL-terminated.
        let name = unsafe { CStr::from_ptr((*ent).d_name.as_ptr()) };
        let bytes = name.to_bytes();
        if bytes == b"." || bytes == b".." {
            continue;
        }
        names.push(String::from_utf8_lossy(bytes).into_owned());
    }
    // SAFETY: `d` is valid and not used after this.
    unsafe { libc::closedir(d) };
    names.sort();
    Ok(names)
}

/// Opens the subdirectory `name` of `dir`, never following a link.
pub(super) fn open_subdir(dir: &OwnedFd, name: &str) -> std::io::Result<OwnedFd> {
    let c = CString::new(name).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `dir` is open and `c` NUL-terminated; the result is checked.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The entries below the directory `rel`, `depth` levels deep (directories
/// before their contents), at most [`MAX_LIST_ENTRIES`]; true when cut there.
pub fn list(ws: &Workspace, rel: &RelPath, depth: u32) -> Result<(Vec<FileInfo>, bool)> {
    if depth > MAX_DEPTH {
        return Err(FileError::invalid(
            "depth",
            format!("{depth} is deeper than {MAX_DEPTH}"),
        ));
    }
    let dir = ws.open_at(rel, "path", libc::O_RDONLY | libc::O_DIRECTORY, "list")?;
    let mut out = Vec::new();
    let truncated = walk(&dir, rel, depth.max(1), &mut out)
        .map_err(|e| FileError::os("path", &rel.shown(), "list", e))?;
    Ok((out, truncated))
}

fn walk(
    dir: &OwnedFd,
    rel: &RelPath,
    levels: u32,
    out: &mut Vec<FileInfo>,
) -> std::io::Result<bool> {
    for name in read_names(dir)? {
        if out.len() >= MAX_LIST_ENTRIES {
            return Ok(true);
        }
        let child = rel.join(&name);
        // Gone since it was listed: skip it.
        let Ok(info) = info_at(dir, &name, &child) else {
            continue;
        };
        let is_dir = info.kind == Kind::Directory as i32;
        out.push(info);
        if is_dir && levels > 1 {
            // A directory the agent cannot open is listed, not entered.
            if let Ok(sub) = open_subdir(dir, &name) {
                if walk(&sub, &child, levels - 1, out)? {
                    return Ok(true);
                }
            }
        }
    }
    Ok(false)
}

/// Creates the directory `rel` (and its parents with `parents`).
pub fn make_dir(ws: &Workspace, rel: &RelPath, parents: bool, mode: u32) -> Result<FileInfo> {
    let mut targets = vec![rel.clone()];
    if parents {
        let mut p = rel.clone();
        while let Some((parent, _)) = p.split() {
            if parent.is_root() {
                break;
            }
            targets.push(parent.clone());
            p = parent;
        }
        targets.reverse();
    }
    for t in &targets {
        let (dir, name) = ws.parent_of(t, "path")?;
        let c = name_c("path", name)?;
        // SAFETY: `dir` is open and `c` NUL-terminated.
        if unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), mode) } != 0 {
            let e = std::io::Error::last_os_error();
            let exists_as_dir = e.raw_os_error() == Some(libc::EEXIST)
                && stat_at(&dir, name).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR);
            if !(parents && exists_as_dir) {
                return Err(FileError::os("path", &t.shown(), "create the directory", e));
            }
        }
    }
    stat(ws, rel, "path")
}

fn unlink_at(dir: &OwnedFd, name: &str, flags: i32) -> std::io::Result<()> {
    let c = CString::new(name).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `dir` is open and `c` NUL-terminated.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), flags) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Removes `rel` (a directory's contents too with `recursive`); returns the
/// number of entries removed.
pub fn remove(ws: &Workspace, rel: &RelPath, recursive: bool) -> Result<u64> {
    let (dir, name) = ws.parent_of(rel, "path")?;
    let shown = rel.shown();
    let st = stat_at(&dir, name).map_err(|e| FileError::os("path", &shown, "remove", e))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
        unlink_at(&dir, name, 0).map_err(|e| FileError::os("path", &shown, "remove", e))?;
        return Ok(1);
    }
    if !recursive {
        return match unlink_at(&dir, name, libc::AT_REMOVEDIR) {
            Ok(()) => Ok(1),
            Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => Err(FileError::new(
                Code::FailedPrecondition,
                "recursive",
                format!("{shown:?} is a directory that is not empty; set recursive to remove it with its contents"),
            )),
            Err(e) => Err(FileError::os("path", &shown, "remove", e)),
        };
    }
    remove_tree(&dir, name, 0).map_err(|e| FileError::os("path", &shown, "remove", e))
}

fn remove_tree(dir: &OwnedFd, name: &str, level: u32) -> std::io::Result<u64> {
    if level > 4 * MAX_DEPTH {
        return Err(std::io::Error::other("the tree is too deep to remove"));
    }
    let sub = open_subdir(dir, name)?;
    let mut n = 0;
    for child in read_names(&sub)? {
        let st = match stat_at(&sub, &child) {
            Ok(st) => st,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
            Err(e) => return Err(e),
        };
        if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            n += remove_tree(&sub, &child, level + 1)?;
        } else {
            unlink_at(&sub, &child, 0)?;
            n += 1;
        }
    }
    unlink_at(dir, name, libc::AT_REMOVEDIR)?;
    Ok(n + 1)
}

/// `renameat2`; `noreplace` refuses an existing target.
pub fn rename_at(
    from_dir: &OwnedFd,
    from: &str,
    to_dir: &OwnedFd,
    to: &str,
    noreplace: bool,
) -> std::io::Result<()> {
    let f = CString::new(from).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    let t = CString::new(to).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    let flags: libc::c_uint = if noreplace { libc::RENAME_NOREPLACE } else { 0 };
    // SAFETY: both descriptors are open and both names NUL-terminated.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            from_dir.as_raw_fd(),
            f.as_ptr(),
            to_dir.as_raw_fd(),
            t.as_ptr(),
            flags,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Moves `from` to `to`; returns the entry at `to`.
pub fn rename(ws: &Workspace, from: &RelPath, to: &RelPath, overwrite: bool) -> Result<FileInfo> {
    let (fdir, fname) = ws.parent_of(from, "from")?;
    let (tdir, tname) = ws.parent_of(to, "to")?;
    rename_at(&fdir, fname, &tdir, tname, !overwrite).map_err(|e| match e.raw_os_error() {
        Some(libc::EEXIST) => FileError::new(
            Code::AlreadyExists,
            "to",
            format!("{:?} exists; set overwrite to replace it", to.shown()),
        ),
        Some(libc::ENOENT) => FileError::os("from", &from.shown(), "rename", e),
        _ => FileError::os(
            "to",
            &to.shown(),
            &format!("rename {:?} to", from.shown()),
            e,
        ),
    })?;
    stat(ws, to, "to")
}

/// Opens the regular file `rel` for reading; returns it and its size.
pub fn open_read(ws: &Workspace, rel: &RelPath) -> Result<(std::fs::File, u64)> {
    // Non-blocking, so a FIFO swapped in cannot hold the open.
    let fd = ws.open_at(rel, "path", libc::O_RDONLY | libc::O_NONBLOCK, "read")?;
    let st = stat_at(&fd, "").map_err(|e| FileError::os("path", &rel.shown(), "read", e))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(FileError::new(
            Code::FailedPrecondition,
            "path",
            format!("{:?} is not a regular file", rel.shown()),
        ));
    }
    Ok((std::fs::File::from(fd), st.st_size.max(0) as u64))
}

/// The names of the subdirectories of `dir` (links not followed).
pub fn subdirs(dir: &OwnedFd) -> std::io::Result<Vec<String>> {
    Ok(read_names(dir)?
        .into_iter()
        .filter(|n| stat_at(dir, n).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR))
        .collect())
}
