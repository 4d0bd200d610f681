//! Images in an object store, chunked and content-addressed.
//!
//! [`push`] cuts each of an image's files into [`CHUNK_BYTES`] pieces and
//! stores every piece once, as object `chunks/<sha256 hex>` (so a kernel
//! shared by two images, or a sparse disk's many zero chunks, is uploaded
//! once), then writes the manifest `manifests/<key>.json` that lists the
//! files and their chunks. The manifest goes last: a push cut off halfway
//! leaves chunks but no manifest, and nothing half-pushed is ever pulled.
//!
//! [`pull`] treats the manifest and every chunk as untrusted: the manifest's
//! names and sizes are checked before anything is written, each chunk's
//! SHA-256 and length are checked against the manifest, and the files are
//! written into `<dest>.partial/`, renamed to `dest` only when complete.
//!
//! The stores: [`jetstream::JetStreamObjects`] (NATS JetStream's object
//! store) and [`cloud::CloudObjects`] (S3-compatible or local-file storage
//! through the `object_store` crate).

pub mod cloud;
mod download;
pub mod jetstream;
mod manifest;
mod upload;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

use crate::error::Result;

pub use download::{meta, pull, PullStats, Pulled};
pub use manifest::MAX_FILES;
pub use upload::{push, PushStats};

/// Size of the pieces files are cut into (the last piece of a file may be
/// shorter).
pub const CHUNK_BYTES: usize = 4 << 20;

/// Where pushed images' chunks and manifests are kept.
#[async_trait::async_trait]
pub trait ObjectStore: Send + Sync {
    /// Stores `data` under `name` (replacing what was there).
    async fn put(&self, name: &str, data: bytes::Bytes) -> Result<()>;
    /// The object `name`, or None when there is none.
    async fn get(&self, name: &str) -> Result<Option<bytes::Bytes>>;
    /// Whether `name` exists.
    async fn exists(&self, name: &str) -> Result<bool>;
    /// Says which store this is, for logs and errors ("NATS object store
    /// agentvm_images at nats://...", "s3://bucket/prefix").
    fn describe(&self) -> String;
}

/// One file of an image to push.
#[derive(Debug, Clone)]
pub struct PushFile {
    /// Its relative name in the manifest, e.g. `kernel`, `rootfs`,
    /// `golden/memory`; [`pull`] writes it to `<dest>/<name>`.
    pub name: String,
    /// The file on this node.
    pub path: PathBuf,
}

/// Whether image `key` has been pushed completely (its manifest exists).
pub async fn pushed(store: &dyn ObjectStore, key: &str) -> Result<bool> {
    manifest::check_key(key)?;
    store.exists(&manifest::manifest_name(key)).await
}
