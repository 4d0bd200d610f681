//! File operations that stay safe in a directory an untrusted process can
//! write: a jailed vmm owns its run directory (`jail/run`), so any name in
//! it may be a symlink, a FIFO or a hard link it planted. host-agent runs as
//! root there, so it never follows the last path component, creates files
//! only with `O_EXCL`, and works through the file descriptors it opened.
//! (The directories above the run directory belong to host-agent and cannot
//! be swapped by the vmm.)
//!
//! Disk copies keep holes (`SEEK_DATA`/`SEEK_HOLE`) and share blocks where the
//! file system can (`FICLONE`); written here rather than with `cp` because
//! `cp` follows a planted symlink.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// `FICLONE`: `_IOW(0x94, 9, int)`, share all blocks of a file (reflink).
const FICLONE: libc::c_ulong = 0x4004_9409;

/// Opens a regular file for reading without following a symlink at `path`
/// (and without blocking on a planted FIFO).
pub fn open_regular(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a regular file", path.display()),
        ));
    }
    Ok(file)
}

/// Creates `path` as a new file (mode 0600), removing whatever name was
/// there first; fails rather than write through anything planted meanwhile.
pub fn create_new(path: &Path) -> io::Result<File> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Makes `path` a real directory (replacing a symlink or file planted there)
/// and, if given, gives it (not a link's target) to `owner`.
pub fn ensure_dir(path: &Path, owner: Option<(u32, u32)>) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            std::fs::remove_file(path)?;
            std::fs::create_dir(path)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => std::fs::create_dir(path)?,
        Err(e) => return Err(e),
    }
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::lchown(path, Some(uid), Some(gid))?;
    }
    Ok(())
}

/// Copies `src` (a regular file, not followed through a symlink) to a new
/// file `dst` (replacing what is there, never through a link) owned by
/// `owner` if given: a reflink where the file system has them, else the
/// data ranges only, leaving holes. The copy is made as `<dst>.partial` and
/// renamed into place once whole, so a copy that fails (a full disk) leaves
/// no `dst` that a later caller would take for a good one.
pub fn copy_file(src: &Path, dst: &Path, owner: Option<(u32, u32)>) -> io::Result<()> {
    let mut partial = dst.as_os_str().to_owned();
    partial.push(".partial");
    let partial = std::path::PathBuf::from(partial);
    let copied = copy_into(src, &partial, owner).and_then(|()| std::fs::rename(&partial, dst));
    if copied.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    copied
}

/// [`copy_file`]'s copy, into `dst` itself.
fn copy_into(src: &Path, dst: &Path, owner: Option<(u32, u32)>) -> io::Result<()> {
    let from = open_regular(src)?;
    let to = create_new(dst)?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::fchown(&to, Some(uid), Some(gid))?;
    }
    // SAFETY: FICLONE takes the source descriptor as its argument; both are open files.
    if unsafe { libc::ioctl(to.as_raw_fd(), FICLONE as _, from.as_raw_fd()) } == 0 {
        return Ok(());
    }
    let len = from.metadata()?.len();
    to.set_len(len)?;
    let mut offset = 0u64;
    while offset < len {
        let Some(start) = seek(&from, offset, libc::SEEK_DATA)? else {
            break;
        };
        let end = seek(&from, start, libc::SEEK_HOLE)?.unwrap_or(len).min(len);
        copy_range(&from, &to, start, end)?;
        offset = end;
    }
    to.sync_all()
}

/// lseek with SEEK_DATA/SEEK_HOLE; None past the last data (ENXIO).
fn seek(file: &File, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    let off = libc::off_t::try_from(offset)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset too large"))?;
    // SAFETY: lseek on an open descriptor; no memory is passed.
    let r = unsafe { libc::lseek(file.as_raw_fd(), off, whence) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    Ok(Some(r as u64))
}

/// Copies bytes `start..end` at the same offsets.
fn copy_range(from: &File, to: &File, start: u64, end: u64) -> io::Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    let mut at = start;
    while at < end {
        let want = usize::try_from(end - at)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let n = from.read_at(&mut buf[..want], at)?;
        if n == 0 {
            break;
        }
        to.write_all_at(&buf[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn copies_keep_the_data_and_the_holes() {
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("src");
        let f = File::create(&src).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(b"head", 0).unwrap();
        f.write_all_at(b"tail", (64 << 20) - 4).unwrap();
        drop(f);
        let dst = t.path().join("dst");
        std::fs::write(&dst, b"old contents").unwrap();
        copy_file(&src, &dst, None).unwrap();
        let a = std::fs::read(&src).unwrap();
        let b = std::fs::read(&dst).unwrap();
        assert!(a == b, "contents differ");
        let meta = std::fs::metadata(&dst).unwrap();
        assert!(
            meta.blocks() * 512 < 8 << 20,
            "the copy filled its holes: {} blocks",
            meta.blocks()
        );
    }

    #[test]
    fn a_failed_copy_leaves_no_destination_and_a_good_one_no_partial_file() {
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("src");
        std::fs::write(&src, b"disk").unwrap();
        let dst = t.path().join("rootfs.ext4");
        let partial = t.path().join("rootfs.ext4.partial");
        // A leftover of a copy that died is replaced, and goes.
        std::fs::write(&partial, b"half").unwrap();
        copy_file(&src, &dst, None).unwrap();
        assert_eq!(std::fs::read(&dst).unwrap(), b"disk");
        assert!(!partial.exists());
        // A copy that fails leaves neither file behind.
        std::fs::remove_file(&dst).unwrap();
        let e = copy_file(&t.path().join("missing"), &dst, None).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(!dst.exists() && !partial.exists());
        // Copying into a directory that is not there fails the same way.
        let nowhere = t.path().join("no-such-dir").join("rootfs.ext4");
        assert!(copy_file(&src, &nowhere, None).is_err());
        assert!(!nowhere.exists());
    }

    #[test]
    fn planted_links_are_neither_read_nor_written_through() {
        let t = tempfile::tempdir().unwrap();
        let secret = t.path().join("secret");
        std::fs::write(&secret, b"host secret").unwrap();
        let link = t.path().join("disk.ext4");
        std::os::unix::fs::symlink(&secret, &link).unwrap();
        // Reading through the link is refused.
        assert!(open_regular(&link).is_err());
        assert!(copy_file(&link, &t.path().join("copy"), None).is_err());
        // Writing over the link replaces the link, never the target.
        let src = t.path().join("src");
        std::fs::write(&src, b"disk").unwrap();
        copy_file(&src, &link, None).unwrap();
        assert_eq!(std::fs::read(&secret).unwrap(), b"host secret");
        assert!(!std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read(&link).unwrap(), b"disk");
        // A FIFO is not opened for reading (it would block).
        let fifo = t.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo with a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(open_regular(&fifo).is_err());
        // A directory planted as a symlink is replaced by a real one.
        let dir = t.path().join("snapshots");
        std::os::unix::fs::symlink(t.path(), &dir).unwrap();
        ensure_dir(&dir, None).unwrap();
        assert!(std::fs::symlink_metadata(&dir).unwrap().is_dir());
    }
}
