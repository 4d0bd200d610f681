//! Output directories cached by input hash.
//!
//! An [`Entry`] is a directory holding a recipe's outputs and, written last,
//! their [`Manifest`]. A lookup succeeds when the manifest exists, its input
//! hash is the one asked for, no build is in progress there and every
//! recorded output file is present with its recorded size: then the step is
//! skipped and costs milliseconds. A build runs in the directory itself
//! (so paths recorded inside outputs, such as a snapshot's disk, stay valid),
//! marked in progress until the manifest is written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::error::{Error, IoContext, Result};
use crate::hash;
use crate::manifest::{self, Inputs, Manifest, Output};
use crate::progress;

/// Marker present while a build is in progress (or was interrupted).
const BUILDING: &str = ".images-building";

/// What a build step hands back besides its files.
#[derive(Debug, Default)]
pub struct Built {
    /// Output files, relative to the entry directory.
    pub outputs: Vec<String>,
    /// Package versions to record.
    pub packages: BTreeMap<String, String>,
}

/// Where a build ended up.
#[derive(Debug)]
pub struct Outcome {
    /// The entry directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// True when it came from the cache.
    pub cached: bool,
}

impl Outcome {
    /// Full path of the output named `name`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// One cacheable output directory.
#[derive(Debug, Clone)]
pub struct Entry {
    kind: String,
    dir: PathBuf,
    inputs: Inputs,
}

impl Entry {
    /// The entry for `kind` and `inputs` under a cache root:
    /// `ROOT/KIND/INPUT_HASH`.
    pub fn in_cache(root: &Path, kind: &str, inputs: Inputs) -> Self {
        let dir = root.join(kind).join(inputs.hash(kind));
        Self::at(dir, kind, inputs)
    }

    /// An entry at a directory of the caller's choosing (`--out DIR`).
    pub fn at(dir: PathBuf, kind: &str, inputs: Inputs) -> Self {
        Self {
            kind: kind.to_string(),
            dir,
            inputs,
        }
    }

    /// The entry directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The input hash.
    pub fn input_hash(&self) -> String {
        self.inputs.hash(&self.kind)
    }

    /// The lock file: beside the directory, so removing the directory
    /// does not remove it.
    fn lock_path(&self) -> PathBuf {
        let mut name = self
            .dir
            .file_name()
            .map(|n| n.to_os_string())
            .unwrap_or_default();
        name.push(".lock");
        self.dir.with_file_name(name)
    }

    /// The complete, matching manifest if this entry is already built.
    pub fn lookup(&self) -> Option<Manifest> {
        if self.dir.join(BUILDING).exists() {
            return None;
        }
        let m = Manifest::load(&self.dir.join(manifest::FILE_NAME)).ok()?;
        if m.kind != self.kind || m.input_hash != self.input_hash() {
            return None;
        }
        let complete = m
            .outputs
            .iter()
            .all(|o| std::fs::metadata(self.dir.join(&o.path)).is_ok_and(|md| md.len() == o.size));
        complete.then_some(m)
    }

    /// Returns the cached outputs, or runs `build` in the entry directory
    /// and records them.
    pub fn get_or_build<F>(&self, step: &str, build: F) -> Result<Outcome>
    where
        F: FnOnce(&Path) -> Result<Built>,
    {
        let _lock = Lock::acquire(&self.lock_path(), step)?;
        if let Some(manifest) = self.lookup() {
            progress::note(
                step,
                &format!(
                    "cached: {} (inputs {})",
                    self.dir.display(),
                    short(&manifest.input_hash)
                ),
            );
            return Ok(Outcome {
                dir: self.dir.clone(),
                manifest,
                cached: true,
            });
        }
        self.prepare_dir()?;
        let start = Instant::now();
        let built = build(&self.dir)?;
        let mut outputs = Vec::with_capacity(built.outputs.len());
        for name in &built.outputs {
            let p = self.dir.join(name);
            let size = std::fs::metadata(&p).at(&p, "record an output")?.len();
            outputs.push(Output {
                path: name.clone(),
                size,
                sha256: hash::file_sha256(&p)?,
            });
        }
        let manifest = Manifest {
            format: manifest::FORMAT,
            kind: self.kind.clone(),
            input_hash: self.input_hash(),
            inputs: self.inputs.clone(),
            packages: built.packages,
            outputs,
            built_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            build_seconds: start.elapsed().as_secs_f64(),
        };
        manifest.store(&self.dir.join(manifest::FILE_NAME))?;
        let marker = self.dir.join(BUILDING);
        std::fs::remove_file(&marker).at(&marker, "finish the build")?;
        progress::note(
            step,
            &format!(
                "built {} in {:.1}s",
                self.dir.display(),
                manifest.build_seconds
            ),
        );
        Ok(Outcome {
            dir: self.dir.clone(),
            manifest,
            cached: false,
        })
    }

    /// Empties the entry directory of a stale or interrupted build and marks
    /// it in progress. A non-empty directory that this tool did not make is
    /// left alone.
    fn prepare_dir(&self) -> Result<()> {
        let step = "prepare the output directory";
        if self.dir.exists() {
            let ours =
                self.dir.join(manifest::FILE_NAME).exists() || self.dir.join(BUILDING).exists();
            let empty = std::fs::read_dir(&self.dir)
                .at(&self.dir, step)?
                .next()
                .is_none();
            if !ours && !empty {
                return Err(Error::ForeignDirectory {
                    path: self.dir.clone(),
                });
            }
            std::fs::remove_dir_all(&self.dir).at(&self.dir, step)?;
        }
        std::fs::create_dir_all(&self.dir).at(&self.dir, step)?;
        let marker = self.dir.join(BUILDING);
        std::fs::write(&marker, b"").at(&marker, step)?;
        Ok(())
    }
}

/// An exclusive lock on a file beside what it protects (`flock`), held
/// until dropped, so that two builds of the same entry (two terminals, or
/// parallel tests) take turns instead of writing over each other.
pub struct Lock {
    _file: std::fs::File,
}

impl Lock {
    /// Locks `path` (created if needed), waiting for another holder.
    pub fn acquire(path: &Path, step: &str) -> Result<Self> {
        use std::os::fd::AsRawFd;
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).at(parent, step)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .at(path, step)?;
        // SAFETY: flock(2) on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            progress::note(
                step,
                &format!("waiting for another build holding {}", path.display()),
            );
            // SAFETY: as above, blocking this time.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
                return Err(Error::io(path, step, std::io::Error::last_os_error()));
            }
        }
        Ok(Self { _file: file })
    }
}

/// `p` made absolute (against the current directory), so that programs
/// run from elsewhere (`make -C`) see the same path.
pub fn absolute(p: &Path) -> Result<PathBuf> {
    std::path::absolute(p).at(p, "resolve a path")
}

/// First 12 hex digits of a hash, for messages.
pub fn short(hash: &str) -> &str {
    hash.get(..12).unwrap_or(hash)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn inputs(v: &str) -> Inputs {
        let mut i = Inputs::default();
        i.set("value", v);
        i
    }

    fn build_file(dir: &Path, content: &str, runs: &Cell<u32>) -> Result<Built> {
        runs.set(runs.get() + 1);
        std::fs::write(dir.join("out"), content).unwrap();
        Ok(Built {
            outputs: vec!["out".into()],
            packages: BTreeMap::new(),
        })
    }

    #[test]
    fn second_build_is_a_cache_hit_and_new_inputs_rebuild() {
        let root = tempfile::tempdir().unwrap();
        let runs = Cell::new(0);
        let e = Entry::in_cache(root.path(), "t", inputs("1"));
        let a = e
            .get_or_build("t", |d| build_file(d, "one", &runs))
            .unwrap();
        assert!(!a.cached);
        assert_eq!(a.manifest.outputs[0].size, 3);
        let b = e
            .get_or_build("t", |d| build_file(d, "one", &runs))
            .unwrap();
        assert!(b.cached);
        assert_eq!(runs.get(), 1);
        assert_eq!(a.manifest, b.manifest);
        let e2 = Entry::in_cache(root.path(), "t", inputs("2"));
        let c = e2
            .get_or_build("t", |d| build_file(d, "two", &runs))
            .unwrap();
        assert!(!c.cached);
        assert_ne!(c.dir, a.dir);
        assert_eq!(runs.get(), 2);
    }

    #[test]
    fn interrupted_or_damaged_entries_are_rebuilt() {
        let root = tempfile::tempdir().unwrap();
        let runs = Cell::new(0);
        let e = Entry::in_cache(root.path(), "t", inputs("1"));
        let failed = e.get_or_build("t", |_| {
            Err(Error::Golden {
                message: "interrupted".into(),
            })
        });
        assert!(failed.is_err());
        assert!(e.lookup().is_none());
        e.get_or_build("t", |d| build_file(d, "one", &runs))
            .unwrap();
        std::fs::write(e.dir().join("out"), "truncated-to-other-size").unwrap();
        assert!(e.lookup().is_none());
        let again = e
            .get_or_build("t", |d| build_file(d, "one", &runs))
            .unwrap();
        assert!(!again.cached);
        assert_eq!(runs.get(), 2);
    }

    #[test]
    fn a_foreign_directory_is_not_replaced() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("precious"), "data").unwrap();
        let e = Entry::at(root.path().to_path_buf(), "golden", inputs("1"));
        let err = e
            .get_or_build("t", |d| build_file(d, "x", &Cell::new(0)))
            .unwrap_err();
        assert!(matches!(err, Error::ForeignDirectory { .. }), "{err}");
        assert!(root.path().join("precious").exists());
    }
}
