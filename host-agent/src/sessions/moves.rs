//! A session paused to disk moving to another node (MoveSession), and the
//! node it moves to taking it in on its first ResumeSession of the id. What
//! travels, and how, is [`crate::fleet::bundle`]'s.
//!
//! The session leaves as it is on disk: its chain of snapshot layers above
//! the image's golden snapshot, its root disk, its audit chain and its
//! cumulative usage counters. It arrives PAUSED to disk with the same id
//! and execution id, and is resumed from disk as any session paused to
//! disk is (a new execution id). Sessions with a network do not move: their
//! namespace, policy, addresses and exposed ports are the node's.

use super::*;
use crate::auth::Caller;
use crate::fleet::bundle::{self, BundleSession, BundleUsage, SessionBundle};
use crate::fleet::Fleet;
use crate::layers::{kind, session_holder, MovedLayer};
use crate::store::EVENT_SESSION;

impl Manager {
    /// Moves session `id`, PAUSED to disk, to node `to_node` through
    /// `fleet`'s image store: its image is pushed first when the store
    /// lacks it (or holds this node's own earlier push of another golden
    /// snapshot), then its bundle. Once the bundle is complete the session
    /// is STOPPED here (reason `moved`, detail `moved to node <to_node>`),
    /// with no final usage record: billing continues on `to_node`, from the
    /// counters the bundle carries. Its layers are let go (deleted unless a
    /// fork or an image still needs them) and its directory removed. Any
    /// failure before the bundle is complete leaves it PAUSED here as it
    /// was. A move already done (a retried call) returns the session.
    pub async fn move_out(&self, fleet: &Fleet, id: &str, to_node: &str) -> Result<SessionRow> {
        bundle::check_to_node(to_node, &fleet.node)?;
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let row = sess.row();
        let detail = format!("moved to node {to_node}");
        if row.state == S::Stopped as i32 && row.reason == reason::MOVED && row.detail == detail {
            return Ok(row);
        }
        if row.state != S::Paused as i32 || !row.persisted {
            let how = if row.state == S::Paused as i32 {
                " (in memory)"
            } else {
                ""
            };
            return Err(Error::FailedPrecondition(format!(
                "session {id} is {}{how}; pause it to disk first (PauseSession persist)",
                state_name(row.state)
            )));
        }
        let image = self.store.image(&row.image_id)?.ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "session {id}'s image {} is not registered on this node any more",
                row.image_id
            ))
        })?;
        if has_network(&image) {
            return Err(Error::FailedPrecondition(format!(
                "session {id}'s image {} has a network device: sessions with a network do not \
                 move to another node (their network namespace, policy and exposed ports are \
                 this node's)",
                image.id
            )));
        }
        if row.base_layer.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "session {id} was paused to disk before snapshot layers were recorded; resume \
                 it and pause it to disk again to move it"
            )));
        }
        let chain = self.layers.chain(&row.base_layer)?;
        let golden = self
            .layers
            .golden(&image)?
            .map(|l| l.id)
            .unwrap_or_default();
        if let Some(bottom) = chain.first().filter(|l| l.kind == kind::GOLDEN) {
            if bottom.id != golden {
                return Err(Error::FailedPrecondition(format!(
                    "session {id} descends from an earlier golden snapshot of image {} (layer \
                     {}; the image's is now {golden}): only sessions over the image's current \
                     golden snapshot move",
                    image.id, bottom.id
                )));
            }
        }
        let jailed = row.jail_uid != 0;
        let disk = (!image.rootfs.is_empty()).then(|| {
            supervisor::run_dirs(Path::new(&row.dir), jailed)
                .0
                .join(VM_DISK)
        });
        let files = bundle::files(&chain, disk.as_deref())?;
        if files.len() > crate::fleet::objects::MAX_FILES {
            return Err(Error::FailedPrecondition(format!(
                "session {id}'s {} snapshot layers hold {} files, more than the {} one move \
                 carries; resume it, take a full snapshot (SnapshotSession) and pause it to \
                 disk again to move it",
                chain.len(),
                files.len(),
                crate::fleet::objects::MAX_FILES
            )));
        }
        fleet.ensure_image_pushed(self, &image, &golden).await?;

        // The meter comes out for the move: no usage record is written
        // meanwhile (none is for a session without one), so the record
        // written here is the session's last on this node, and the one the
        // bundle carries. It goes back if the move fails.
        let now = now_ms();
        let snapshot_bytes = self.layers.bytes_of_session(id)?;
        let taken = sess.lock().meter.take();
        let put_back = |m: Option<Meter>| {
            if let Some(m) = m {
                sess.lock().meter = Some(m);
            }
        };
        let (meter, last_usage) = match taken {
            Some(mut m) => {
                m.set_snapshot_bytes(now, snapshot_bytes);
                let r = m.record(now, None);
                if let Err(e) = self.store.insert_usage(&r) {
                    put_back(Some(m));
                    return Err(e);
                }
                (Some(m), Some(r))
            }
            None => (None, self.store.last_usage(id)?),
        };
        let pushed = async {
            let b = SessionBundle {
                format: bundle::FORMAT,
                session: BundleSession::from_row(&row),
                layers: bundle::bundle_layers(&chain),
                golden_layer: golden.clone(),
                from_node: fleet.node.clone(),
                to_node: to_node.to_string(),
                jailed,
                disk: disk.is_some(),
                audit: bundle::bundle_audit(&self.store.audit_since(id, 0)?),
                last_usage: last_usage.as_ref().map(BundleUsage::from_row),
                moved_at: now,
            };
            fleet.push_bundle(&b, &files).await
        }
        .await;
        if let Err(e) = pushed {
            put_back(meter);
            return Err(e);
        }
        // The session is `to_node`'s from here. Its meter stays out, so the
        // STOPPED below writes no final usage record: billing continues on
        // `to_node` from the counters of the record the bundle carries.
        drop(meter);
        let stopped = self
            .transition(&sess, S::Stopping, reason::MOVED, &detail)
            .and_then(|()| self.transition(&sess, S::Stopped, reason::MOVED, &detail));
        if let Err(e) = stopped {
            tracing::error!(
                session = %id, to = %to_node, error = %e,
                "the session's bundle is pushed but its move is not recorded here; do not \
                 resume it on both nodes"
            );
            return Err(e);
        }
        // Its layers were let go with the STOPPED transition; its files go.
        if let Err(e) = std::fs::remove_dir_all(&row.dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(session = %id, dir = %row.dir, error = %e, "removing the moved session's directory");
            }
        }
        tracing::info!(session = %id, to = %to_node, layers = chain.len(), "session moved to another node");
        Ok(sess.row())
    }

    /// Takes in session `id` when it was moved to this node: with an image
    /// store, a bundle of `id` in it whose `to_node` is this node and whose
    /// session `caller` owns. The image is pulled when this node lacks it;
    /// its golden snapshot must be the one the session's chain is over. The
    /// bundle is pulled (a damaged one is DATA_LOSS, and nothing is
    /// recorded), its layers taken into the layer store under their ids,
    /// its disk put in the session's new directory, and the session
    /// recorded PAUSED to disk with its id, execution id, audit records and
    /// last usage record, with an event (reason `moved`, detail `moved from
    /// node <from>`). Nothing is deleted from the object store. Returns
    /// whether this node has the session now; `false` (no bundle for this
    /// node and caller) is for the caller to answer as an unknown session.
    pub async fn move_in(&self, fleet: &Fleet, caller: &Caller, id: &str) -> Result<bool> {
        // Only what can be a session id names a bundle.
        let plausible = !id.is_empty()
            && id.len() <= 64
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'));
        if !plausible || !fleet.has_image_store() {
            return Ok(false);
        }
        let Some(b) = fleet.read_bundle(id).await? else {
            return Ok(false);
        };
        if b.to_node != fleet.node || !caller.owns(&b.session.owner) {
            return Ok(false);
        }
        b.check(id)?;
        let _one = fleet.move_lock.lock().await;
        if self.session(id).is_ok() {
            // Taken in by a call that held the lock first.
            return Ok(true);
        }
        if b.jailed != self.cfg.jailed() {
            let how = |jailed: bool| if jailed { "jailed" } else { "unjailed" };
            return Err(Error::FailedPrecondition(format!(
                "session {id} ran in a {} vmm on node {} and this node runs vmms {}: its \
                 snapshot restores only on a node with the same jail setting",
                how(b.jailed),
                b.from_node,
                how(self.cfg.jailed())
            )));
        }
        if self.live_count() >= self.cfg.max_sessions as usize {
            return Err(Error::ResourceExhausted(format!(
                "node is at its limit of {} live sessions; stop or delete one first, then \
                 resume session {id} again",
                self.cfg.max_sessions
            )));
        }
        let image = fleet.image_or_pull(self, &b.session.image_id).await?;
        if has_network(&image) {
            return Err(Error::FailedPrecondition(format!(
                "image {} has a network device here: session {id} moved without one cannot \
                 resume on it",
                image.id
            )));
        }
        if image.guest_init
            && !Path::new(&b.session.repository).join(".git").exists()
            && !Path::new(&b.session.repository).join("HEAD").exists()
        {
            return Err(Error::FailedPrecondition(format!(
                "session {id} works on repository {:?}, which is not a git repository on this \
                 node; make it one (a clone of the repository on node {}) and resume again",
                b.session.repository, b.from_node
            )));
        }
        let golden = self
            .layers
            .golden(&image)?
            .map(|l| l.id)
            .unwrap_or_default();
        if let Some(bottom) = b.layers.first().filter(|l| l.kind == kind::GOLDEN) {
            if bottom.id != golden {
                return Err(Error::FailedPrecondition(format!(
                    "session {id}'s snapshot chain is over golden snapshot layer {} of image \
                     {}, but the image here has a different golden snapshot (layer {}): it \
                     cannot resume on it. Delete image {} on this node so that the image node \
                     {} pushed is pulled, then resume again",
                    bottom.id,
                    image.id,
                    if golden.is_empty() { "none" } else { &golden },
                    image.id,
                    b.from_node
                )));
            }
        }
        if b.disk == image.rootfs.is_empty() {
            return Err(Error::Corrupt(format!(
                "the bundle of session {id} {} a root disk, and image {} {} one",
                if b.disk { "holds" } else { "lacks" },
                image.id,
                if image.rootfs.is_empty() {
                    "has no"
                } else {
                    "has"
                }
            )));
        }
        // In the layer store: a directory no layer names is removed at start.
        let incoming = self.layers.root().join(format!(".incoming-{id}"));
        let _ = std::fs::remove_dir_all(&incoming);
        let pulled = fleet.pull_bundle(id, &incoming).await?;
        let taken = if pulled != b {
            Err(Error::Fleet(format!(
                "session {id}'s bundle was pushed again while it was pulled; resume it again"
            )))
        } else {
            self.take_in_moved(&b, &incoming, image)
        };
        if let Err(e) = std::fs::remove_dir_all(&incoming) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(dir = %incoming.display(), error = %e, "removing a pulled session bundle");
            }
        }
        taken.map(|()| true)
    }

    /// Records session bundle `b`, pulled into `incoming`, as a session of
    /// this node PAUSED to disk (see [`Manager::move_in`]). On failure
    /// nothing is recorded and nothing of it is left.
    fn take_in_moved(&self, b: &SessionBundle, incoming: &Path, image: ImageRow) -> Result<()> {
        let id = b.session.id.as_str();
        let dir = PathBuf::from(self.session_dir(id));
        // A directory without a session: an earlier try that failed.
        if std::fs::symlink_metadata(&dir).is_ok() {
            std::fs::remove_dir_all(&dir)
                .map_err(|e| Error::io(format!("removing {}", dir.display()), e))?;
        }
        let uid = self.allocate_jail_uid()?;
        let holder = session_holder(id);
        let files: Vec<PathBuf> = b
            .moved_layers()
            .iter()
            .map(|l| bundle::layer_files(incoming, &l.id))
            .collect();
        let moved: Vec<MovedLayer<'_>> = b
            .moved_layers()
            .iter()
            .zip(&files)
            .map(|(l, files)| MovedLayer {
                id: &l.id,
                kind: &l.kind,
                parent: &l.parent,
                owner_session: &l.owner_session,
                created_at: l.created_at,
                files,
            })
            .collect();
        let rows = match self.layers.take_in(&moved, &holder) {
            Ok(rows) => rows,
            Err(e) => {
                if let Some(u) = uid {
                    self.jail_uids.release(u);
                }
                return Err(e);
            }
        };
        let undo = |e: Error| -> Error {
            if let Some(u) = uid {
                self.jail_uids.release(u);
            }
            if let Err(r) = self.layers.release(None, &holder) {
                tracing::warn!(session = %id, error = %r, "letting go of the moved session's layers");
            }
            let _ = std::fs::remove_dir_all(&dir);
            e
        };
        let Some(top) = rows.last() else {
            // `check` refuses a chain with nothing above the golden snapshot.
            return Err(undo(Error::Corrupt(format!(
                "the bundle of session {id} holds no snapshot layer"
            ))));
        };
        if b.disk {
            let run = supervisor::run_dirs(&dir, uid.is_some()).0;
            let disk = run.join(VM_DISK);
            let placed = std::fs::create_dir_all(&run)
                .and_then(|()| std::fs::rename(bundle::disk_file(incoming), &disk))
                .and_then(|()| match uid {
                    Some(u) => std::os::unix::fs::chown(&disk, Some(u), Some(u)),
                    None => Ok(()),
                });
            if let Err(e) = placed {
                return Err(undo(Error::io(
                    format!("putting the moved session's disk at {}", disk.display()),
                    e,
                )));
            }
        }
        let now = now_ms();
        let detail = format!("moved from node {}", b.from_node);
        let mut row = b.session.to_row(&dir, uid.unwrap_or(0), &top.id, now);
        row.detail = detail.clone();
        let usage = b.last_usage.as_ref().map(|u| u.to_row(id));
        let ev = EventRow {
            seq: 0,
            session_id: id.to_string(),
            execution_id: row.execution_id.clone(),
            at: now,
            from: S::Paused as i32,
            to: S::Paused as i32,
            reason: reason::MOVED.into(),
            detail,
            kind: EVENT_SESSION.into(),
            ..Default::default()
        };
        let seq = self
            .store
            .insert_moved_session(&row, &ev, &b.audit_rows(id), usage.as_ref())
            .map_err(undo)?;
        // Its VMs run with its own limits, as on the node it left.
        let image = ImageRow {
            io_limits: row.io_limits.clone(),
            ..image
        };
        let mem_mib = image.mem_mib;
        let sess = self.insert_session(row, image);
        // Its next records continue the cumulative counters (as after a
        // restart of host-agent: see `recover_one`); not billed while PAUSED.
        sess.lock().meter = usage
            .as_ref()
            .map(|u| Meter::resume_from(u, mem_mib, false));
        self.events.committed(seq);
        tracing::info!(session = %id, from = %b.from_node, layers = rows.len(), "session moved here");
        Ok(())
    }
}
