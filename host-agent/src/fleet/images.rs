//! Images between nodes: what of an image is pushed (its kernel, initrd,
//! root disk and golden snapshot, under the names below), and a pulled
//! image registered on this node with its golden snapshot.
//!
//! A pulled image's files live in its image directory:
//! `<state>/images/<id>/pull-<time>/{kernel,initrd,rootfs}` and the golden
//! snapshot in `<state>/images/<id>/golden-<time>/`, as a built one. The
//! snapshot is restored as it was written on the pushing node, so the nodes
//! of a fleet run the same vmm version on the same CPU model (the snapshot's
//! CPU state is the pushing host's).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::objects::{self, PushFile};
use super::Fleet;
use crate::error::{Error, Result};
use crate::launch::NETWORK_MARKER;
use crate::sessions::{now_ms, Manager};
use crate::store::ImageRow;

/// The manifest's `meta`: the image's settings. Fields a newer host-agent
/// adds are ignored (the manifest's format number says what must be
/// understood), so nodes of mixed versions still share images.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageMeta {
    /// The image id.
    pub image_id: String,
    /// Kernel command line.
    pub cmdline: String,
    /// Guest memory, MiB.
    pub mem_mib: u32,
    /// vCPUs.
    pub vcpus: u32,
    /// Whether it runs guest-init.
    pub guest_init: bool,
    /// Its encoded device limits.
    pub io_limits: String,
    /// When its golden snapshot was built (Unix ms).
    pub golden_built_at: i64,
    /// The node that pushed it.
    pub pushed_by: String,
    /// When (Unix ms).
    pub pushed_at: i64,
    /// The id of the golden snapshot's layer on the pushing node; a node
    /// that pulls the image records its golden snapshot under the same id,
    /// so that a session's chain moved between them (MoveSession), whose
    /// bottom diff names it, resolves. Empty in a push from before moves.
    #[serde(default)]
    pub golden_layer: String,
    /// Its shares, encoded as stored (their devices are in the golden
    /// snapshot; the directories are checked against the pulling node's
    /// roots whenever a VM starts). Empty in a push from before shares.
    #[serde(default)]
    pub shares: String,
}

/// Name prefix of the golden snapshot's files in a push.
const GOLDEN: &str = "golden/";

/// The files of `image` a push uploads: `kernel`, `initrd` and `rootfs`
/// when it has them, and every regular file of its golden snapshot as
/// `golden/<name>`.
pub fn push_files(image: &ImageRow) -> Result<Vec<PushFile>> {
    if image.golden_dir.is_empty() {
        return Err(Error::FailedPrecondition(format!(
            "image {:?} has no golden snapshot yet; call BuildGoldenSnapshot before pushing it",
            image.id
        )));
    }
    if !image.source_session.is_empty() {
        return Err(Error::FailedPrecondition(format!(
            "image {:?} was made from session {}: its golden snapshot is a diff over another \
             image's, and only images with a full golden snapshot can be pushed",
            image.id, image.source_session
        )));
    }
    let mut files = Vec::new();
    for (name, path) in [
        ("kernel", &image.kernel),
        ("initrd", &image.initrd),
        ("rootfs", &image.rootfs),
    ] {
        if !path.is_empty() {
            files.push(PushFile {
                name: name.into(),
                path: PathBuf::from(path),
            });
        }
    }
    let dir = Path::new(&image.golden_dir);
    let entries = std::fs::read_dir(dir)
        .map_err(|e| Error::io(format!("reading golden snapshot {}", dir.display()), e))?;
    let mut golden = Vec::new();
    for entry in entries {
        let entry = entry
            .map_err(|e| Error::io(format!("reading golden snapshot {}", dir.display()), e))?;
        let ty = entry
            .file_type()
            .map_err(|e| Error::io(format!("reading {}", entry.path().display()), e))?;
        // Sockets and links a vmm may leave are not part of the snapshot.
        if ty.is_file() {
            if let Some(name) = entry.file_name().to_str() {
                golden.push(PushFile {
                    name: format!("{GOLDEN}{name}"),
                    path: entry.path(),
                });
            }
        }
    }
    golden.sort_by(|a, b| a.name.cmp(&b.name));
    files.extend(golden);
    Ok(files)
}

/// What a push or pull did.
#[derive(Debug, Clone, Default)]
pub struct Moved {
    /// Which store.
    pub store: String,
    /// Files.
    pub files: u32,
    /// Their bytes.
    pub bytes: u64,
    /// Chunks.
    pub chunks: u32,
    /// Chunks sent (push) or fetched (pull).
    pub chunks_moved: u32,
    /// Their bytes.
    pub bytes_moved: u64,
}

impl Fleet {
    /// Pushes image `id` to the image store.
    pub async fn push_image(&self, mgr: &Manager, id: &str) -> Result<Moved> {
        crate::images::valid_id(id)?;
        let store = self.image_store().await?;
        let image = mgr
            .store
            .image(id)?
            .ok_or_else(|| Error::not_found("image", id))?;
        let files = push_files(&image)?;
        let golden_layer = mgr.layers.golden(&image)?.map(|l| l.id).unwrap_or_default();
        let meta = ImageMeta {
            image_id: image.id.clone(),
            cmdline: image.cmdline.clone(),
            mem_mib: image.mem_mib,
            vcpus: image.vcpus,
            guest_init: image.guest_init,
            io_limits: image.io_limits.clone(),
            golden_built_at: image.golden_built_at,
            pushed_by: self.node.clone(),
            pushed_at: now_ms(),
            golden_layer,
            shares: image.shares.clone(),
        };
        let meta = serde_json::to_value(&meta)
            .map_err(|e| Error::Fleet(format!("encoding image {id}'s manifest: {e}")))?;
        let s = objects::push(store.as_ref(), id, meta, &files).await?;
        tracing::info!(
            image = %id, store = %store.describe(), files = s.files, bytes = s.bytes,
            chunks = s.chunks, uploaded = s.chunks_uploaded, "image pushed"
        );
        Ok(Moved {
            store: store.describe(),
            files: s.files as u32,
            bytes: s.bytes,
            chunks: s.chunks as u32,
            chunks_moved: s.chunks_uploaded as u32,
            bytes_moved: s.bytes_uploaded,
        })
    }

    /// Image `id` of this node, pulled first when it lacks it (a create on
    /// a node without the image); a create racing another one waits for
    /// its pull.
    pub async fn image_or_pull(&self, mgr: &Manager, id: &str) -> Result<ImageRow> {
        match self.pull_image(mgr, id).await {
            Ok((image, _)) => Ok(image),
            Err(Error::AlreadyExists(_)) => mgr
                .store
                .image(id)?
                .ok_or_else(|| Error::not_found("image", id)),
            Err(e) => Err(e),
        }
    }

    /// Pulls image `id` from the image store and registers it here with
    /// its golden snapshot; AlreadyExists when this node has it.
    pub async fn pull_image(&self, mgr: &Manager, id: &str) -> Result<(ImageRow, Moved)> {
        crate::images::valid_id(id)?;
        let _one = self.pull_lock.lock().await;
        if mgr.store.image(id)?.is_some() {
            return Err(Error::AlreadyExists(format!(
                "image {id:?} is already registered on this node"
            )));
        }
        let store = self.image_store().await?;
        let dir = mgr.image_dir(id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let at = now_ms();
        let files = dir.join(format!("pull-{at}"));
        let pulled = match objects::pull(store.as_ref(), id, &files).await {
            Ok(p) => p,
            Err(Error::NotFound { .. }) => {
                return Err(Error::not_found(
                    "image (on this node or in the fleet's image store)",
                    id,
                ))
            }
            Err(e) => return Err(e),
        };
        let registered = self.register_pulled(mgr, id, &files, &pulled.meta, at);
        if registered.is_err() {
            let _ = std::fs::remove_dir_all(&files);
            let _ = std::fs::remove_dir_all(dir.join(format!("golden-{at}")));
        }
        let image = registered?;
        let s = pulled.stats;
        tracing::info!(
            image = %id, store = %store.describe(), files = s.files, bytes = s.bytes,
            fetched = s.bytes_fetched, "image pulled and registered"
        );
        Ok((
            image,
            Moved {
                store: store.describe(),
                files: s.files as u32,
                bytes: s.bytes,
                chunks: s.chunks as u32,
                chunks_moved: s.chunks_fetched as u32,
                bytes_moved: s.bytes_fetched,
            },
        ))
    }

    fn register_pulled(
        &self,
        mgr: &Manager,
        id: &str,
        files: &Path,
        meta: &serde_json::Value,
        at: i64,
    ) -> Result<ImageRow> {
        let meta: ImageMeta = serde_json::from_value(meta.clone())
            .map_err(|e| Error::Corrupt(format!("image {id}'s manifest: {e}")))?;
        if meta.image_id != id {
            return Err(Error::Corrupt(format!(
                "the manifest pushed as image {id:?} describes image {:?}",
                meta.image_id
            )));
        }
        let golden_from = files.join(GOLDEN.trim_end_matches('/'));
        if !golden_from.is_dir() {
            return Err(Error::Corrupt(format!(
                "image {id}'s push holds no golden snapshot"
            )));
        }
        if golden_from.join(NETWORK_MARKER).exists() && mgr.network.is_none() {
            return Err(Error::FailedPrecondition(format!(
                "image {id}'s golden snapshot has a network device, and this node has no \
                 network for sessions (the `network` setting)"
            )));
        }
        let golden = mgr.image_dir(id).join(format!("golden-{at}"));
        std::fs::rename(&golden_from, &golden).map_err(|e| {
            Error::io(
                format!("moving the pulled snapshot to {}", golden.display()),
                e,
            )
        })?;
        let file = |name: &str| {
            let p = files.join(name);
            if p.exists() {
                p.display().to_string()
            } else {
                String::new()
            }
        };
        let image = ImageRow {
            id: id.to_string(),
            kernel: file("kernel"),
            rootfs: file("rootfs"),
            initrd: file("initrd"),
            cmdline: meta.cmdline,
            mem_mib: meta.mem_mib,
            vcpus: meta.vcpus,
            guest_init: meta.guest_init,
            golden_dir: golden.display().to_string(),
            created_at: at,
            golden_built_at: meta.golden_built_at,
            io_limits: meta.io_limits,
            source_session: String::new(),
            shares: meta.shares,
        };
        if image.kernel.is_empty() {
            return Err(Error::Corrupt(format!("image {id}'s push holds no kernel")));
        }
        crate::io_limits::IoLimits::decode(&image.io_limits)?;
        mgr.store.insert_image(&image)?;
        let golden = match meta.golden_layer.as_str() {
            "" => mgr.layers.golden(&image),
            id => mgr.layers.golden_as(&image, id),
        };
        if let Err(e) = golden {
            let _ = mgr.store.delete_image(id);
            return Err(e);
        }
        Ok(image)
    }
}

/// Whether `path` is one of a pulled image's own files (they lie in its
/// image directory, not under the allowed image roots).
pub fn is_pulled_file(mgr: &Manager, image_id: &str, path: &str) -> bool {
    Path::new(path).starts_with(mgr.image_dir(image_id))
}
