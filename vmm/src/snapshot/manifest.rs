//! The `manifest` file: a JSON description of one snapshot layer (format
//! version, guest memory layout, parent for a diff, creation time, and the
//! page extents its memory file holds), and the resolution of a diff's chain
//! of parents down to its full base.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::format::{FORMAT_MAJOR, FORMAT_MINOR};
use crate::memory::PAGE_SIZE;

/// Manifest file name inside a snapshot directory.
pub const MANIFEST_FILE: &str = "manifest";
/// State file name.
pub const STATE_FILE: &str = "state";
/// Memory file name.
pub const MEMORY_FILE: &str = "memory";
/// Largest manifest accepted.
pub const MAX_MANIFEST_LEN: u64 = 64 << 20;
/// Longest chain of diffs followed.
pub const MAX_CHAIN_DEPTH: usize = 64;
/// Most memory regions in a layout.
const MAX_REGIONS: usize = 8;
/// Largest guest accepted from a manifest (1 TiB).
const MAX_GUEST_BYTES: u64 = 1 << 40;

/// Full or diff (the control protocol's snapshot kinds).
pub use vmm_api::protocol::SnapshotKind;

/// One guest RAM region and where it lives in the memory file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionLayout {
    /// Guest-physical start.
    pub gpa: u64,
    /// Length in bytes.
    pub size: u64,
    /// Offset of its first byte in the memory file.
    pub file_offset: u64,
}

/// A run of pages present in a layer's memory file: `[file_offset, len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    /// Offset in the memory file (page aligned).
    pub offset: u64,
    /// Length (page multiple).
    pub len: u64,
}

/// One snapshot layer's manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// `[major, minor]` of the snapshot format.
    pub format_version: [u16; 2],
    /// Full or diff.
    pub kind: SnapshotKind,
    /// Milliseconds since the Unix epoch when the snapshot was taken.
    pub created_unix_ms: u64,
    /// Guest memory layout; every layer of a chain has the same one.
    pub regions: Vec<RegionLayout>,
    /// The parent layer's directory (diff only; relative paths are relative to this
    /// directory's parent).
    pub parent: Option<PathBuf>,
    /// Extents of the memory file that hold this layer's pages. For a full snapshot the
    /// rest of the file reads as zeros; for a diff, pages outside come from the parent.
    pub extents: Vec<Extent>,
}

/// Errors reading a manifest or resolving a chain.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The file cannot be read.
    #[error("cannot read snapshot manifest {path}: {source}")]
    Unreadable {
        /// The manifest path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The JSON is malformed.
    #[error("invalid snapshot manifest {path}: {reason}")]
    Invalid {
        /// The manifest path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The format version is newer.
    #[error("snapshot {path} has format version {major}.{minor}, newer than this vmm supports ({FORMAT_MAJOR}.{FORMAT_MINOR}); restore it with a newer vmm")]
    NewerVersion {
        /// The snapshot directory.
        path: PathBuf,
        /// Major version.
        major: u16,
        /// Minor version.
        minor: u16,
    },
    /// A parent in the chain is missing.
    #[error("snapshot {child} names parent {parent}, which does not exist")]
    MissingParent {
        /// The diff.
        child: PathBuf,
        /// The missing parent.
        parent: PathBuf,
    },
    /// The chain loops back on itself.
    #[error("snapshot chain loops: {0} appears twice")]
    Loop(PathBuf),
    /// The chain is too long.
    #[error("snapshot chain is longer than {MAX_CHAIN_DEPTH} layers")]
    TooDeep,
    /// Layers disagree on the memory layout.
    #[error("snapshot {child} has a different memory layout from its parent {parent}")]
    LayoutMismatch {
        /// The diff.
        child: PathBuf,
        /// Its parent.
        parent: PathBuf,
    },
    /// The memory file is shorter than the layout needs.
    #[error("memory file {path} holds {actual} bytes, the manifest describes {expected}")]
    MemoryFileShort {
        /// The memory file.
        path: PathBuf,
        /// Bytes described.
        expected: u64,
        /// Bytes present.
        actual: u64,
    },
}

impl Manifest {
    /// Total bytes of guest memory (and of the memory file).
    pub fn memory_bytes(&self) -> u64 {
        self.regions.iter().map(|r| r.size).sum()
    }

    /// Checks every field that comes from disk.
    pub fn validate(&self) -> Result<(), String> {
        if self.regions.is_empty() || self.regions.len() > MAX_REGIONS {
            return Err(format!(
                "{} memory regions (1 to {MAX_REGIONS} expected)",
                self.regions.len()
            ));
        }
        let mut file_end = 0u64;
        let mut prev_gpa_end = 0u64;
        for r in &self.regions {
            if r.size == 0 || r.size % PAGE_SIZE != 0 || r.gpa % PAGE_SIZE != 0 {
                return Err(format!(
                    "region at {:#x} is empty or not page aligned",
                    r.gpa
                ));
            }
            if r.file_offset != file_end {
                return Err(format!(
                    "region at {:#x} starts at file offset {:#x}, expected {file_end:#x}",
                    r.gpa, r.file_offset
                ));
            }
            if r.gpa < prev_gpa_end {
                return Err(format!("region at {:#x} overlaps the previous one", r.gpa));
            }
            prev_gpa_end = r.gpa.checked_add(r.size).ok_or("region wraps around")?;
            file_end = file_end.checked_add(r.size).ok_or("layout too large")?;
        }
        if file_end > MAX_GUEST_BYTES {
            return Err(format!(
                "guest memory of {file_end} bytes is beyond the 1 TiB limit"
            ));
        }
        let mut prev_end = 0u64;
        for e in &self.extents {
            if e.len == 0 || e.offset % PAGE_SIZE != 0 || e.len % PAGE_SIZE != 0 {
                return Err(format!(
                    "extent {:#x}+{:#x} is empty or not page aligned",
                    e.offset, e.len
                ));
            }
            let end = e.offset.checked_add(e.len).ok_or("extent wraps around")?;
            if e.offset < prev_end || end > file_end {
                return Err(format!(
                    "extent {:#x}+{:#x} overlaps another or lies past the end of memory",
                    e.offset, e.len
                ));
            }
            prev_end = end;
        }
        match (self.kind, &self.parent) {
            (SnapshotKind::Diff, None) => Err("a diff snapshot has no parent".into()),
            (SnapshotKind::Full, Some(_)) => Err("a full snapshot names a parent".into()),
            _ => Ok(()),
        }
    }

    /// Parses and validates manifest text (untrusted input).
    pub fn parse(text: &str) -> Result<Manifest, String> {
        let manifest: Manifest = serde_json::from_str(text).map_err(|e| e.to_string())?;
        manifest.validate()?;
        Ok(manifest)
    }

    /// Reads and validates `dir/manifest`.
    pub fn load(dir: &Path) -> Result<Manifest, ManifestError> {
        let path = dir.join(MANIFEST_FILE);
        let unreadable = |source| ManifestError::Unreadable {
            path: path.clone(),
            source,
        };
        let file = std::fs::File::open(&path).map_err(unreadable)?;
        let len = file.metadata().map_err(unreadable)?.len();
        if len > MAX_MANIFEST_LEN {
            return Err(ManifestError::Invalid {
                path,
                reason: format!("{len} bytes, more than the {MAX_MANIFEST_LEN}-byte limit"),
            });
        }
        let text = std::fs::read_to_string(&path).map_err(unreadable)?;
        // Look at the version before the rest, so a newer format gets the right message.
        #[derive(Deserialize)]
        struct VersionOnly {
            format_version: [u16; 2],
        }
        if let Ok(v) = serde_json::from_str::<VersionOnly>(&text) {
            let [major, minor] = v.format_version;
            if major > FORMAT_MAJOR {
                return Err(ManifestError::NewerVersion {
                    path: dir.into(),
                    major,
                    minor,
                });
            }
        }
        Manifest::parse(&text).map_err(|reason| ManifestError::Invalid { path, reason })
    }
}

/// One layer of a resolved chain.
#[derive(Debug, Clone)]
pub struct Layer {
    /// The snapshot directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
}

/// Where a diff's parent lives.
fn parent_dir(child: &Path, parent: &Path) -> PathBuf {
    if parent.is_absolute() {
        parent.to_path_buf()
    } else {
        child.parent().unwrap_or(Path::new(".")).join(parent)
    }
}

/// Resolves the chain ending at `top`, returned base first, checking for
/// loops, missing parents, depth and layout agreement, and memory file sizes.
pub fn resolve_chain(top: &Path) -> Result<Vec<Layer>, ManifestError> {
    let mut layers = Vec::new();
    let mut seen = HashSet::new();
    let mut dir = top.to_path_buf();
    loop {
        let canonical =
            std::fs::canonicalize(&dir).map_err(|source| ManifestError::Unreadable {
                path: dir.clone(),
                source,
            })?;
        if !seen.insert(canonical.clone()) {
            return Err(ManifestError::Loop(canonical));
        }
        if layers.len() >= MAX_CHAIN_DEPTH {
            return Err(ManifestError::TooDeep);
        }
        let manifest = Manifest::load(&canonical)?;
        let memory = canonical.join(MEMORY_FILE);
        let actual = std::fs::metadata(&memory)
            .map_err(|source| ManifestError::Unreadable {
                path: memory.clone(),
                source,
            })?
            .len();
        let expected = manifest.memory_bytes();
        if actual < expected {
            return Err(ManifestError::MemoryFileShort {
                path: memory,
                expected,
                actual,
            });
        }
        if let Some(child) = layers.last() {
            let child: &Layer = child;
            if child.manifest.regions != manifest.regions {
                return Err(ManifestError::LayoutMismatch {
                    child: child.dir.clone(),
                    parent: canonical,
                });
            }
        }
        let parent = manifest.parent.clone();
        layers.push(Layer {
            dir: canonical.clone(),
            manifest,
        });
        match parent {
            None => break,
            Some(p) => {
                let next = parent_dir(&canonical, &p);
                if !next.exists() {
                    return Err(ManifestError::MissingParent {
                        child: canonical,
                        parent: next,
                    });
                }
                dir = next;
            }
        }
    }
    layers.reverse();
    Ok(layers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(kind: SnapshotKind, parent: Option<&str>) -> Manifest {
        Manifest {
            format_version: [FORMAT_MAJOR, FORMAT_MINOR],
            kind,
            created_unix_ms: 1,
            regions: vec![RegionLayout {
                gpa: 0,
                size: 16 * PAGE_SIZE,
                file_offset: 0,
            }],
            parent: parent.map(PathBuf::from),
            extents: vec![Extent {
                offset: PAGE_SIZE,
                len: 2 * PAGE_SIZE,
            }],
        }
    }

    fn write_layer(dir: &Path, m: &Manifest, mem_len: u64) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(MANIFEST_FILE), serde_json::to_string(m).unwrap()).unwrap();
        let f = std::fs::File::create(dir.join(MEMORY_FILE)).unwrap();
        f.set_len(mem_len).unwrap();
    }

    #[test]
    fn validation_catches_bad_layouts_and_extents() {
        assert!(manifest(SnapshotKind::Full, None).validate().is_ok());
        assert!(manifest(SnapshotKind::Diff, None).validate().is_err());
        assert!(manifest(SnapshotKind::Full, Some("p")).validate().is_err());
        let mut m = manifest(SnapshotKind::Full, None);
        m.extents.push(Extent {
            offset: 15 * PAGE_SIZE,
            len: 2 * PAGE_SIZE,
        });
        assert!(m.validate().unwrap_err().contains("past the end"));
        let mut m = manifest(SnapshotKind::Full, None);
        m.extents.push(Extent {
            offset: 0,
            len: PAGE_SIZE,
        });
        assert!(m.validate().unwrap_err().contains("overlaps"));
        let mut m = manifest(SnapshotKind::Full, None);
        m.regions[0].size = 100;
        assert!(m.validate().is_err());
        let mut m = manifest(SnapshotKind::Full, None);
        m.regions[0].file_offset = 4096;
        assert!(m.validate().is_err());
    }

    #[test]
    fn chains_resolve_base_first() {
        let t = tempfile::tempdir().unwrap();
        write_layer(
            &t.path().join("base"),
            &manifest(SnapshotKind::Full, None),
            16 * PAGE_SIZE,
        );
        write_layer(
            &t.path().join("d1"),
            &manifest(SnapshotKind::Diff, Some("base")),
            16 * PAGE_SIZE,
        );
        let abs = t.path().join("d1").to_string_lossy().into_owned();
        write_layer(
            &t.path().join("d2"),
            &manifest(SnapshotKind::Diff, Some(&abs)),
            16 * PAGE_SIZE,
        );
        let chain = resolve_chain(&t.path().join("d2")).unwrap();
        let names: Vec<_> = chain
            .iter()
            .map(|l| l.dir.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["base", "d1", "d2"]);
    }

    #[test]
    fn loops_missing_parents_and_short_memory_are_errors() {
        let t = tempfile::tempdir().unwrap();
        write_layer(
            &t.path().join("a"),
            &manifest(SnapshotKind::Diff, Some("b")),
            16 * PAGE_SIZE,
        );
        write_layer(
            &t.path().join("b"),
            &manifest(SnapshotKind::Diff, Some("a")),
            16 * PAGE_SIZE,
        );
        assert!(matches!(
            resolve_chain(&t.path().join("a")),
            Err(ManifestError::Loop(_))
        ));
        write_layer(
            &t.path().join("c"),
            &manifest(SnapshotKind::Diff, Some("gone")),
            16 * PAGE_SIZE,
        );
        assert!(matches!(
            resolve_chain(&t.path().join("c")),
            Err(ManifestError::MissingParent { .. })
        ));
        write_layer(
            &t.path().join("short"),
            &manifest(SnapshotKind::Full, None),
            4 * PAGE_SIZE,
        );
        let err = resolve_chain(&t.path().join("short")).unwrap_err();
        assert!(err
            .to_string()
            .contains("holds 16384 bytes, the manifest describes 65536"));
    }

    #[test]
    fn a_newer_format_is_refused_by_name() {
        let t = tempfile::tempdir().unwrap();
        let mut m = manifest(SnapshotKind::Full, None);
        m.format_version = [FORMAT_MAJOR + 1, 3];
        write_layer(t.path(), &m, 16 * PAGE_SIZE);
        let err = Manifest::load(t.path()).unwrap_err();
        assert!(err
            .to_string()
            .contains(&format!("format version {}.3, newer", FORMAT_MAJOR + 1)));
    }
}
