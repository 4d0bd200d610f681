//! Writing a file from streamed chunks.
//!
//! CREATE and TRUNCATE write a temporary file beside the target
//! (`.<name>.<unique>.part`, mode 0600 until done) and rename it into place
//! once the last chunk is written and synced: until then the target is
//! untouched, and a write that fails or is dropped removes the temporary
//! file ([`Drop`]). CREATE renames with RENAME_NOREPLACE, so a file that
//! appeared meanwhile is not replaced. APPEND writes in place (a link there
//! is refused, never followed).

use std::ffi::CString;
use std::io::Write as _;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use proto::guest::{file_error::Code, file_write::Mode, FileInfo};

use super::ops::{rename_at, stat};
use super::path::{RelPath, Workspace};
use super::{FileError, Result, MAX_WRITE_BYTES};

/// Default permissions of a written file.
pub const DEFAULT_PERMISSIONS: u32 = 0o644;

/// A file being written.
pub struct Writer {
    dir: OwnedFd,
    name: String,
    /// The temporary name while it is not yet renamed into place.
    temp: Option<String>,
    file: std::fs::File,
    rel: RelPath,
    mode: Mode,
    permissions: u32,
    written: u64,
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

fn temp_name(name: &str) -> String {
    let mut short = name;
    while short.len() > 200 {
        let mut cut = short.len() - 1;
        while !short.is_char_boundary(cut) {
            cut -= 1;
        }
        short = &short[..cut];
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let n = UNIQUE.fetch_add(1, Ordering::Relaxed);
    format!(".{short}.{}-{n}-{nanos:x}.part", std::process::id())
}

/// Checks a permissions field (0: the default).
pub fn check_permissions(p: u32, default: u32) -> Result<u32> {
    match p {
        0 => Ok(default),
        p if p & !0o1777 != 0 => Err(FileError::invalid(
            "permissions",
            format!("{p:#o} has bits other than 0o777 and sticky (set-id bits are refused)"),
        )),
        p => Ok(p),
    }
}

fn open_in(dir: &OwnedFd, name: &str, flags: i32, mode: u32) -> std::io::Result<std::fs::File> {
    let c = CString::new(name).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `dir` is open and `c` NUL-terminated; the result is checked.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            mode,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor, owned by nobody else.
    Ok(std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

impl Writer {
    /// Opens the write of `rel` in `mode` with `permissions` (checked).
    pub fn open(ws: &Workspace, rel: &RelPath, mode: Mode, permissions: u32) -> Result<Self> {
        let permissions = check_permissions(permissions, DEFAULT_PERMISSIONS)?;
        let (dir, name) = ws.parent_of(rel, "path")?;
        let shown = rel.shown();
        let (file, temp) = match mode {
            Mode::Unspecified => {
                return Err(FileError::invalid(
                    "mode",
                    "is required: CREATE, TRUNCATE or APPEND",
                ))
            }
            Mode::Append => {
                let f = open_in(
                    &dir,
                    name,
                    libc::O_WRONLY | libc::O_APPEND | libc::O_CREAT,
                    permissions,
                )
                .map_err(|e| FileError::os("path", &shown, "open for appending", e))?;
                (f, None)
            }
            Mode::Create | Mode::Truncate => {
                if mode == Mode::Create && stat(ws, rel, "path").is_ok() {
                    return Err(FileError::new(
                        Code::AlreadyExists,
                        "path",
                        format!("{shown:?} exists; use mode TRUNCATE to replace it"),
                    ));
                }
                let temp = temp_name(name);
                let f = open_in(
                    &dir,
                    &temp,
                    libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
                    0o600,
                )
                .map_err(|e| FileError::os("path", &shown, "create a file beside", e))?;
                (f, Some(temp))
            }
        };
        if let Some(s) = &temp {
            tracing::debug!(path = %shown, temp = %s, "writing through a temporary file");
        }
        Ok(Self {
            name: name.to_string(),
            dir,
            temp,
            file,
            rel: rel.clone(),
            mode,
            permissions,
            written: 0,
        })
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Appends `data`.
    pub fn write(&mut self, data: &[u8]) -> Result<()> {
        let after = self.written.saturating_add(data.len() as u64);
        if after > MAX_WRITE_BYTES {
            return Err(FileError::new(
                Code::ResourceExhausted,
                "data",
                format!("the file would pass the limit of {MAX_WRITE_BYTES} bytes per write"),
            ));
        }
        self.file.write_all(data).map_err(|e| {
            let mut err = FileError::os("path", &self.rel.shown(), "write", e);
            if self.temp.is_none() {
                err.message
                    .push_str(&format!(" ({} bytes were appended before)", self.written));
            }
            err
        })?;
        self.written = after;
        Ok(())
    }

    /// Syncs the content, sets the permissions and (CREATE, TRUNCATE) renames
    /// it into place. Returns the bytes written and the file's info.
    pub fn finish(mut self, ws: &Workspace) -> Result<(u64, FileInfo)> {
        let shown = self.rel.shown();
        self.file
            .sync_data()
            .map_err(|e| FileError::os("path", &shown, "sync", e))?;
        if let Some(temp) = self.temp.clone() {
            use std::os::unix::fs::PermissionsExt;
            self.file
                .set_permissions(std::fs::Permissions::from_mode(self.permissions))
                .map_err(|e| FileError::os("permissions", &shown, "set the permissions of", e))?;
            rename_at(
                &self.dir,
                &temp,
                &self.dir,
                &self.name,
                self.mode == Mode::Create,
            )
            .map_err(|e| match e.raw_os_error() {
                Some(libc::EEXIST) => FileError::new(
                    Code::AlreadyExists,
                    "path",
                    format!("{shown:?} was created meanwhile; nothing was written"),
                ),
                _ => FileError::os("path", &shown, "put in place", e),
            })?;
            self.temp = None;
        }
        let info = stat(ws, &self.rel, "path")?;
        Ok((self.written, info))
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if let Some(temp) = self.temp.take() {
            if let Ok(c) = CString::new(temp) {
                // SAFETY: `dir` is open and `c` NUL-terminated.
                unsafe { libc::unlinkat(self.dir.as_raw_fd(), c.as_ptr(), 0) };
            }
        }
    }
}
