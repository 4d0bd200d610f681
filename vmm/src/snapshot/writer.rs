//! Writes a snapshot directory atomically: everything goes into a hidden
//! temporary directory beside the target, each file is fsynced, and the
//! directory is renamed into place last. A crash or a full disk leaves at most
//! a temporary directory (removed on error), never a directory that looks
//! like a valid snapshot.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::format::{FORMAT_MAJOR, FORMAT_MINOR};
use super::manifest::{Manifest, SnapshotKind, MANIFEST_FILE, MEMORY_FILE, STATE_FILE};
use super::memory_file;
use crate::memory::GuestMemoryMmap;

/// Errors writing a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The target exists.
    #[error("snapshot directory {0} already exists; choose a new path")]
    Exists(PathBuf),
    /// The target's parent directory is missing.
    #[error("cannot create snapshot {path}: its parent directory does not exist")]
    NoParentDir {
        /// The target.
        path: PathBuf,
    },
    /// An I/O step failed (ENOSPC included).
    #[error("writing snapshot {path} failed while {step}: {source}")]
    Io {
        /// The target.
        path: PathBuf,
        /// What was being done.
        step: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// What goes into the memory file.
pub enum MemoryContent<'a> {
    /// Every non-zero page.
    Full {
        /// Per region, the pages that may be non-zero (all others are known
        /// to be zero and are not read); `None` reads every page.
        candidates: Option<&'a [Vec<u64>]>,
    },
    /// The pages set in these per-region bitmaps, relative to `parent`.
    Diff {
        /// Dirty pages per region.
        dirty: &'a [Vec<u64>],
        /// The parent snapshot directory (absolute).
        parent: PathBuf,
    },
}

/// Removes the temporary directory unless disarmed.
struct TempDir {
    path: PathBuf,
    keep: bool,
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

fn sync_dir(path: &Path) -> std::io::Result<()> {
    File::open(path)?.sync_all()
}

/// The result of a sync run on a scoped thread; a thread that panicked is an I/O error.
fn joined(handle: std::thread::ScopedJoinHandle<'_, std::io::Result<()>>) -> std::io::Result<()> {
    handle
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("the sync thread panicked")))
}

fn create_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().write(true).create_new(true).open(path)
}

/// Writes the snapshot `target` from `state` (a complete state file) and `mem`.
pub fn write_snapshot(
    target: &Path,
    state: &[u8],
    mem: &GuestMemoryMmap,
    content: MemoryContent<'_>,
) -> Result<Manifest, WriteError> {
    let io = |step: &'static str| {
        let path = target.to_path_buf();
        move |source| WriteError::Io { path, step, source }
    };
    if target.exists() {
        return Err(WriteError::Exists(target.into()));
    }
    let name = target.file_name().ok_or_else(|| WriteError::NoParentDir {
        path: target.into(),
    })?;
    let parent_dir = match target.parent() {
        Some(p) if p.as_os_str().is_empty() => Path::new("."),
        Some(p) => p,
        None => {
            return Err(WriteError::NoParentDir {
                path: target.into(),
            })
        }
    };
    if !parent_dir.is_dir() {
        return Err(WriteError::NoParentDir {
            path: target.into(),
        });
    }
    let tmp_path = parent_dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp_path);
    std::fs::create_dir(&tmp_path).map_err(io("creating the temporary directory"))?;
    let mut tmp = TempDir {
        path: tmp_path.clone(),
        keep: false,
    };

    let memory =
        create_file(&tmp_path.join(MEMORY_FILE)).map_err(io("creating the memory file"))?;
    let (kind, parent, extents) = match content {
        MemoryContent::Full { candidates } => (
            SnapshotKind::Full,
            None,
            memory_file::write_full(mem, &memory, candidates)
                .map_err(io("writing guest memory"))?,
        ),
        MemoryContent::Diff { dirty, parent } => (
            SnapshotKind::Diff,
            Some(parent),
            memory_file::write_diff(mem, &memory, dirty).map_err(io("writing dirty pages"))?,
        ),
    };
    // The memory file's fsync (the device write of every page) runs while the
    // small files are written; then the small files and the directory are
    // synced at once, so the filesystem can commit them together instead of
    // one journal commit after another.
    let manifest = std::thread::scope(|scope| -> Result<Manifest, WriteError> {
        let memory_synced = scope.spawn(|| memory.sync_all());

        let mut state_file =
            create_file(&tmp_path.join(STATE_FILE)).map_err(io("creating the state file"))?;
        state_file
            .write_all(state)
            .map_err(io("writing the state file"))?;
        let state_synced = scope.spawn(move || state_file.sync_all());

        let manifest = Manifest {
            format_version: [FORMAT_MAJOR, FORMAT_MINOR],
            kind,
            created_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            regions: memory_file::layout(mem),
            parent,
            extents,
        };
        let json = serde_json::to_vec_pretty(&manifest).map_err(|e| WriteError::Io {
            path: target.into(),
            step: "encoding the manifest",
            source: std::io::Error::other(e),
        })?;
        let mut manifest_file =
            create_file(&tmp_path.join(MANIFEST_FILE)).map_err(io("creating the manifest"))?;
        manifest_file
            .write_all(&json)
            .map_err(io("writing the manifest"))?;
        let manifest_synced = scope.spawn(move || manifest_file.sync_all());
        sync_dir(&tmp_path).map_err(io("syncing the snapshot directory"))?;

        joined(memory_synced).map_err(io("syncing the memory file"))?;
        joined(state_synced).map_err(io("syncing the state file"))?;
        joined(manifest_synced).map_err(io("syncing the manifest"))?;
        Ok(manifest)
    })?;

    std::fs::rename(&tmp_path, target).map_err(io("renaming the snapshot into place"))?;
    tmp.keep = true;
    sync_dir(parent_dir).map_err(io("syncing the parent directory"))?;
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress};

    #[test]
    fn writes_all_three_files_and_refuses_to_overwrite() {
        let t = tempfile::tempdir().unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        mem.write_obj(7u64, GuestAddress(0x3000)).unwrap();
        let target = t.path().join("snap");
        let m = write_snapshot(
            &target,
            b"state",
            &mem,
            MemoryContent::Full { candidates: None },
        )
        .unwrap();
        assert_eq!(m.kind, SnapshotKind::Full);
        for f in [MEMORY_FILE, STATE_FILE, MANIFEST_FILE] {
            assert!(target.join(f).is_file(), "{f}");
        }
        assert_eq!(Manifest::load(&target).unwrap(), m);
        assert!(matches!(
            write_snapshot(
                &target,
                b"state",
                &mem,
                MemoryContent::Full { candidates: None }
            ),
            Err(WriteError::Exists(_))
        ));
        let leftovers: Vec<_> = std::fs::read_dir(t.path()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temporary directory left behind");
    }

    #[test]
    fn a_missing_parent_directory_is_an_error() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let err = write_snapshot(
            Path::new("/nonexistent/x/snap"),
            b"s",
            &mem,
            MemoryContent::Full { candidates: None },
        )
        .unwrap_err();
        assert!(matches!(err, WriteError::NoParentDir { .. }));
    }
}
