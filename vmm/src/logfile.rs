//! Size bounds on the files a vmm writes for hours on end: the serial console
//! file (`--serial file:PATH`) and its own log on stderr. A guest controls
//! what it prints and, through device errors, part of what the vmm logs; the
//! state directory these files live in also holds host-agent's database, so
//! neither may grow without bound.
//!
//! * The serial file is rotated: once it holds `--log-max-bytes`, it is
//!   renamed to `PATH.1` (replacing the previous one) and a new `PATH` is
//!   started. At most twice the bound is kept, the latest output always.
//! * The vmm's log on stderr, where stderr is a regular file (host-agent's
//!   `vmm.log`), is capped: past the bound, one line says so and later log
//!   lines are dropped. (The file belongs to whoever started the vmm, often
//!   outside a jail, so the vmm cannot rotate it.) The few lines written on
//!   the way out (a fatal error, the seccomp handler's) are not counted.
//!
//! RLIMIT_FSIZE is not used for this: it would also bound snapshot memory
//! files and disks, and a write past it raises SIGXFSZ, killing the VM.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

/// Default bound of each log file, bytes (16 MiB).
pub const DEFAULT_MAX_BYTES: u64 = 16 << 20;

/// The smallest bound accepted (a serial line must fit).
pub const MIN_MAX_BYTES: u64 = 4096;

static MAX_BYTES: OnceLock<u64> = OnceLock::new();

/// Sets the bound for this process (from `--log-max-bytes`; call once, early).
pub fn set_max_bytes(bytes: u64) {
    let _ = MAX_BYTES.set(bytes.max(MIN_MAX_BYTES));
}

/// The bound in force.
pub fn max_bytes() -> u64 {
    MAX_BYTES.get().copied().unwrap_or(DEFAULT_MAX_BYTES)
}

/// The name a rotated file gets: `PATH.1`.
pub fn previous_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// A file appended to and rotated at `max` bytes (see the module docs).
pub struct RotatingFile {
    path: PathBuf,
    file: File,
    written: u64,
    max: u64,
}

impl RotatingFile {
    /// Opens (creates, appends to) `path`, rotating at `max` bytes.
    pub fn open(path: &Path, max: u64) -> io::Result<RotatingFile> {
        let file = Self::open_append(path)?;
        let written = file.metadata()?.len();
        Ok(RotatingFile {
            path: path.to_path_buf(),
            file,
            written,
            max: max.max(MIN_MAX_BYTES),
        })
    }

    fn open_append(path: &Path) -> io::Result<File> {
        OpenOptions::new().create(true).append(true).open(path)
    }

    fn rotate(&mut self) -> io::Result<()> {
        std::fs::rename(&self.path, previous_path(&self.path))?;
        self.file = Self::open_append(&self.path)?;
        self.written = 0;
        Ok(())
    }
}

impl Write for RotatingFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.written >= self.max {
            self.rotate()?;
        }
        let room = usize::try_from(self.max - self.written).unwrap_or(usize::MAX);
        let n = self.file.write(&buf[..buf.len().min(room)])?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

/// Bytes of log written to stderr so far, and whether the cap was hit.
static STDERR_WRITTEN: AtomicU64 = AtomicU64::new(0);
static STDERR_CAPPED: AtomicBool = AtomicBool::new(false);
/// Whether stderr is a regular file (set once by [`init_stderr`]).
static STDERR_IS_FILE: AtomicBool = AtomicBool::new(false);

/// Looks at stderr once: a regular file gets the cap, counting what it holds
/// already. Call early in main, before any thread starts.
pub fn init_stderr() {
    let is_file = io::stderr()
        .as_fd()
        .try_clone_to_owned()
        .map(File::from)
        .and_then(|f| f.metadata())
        .map(|m| {
            STDERR_WRITTEN.store(m.len(), Ordering::Relaxed);
            m.is_file()
        })
        .unwrap_or(false);
    STDERR_IS_FILE.store(is_file, Ordering::Relaxed);
}

/// A writer for log lines to stderr, capped at [`max_bytes`] where stderr is
/// a regular file.
pub struct CappedStderr;

impl Write for CappedStderr {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if !STDERR_IS_FILE.load(Ordering::Relaxed) {
            return io::stderr().write(buf);
        }
        let max = max_bytes();
        let before = STDERR_WRITTEN.fetch_add(buf.len() as u64, Ordering::Relaxed);
        if before.saturating_add(buf.len() as u64) <= max {
            return io::stderr().write(buf);
        }
        if !STDERR_CAPPED.swap(true, Ordering::Relaxed) {
            let _ = writeln!(
                io::stderr(),
                "vmm: the log reached its {max}-byte bound (--log-max-bytes); later log lines are dropped"
            );
        }
        // Dropped: report it written so the logger carries on.
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rotating_file_never_passes_its_bound_and_keeps_one_previous_file() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("serial.log");
        let mut f = RotatingFile::open(&path, 4096).unwrap();
        let line = [b'x'; 1000];
        for _ in 0..20 {
            f.write_all(&line).unwrap();
            assert!(std::fs::metadata(&path).unwrap().len() <= 4096);
        }
        assert_eq!(std::fs::metadata(previous_path(&path)).unwrap().len(), 4096);
        // 20000 bytes: four full files (the fifth holds the rest).
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 20000 - 4 * 4096);
        let entries = std::fs::read_dir(t.path()).unwrap().count();
        assert_eq!(entries, 2);
    }

    #[test]
    fn an_existing_file_counts_toward_the_bound() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("serial.log");
        std::fs::write(&path, vec![b'a'; 4000]).unwrap();
        let mut f = RotatingFile::open(&path, 4096).unwrap();
        f.write_all(&[b'b'; 200]).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 104);
        assert_eq!(std::fs::metadata(previous_path(&path)).unwrap().len(), 4096);
    }
}
