//! A layer's files: taking a snapshot directory a (possibly jailed) vmm
//! wrote into the layer store, pointing its manifest at its parent layer,
//! and measuring it.
//!
//! The directory comes from a process host-agent does not trust: any name
//! in it may be a symlink, a FIFO or a hard link it planted, and it may
//! still hold descriptors of what it wrote. So the directory is first moved
//! out of its reach (a rename within the state directory), then every
//! entry is opened without following links, checked to be a regular file
//! with one link, and given to root (mode 0644: other VMs' jails read
//! layers through read-only binds); anything else is removed.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// The files of a snapshot directory (the vmm's `manifest`, `state` and
/// `memory`), each required.
pub const SNAPSHOT_FILES: [&str; 3] = ["manifest", "state", "memory"];

/// Files a layer may also hold: the network marker and console of a golden
/// snapshot, the root disk kept with it.
const OPTIONAL_FILES: [&str; 3] = [
    crate::launch::NETWORK_MARKER,
    "console.log",
    crate::launch::GOLDEN_DISK,
];

/// Largest manifest read back (a vmm's manifest is a few KiB).
const MAX_MANIFEST_BYTES: u64 = 1 << 20;

/// What went wrong with a layer's files.
#[derive(Debug, thiserror::Error)]
pub enum LayerFileError {
    /// A file system call failed.
    #[error("{step} {path}: {source}")]
    Io {
        /// What was being done.
        step: &'static str,
        /// The path concerned.
        path: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A required file is missing or is not a plain file.
    #[error("snapshot {dir} is incomplete or tampered with: {detail}")]
    Damaged {
        /// The layer directory.
        dir: String,
        /// What is wrong.
        detail: String,
    },
}

fn io_err(step: &'static str, path: &Path) -> impl FnOnce(io::Error) -> LayerFileError {
    let path = path.display().to_string();
    move |source| LayerFileError::Io { step, path, source }
}

/// Moves the snapshot directory `written` to `to` (which must not exist, on
/// the same file system), makes its files root's and read-only to others,
/// removes anything else, and, with `parent`, points its manifest at the
/// sibling layer directory of that name. Returns the bytes it takes on disk.
pub fn adopt(written: &Path, to: &Path, parent: Option<&str>) -> Result<u64, LayerFileError> {
    if std::fs::symlink_metadata(to).is_ok() {
        return Err(LayerFileError::Damaged {
            dir: to.display().to_string(),
            detail: "a layer of that name exists already".into(),
        });
    }
    let meta = std::fs::symlink_metadata(written).map_err(io_err("reading", written))?;
    if !meta.is_dir() {
        return Err(LayerFileError::Damaged {
            dir: written.display().to_string(),
            detail: "not a directory".into(),
        });
    }
    std::fs::rename(written, to).map_err(io_err("moving the snapshot to", to))?;
    // Out of the vmm's reach from here on (its name); what it may still
    // hold open is checked entry by entry.
    std::os::unix::fs::lchown(to, Some(0), Some(0)).map_err(io_err("owning", to))?;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755))
        .map_err(io_err("setting the mode of", to))?;
    let mut bytes = 0;
    for entry in std::fs::read_dir(to).map_err(io_err("listing", to))? {
        let entry = entry.map_err(io_err("listing", to))?;
        let name = entry.file_name();
        let path = entry.path();
        let name = name.to_str().unwrap_or_default();
        if !SNAPSHOT_FILES.contains(&name) && !OPTIONAL_FILES.contains(&name) {
            remove_any(&path)?;
            continue;
        }
        bytes += own_file(to, &path)?;
    }
    for required in SNAPSHOT_FILES {
        if std::fs::symlink_metadata(to.join(required)).is_err() {
            return Err(LayerFileError::Damaged {
                dir: to.display().to_string(),
                detail: format!("its {required} file is missing"),
            });
        }
    }
    if let Some(parent) = parent {
        set_parent(to, Some(parent))?;
    }
    Ok(bytes)
}

/// Opens `path` without following a link, checks it is a regular file with
/// one link, gives it to root with mode 0644; returns its allocated bytes.
fn own_file(dir: &Path, path: &Path) -> Result<u64, LayerFileError> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| LayerFileError::Damaged {
            dir: dir.display().to_string(),
            detail: format!("{} does not open as a plain file: {e}", path.display()),
        })?;
    let meta = file.metadata().map_err(io_err("reading", path))?;
    if !meta.is_file() || meta.nlink() != 1 {
        return Err(LayerFileError::Damaged {
            dir: dir.display().to_string(),
            detail: format!(
                "{} is not a plain file with one link (links: {})",
                path.display(),
                meta.nlink()
            ),
        });
    }
    // SAFETY: fchown on a descriptor this function owns; no memory is passed.
    if unsafe { libc::fchown(file.as_raw_fd(), 0, 0) } != 0 {
        return Err(io_err("owning", path)(io::Error::last_os_error()));
    }
    file.set_permissions(std::fs::Permissions::from_mode(0o644))
        .map_err(io_err("setting the mode of", path))?;
    Ok(meta.blocks() * 512)
}

/// Removes `path` (a file, link or directory the vmm left) without
/// following anything.
fn remove_any(path: &Path) -> Result<(), LayerFileError> {
    let meta = std::fs::symlink_metadata(path).map_err(io_err("reading", path))?;
    if meta.is_dir() {
        std::fs::remove_dir_all(path).map_err(io_err("removing", path))
    } else {
        std::fs::remove_file(path).map_err(io_err("removing", path))
    }
}

/// Rewrites the manifest in layer directory `dir` to name `parent` (a
/// sibling directory name; `None`: no parent, a full snapshot).
pub fn set_parent(dir: &Path, parent: Option<&str>) -> Result<(), LayerFileError> {
    let path = dir.join("manifest");
    let damaged = |detail: String| LayerFileError::Damaged {
        dir: dir.display().to_string(),
        detail,
    };
    let mut text = Vec::new();
    crate::safe_fs::open_regular(&path)
        .map_err(|e| damaged(format!("its manifest does not open: {e}")))?
        .take(MAX_MANIFEST_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(io_err("reading", &path))?;
    if text.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(damaged("its manifest is over 1 MiB".into()));
    }
    let mut manifest: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| damaged(format!("its manifest is not JSON: {e}")))?;
    let Some(fields) = manifest.as_object_mut() else {
        return Err(damaged("its manifest is not a JSON object".into()));
    };
    fields.insert(
        "parent".into(),
        parent.map_or(serde_json::Value::Null, |p| p.into()),
    );
    let out = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| damaged(format!("its manifest does not encode: {e}")))?;
    let tmp = dir.join(".manifest.tmp");
    let mut file = crate::safe_fs::create_new(&tmp).map_err(io_err("creating", &tmp))?;
    file.write_all(&out).map_err(io_err("writing", &tmp))?;
    file.set_permissions(std::fs::Permissions::from_mode(0o644))
        .map_err(io_err("setting the mode of", &tmp))?;
    file.sync_all().map_err(io_err("syncing", &tmp))?;
    std::fs::rename(&tmp, &path).map_err(io_err("replacing", &path))?;
    sync_dir(dir)
}

/// Makes the entries of `dir` durable.
fn sync_dir(dir: &Path) -> Result<(), LayerFileError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("syncing", dir))
}

/// Bytes the files directly in `dir` take on disk (0 if it is gone).
pub fn size_on_disk(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| std::fs::symlink_metadata(e.path()).ok())
        .filter(|m| m.is_file())
        .map(|m| m.blocks() * 512)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(dir: &Path) {
        std::fs::create_dir(dir).unwrap();
        std::fs::write(
            dir.join("manifest"),
            br#"{"kind":"diff","parent":"/golden"}"#,
        )
        .unwrap();
        std::fs::write(dir.join("state"), b"s").unwrap();
        std::fs::write(dir.join("memory"), vec![1u8; 8192]).unwrap();
    }

    #[test]
    fn an_adopted_snapshot_names_its_parent_layer_and_loses_what_it_should_not_hold() {
        let t = tempfile::tempdir().unwrap();
        let from = t.path().join("run-snap");
        written(&from);
        std::os::unix::fs::symlink("/etc/passwd", from.join("planted")).unwrap();
        std::fs::create_dir(from.join("subdir")).unwrap();
        let to = t.path().join("layer-1");
        let bytes = adopt(&from, &to, Some("golden-layer")).unwrap();
        assert!(!from.exists(), "moved, not copied");
        assert!(bytes >= 8192, "{bytes}");
        let mut names: Vec<String> = std::fs::read_dir(&to)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["manifest", "memory", "state"]);
        let manifest: serde_json::Value =
            serde_json::from_slice(&std::fs::read(to.join("manifest")).unwrap()).unwrap();
        assert_eq!(manifest["parent"], "golden-layer");
        assert_eq!(manifest["kind"], "diff", "the rest of the manifest stays");
        let mode = std::fs::metadata(to.join("memory")).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o644);
    }

    #[test]
    fn a_snapshot_with_a_link_for_a_file_or_a_missing_file_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let from = t.path().join("a");
        written(&from);
        std::fs::remove_file(from.join("state")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", from.join("state")).unwrap();
        let err = adopt(&from, &t.path().join("la"), None).unwrap_err();
        assert!(err.to_string().contains("plain file"), "{err}");

        let from = t.path().join("b");
        written(&from);
        std::fs::remove_file(from.join("memory")).unwrap();
        let err = adopt(&from, &t.path().join("lb"), None).unwrap_err();
        assert!(err.to_string().contains("memory file is missing"), "{err}");

        let from = t.path().join("c");
        written(&from);
        std::fs::hard_link(from.join("state"), t.path().join("elsewhere")).unwrap();
        let err = adopt(&from, &t.path().join("lc"), None).unwrap_err();
        assert!(err.to_string().contains("one link"), "{err}");
    }
}
