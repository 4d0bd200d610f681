//! Snapshot layers: the node's golden snapshots and the diff snapshots
//! written over them (persisted pauses, fork points, SnapshotSession
//! snapshots), as one tree.
//!
//! Every layer but a golden snapshot lives in `<state>/layers/<id>/`; its
//! manifest names its parent by directory name (`<parent id>`), which the
//! vmm resolves next to the layer. A golden snapshot stays in its image's
//! directory; the layer store has a symlink of its id to it, so a chain
//! resolves in place for an unjailed vmm, and a jailed vmm gets each layer
//! of its chain bound read-only at `/layers/<id>`.
//!
//! Who needs a layer is recorded in SQLite: holders (`image:<id>` for an
//! image's golden snapshot, `session:<id>` for the layer a session's memory
//! descends from, `snapshots:<id>` for its SnapshotSession snapshots) and
//! children (a diff needs its parent). A layer with neither is deleted
//! ([`Layers::collect`], run whenever something lets go). At start the
//! records are checked against the files ([`Layers::check_at_start`]).

pub mod files;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
pub use crate::store::LayerRow;
use crate::store::{ImageRow, Store};

/// Layer kinds, as recorded and listed.
pub mod kind {
    /// An image's golden snapshot (full).
    pub const GOLDEN: &str = "golden";
    /// A session paused to disk.
    pub const PAUSE: &str = "pause";
    /// The snapshot a fork's sessions restore.
    pub const FORK: &str = "fork";
    /// A SnapshotSession snapshot.
    pub const SNAPSHOT: &str = "snapshot";
}

/// The holder name of image `id` (its golden snapshot).
pub fn image_holder(id: &str) -> String {
    format!("image:{id}")
}

/// The holder name of session `id` for the layer its memory descends from.
pub fn session_holder(id: &str) -> String {
    format!("session:{id}")
}

/// The holder name of session `id` for its SnapshotSession snapshots.
pub fn snapshots_holder(id: &str) -> String {
    format!("snapshots:{id}")
}

/// A chain this long gets a full snapshot next rather than one more diff
/// (the vmm follows at most 64 layers; each costs a mapping at restore).
pub const MAX_DIFF_CHAIN: usize = 16;

/// The longest chain the vmm follows (`MAX_CHAIN_DEPTH` in its manifest
/// module).
pub const VMM_MAX_CHAIN: usize = 64;

/// Where a jailed vmm sees the layers of its chain.
pub const LAYERS_IN_JAIL: &str = "/layers";

/// A layer to take in with [`Layers::adopt`].
pub struct NewLayer<'a> {
    /// One of [`kind`].
    pub kind: &'a str,
    /// The layer it is a diff over (`None`: a full snapshot).
    pub parent: Option<&'a LayerRow>,
    /// The session whose vmm wrote it.
    pub owner_session: &'a str,
    /// Who holds it from the start.
    pub holders: &'a [&'a str],
    /// `(holder, layer)` holds given up in the same transaction.
    pub release: &'a [(&'a str, &'a str)],
}

/// How a golden layer's id starts (`g-<uuid>`).
pub const GOLDEN_PREFIX: &str = "g-";

/// Longest layer id taken from another node.
const MAX_LAYER_ID: usize = 64;

/// Checks a layer id that came from another node (a moved chain, a pulled
/// image's golden layer): 1..=64 of `[A-Za-z0-9_-]`, so it names a
/// directory of the layer store safely. A bad one is [`Error::Corrupt`].
pub fn check_layer_id(id: &str) -> Result<()> {
    if id.is_empty()
        || id.len() > MAX_LAYER_ID
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
    {
        return Err(Error::Corrupt(format!(
            "snapshot layer id {id:?} must be 1 to {MAX_LAYER_ID} letters, digits, '_' or '-'"
        )));
    }
    Ok(())
}

/// A layer of a chain moved from another node, its files pulled, to take
/// in with [`Layers::take_in`].
pub struct MovedLayer<'a> {
    /// Its id on the other node (kept: the manifests of the layers above
    /// name it).
    pub id: &'a str,
    /// One of [`kind`] (not a golden snapshot: those come with images).
    pub kind: &'a str,
    /// The layer it is a diff over (empty: a full snapshot).
    pub parent: &'a str,
    /// The session whose vmm wrote it.
    pub owner_session: &'a str,
    /// When it was written (Unix ms).
    pub created_at: i64,
    /// Its pulled directory (moved into the store).
    pub files: &'a Path,
}

/// A layer with who needs it, for listings.
#[derive(Debug, Clone)]
pub struct LayerInfo {
    /// The layer.
    pub row: LayerRow,
    /// Its holders.
    pub holders: Vec<String>,
    /// Layers whose parent it is.
    pub children: u32,
}

/// The node's snapshot layers.
pub struct Layers {
    root: PathBuf,
    store: Arc<Store>,
    /// Serializes changes to the tree's files (adopt, collect).
    lock: Mutex<()>,
}

impl Layers {
    /// Opens the layer store under `state_dir` (creating `layers/`).
    pub fn open(state_dir: &Path, store: Arc<Store>) -> Result<Layers> {
        let root = state_dir.join("layers");
        crate::safe_fs::ensure_dir(&root, None)
            .map_err(|e| Error::io(format!("creating {}", root.display()), e))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| Error::io(format!("setting the mode of {}", root.display()), e))?;
        Ok(Layers {
            root,
            store,
            lock: Mutex::new(()),
        })
    }

    fn guard(&self) -> std::sync::MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The directory layers live in.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The layer `id`, or an [`Error::Snapshot`] naming it when it is gone.
    pub fn get(&self, id: &str) -> Result<LayerRow> {
        self.store
            .layer(id)?
            .ok_or_else(|| Error::Snapshot(format!("snapshot layer {id} is missing")))
    }

    /// The layer of `image`'s golden snapshot, recorded (held by the image)
    /// the first time it is asked for; `None` when the image has none.
    pub fn golden(&self, image: &ImageRow) -> Result<Option<LayerRow>> {
        self.golden_with_id(image, None)
    }

    /// [`Layers::golden`] for an image pulled from the fleet: the first
    /// time, its golden snapshot is recorded as layer `id`, the id the
    /// pushing node gave it, so a diff moved from there that names `id` as
    /// its parent resolves here. An `id` that is not a golden layer's id is
    /// refused; one this node already uses (another copy of the image,
    /// deleted while sessions still hold its snapshot) gets a new id, with
    /// a warning: sessions moved here from that chain cannot resume.
    pub fn golden_as(&self, image: &ImageRow, id: &str) -> Result<Option<LayerRow>> {
        check_layer_id(id)?;
        if !id.starts_with(GOLDEN_PREFIX) {
            return Err(Error::Corrupt(format!(
                "image {}'s golden layer id {id:?} does not start with {GOLDEN_PREFIX:?}",
                image.id
            )));
        }
        self.golden_with_id(image, Some(id))
    }

    fn golden_with_id(&self, image: &ImageRow, id: Option<&str>) -> Result<Option<LayerRow>> {
        if image.golden_dir.is_empty() {
            return Ok(None);
        }
        if let Some(l) = self.store.layer_by_dir(&image.golden_dir)? {
            return Ok(Some(l));
        }
        let _g = self.guard();
        if let Some(l) = self.store.layer_by_dir(&image.golden_dir)? {
            return Ok(Some(l));
        }
        let fresh = || format!("{GOLDEN_PREFIX}{}", uuid::Uuid::new_v4().simple());
        let id = match id {
            Some(id) if self.store.layer(id)?.is_some() => {
                let new = fresh();
                tracing::warn!(
                    image = %image.id, layer = id, new = %new,
                    "the pulled image's golden layer id is taken on this node (an earlier \
                     copy of the image, still held); it gets a new id, and sessions moved \
                     here from the other node's chain cannot resume"
                );
                new
            }
            Some(id) => id.to_string(),
            None => fresh(),
        };
        let row = LayerRow {
            id,
            parent: String::new(),
            kind: kind::GOLDEN.into(),
            dir: image.golden_dir.clone(),
            bytes: files::size_on_disk(Path::new(&image.golden_dir)),
            created_at: image.golden_built_at,
            owner_session: String::new(),
        };
        self.link_golden(&row)?;
        self.store
            .insert_layer(&row, &[&image_holder(&image.id)], &[])?;
        Ok(Some(row))
    }

    /// The symlink `<root>/<id>` to a golden snapshot's directory.
    fn link_golden(&self, row: &LayerRow) -> Result<()> {
        let link = self.root.join(&row.id);
        match std::fs::read_link(&link) {
            Ok(target) if target == Path::new(&row.dir) => return Ok(()),
            Ok(_) => {
                let _ = std::fs::remove_file(&link);
            }
            Err(_) => {}
        }
        std::os::unix::fs::symlink(&row.dir, &link)
            .map_err(|e| Error::io(format!("linking {}", link.display()), e))
    }

    /// Takes the snapshot directory a vmm wrote at `written` (host path)
    /// into the store as a new layer (see [`files::adopt`]) and records it
    /// with its holders, giving up `new.release` in the same transaction.
    /// On failure nothing is recorded and the directory is removed.
    pub fn adopt(&self, written: &Path, new: NewLayer<'_>) -> Result<LayerRow> {
        let _g = self.guard();
        let id = uuid::Uuid::new_v4().simple().to_string();
        let dir = self.root.join(&id);
        let adopted = files::adopt(written, &dir, new.parent.map(|p| p.id.as_str()));
        let bytes = match adopted {
            Ok(b) => b,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                let _ = std::fs::remove_dir_all(written);
                return Err(Error::Snapshot(e.to_string()));
            }
        };
        let row = LayerRow {
            id,
            parent: new.parent.map(|p| p.id.clone()).unwrap_or_default(),
            kind: new.kind.into(),
            dir: dir.display().to_string(),
            bytes,
            created_at: crate::clock::now_ms(),
            owner_session: new.owner_session.into(),
        };
        if let Err(e) = self.store.insert_layer(&row, new.holders, new.release) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        Ok(row)
    }

    /// Takes in `chain` (bottom first), a chain moved from another node,
    /// with `holder` holding its top. The bottom's parent, if any, must be
    /// a layer of this node (the image's golden snapshot, recorded under
    /// the id the pushing node gave it); each layer above is a diff over the
    /// one below. A layer whose id this node has already is used as it is
    /// (ids are never reused for other contents); any other is moved in
    /// from its pulled directory as [`files::adopt`] does, its manifest
    /// pointed at its parent. Under the lock [`Layers::collect`] takes, so
    /// no layer of the chain is collected before its child is recorded. On
    /// failure nothing is recorded or held and the layers made are removed.
    pub fn take_in(&self, chain: &[MovedLayer<'_>], holder: &str) -> Result<Vec<LayerRow>> {
        let _g = self.guard();
        let mut made: Vec<LayerRow> = Vec::new();
        let mut rows = Vec::new();
        let result = (|| {
            for (i, l) in chain.iter().enumerate() {
                check_layer_id(l.id)?;
                let expected_parent = match i {
                    0 => l.parent,
                    _ => chain[i - 1].id,
                };
                if l.parent != expected_parent || l.kind == kind::GOLDEN {
                    return Err(Error::Corrupt(format!(
                        "moved snapshot layer {} ({}) does not fit its chain: parent {:?}, \
                         expected {expected_parent:?}",
                        l.id, l.kind, l.parent
                    )));
                }
                if i == 0 && !l.parent.is_empty() && self.store.layer(l.parent)?.is_none() {
                    return Err(Error::Snapshot(format!(
                        "snapshot layer {}, the base of the moved chain, is not on this node",
                        l.parent
                    )));
                }
                let top = i + 1 == chain.len();
                if let Some(have) = self.store.layer(l.id)? {
                    if have.parent != l.parent {
                        return Err(Error::Snapshot(format!(
                            "snapshot layer {} is on this node already with parent {:?}, not \
                             {:?}",
                            l.id, have.parent, l.parent
                        )));
                    }
                    if top {
                        self.store.hold_layer(l.id, holder)?;
                    }
                    rows.push(have);
                    continue;
                }
                let dir = self.root.join(l.id);
                let parent = (!l.parent.is_empty()).then_some(l.parent);
                let bytes = files::adopt(l.files, &dir, parent)
                    .and_then(|b| match parent {
                        // A full snapshot names no parent, whatever it said.
                        None => files::set_parent(&dir, None).map(|()| b),
                        Some(_) => Ok(b),
                    })
                    .map_err(|e| {
                        let _ = std::fs::remove_dir_all(&dir);
                        Error::Snapshot(e.to_string())
                    })?;
                let row = LayerRow {
                    id: l.id.to_string(),
                    parent: l.parent.to_string(),
                    kind: l.kind.to_string(),
                    dir: dir.display().to_string(),
                    bytes,
                    created_at: l.created_at,
                    owner_session: l.owner_session.to_string(),
                };
                let holders: &[&str] = if top { &[holder] } else { &[] };
                if let Err(e) = self.store.insert_layer(&row, holders, &[]) {
                    let _ = std::fs::remove_dir_all(&dir);
                    return Err(e);
                }
                made.push(row.clone());
                rows.push(row);
            }
            Ok(())
        })();
        match result {
            Ok(()) => Ok(rows),
            Err(e) => {
                if let Some(top) = chain.last() {
                    let _ = self.store.release_layer(Some(top.id), holder);
                }
                for l in made.iter().rev() {
                    self.remove_files(l);
                    let _ = self.store.delete_layer(&l.id);
                }
                Err(e)
            }
        }
    }

    /// Measures layer `id` again (after a disk copy was put in it).
    pub fn grew(&self, id: &str) -> Result<()> {
        let row = self.get(id)?;
        let bytes = files::size_on_disk(Path::new(&row.dir));
        self.store.set_layer_bytes(id, bytes)
    }

    /// The chain ending at `top`, its full base first. A missing layer or
    /// directory is an [`Error::Snapshot`] naming it.
    pub fn chain(&self, top: &str) -> Result<Vec<LayerRow>> {
        let mut chain = Vec::new();
        let mut next = top.to_string();
        while !next.is_empty() {
            if chain.len() >= VMM_MAX_CHAIN {
                return Err(Error::Snapshot(format!(
                    "the chain of snapshot layer {top} is longer than {} layers",
                    VMM_MAX_CHAIN
                )));
            }
            let row = self.store.layer(&next)?.ok_or_else(|| {
                Error::Snapshot(format!(
                    "snapshot layer {next} (in the chain of {top}) is missing"
                ))
            })?;
            if !Path::new(&row.dir).join("manifest").is_file() {
                return Err(Error::Snapshot(format!(
                    "the files of snapshot layer {next} are missing ({} has no manifest)",
                    row.dir
                )));
            }
            next = row.parent.clone();
            chain.push(row);
        }
        chain.reverse();
        Ok(chain)
    }

    /// `holder` holds layer `id` too. Under the lock [`Layers::collect`]
    /// takes, so a layer is either still there and held, or already gone
    /// and the hold refused: never a hold on a collected layer.
    pub fn hold(&self, id: &str, holder: &str) -> Result<()> {
        let _g = self.guard();
        if self.store.layer(id)?.is_none() {
            return Err(Error::Snapshot(format!(
                "snapshot layer {id} is gone (nothing held it any more) and cannot be held by \
                 {holder}"
            )));
        }
        self.store.hold_layer(id, holder)
    }

    /// `holder` lets go of layer `id` (or of all it holds, with `None`), and
    /// whatever nothing needs any more is deleted.
    pub fn release(&self, id: Option<&str>, holder: &str) -> Result<()> {
        self.store.release_layer(id, holder)?;
        self.collect(false).map(|_| ())
    }

    /// Deletes (with `dry_run`, only lists) every layer nothing holds and
    /// nothing descends from, repeatedly (a deleted diff may free its
    /// parent). Returns what went, children before parents.
    pub fn collect(&self, dry_run: bool) -> Result<Vec<LayerRow>> {
        let _g = self.guard();
        if dry_run {
            return self.would_collect();
        }
        let mut gone = Vec::new();
        loop {
            let leaves = self.store.unheld_leaves()?;
            if leaves.is_empty() {
                break;
            }
            for l in leaves {
                self.remove_files(&l);
                self.store.delete_layer(&l.id)?;
                tracing::info!(layer = %l.id, kind = %l.kind, bytes = l.bytes, "snapshot layer deleted");
                gone.push(l);
            }
        }
        Ok(gone)
    }

    /// What [`Layers::collect`] would delete, computed on the records.
    fn would_collect(&self) -> Result<Vec<LayerRow>> {
        let layers = self.store.layers()?;
        let held: std::collections::HashSet<String> = self
            .store
            .layer_holds()?
            .into_iter()
            .map(|(l, _)| l)
            .collect();
        let mut children: HashMap<String, u32> = HashMap::new();
        for l in &layers {
            if !l.parent.is_empty() {
                *children.entry(l.parent.clone()).or_default() += 1;
            }
        }
        let mut alive: BTreeMap<String, LayerRow> =
            layers.into_iter().map(|l| (l.id.clone(), l)).collect();
        let mut gone = Vec::new();
        loop {
            let leaves: Vec<String> = alive
                .values()
                .filter(|l| !held.contains(&l.id) && children.get(&l.id).copied().unwrap_or(0) == 0)
                .map(|l| l.id.clone())
                .collect();
            if leaves.is_empty() {
                break;
            }
            for id in leaves {
                if let Some(l) = alive.remove(&id) {
                    if let Some(n) = children.get_mut(&l.parent) {
                        *n = n.saturating_sub(1);
                    }
                    gone.push(l);
                }
            }
        }
        Ok(gone)
    }

    /// Removes a layer's files: its directory (a golden snapshot's in its
    /// image's directory, with the image's directory itself if that is left
    /// empty) and its link in the store.
    fn remove_files(&self, l: &LayerRow) {
        let dir = Path::new(&l.dir);
        if let Err(e) = std::fs::remove_dir_all(dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(layer = %l.id, dir = %dir.display(), error = %e, "removing a snapshot layer's files");
            }
        }
        if l.kind == kind::GOLDEN {
            let _ = std::fs::remove_file(self.root.join(&l.id));
            if let Some(image_dir) = dir.parent() {
                // Only when empty: the image may have a newer golden snapshot.
                let _ = std::fs::remove_dir(image_dir);
            }
        }
    }

    /// Every layer with its holders and number of children, parents first.
    pub fn list(&self) -> Result<Vec<LayerInfo>> {
        let layers = self.store.layers()?;
        let mut holders: HashMap<String, Vec<String>> = HashMap::new();
        for (l, h) in self.store.layer_holds()? {
            holders.entry(l).or_default().push(h);
        }
        let mut children: HashMap<String, u32> = HashMap::new();
        for l in &layers {
            if !l.parent.is_empty() {
                *children.entry(l.parent.clone()).or_default() += 1;
            }
        }
        // Parents first: a layer is listed after its parent.
        let by_id: HashMap<String, LayerRow> =
            layers.iter().map(|l| (l.id.clone(), l.clone())).collect();
        let mut out = Vec::new();
        let mut listed = std::collections::HashSet::new();
        for l in &layers {
            let mut stack = vec![l.clone()];
            while let Some(top) = stack.last() {
                match by_id.get(&top.parent) {
                    Some(p) if !listed.contains(&p.id) && !stack.iter().any(|s| s.id == p.id) => {
                        stack.push(p.clone())
                    }
                    _ => break,
                }
            }
            while let Some(row) = stack.pop() {
                if listed.insert(row.id.clone()) {
                    out.push(LayerInfo {
                        holders: holders.remove(&row.id).unwrap_or_default(),
                        children: children.get(&row.id).copied().unwrap_or(0),
                        row,
                    });
                }
            }
        }
        Ok(out)
    }

    /// Checks the records against the files at start: golden snapshots of
    /// `images` not yet recorded are (held by their image); a layer whose
    /// files are gone is logged (whoever restores it fails, naming it);
    /// a directory in the store that no layer names (a crash between
    /// taking a snapshot in and recording it) is removed; golden links are
    /// made again; then whatever nothing holds is deleted.
    pub fn check_at_start(&self, images: &[ImageRow]) -> Result<()> {
        for image in images {
            self.golden(image)?;
        }
        let layers = self.store.layers()?;
        let known: std::collections::HashSet<&str> = layers.iter().map(|l| l.id.as_str()).collect();
        for l in &layers {
            if !Path::new(&l.dir).join("manifest").is_file() {
                tracing::error!(layer = %l.id, dir = %l.dir, "snapshot layer's files are missing; sessions that need it fail when restored");
            }
            if l.kind == kind::GOLDEN && Path::new(&l.dir).is_dir() {
                self.link_golden(l)?;
            }
        }
        if let Ok(entries) = std::fs::read_dir(&self.root) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if known.contains(name.as_str()) {
                    continue;
                }
                let path = e.path();
                tracing::warn!(dir = %path.display(), "removing a snapshot directory no layer names");
                let removed = match std::fs::symlink_metadata(&path) {
                    Ok(m) if m.is_dir() => std::fs::remove_dir_all(&path),
                    _ => std::fs::remove_file(&path),
                };
                if let Err(err) = removed {
                    tracing::warn!(dir = %path.display(), error = %err, "could not remove it");
                }
            }
        }
        let gone = self.collect(false)?;
        if !gone.is_empty() {
            tracing::info!(
                layers = gone.len(),
                "snapshot layers nothing holds deleted at start"
            );
        }
        Ok(())
    }

    /// Bytes of every layer sessions' vmms wrote (the quota's measure).
    pub fn session_bytes(&self) -> Result<u64> {
        self.store.snapshot_bytes(None)
    }

    /// Bytes of the layers session `id`'s vmm wrote that are still kept.
    pub fn bytes_of_session(&self, id: &str) -> Result<u64> {
        self.store.snapshot_bytes(Some(id))
    }
}
