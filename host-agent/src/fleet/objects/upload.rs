//! [`push`]: an image's files into chunks and a manifest.

use std::collections::HashSet;
use std::os::unix::fs::PermissionsExt;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;

use super::manifest::{self, FileEntry, Manifest};
use super::{ObjectStore, PushFile, CHUNK_BYTES};
use crate::error::{Error, Result};

/// What a [`push`] did.
#[derive(Debug, Clone, Default)]
pub struct PushStats {
    /// Files pushed.
    pub files: u64,
    /// Their bytes in all.
    pub bytes: u64,
    /// Their chunks in all (a chunk used twice counts twice).
    pub chunks: u64,
    /// Chunks the store did not have yet and got.
    pub chunks_uploaded: u64,
    /// Bytes of those chunks.
    pub bytes_uploaded: u64,
}

/// Pushes `files` as image `key` with the caller's `meta`: every chunk the
/// store lacks, then (last) the manifest, replacing any earlier manifest of
/// `key`. Chunks the store has already (`exists`) are not uploaded again.
pub async fn push(
    store: &dyn ObjectStore,
    key: &str,
    meta: serde_json::Value,
    files: &[PushFile],
) -> Result<PushStats> {
    manifest::check_key(key)?;
    manifest::check_names(files.iter().map(|f| f.name.as_str()))
        .map_err(|why| Error::invalid(format!("pushing image {key}: {why}")))?;
    let mut stats = PushStats::default();
    // Chunks known to be in the store already (checked or uploaded by this
    // push), so a disk's thousand zero chunks cost one `exists`.
    let mut present = HashSet::new();
    let mut entries = Vec::with_capacity(files.len());
    for f in files {
        entries.push(push_file(store, key, f, &mut present, &mut stats).await?);
        stats.files += 1;
    }
    let m = Manifest {
        format: manifest::FORMAT,
        key: key.to_string(),
        meta,
        chunk_bytes: CHUNK_BYTES as u64,
        files: entries,
    };
    let name = manifest::manifest_name(key);
    let body = serde_json::to_vec(&m)
        .map_err(|e| Error::invalid(format!("encoding manifest {name}: {e}")))?;
    store
        .put(&name, Bytes::from(body))
        .await
        .map_err(|e| manifest::with_context(e, &format!("pushing image {key}: its manifest")))?;
    tracing::info!(
        key,
        store = %store.describe(),
        files = stats.files,
        bytes = stats.bytes,
        chunks = stats.chunks,
        chunks_uploaded = stats.chunks_uploaded,
        bytes_uploaded = stats.bytes_uploaded,
        "pushed image"
    );
    Ok(stats)
}

/// Chunks and uploads one file; returns its manifest entry.
async fn push_file(
    store: &dyn ObjectStore,
    key: &str,
    f: &PushFile,
    present: &mut HashSet<String>,
    stats: &mut PushStats,
) -> Result<FileEntry> {
    let what = format!("{} ({} of image {key})", f.path.display(), f.name);
    let mut file = tokio::fs::File::open(&f.path)
        .await
        .map_err(|e| Error::io(format!("opening {what} to push"), e))?;
    let md = file
        .metadata()
        .await
        .map_err(|e| Error::io(format!("reading the metadata of {what}"), e))?;
    if !md.is_file() {
        return Err(Error::invalid(format!(
            "pushing {what}: not a regular file"
        )));
    }
    let mut entry = FileEntry {
        name: f.name.clone(),
        size: 0,
        mode: md.permissions().mode() & 0o777,
        chunks: Vec::new(),
    };
    loop {
        let mut buf = Vec::with_capacity(CHUNK_BYTES);
        (&mut file)
            .take(CHUNK_BYTES as u64)
            .read_to_end(&mut buf)
            .await
            .map_err(|e| Error::io(format!("reading chunk {} of {what}", entry.chunks.len()), e))?;
        if buf.is_empty() {
            break;
        }
        let len = buf.len() as u64;
        let data = Bytes::from(buf);
        let hash = sha256_hex(data.clone()).await?;
        if !present.contains(&hash) {
            let obj = manifest::chunk_name(&hash);
            // The store's own errors name it and the object.
            let ctx = || format!("pushing chunk {} of {}", entry.chunks.len(), f.name);
            let there = store
                .exists(&obj)
                .await
                .map_err(|e| manifest::with_context(e, &ctx()))?;
            if !there {
                store
                    .put(&obj, data)
                    .await
                    .map_err(|e| manifest::with_context(e, &ctx()))?;
                stats.chunks_uploaded += 1;
                stats.bytes_uploaded += len;
            }
            present.insert(hash.clone());
        }
        entry.chunks.push(hash);
        entry.size += len;
        stats.chunks += 1;
        stats.bytes += len;
        if len < CHUNK_BYTES as u64 {
            break;
        }
    }
    Ok(entry)
}

/// SHA-256 of `data` in lowercase hex, computed off the async threads.
pub(super) async fn sha256_hex(data: Bytes) -> Result<String> {
    tokio::task::spawn_blocking(move || hex::encode(Sha256::digest(&data)))
        .await
        .map_err(|e| Error::io("hashing a chunk", std::io::Error::other(e)))
}
