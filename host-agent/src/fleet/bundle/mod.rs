//! A session paused to disk on its way to another node (MoveSession).
//!
//! The node the session leaves pushes its *bundle* under key
//! `session-<session id>` ([`key`]) with [`objects::push`]: the files of
//! every layer of its chain above the image's golden snapshot, as
//! `layers/<layer id>/<name>`, in chain order, and, for an image with a
//! root disk, the session's disk as `disk/disk.ext4`; the manifest's meta is
//! a [`SessionBundle`] (the session's settings, its chain, its audit records
//! and its last usage record). The image itself travels as an image push
//! (see [`super::images`]), whose meta names its golden layer, so the node
//! that pulls it records the golden snapshot under the same layer id and
//! the bottom diff of the chain resolves there.
//!
//! The node the bundle names ([`SessionBundle::to_node`]) reads the meta
//! first ([`Fleet::read_bundle`]: is it for this node, and this caller?),
//! then pulls it all ([`Fleet::pull_bundle`]), every chunk checked. After
//! the session is taken in nothing is deleted from the object store: the
//! bundle's manifest and chunks stay until the store is cleaned by other
//! means (a garbage collection of the store is not part of host-agent yet).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::images::ImageMeta;
use super::objects::{self, PushFile, PushStats};
use super::Fleet;
use crate::accounting::NetIo;
use crate::error::{Error, Result};
use crate::layers::{check_layer_id, kind, LayerRow};
use crate::sessions::Manager;
use crate::store::{AuditRow, ImageRow, SessionRow, UsageRow};

/// The bundle format this host-agent writes and reads.
pub const FORMAT: u32 = 1;

/// Folder of the layers' files in a bundle.
pub const LAYERS_DIR: &str = "layers";

/// Folder of the session's root disk in a bundle (`disk/disk.ext4`).
pub const DISK_DIR: &str = "disk";

/// Longest node name (as `fleet.node_name`).
const MAX_NODE_NAME: usize = 64;

/// The object store key of session `id`'s bundle.
pub fn key(session_id: &str) -> String {
    format!("session-{session_id}")
}

/// Checks MoveSession's `to_node`: 1..=64 of `[A-Za-z0-9_-]` (a node name)
/// and not `this` node's name.
pub fn check_to_node(to_node: &str, this: &str) -> Result<()> {
    if to_node.is_empty()
        || to_node.len() > MAX_NODE_NAME
        || !to_node
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
    {
        return Err(Error::invalid(format!(
            "to_node {to_node:?} must be a node name: 1 to {MAX_NODE_NAME} letters, digits, \
             '_' or '-'"
        )));
    }
    if to_node == this {
        return Err(Error::invalid(format!(
            "to_node {to_node:?} is this node; name the node the session should move to"
        )));
    }
    Ok(())
}

/// The manifest's meta of a session bundle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionBundle {
    /// [`FORMAT`].
    pub format: u32,
    /// The session.
    pub session: BundleSession,
    /// Its chain of snapshot layers, its base first: the bottom is the
    /// image's golden snapshot (not in the bundle's files: it comes with
    /// the image) or a full snapshot; each layer above is a diff over the
    /// one below. The top holds the session's memory.
    pub layers: Vec<BundleLayer>,
    /// The image's golden layer on the node that pushed the bundle.
    pub golden_layer: String,
    /// The node the session left.
    pub from_node: String,
    /// The node that may take it in.
    pub to_node: String,
    /// Whether its vmm ran jailed (the node taking it in must run jailed
    /// vmms too: the snapshot's device paths are the jail's).
    pub jailed: bool,
    /// Whether the bundle holds the session's root disk.
    pub disk: bool,
    /// Its audit records, in guest seq order, chained as they were.
    pub audit: Vec<BundleAudit>,
    /// Its last usage record on the node it left: the cumulative counters
    /// its next records continue (none: it was never metered).
    pub last_usage: Option<BundleUsage>,
    /// When it was pushed (Unix ms).
    pub moved_at: i64,
}

/// The fields of a session row that matter on the node taking it in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BundleSession {
    /// Session id.
    pub id: String,
    /// Its image.
    pub image_id: String,
    /// Its execution id when it was paused to disk.
    pub execution_id: String,
    /// The client that created it.
    pub owner: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// TTL seconds (0: none), counted from `created_at`.
    pub ttl_s: u64,
    /// Idle timeout seconds (0: none).
    pub idle_s: u64,
    /// Session branch (after a stop).
    pub branch: String,
    /// Its head commit.
    pub head_commit: String,
    /// Host repository served to guest-init.
    pub repository: String,
    /// Agent name for guest-init.
    pub agent: String,
    /// Base ref for guest-init.
    pub base_ref: String,
    /// Its size, encoded as recorded.
    pub resources: String,
    /// Its device rate limits, encoded as recorded.
    pub io_limits: String,
    /// Exec and Files calls resume it from disk.
    pub auto_resume: bool,
    /// The session it was forked from.
    pub parent_session: String,
    /// Creation time (Unix ms).
    pub created_at: i64,
    /// First READY (Unix ms).
    pub ready_at: i64,
    /// Its shares, encoded as recorded (its snapshot has their devices; the
    /// directories are checked against the taking node's roots at resume).
    /// Empty in a bundle from before shares.
    #[serde(default)]
    pub shares: String,
}

impl BundleSession {
    /// The fields of `row` that move.
    pub fn from_row(row: &SessionRow) -> BundleSession {
        BundleSession {
            id: row.id.clone(),
            image_id: row.image_id.clone(),
            execution_id: row.execution_id.clone(),
            owner: row.owner.clone(),
            labels: row.labels.clone(),
            ttl_s: row.ttl_s,
            idle_s: row.idle_s,
            branch: row.branch.clone(),
            head_commit: row.head_commit.clone(),
            repository: row.repository.clone(),
            agent: row.agent.clone(),
            base_ref: row.base_ref.clone(),
            resources: row.resources.clone(),
            io_limits: row.io_limits.clone(),
            auto_resume: row.auto_resume,
            parent_session: row.parent_session.clone(),
            created_at: row.created_at,
            ready_at: row.ready_at,
            shares: row.shares.clone(),
        }
    }

    /// The session's row on the node taking it in: PAUSED to disk in `dir`,
    /// jailed as `jail_uid` (0: unjailed), its memory in layer `base_layer`,
    /// with `state`, `reason` and `detail`.
    pub fn to_row(&self, dir: &Path, jail_uid: u32, base_layer: &str, now: i64) -> SessionRow {
        SessionRow {
            id: self.id.clone(),
            image_id: self.image_id.clone(),
            state: proto::hostagent::SessionState::Paused as i32,
            execution_id: self.execution_id.clone(),
            reason: crate::sessions::reason::MOVED.into(),
            detail: String::new(),
            created_at: self.created_at,
            ready_at: self.ready_at,
            ended_at: 0,
            vmm_pid: 0,
            vmm_start_ticks: 0,
            dir: dir.display().to_string(),
            ttl_s: self.ttl_s,
            idle_s: self.idle_s,
            labels: self.labels.clone(),
            branch: self.branch.clone(),
            head_commit: self.head_commit.clone(),
            // Its idle timeout counts from its arrival.
            last_activity: now,
            repository: self.repository.clone(),
            agent: self.agent.clone(),
            base_ref: self.base_ref.clone(),
            owner: self.owner.clone(),
            jail_uid,
            io_limits: self.io_limits.clone(),
            // Without a network (sessions with one do not move).
            vm_addresses: String::new(),
            resources: self.resources.clone(),
            base_layer: base_layer.into(),
            persisted: true,
            auto_resume: self.auto_resume,
            parent_session: self.parent_session.clone(),
            shares: self.shares.clone(),
            fs_daemons: String::new(),
        }
    }
}

/// One layer of a bundle's chain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BundleLayer {
    /// Its id (its directory name; the manifest of the layer above names it).
    pub id: String,
    /// One of [`kind`].
    pub kind: String,
    /// The layer below (empty for the bottom).
    pub parent: String,
    /// The session whose vmm wrote it.
    pub owner_session: String,
    /// When it was written (Unix ms).
    pub created_at: i64,
}

/// One audit record, as stored on the node the session left.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BundleAudit {
    /// The guest's seq.
    pub guest_seq: u64,
    /// The JSON line.
    pub json: String,
    /// sha256(previous host_hash || json), hex.
    pub host_hash: String,
    /// When it was received (Unix ms).
    pub received_at: i64,
}

/// A usage record's cumulative counters (see [`UsageRow`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BundleUsage {
    /// Its execution id.
    pub execution_id: String,
    /// Interval start (Unix ms).
    pub interval_start: i64,
    /// Interval end (Unix ms): where the next record starts.
    pub interval_end: i64,
    /// Cumulative billed milliseconds.
    pub billed_ms: i64,
    /// Cumulative vCPU nanoseconds.
    pub vcpu_ns: u64,
    /// Cumulative GiB x ms at allocated size.
    pub mem_alloc_gib_ms: f64,
    /// Cumulative GiB x ms at resident size.
    pub mem_resident_gib_ms: f64,
    /// Cumulative snapshot storage, GiB x ms.
    pub snapshot_gib_ms: f64,
    /// Cumulative disk bytes written.
    pub disk_bytes: u64,
    /// Cumulative bytes delivered to the guest.
    pub net_rx_bytes: u64,
    /// Cumulative frames delivered to the guest.
    pub net_rx_packets: u64,
    /// Cumulative bytes the guest sent.
    pub net_tx_bytes: u64,
    /// Cumulative frames the guest sent.
    pub net_tx_packets: u64,
    /// Cumulative guest packets the egress rules dropped.
    pub net_denied_packets: u64,
    /// Cumulative DNS queries refused.
    pub dns_denied: u64,
}

impl BundleUsage {
    /// The counters of `u`.
    pub fn from_row(u: &UsageRow) -> BundleUsage {
        BundleUsage {
            execution_id: u.execution_id.clone(),
            interval_start: u.interval_start,
            interval_end: u.interval_end,
            billed_ms: u.billed_ms,
            vcpu_ns: u.vcpu_ns,
            mem_alloc_gib_ms: u.mem_alloc_gib_ms,
            mem_resident_gib_ms: u.mem_resident_gib_ms,
            snapshot_gib_ms: u.snapshot_gib_ms,
            disk_bytes: u.disk_bytes,
            net_rx_bytes: u.net.rx_bytes,
            net_rx_packets: u.net.rx_packets,
            net_tx_bytes: u.net.tx_bytes,
            net_tx_packets: u.net.tx_packets,
            net_denied_packets: u.net.denied_packets,
            dns_denied: u.net.dns_denied,
        }
    }

    /// The record of session `session_id` on the node taking it in (not
    /// final; the raw process readings are not kept: its next vmm is a new
    /// process, whose first reading is a baseline).
    pub fn to_row(&self, session_id: &str) -> UsageRow {
        UsageRow {
            seq: 0,
            session_id: session_id.into(),
            execution_id: self.execution_id.clone(),
            interval_start: self.interval_start,
            interval_end: self.interval_end,
            billed_ms: self.billed_ms,
            vcpu_ns: self.vcpu_ns,
            mem_alloc_gib_ms: self.mem_alloc_gib_ms,
            mem_resident_gib_ms: self.mem_resident_gib_ms,
            snapshot_gib_ms: self.snapshot_gib_ms,
            disk_bytes: self.disk_bytes,
            is_final: false,
            raw_cpu_ns: 0,
            raw_disk: 0,
            net: NetIo {
                rx_bytes: self.net_rx_bytes,
                rx_packets: self.net_rx_packets,
                tx_bytes: self.net_tx_bytes,
                tx_packets: self.net_tx_packets,
                denied_packets: self.net_denied_packets,
                dns_denied: self.dns_denied,
            },
        }
    }
}

impl SessionBundle {
    /// Checks a bundle read from the object store for session `id` (it is
    /// untrusted input): its format, ids and names, a chain whose layers
    /// each sit on the one below, and an audit chain whose hashes hold.
    /// A bundle that fails is [`Error::Corrupt`] (DATA_LOSS).
    pub fn check(&self, id: &str) -> Result<()> {
        let bad = |why: String| Error::Corrupt(format!("the bundle of session {id}: {why}"));
        if self.format != FORMAT {
            return Err(bad(format!(
                "format {} (this host-agent reads format {FORMAT})",
                self.format
            )));
        }
        if self.session.id != id {
            return Err(bad(format!("it describes session {:?}", self.session.id)));
        }
        crate::images::valid_id(&self.session.image_id).map_err(|e| bad(e.to_string()))?;
        if self.session.owner.is_empty() || self.session.execution_id.is_empty() {
            return Err(bad("it names no owner or execution id".into()));
        }
        for node in [&self.from_node, &self.to_node] {
            check_to_node(node, "").map_err(|e| bad(e.to_string()))?;
        }
        crate::io_limits::IoLimits::decode(&self.session.io_limits)
            .map_err(|e| bad(format!("its io_limits: {e}")))?;
        let Some(top) = self.layers.last() else {
            return Err(bad("its chain has no layer".into()));
        };
        if top.kind == kind::GOLDEN {
            return Err(bad(
                "its chain has no layer above the golden snapshot".into()
            ));
        }
        if self.layers.len() > crate::layers::VMM_MAX_CHAIN {
            return Err(bad(format!("its chain has {} layers", self.layers.len())));
        }
        let mut below = "";
        for (i, l) in self.layers.iter().enumerate() {
            check_layer_id(&l.id).map_err(|e| bad(e.to_string()))?;
            let known = [kind::GOLDEN, kind::PAUSE, kind::FORK, kind::SNAPSHOT];
            if !known.contains(&l.kind.as_str()) || (l.kind == kind::GOLDEN && i > 0) {
                return Err(bad(format!("layer {} is of kind {:?}", l.id, l.kind)));
            }
            if l.parent != below {
                return Err(bad(format!(
                    "layer {} names parent {:?}, not the layer below it ({below:?})",
                    l.id, l.parent
                )));
            }
            below = &l.id;
        }
        if self.layers[0].kind == kind::GOLDEN && self.layers[0].id != self.golden_layer {
            return Err(bad(format!(
                "its chain starts at golden layer {} but it names golden layer {}",
                self.layers[0].id, self.golden_layer
            )));
        }
        let mut prev = String::new();
        for (i, a) in self.audit.iter().enumerate() {
            if a.guest_seq != i as u64 + 1 {
                return Err(bad(format!(
                    "audit record {} has guest seq {}",
                    i + 1,
                    a.guest_seq
                )));
            }
            let mut h = Sha256::new();
            h.update(prev.as_bytes());
            h.update(a.json.as_bytes());
            let hash = hex::encode(h.finalize());
            if hash != a.host_hash {
                return Err(bad(format!(
                    "audit record {} does not chain (its host_hash is not sha256 of the \
                     previous hash and its JSON)",
                    a.guest_seq
                )));
            }
            prev = hash;
        }
        Ok(())
    }

    /// The layers in the bundle's files: the chain above the golden
    /// snapshot, bottom first.
    pub fn moved_layers(&self) -> &[BundleLayer] {
        match self.layers.first() {
            Some(l) if l.kind == kind::GOLDEN => &self.layers[1..],
            _ => &self.layers,
        }
    }

    /// Its audit records as rows of session `id`.
    pub fn audit_rows(&self, id: &str) -> Vec<AuditRow> {
        self.audit
            .iter()
            .map(|a| AuditRow {
                session_id: id.into(),
                guest_seq: a.guest_seq,
                json: a.json.clone(),
                host_hash: a.host_hash.clone(),
                received_at: a.received_at,
            })
            .collect()
    }
}

/// `audit` as a bundle holds it.
pub fn bundle_audit(audit: &[AuditRow]) -> Vec<BundleAudit> {
    audit
        .iter()
        .map(|a| BundleAudit {
            guest_seq: a.guest_seq,
            json: a.json.clone(),
            host_hash: a.host_hash.clone(),
            received_at: a.received_at,
        })
        .collect()
}

/// `chain` as a bundle lists it.
pub fn bundle_layers(chain: &[LayerRow]) -> Vec<BundleLayer> {
    chain
        .iter()
        .map(|l| BundleLayer {
            id: l.id.clone(),
            kind: l.kind.clone(),
            parent: l.parent.clone(),
            owner_session: l.owner_session.clone(),
            created_at: l.created_at,
        })
        .collect()
}

/// Where the files of layer `id` lie in a bundle pulled into `dir`.
pub fn layer_files(dir: &Path, id: &str) -> PathBuf {
    dir.join(LAYERS_DIR).join(id)
}

/// Where the session's disk lies in a bundle pulled into `dir`.
pub fn disk_file(dir: &Path) -> PathBuf {
    dir.join(DISK_DIR).join(crate::launch::VM_DISK)
}

/// The files a bundle of `chain` pushes: every regular file of each layer
/// above the golden snapshot, `layers/<id>/<name>`, layer by layer from
/// the bottom, and the session's root disk `disk` (a file in the stopped
/// vmm's run directory: refused unless it is a plain file with one link,
/// so nothing a vmm planted there is pushed in its place).
pub fn files(chain: &[LayerRow], disk: Option<&Path>) -> Result<Vec<PushFile>> {
    let mut out = Vec::new();
    for l in chain.iter().filter(|l| l.kind != kind::GOLDEN) {
        let dir = Path::new(&l.dir);
        let entries = std::fs::read_dir(dir)
            .map_err(|e| Error::io(format!("reading snapshot layer {}", dir.display()), e))?;
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry
                .map_err(|e| Error::io(format!("reading snapshot layer {}", dir.display()), e))?;
            let ty = entry
                .file_type()
                .map_err(|e| Error::io(format!("reading {}", entry.path().display()), e))?;
            if let (true, Some(name)) = (ty.is_file(), entry.file_name().to_str()) {
                names.push(name.to_string());
            }
        }
        names.sort();
        out.extend(names.into_iter().map(|name| PushFile {
            name: format!("{LAYERS_DIR}/{}/{name}", l.id),
            path: dir.join(name),
        }));
    }
    if let Some(disk) = disk {
        let meta = std::fs::symlink_metadata(disk)
            .map_err(|e| Error::io(format!("reading the session's disk {}", disk.display()), e))?;
        if !meta.is_file() || meta.nlink() != 1 {
            return Err(Error::FailedPrecondition(format!(
                "the session's disk {} is not a plain file with one link; it is not moved",
                disk.display()
            )));
        }
        out.push(PushFile {
            name: format!("{DISK_DIR}/{}", crate::launch::VM_DISK),
            path: disk.to_path_buf(),
        });
    }
    Ok(out)
}

/// Parses a bundle's meta.
fn parse(meta: serde_json::Value, id: &str) -> Result<SessionBundle> {
    serde_json::from_value(meta).map_err(|e| {
        Error::Corrupt(format!(
            "the bundle of session {id} does not parse as a session bundle: {e}"
        ))
    })
}

impl Fleet {
    /// The bundle of session `id` in the image store (its manifest only, not
    /// checked yet), or `None` when none was pushed.
    pub async fn read_bundle(&self, id: &str) -> Result<Option<SessionBundle>> {
        let store = self.image_store().await?;
        match objects::meta(store.as_ref(), &key(id)).await? {
            Some(meta) => parse(meta, id).map(Some),
            None => Ok(None),
        }
    }

    /// Pulls the bundle of session `id` into the new directory `dest`
    /// (every chunk checked: a damaged one is DATA_LOSS and nothing is left
    /// at `dest`); returns its meta.
    pub async fn pull_bundle(&self, id: &str, dest: &Path) -> Result<SessionBundle> {
        let store = self.image_store().await?;
        let pulled = objects::pull(store.as_ref(), &key(id), dest).await?;
        let bundle = parse(pulled.meta, id);
        if bundle.is_err() {
            let _ = std::fs::remove_dir_all(dest);
        }
        bundle
    }

    /// Pushes `bundle` of a session with `files`.
    pub async fn push_bundle(
        &self,
        bundle: &SessionBundle,
        files: &[PushFile],
    ) -> Result<PushStats> {
        let store = self.image_store().await?;
        let id = &bundle.session.id;
        let meta = serde_json::to_value(bundle)
            .map_err(|e| Error::Fleet(format!("encoding the bundle of session {id}: {e}")))?;
        let s = objects::push(store.as_ref(), &key(id), meta, files).await?;
        tracing::info!(
            session = %id, to = %bundle.to_node, store = %store.describe(), files = s.files,
            bytes = s.bytes, uploaded = s.bytes_uploaded, "session bundle pushed"
        );
        Ok(s)
    }

    /// Makes sure the image store holds `image` with golden layer `golden`
    /// (this node's), so the node a session moves to restores the same
    /// golden snapshot its chain names: pushed when the store lacks it, or
    /// when this node's own earlier push names another golden layer (a
    /// golden snapshot built again, a push from before moves). An image of
    /// that id pushed by another node with another golden snapshot is
    /// FAILED_PRECONDITION: the session could not resume from it.
    pub async fn ensure_image_pushed(
        &self,
        mgr: &Manager,
        image: &ImageRow,
        golden: &str,
    ) -> Result<()> {
        let store = self.image_store().await?;
        let stored = match objects::meta(store.as_ref(), &image.id).await? {
            None => None,
            Some(v) => Some(serde_json::from_value::<ImageMeta>(v).map_err(|e| {
                Error::Corrupt(format!(
                    "image {}'s manifest in {}: {e}",
                    image.id,
                    store.describe()
                ))
            })?),
        };
        match stored {
            Some(m) if m.golden_layer == golden => return Ok(()),
            Some(m) if m.pushed_by != self.node => {
                return Err(Error::FailedPrecondition(format!(
                    "image {} in {} was pushed by node {} with golden snapshot layer {:?}, and \
                     the session's chain is over this node's golden snapshot layer {golden}: \
                     the other node could not resume it. Push this node's image (PushImage) \
                     if it should replace that one, then move the session again",
                    image.id,
                    store.describe(),
                    m.pushed_by,
                    m.golden_layer
                )))
            }
            _ => {}
        }
        self.push_image(mgr, &image.id).await.map(|_| ())
    }
}

#[cfg(test)]
mod tests;
