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

/// What a scoped I/O thread failed at, and how.
type StepError = (&'static str, std::io::Error);

/// The outcome of a scoped I/O thread as the snapshot's error; a thread that
/// panicked failed at `step`.
fn joined(
    target: &Path,
    step: &'static str,
    handle: std::thread::ScopedJoinHandle<'_, Result<(), StepError>>,
) -> Result<(), WriteError> {
    let (step, source) = match handle.join() {
        Ok(Ok(())) => return Ok(()),
        Ok(Err(failed)) => failed,
        Err(_) => (step, std::io::Error::other("its thread panicked")),
    };
    Err(WriteError::Io {
        path: target.into(),
        step,
        source,
    })
}

/// Syncs `file` on a thread of `scope`.
fn sync_on<'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    file: File,
    step: &'static str,
) -> std::thread::ScopedJoinHandle<'scope, Result<(), StepError>> {
    scope.spawn(move || file.sync_all().map_err(|e| (step, e)))
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
    // A diff's extents follow from its dirty bitmaps alone, so its manifest
    // is written while its pages are; a full snapshot's depend on which
    // pages turn out to be zero, so its manifest waits for the memory write.
    let (kind, parent, candidates, diff_runs) = match content {
        MemoryContent::Full { candidates } => (SnapshotKind::Full, None, candidates, None),
        MemoryContent::Diff { parent, dirty } => (
            SnapshotKind::Diff,
            Some(parent),
            None,
            Some(memory_file::DiffRuns::new(mem, dirty)),
        ),
    };
    let planned = diff_runs.as_ref().map(memory_file::DiffRuns::extents);
    // One thread writes guest memory and syncs its file. Meanwhile this one
    // saves the state, writes the state file and the manifest, and syncs
    // them and the directory (two more threads, so the syncs run at once
    // and the filesystem can commit them together). For a diff those syncs
    // are issued while its pages are still being written (on ext4 their
    // commit may still end with the page write's). What this order saves is
    // hand-offs after the page write, each a thread started or woken that
    // may wait for a CPU: with both cores of a 2-core host busy, a 1 % diff
    // of 256 MiB took 6.5 ms when the memory thread was joined and three
    // sync threads started after it, 2.9 ms this way (perf/README.md).
    let manifest = std::thread::scope(|scope| -> Result<Manifest, WriteError> {
        let (extents_tx, extents_rx) = std::sync::mpsc::sync_channel(1);
        let memory_done = scope.spawn(move || -> Result<(), StepError> {
            match diff_runs {
                Some(runs) => memory_file::write_diff(mem, &memory, Some(&memory_path), &runs)
                    .map_err(|e| ("writing dirty pages", e))?,
                None => {
                    let extents = memory_file::write_full(mem, &memory, candidates)
                        .map_err(|e| ("writing guest memory", e))?;
                    // The receiver is gone only if the state failed.
                    let _ = extents_tx.send(extents);
                }
            }
            memory
                .sync_all()
                .map_err(|e| ("syncing the memory file", e))
        });

        let state = state().map_err(WriteError::State)?;
        let mut state_file =
            create_file(&tmp_path.join(STATE_FILE)).map_err(io("creating the state file"))?;
        state_file
            .write_all(&state)
            .map_err(io("writing the state file"))?;

        let extents = match planned {
            Some(extents) => extents,
            None => match extents_rx.recv() {
                Ok(extents) => extents,
                // The memory thread ended before its extents were known:
                // its error says why.
                Err(_) => {
                    joined(target, "writing guest memory", memory_done)?;
                    return Err(io("writing guest memory")(std::io::Error::other(
                        "the memory writer ended without its extents",
                    )));
                }
            },
        };
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
        let state_synced = sync_on(scope, state_file, "syncing the state file");
        let manifest_synced = sync_on(scope, manifest_file, "syncing the manifest");
        sync_dir(&tmp_path).map_err(io("syncing the snapshot directory"))?;

        joined(target, "syncing the state file", state_synced)?;
        joined(target, "syncing the manifest", manifest_synced)?;
        joined(target, "writing guest memory", memory_done)?;
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
    use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

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

    /// Asserts `err` is the system error `errno` at `step` and that `dir`
    /// is empty.
    fn failed_at_and_left_nothing(err: WriteError, step: &str, errno: i32, dir: &Path) {
        match &err {
            WriteError::Io {
                step: at, source, ..
            } => {
                assert_eq!(*at, step, "{err}");
                assert_eq!(source.raw_os_error(), Some(errno), "{err}");
            }
            other => panic!("expected an I/O error while {step}, got {other}"),
        }
        assert_eq!(
            std::fs::read_dir(dir).unwrap().count(),
            0,
            "neither the snapshot nor its temporary directory is left"
        );
    }

    #[test]
    fn a_diff_whose_pages_cannot_be_read_names_the_step_and_leaves_nothing() {
        // A dirty page the kernel cannot read from (PROT_NONE) fails the
        // memory thread's write with EFAULT, while this thread has already
        // written and is syncing the state file and the manifest.
        let t = tempfile::tempdir().unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        let host = mem.get_host_address(GuestAddress(2 << 20)).unwrap();
        // SAFETY: one page inside the 4 MiB mapping that `mem` owns; nothing
        // else touches it, and `mem` unmaps it whatever its protection.
        let rc = unsafe { libc::mprotect(host.cast(), 4096, libc::PROT_NONE) };
        assert_eq!(rc, 0);
        let mut dirty = vec![0u64; 16];
        dirty[0] = 1;
        dirty[8] = u64::MAX; // pages 512-575: 2 MiB on, the unreadable page first
        let err = write_snapshot(
            &t.path().join("snap"),
            || Ok(b"state".to_vec()),
            &mem,
            MemoryContent::Diff {
                dirty: &[dirty],
                parent: t.path().join("base"),
            },
        )
        .unwrap_err();
        failed_at_and_left_nothing(err, "writing dirty pages", libc::EFAULT, t.path());
    }

    /// RLIMIT_FSIZE given to [`full_write_beyond_the_file_size_limit_child`].
    const CHILD_FSIZE: libc::rlim_t = 64 << 10;

    #[test]
    fn a_full_snapshot_that_cannot_be_written_names_the_step_and_leaves_nothing() {
        // The file-size limit applies to the whole process, so the write
        // runs in a child: this test binary again, running only the test
        // below, with the limit set (and SIGXFSZ ignored) before its exec.
        let mut child = std::process::Command::new(std::env::current_exe().unwrap());
        child.args([
            "--exact",
            "snapshot::writer::tests::full_write_beyond_the_file_size_limit_child",
            "--ignored",
            "--nocapture",
        ]);
        // SAFETY: between fork and exec the closure only makes two system
        // calls, both async-signal-safe.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut child, || {
                let limit = libc::rlimit {
                    rlim_cur: CHILD_FSIZE,
                    rlim_max: CHILD_FSIZE,
                };
                if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0
                    || libc::signal(libc::SIGXFSZ, libc::SIG_IGN) == libc::SIG_ERR
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        };
        let out = child.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "the child failed: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    #[ignore = "run by its parent test, in a child process with a file-size limit"]
    fn full_write_beyond_the_file_size_limit_child() {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into `limit`, which outlives the call.
        let rc = unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut limit) };
        assert_eq!(rc, 0);
        assert_eq!(limit.rlim_cur, CHILD_FSIZE, "run only by its parent test");
        // 1 MiB of memory does not fit a 64 KiB file: sizing the memory file
        // fails (EFBIG) before the memory thread has extents to hand over.
        let t = tempfile::tempdir().unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        mem.write_obj(7u64, GuestAddress(0x3000)).unwrap();
        let err = write_snapshot(
            &t.path().join("snap"),
            || Ok(b"state".to_vec()),
            &mem,
            MemoryContent::Full { candidates: None },
        )
        .unwrap_err();
        failed_at_and_left_nothing(err, "writing guest memory", libc::EFBIG, t.path());
    }
}
