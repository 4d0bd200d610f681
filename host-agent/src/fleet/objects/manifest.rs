//! The manifest of a pushed image and its checks (pulled manifests are
//! untrusted input).

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The manifest format this host-agent writes and reads.
pub(super) const FORMAT: u32 = 1;
/// Most files one push may hold.
pub const MAX_FILES: usize = 64;
/// Smallest chunk size a pulled manifest may state.
pub(super) const MIN_CHUNK_BYTES: u64 = 64 << 10;
/// Largest chunk size a pulled manifest may state.
pub(super) const MAX_CHUNK_BYTES: u64 = 64 << 20;
/// Largest manifest object a pull reads (64 files of 1 TiB each in 4 MiB
/// chunks list about 1.1 GiB of hashes; real images are far below this).
pub(super) const MAX_MANIFEST_BYTES: usize = 256 << 20;
/// Longest file name in a manifest.
const MAX_NAME_BYTES: usize = 1024;
/// Longest image key.
const MAX_KEY_BYTES: usize = 128;

/// `manifests/<key>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// The image id it was pushed under.
    pub key: String,
    /// What the pusher stored alongside (opaque here).
    pub meta: serde_json::Value,
    /// Size of every chunk but each file's last.
    pub chunk_bytes: u64,
    /// The files, in push order.
    pub files: Vec<FileEntry>,
}

/// One file of a [`Manifest`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileEntry {
    /// Relative name (`kernel`, `golden/memory`).
    pub name: String,
    /// Its length in bytes.
    pub size: u64,
    /// Its permission bits (at most 0o7777; a pull applies only 0o777).
    pub mode: u32,
    /// SHA-256 (lowercase hex) of each chunk, in order.
    pub chunks: Vec<String>,
}

/// The object holding image `key`'s manifest.
pub(super) fn manifest_name(key: &str) -> String {
    format!("manifests/{key}.json")
}

/// The object holding the chunk with SHA-256 `hash`.
pub(super) fn chunk_name(hash: &str) -> String {
    format!("chunks/{hash}")
}

/// Checks an image key: 1..=128 of `[A-Za-z0-9._-]`, not starting with '.'
/// (it becomes part of an object name).
pub(super) fn check_key(key: &str) -> Result<()> {
    if key.is_empty()
        || key.len() > MAX_KEY_BYTES
        || key.starts_with('.')
        || !key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(Error::invalid(format!(
            "pushed image key {key:?} must be 1 to {MAX_KEY_BYTES} letters, digits, '.', '_' or '-', not starting with '.'"
        )));
    }
    Ok(())
}

/// Checks one file name: relative, '/'-separated components none of which
/// is empty, `.` or `..`, no NUL.
fn check_name(name: &str) -> std::result::Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(format!(
            "file name {name:?} must be 1 to {MAX_NAME_BYTES} bytes"
        ));
    }
    if name.contains('\0') {
        return Err(format!("file name {name:?} holds a NUL byte"));
    }
    if name.starts_with('/') {
        return Err(format!("file name {name:?} is absolute"));
    }
    if name
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(format!(
            "file name {name:?} has an empty, '.' or '..' component"
        ));
    }
    Ok(())
}

/// Checks a set of file names: each valid, at most [`MAX_FILES`], unique,
/// and none a directory of another (`golden` and `golden/memory`).
pub(super) fn check_names<'a>(
    names: impl IntoIterator<Item = &'a str>,
) -> std::result::Result<(), String> {
    let names: Vec<&str> = names.into_iter().collect();
    if names.len() > MAX_FILES {
        return Err(format!(
            "{} files, at most {MAX_FILES} allowed",
            names.len()
        ));
    }
    let mut seen = HashSet::new();
    for name in &names {
        check_name(name)?;
        if !seen.insert(*name) {
            return Err(format!("file name {name:?} appears twice"));
        }
    }
    for name in &names {
        let mut dir = *name;
        while let Some((parent, _)) = dir.rsplit_once('/') {
            if seen.contains(parent) {
                return Err(format!(
                    "file {parent:?} is also the directory of file {name:?}"
                ));
            }
            dir = parent;
        }
    }
    Ok(())
}

/// Whether `h` is 64 lowercase hex digits.
fn is_sha256_hex(h: &str) -> bool {
    h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl Manifest {
    /// Parses and checks a manifest fetched for image `key`; says what is
    /// wrong otherwise.
    pub(super) fn parse(raw: &[u8], key: &str) -> std::result::Result<Manifest, String> {
        if raw.len() > MAX_MANIFEST_BYTES {
            return Err(format!(
                "it is {} bytes, at most {MAX_MANIFEST_BYTES} allowed",
                raw.len()
            ));
        }
        let m: Manifest =
            serde_json::from_slice(raw).map_err(|e| format!("it does not parse: {e}"))?;
        m.check(key)?;
        Ok(m)
    }

    /// The checks of [`Manifest::parse`] after decoding.
    fn check(&self, key: &str) -> std::result::Result<(), String> {
        if self.format != FORMAT {
            return Err(format!(
                "format {} (this host-agent reads format {FORMAT})",
                self.format
            ));
        }
        if self.key != key {
            return Err(format!("it is the manifest of {:?}", self.key));
        }
        if !(MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES).contains(&self.chunk_bytes) {
            return Err(format!(
                "chunk_bytes {} is not between {MIN_CHUNK_BYTES} and {MAX_CHUNK_BYTES}",
                self.chunk_bytes
            ));
        }
        check_names(self.files.iter().map(|f| f.name.as_str()))?;
        for f in &self.files {
            if f.mode > 0o7777 {
                return Err(format!("file {:?} has mode {:o}", f.name, f.mode));
            }
            let want = f.size.div_ceil(self.chunk_bytes);
            if f.chunks.len() as u64 != want {
                return Err(format!(
                    "file {:?} of {} bytes lists {} chunks, {want} expected at {} bytes a chunk",
                    f.name,
                    f.size,
                    f.chunks.len(),
                    self.chunk_bytes
                ));
            }
            if let Some((i, h)) = f.chunks.iter().enumerate().find(|(_, h)| !is_sha256_hex(h)) {
                return Err(format!(
                    "chunk {i} of file {:?} is named {h:?}, not a SHA-256 in lowercase hex",
                    f.name
                ));
            }
        }
        Ok(())
    }

    /// Length of chunk `index` of `file`: `chunk_bytes`, or the remainder
    /// for the last.
    pub(super) fn chunk_len(&self, file: &FileEntry, index: usize) -> u64 {
        let start = index as u64 * self.chunk_bytes;
        (file.size - start).min(self.chunk_bytes)
    }
}

/// Puts `context` in front of the message of a store or data error, so it
/// says which object and file it was about; other errors pass unchanged.
pub(super) fn with_context(err: Error, context: &str) -> Error {
    match err {
        Error::Fleet(m) => Error::Fleet(format!("{context}: {m}")),
        Error::Corrupt(m) => Error::Corrupt(format!("{context}: {m}")),
        Error::InvalidArgument(m) => Error::InvalidArgument(format!("{context}: {m}")),
        other => other,
    }
}
