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
    /// Saving the VM's state (vCPUs, devices) failed.
    #[error("cannot save VM state: {0}")]
    State(String),
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

/// The result of I/O run on a scoped thread; a thread that panicked is an I/O error.
fn joined<T>(handle: std::thread::ScopedJoinHandle<'_, std::io::Result<T>>) -> std::io::Result<T> {
    handle
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("the I/O thread panicked")))
}

fn create_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().write(true).create_new(true).open(path)
}

/// Writes the snapshot `target` of `mem`, with the state file that `state`
/// returns.
///
/// Guest memory is written on another thread while `state` runs on this one,
/// so saving the vCPUs' and devices' state adds no time of its own. `state`
/// must therefore not write guest memory (the VM is paused and its devices
/// quiesced, so saving their state only reads).
pub fn write_snapshot(
    target: &Path,
    state: impl FnOnce() -> Result<Vec<u8>, String>,
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

    let memory_path = tmp_path.join(MEMORY_FILE);
    let memory = create_file(&memory_path).map_err(io("creating the memory file"))?;
    let (kind, parent, step) = match &content {
        MemoryContent::Full { .. } => (SnapshotKind::Full, None, "writing guest memory"),
        MemoryContent::Diff { parent, .. } => (
            SnapshotKind::Diff,
            Some(parent.clone()),
            "writing dirty pages",
        ),
    };
    // Guest memory is written on one thread while the state is saved and
    // written on this one. Then the memory file's fsync (the device write of
    // every buffered page) runs while the manifest is written, and the small
    // files and the directory are synced at once, so the filesystem can
    // commit them together instead of one journal commit after another.
    let manifest = std::thread::scope(|scope| -> Result<Manifest, WriteError> {
        let memory_written = scope.spawn(|| match content {
            MemoryContent::Full { candidates } => memory_file::write_full(mem, &memory, candidates),
            MemoryContent::Diff { dirty, .. } => {
                memory_file::write_diff(mem, &memory, Some(&memory_path), dirty)
            }
        });

        let state = state().map_err(WriteError::State)?;
        let mut state_file =
            create_file(&tmp_path.join(STATE_FILE)).map_err(io("creating the state file"))?;
        state_file
            .write_all(&state)
            .map_err(io("writing the state file"))?;

        let extents = joined(memory_written).map_err(io(step))?;
        let memory_synced = scope.spawn(|| memory.sync_all());
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
            || Ok(b"state".to_vec()),
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
                || Ok(b"state".to_vec()),
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
            || Ok(b"s".to_vec()),
            &mem,
            MemoryContent::Full { candidates: None },
        )
        .unwrap_err();
        assert!(matches!(err, WriteError::NoParentDir { .. }));
    }

    #[test]
    fn a_state_that_cannot_be_saved_leaves_nothing_behind() {
        let t = tempfile::tempdir().unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        mem.write_slice(&[0x5a; 1 << 20], GuestAddress(1 << 20))
            .unwrap();
        let target = t.path().join("snap");
        let err = write_snapshot(
            &target,
            || Err("KVM_GET_REGS: Bad file descriptor".into()),
            &mem,
            MemoryContent::Diff {
                dirty: &[vec![u64::MAX; 16]],
                parent: t.path().join("base"),
            },
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot save VM state: KVM_GET_REGS: Bad file descriptor"
        );
        assert_eq!(
            std::fs::read_dir(t.path()).unwrap().count(),
            0,
            "neither the snapshot nor its temporary directory is left"
        );
    }

    #[test]
    fn a_diff_holds_the_dirty_pages_however_they_were_written() {
        // Pages 256-511 (1 MiB, written with O_DIRECT where the filesystem
        // allows it) and every other page of 0-63 (buffered).
        let t = tempfile::tempdir().unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        for page in 0..1024u64 {
            mem.write_obj(page + 1, GuestAddress(page * 4096 + 64))
                .unwrap();
        }
        let mut dirty = vec![0u64; 16];
        dirty[0] = 0x5555_5555_5555_5555;
        for w in &mut dirty[4..8] {
            *w = u64::MAX;
        }
        let target = t.path().join("snap");
        let m = write_snapshot(
            &target,
            || Ok(b"state".to_vec()),
            &mem,
            MemoryContent::Diff {
                dirty: &[dirty.clone()],
                parent: t.path().join("base"),
            },
        )
        .unwrap();
        assert_eq!(m.kind, SnapshotKind::Diff);
        let file = File::open(target.join(MEMORY_FILE)).unwrap();
        for page in 0..1024u64 {
            let mut b = [0u8; 8];
            std::os::unix::fs::FileExt::read_exact_at(&file, &mut b, page * 4096 + 64).unwrap();
            let is_dirty = dirty[(page / 64) as usize] & (1 << (page % 64)) != 0;
            let want = if is_dirty { page + 1 } else { 0 };
            assert_eq!(u64::from_le_bytes(b), want, "page {page}");
        }
        let written: u64 = m.extents.iter().map(|e| e.len).sum();
        assert_eq!(written, (32 + 256) * 4096);
    }
}
