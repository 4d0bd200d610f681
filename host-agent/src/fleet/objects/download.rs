//! [`pull`]: a pushed image's manifest and chunks into a directory.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use sha2::{Digest, Sha256};

use super::manifest::{self, FileEntry, Manifest};
use super::ObjectStore;
use crate::error::{Error, Result};

/// Retries of a chunk whose fetch failed (damaged, missing, store error).
const RETRIES: u32 = 3;
/// Wait before the first retry; doubled for each further one.
const BACKOFF: Duration = Duration::from_millis(100);
/// Chunks fetched at the same time.
const PARALLEL: usize = 4;

/// What a [`pull`] did.
#[derive(Debug, Clone, Default)]
pub struct PullStats {
    /// Files written.
    pub files: u64,
    /// Their bytes in all.
    pub bytes: u64,
    /// Their chunks in all.
    pub chunks: u64,
    /// Chunks fetched from the store (full-size zero chunks are known from
    /// their name and not fetched).
    pub chunks_fetched: u64,
    /// Bytes of those chunks.
    pub bytes_fetched: u64,
}

/// A pulled image.
#[derive(Debug, Clone)]
pub struct Pulled {
    /// The `meta` its pusher stored.
    pub meta: serde_json::Value,
    /// What the pull did.
    pub stats: PullStats,
}

/// Pulls image `key` into the new directory `dest` (which must not exist;
/// its parent is created). Files are written into `<dest>.partial/` (left
/// over from an earlier try: removed first), each chunk checked against the
/// manifest, zero chunks left as holes; `dest` appears only when every file
/// is complete. On failure nothing is left at `dest` or `<dest>.partial`.
/// Two pulls to the same `dest` at once are the caller's to prevent.
pub async fn pull(store: &dyn ObjectStore, key: &str, dest: &Path) -> Result<Pulled> {
    manifest::check_key(key)?;
    let mname = manifest::manifest_name(key);
    let raw = store
        .get(&mname)
        .await
        .map_err(|e| manifest::with_context(e, &format!("pulling image {key}: its manifest")))?
        .ok_or_else(|| Error::not_found("pushed image", key))?;
    let m = Manifest::parse(&raw, key).map_err(|why| {
        Error::Corrupt(format!(
            "manifest {mname} in {} is refused: {why}",
            store.describe()
        ))
    })?;
    drop(raw);

    let partial = partial_path(dest)?;
    if present(dest)? {
        return Err(Error::AlreadyExists(format!(
            "cannot pull image {key} to {}: it exists",
            dest.display()
        )));
    }
    remove_any(&partial)
        .map_err(|e| Error::io(format!("removing the leftover {}", partial.display()), e))?;
    if let Some(parent) = dest.parent().filter(|p| !p.as_os_str().is_empty()) {
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
    }
    tokio::fs::create_dir(&partial)
        .await
        .map_err(|e| Error::io(format!("creating {}", partial.display()), e))?;

    let result = async {
        let stats = write_files(store, &m, &partial).await?;
        finish(&partial, dest).await?;
        Ok(stats)
    }
    .await;
    match result {
        Ok(stats) => {
            tracing::info!(
                key,
                store = %store.describe(),
                dest = %dest.display(),
                files = stats.files,
                bytes = stats.bytes,
                chunks_fetched = stats.chunks_fetched,
                bytes_fetched = stats.bytes_fetched,
                "pulled image"
            );
            Ok(Pulled {
                meta: m.meta,
                stats,
            })
        }
        Err(e) => {
            if let Err(rm) = remove_any(&partial) {
                tracing::warn!(path = %partial.display(), error = %rm, "removing a failed pull's partial directory");
            }
            Err(e)
        }
    }
}

/// The `meta` of pushed key `key` (its manifest read and checked, no
/// chunk fetched), or `None` when nothing complete was pushed under it.
/// What a [`pull`] of it would return, unless the key is pushed again
/// meanwhile.
pub async fn meta(store: &dyn ObjectStore, key: &str) -> Result<Option<serde_json::Value>> {
    manifest::check_key(key)?;
    let mname = manifest::manifest_name(key);
    let Some(raw) = store
        .get(&mname)
        .await
        .map_err(|e| manifest::with_context(e, &format!("reading {key}'s manifest")))?
    else {
        return Ok(None);
    };
    let m = Manifest::parse(&raw, key).map_err(|why| {
        Error::Corrupt(format!(
            "manifest {mname} in {} is refused: {why}",
            store.describe()
        ))
    })?;
    Ok(Some(m.meta))
}

/// `<dest>.partial`, beside `dest`.
fn partial_path(dest: &Path) -> Result<PathBuf> {
    let name = dest.file_name().ok_or_else(|| {
        Error::invalid(format!(
            "pull destination {} does not end in a name",
            dest.display()
        ))
    })?;
    let mut partial = name.to_os_string();
    partial.push(".partial");
    Ok(dest.with_file_name(partial))
}

/// Whether anything (a link included) is at `path`.
fn present(path: &Path) -> Result<bool> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(format!("looking at {}", path.display()), e)),
    }
}

/// Removes whatever is at `path` (a directory tree, a file or a link);
/// nothing there is fine.
fn remove_any(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Runs `f` off the async threads; `what` names it should it panic.
async fn blocking<T: Send + 'static>(
    what: String,
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(|e| Error::io(what, e)),
        Err(join) => Err(Error::io(what, io::Error::other(join))),
    }
}

/// One chunk as fetched: its bytes, or a hole of this many bytes.
enum Piece {
    Data(Bytes),
    Hole(u64),
}

/// Writes every file of `m` under `partial`; fsyncs the files and their
/// directories.
async fn write_files(store: &dyn ObjectStore, m: &Manifest, partial: &Path) -> Result<PullStats> {
    let chunk_bytes = m.chunk_bytes;
    let zero_hash = blocking("hashing a zero chunk".into(), move || {
        Ok(zero_sha256(chunk_bytes))
    })
    .await?;
    let mut stats = PullStats::default();
    let mut dirs = vec![partial.to_path_buf()];
    for f in &m.files {
        let path = partial.join(&f.name);
        if let Some(parent) = path.parent() {
            if !dirs.iter().any(|d| d == parent) {
                tokio::fs::create_dir_all(parent)
                    .await
                    .map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
                let mut d = parent;
                while d != partial {
                    if !dirs.iter().any(|x| x == d) {
                        dirs.push(d.to_path_buf());
                    }
                    match d.parent() {
                        Some(p) => d = p,
                        None => break,
                    }
                }
            }
        }
        write_file(store, m, f, &path, &zero_hash, &mut stats).await?;
        stats.files += 1;
    }
    for d in dirs {
        let what = format!("syncing {}", d.display());
        blocking(what, move || std::fs::File::open(&d)?.sync_all()).await?;
    }
    Ok(stats)
}

/// Fetches, checks and writes one file's chunks to `path`.
async fn write_file(
    store: &dyn ObjectStore,
    m: &Manifest,
    f: &FileEntry,
    path: &Path,
    zero_hash: &str,
    stats: &mut PullStats,
) -> Result<()> {
    let file = tokio::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .await
        .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
    let file = Arc::new(file.into_std().await);
    // Up to PARALLEL chunks in flight, written in order. (A named async fn,
    // not a closure over the iterator, keeps the future `Send` for callers.)
    let mut pieces = futures::stream::FuturesOrdered::new();
    let mut next = 0;
    loop {
        while pieces.len() < PARALLEL && next < f.chunks.len() {
            pieces.push_back(get_piece(store, m, f, next, zero_hash));
            next += 1;
        }
        let Some(piece) = pieces.next().await else {
            break;
        };
        let (i, piece) = piece?;
        stats.chunks += 1;
        match piece {
            Piece::Hole(len) => stats.bytes += len,
            Piece::Data(data) => {
                let len = data.len() as u64;
                stats.chunks_fetched += 1;
                stats.bytes_fetched += len;
                stats.bytes += len;
                let offset = i as u64 * m.chunk_bytes;
                let file = file.clone();
                let what = format!("writing chunk {i} of {} to {}", f.name, path.display());
                blocking(what, move || file.write_all_at(&data, offset)).await?;
            }
        }
    }
    let (size, mode) = (f.size, f.mode & 0o777);
    let what = format!("completing {}", path.display());
    blocking(what, move || {
        file.set_len(size)?;
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
        file.sync_all()
    })
    .await
}

/// Chunk `index` of `f`: a hole when its name says it is a full-size zero
/// chunk, else fetched and checked.
async fn get_piece(
    store: &dyn ObjectStore,
    m: &Manifest,
    f: &FileEntry,
    index: usize,
    zero_hash: &str,
) -> Result<(usize, Piece)> {
    let hash = &f.chunks[index];
    let len = m.chunk_len(f, index);
    if len == m.chunk_bytes && hash == zero_hash {
        return Ok((index, Piece::Hole(len)));
    }
    fetch_chunk(store, f, index, hash, len)
        .await
        .map(|p| (index, p))
}

/// Fetches chunk `index` of `f` (SHA-256 `hash`, `len` bytes) and checks
/// it, retrying [`RETRIES`] times; an all-zero chunk comes back as a hole.
async fn fetch_chunk(
    store: &dyn ObjectStore,
    f: &FileEntry,
    index: usize,
    hash: &str,
    len: u64,
) -> Result<Piece> {
    let obj = manifest::chunk_name(hash);
    let mut retry = 0;
    loop {
        let err = match store.get(&obj).await {
            Ok(Some(data)) => match check_chunk(data, hash, len).await? {
                Ok(piece) => return Ok(piece),
                Err(why) => Error::Corrupt(format!(
                    "chunk {index} of {} ({obj} in {}) is damaged: {why}",
                    f.name,
                    store.describe()
                )),
            },
            Ok(None) => Error::Corrupt(format!(
                "chunk {index} of {} ({obj}) is missing from {}",
                f.name,
                store.describe()
            )),
            Err(e) => manifest::with_context(
                e,
                // The store's own errors name it and the object.
                &format!("chunk {index} of {}", f.name),
            ),
        };
        if retry == RETRIES {
            return Err(err);
        }
        tracing::warn!(error = %err, retry = retry + 1, "retrying a chunk");
        tokio::time::sleep(BACKOFF * 2u32.pow(retry)).await;
        retry += 1;
    }
}

/// Checks a fetched chunk's length and SHA-256; `Err(why)` when damaged.
async fn check_chunk(
    data: Bytes,
    hash: &str,
    len: u64,
) -> Result<std::result::Result<Piece, String>> {
    if data.len() as u64 != len {
        return Ok(Err(format!("it is {} bytes, {len} expected", data.len())));
    }
    let hash = hash.to_string();
    blocking("checking a chunk".into(), move || {
        let got = hex::encode(Sha256::digest(&data));
        if got != hash {
            return Ok(Err(format!("its SHA-256 is {got}")));
        }
        if data.iter().all(|&b| b == 0) {
            return Ok(Ok(Piece::Hole(len)));
        }
        Ok(Ok(Piece::Data(data)))
    })
    .await
}

/// SHA-256 (hex) of `len` zero bytes.
fn zero_sha256(len: u64) -> String {
    static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
    let mut h = Sha256::new();
    let mut left = len;
    while left > 0 {
        let n = left.min(ZEROS.len() as u64) as usize;
        h.update(&ZEROS[..n]);
        left -= n as u64;
    }
    hex::encode(h.finalize())
}

/// Fsyncs the files' directories, renames `partial` to `dest` (refusing to
/// replace anything there) and fsyncs `dest`'s parent.
async fn finish(partial: &Path, dest: &Path) -> Result<()> {
    let (from, to) = (partial.to_path_buf(), dest.to_path_buf());
    let what = format!("renaming {} to {}", partial.display(), dest.display());
    let moved = tokio::task::spawn_blocking(move || rename_noreplace(&from, &to))
        .await
        .map_err(|e| Error::io(what.clone(), io::Error::other(e)))?;
    match moved {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            return Err(Error::AlreadyExists(format!(
                "cannot pull to {}: it appeared during the pull",
                dest.display()
            )))
        }
        Err(e) => return Err(Error::io(what, e)),
    }
    let parent = match dest.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => p.to_path_buf(),
        None => PathBuf::from("."),
    };
    let what = format!("syncing {}", parent.display());
    blocking(what, move || std::fs::File::open(&parent)?.sync_all()).await
}

/// `rename(from, to)` that fails with `AlreadyExists` instead of replacing
/// `to` (an empty directory would be replaced by a plain rename).
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let cstr = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))
    };
    let (f, t) = (cstr(from)?, cstr(to)?);
    // SAFETY: both are valid NUL-terminated paths that outlive the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        // A filesystem or kernel without RENAME_NOREPLACE: check, then rename.
        Some(libc::EINVAL) | Some(libc::ENOSYS) => {
            if std::fs::symlink_metadata(to).is_ok() {
                return Err(io::Error::from(io::ErrorKind::AlreadyExists));
            }
            std::fs::rename(from, to)
        }
        _ => Err(err),
    }
}
