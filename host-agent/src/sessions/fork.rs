//! ForkSession: new sessions restored from a snapshot layer of a running
//! (or paused) session, each with its own disk copy, id, execution id,
//! network and audit chain; the guest becomes each of them on
//! ForkSession. Sessions of an image made from a session's snapshot start
//! the same way.

use super::*;
use crate::layers::{kind, session_holder, LayerRow};
use proto::guest::ForkSession as GForkSession;

/// Where a fork's guest comes from: the session whose snapshot it restores
/// and that session's last audit event the host held then.
#[derive(Debug, Clone, Default)]
pub struct ForkOrigin {
    /// The session the snapshot is of.
    pub parent_session_id: String,
    /// Its last audit event's seq (0: none).
    pub parent_audit_seq: u64,
    /// The guest's hash of that event (empty: none).
    pub parent_audit_hash: String,
}

/// Most sessions one ForkSession makes.
pub const MAX_FORK_COUNT: u32 = 64;

impl Manager {
    /// The origin of forks of session `id` as its audit records stand now.
    pub(super) fn fork_origin(&self, id: &str) -> Result<ForkOrigin> {
        let last = self.store.last_audit(id)?;
        Ok(ForkOrigin {
            parent_session_id: id.to_string(),
            parent_audit_seq: last.as_ref().map_or(0, |a| a.guest_seq),
            parent_audit_hash: last
                .and_then(|a| serde_json::from_str::<serde_json::Value>(&a.json).ok())
                .and_then(|v| v.get("hash").and_then(|h| h.as_str()).map(str::to_string))
                .unwrap_or_default(),
        })
    }

    /// Opens the guest channel of a fork and makes its guest the session:
    /// ForkSession (instead of StartSession), then waits for Ready.
    pub(super) async fn fork_guest(
        &self,
        sess: &Session,
        origin: &ForkOrigin,
    ) -> Result<GuestConn> {
        let timeout = Duration::from_secs(self.cfg.guest_ready_timeout_seconds);
        let conn = self.connect_guest(sess, timeout).await?;
        conn.send(In::ForkSession(GForkSession {
            session_id: sess.id.clone(),
            parent_session_id: origin.parent_session_id.clone(),
            parent_audit_seq: origin.parent_audit_seq,
            parent_audit_hash: origin.parent_audit_hash.clone(),
            host_time_unix_ns: super::channel::unix_now_ns(),
            entropy: super::channel::fresh_entropy()?,
        }))
        .await?;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match conn.next_control_before(deadline).await?.kind {
                Some(Out::Ready(_)) => return Ok(conn),
                Some(Out::Error(e)) => {
                    return Err(Error::Guest(format!(
                        "guest-init refused to become fork {} of session {}: {}",
                        sess.id, origin.parent_session_id, e.message
                    )))
                }
                _ => continue,
            }
        }
    }

    /// Makes `count` sessions from session `id` (see ForkSession): checks
    /// the node's limits for all of them first, takes the fork's snapshot
    /// layer (with a copy of the disk) while the source is paused, resumes
    /// the source, then restores each new session from the layer. Returns
    /// the source and the new sessions (one that failed to start is FAILED,
    /// with why; all failing is an error).
    pub async fn fork(
        self: &Arc<Self>,
        id: &str,
        count: u32,
        labels: Option<BTreeMap<String, String>>,
        owner: &str,
    ) -> Result<(SessionRow, Vec<SessionRow>)> {
        if !(1..=MAX_FORK_COUNT).contains(&count) {
            return Err(Error::invalid(format!(
                "count {count} is out of range 1..={MAX_FORK_COUNT}"
            )));
        }
        let src = self.session(id)?;
        let children = {
            let _op = src.op.lock().await;
            let row = src.row();
            let image = src.lock().image.clone();
            let state = row.state;
            if state != S::Running as i32 && state != S::Ready as i32 && state != S::Paused as i32 {
                return Err(Error::FailedPrecondition(format!(
                    "session {id} is {}; only a RUNNING or PAUSED session can be forked",
                    state_name(state)
                )));
            }
            self.check_fork_room(&row, &image, count, !row.persisted)?;
            let layer = self.fork_layer(&src, &row, &image).await?;
            let origin = self.fork_origin(id)?;
            let chain = self.layers.chain(&layer.id)?;
            self.insert_forks(&row, &image, &chain, &origin, count, labels, owner)
                .await?
        };
        let mut set = tokio::task::JoinSet::new();
        for (sess, image) in children {
            let mgr = self.clone();
            set.spawn(async move {
                let _op = sess.op.lock().await;
                let started = mgr.start(&sess, &image, false).await;
                sess.lock().fork_of = None;
                (sess.row(), started)
            });
        }
        let mut made = Vec::new();
        let mut first_error = None;
        while let Some(done) = set.join_next().await {
            match done {
                Ok((row, started)) => {
                    if let Err(e) = started {
                        tracing::warn!(session = %row.id, parent = %id, error = %e, "a fork failed to start");
                        first_error.get_or_insert(e);
                    }
                    made.push(row);
                }
                Err(e) => tracing::error!(parent = %id, error = %e, "a fork's task failed"),
            }
        }
        made.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        if made.iter().all(|r| r.state == S::Failed as i32) {
            if let Some(e) = first_error {
                return Err(e);
            }
        }
        Ok((src.row(), made))
    }

    /// Refuses a fork of `count` that the node's session, memory or
    /// snapshot limits would not take.
    /// `snapshot`: the fork still has its snapshot to write.
    fn check_fork_room(
        &self,
        row: &SessionRow,
        image: &ImageRow,
        count: u32,
        snapshot: bool,
    ) -> Result<()> {
        let live = self.live_count();
        if live + count as usize > self.cfg.max_sessions as usize {
            return Err(Error::ResourceExhausted(format!(
                "node is at {live} of its {} live sessions; a fork of {count} does not fit",
                self.cfg.max_sessions
            )));
        }
        let mem = resources::Resources::decode(&row.resources).map_or(image.mem_mib, |s| s.mem_mib);
        let (_, mem_used) = self.used_resources();
        let mem_limit = self.memory_limit_mib();
        let need = u64::from(mem) * u64::from(count);
        if mem_limit > 0 && mem_used + need > mem_limit {
            return Err(Error::ResourceExhausted(format!(
                "node memory: {mem_used} MiB of {mem_limit} MiB are committed to live sessions; \
                 a fork of {count} needs {need} MiB more"
            )));
        }
        if snapshot {
            self.check_snapshot_room("a fork needs a snapshot")?;
        }
        Ok(())
    }

    /// The layer forks of `src` restore, with the disk that goes with it: a
    /// diff written now while the source is paused (it resumes after), or,
    /// for a session paused to disk, the layer it is kept in.
    pub(super) async fn fork_layer(
        &self,
        src: &Session,
        row: &SessionRow,
        image: &ImageRow,
    ) -> Result<LayerRow> {
        let has_disk = !image.rootfs.is_empty();
        if row.persisted {
            let layer = self.layers.get(&row.base_layer)?;
            let kept = Path::new(&layer.dir).join(crate::launch::GOLDEN_DISK);
            if has_disk && !kept.exists() {
                // No vmm runs: the disk is as the layer's memory left it.
                let run = supervisor::run_dirs(Path::new(&row.dir), row.jail_uid != 0).0;
                copy_disk(&run.join(VM_DISK), &kept, None).await?;
                self.layers.grew(&layer.id)?;
            }
            return Ok(layer);
        }
        let vmm = src
            .vmm()
            .ok_or_else(|| Error::Vmm(format!("session {} has no vmm", row.id)))?;
        let running = row.state != S::Paused as i32;
        if running {
            vmm.pause().await?;
        }
        let taken = async {
            let w = self.write_layer(src, &vmm, kind::FORK, false, &[]).await?;
            if has_disk {
                let run = supervisor::run_dirs(Path::new(&row.dir), vmm.jailed).0;
                let kept = Path::new(&w.layer.dir).join(crate::launch::GOLDEN_DISK);
                copy_disk(&run.join(VM_DISK), &kept, None).await?;
                self.layers.grew(&w.layer.id)?;
            }
            Ok::<_, Error>(w.layer)
        }
        .await;
        if running {
            vmm.resume().await?;
        }
        let layer = taken?;
        self.touch(src);
        Ok(layer)
    }

    /// Records the forks (PENDING, each holding the fork's layer) under the
    /// create lock, with the node's limits checked again there.
    #[allow(clippy::too_many_arguments)]
    async fn insert_forks(
        &self,
        row: &SessionRow,
        image: &ImageRow,
        chain: &[LayerRow],
        origin: &ForkOrigin,
        count: u32,
        labels: Option<BTreeMap<String, String>>,
        owner: &str,
    ) -> Result<Vec<(Arc<Session>, ImageRow)>> {
        let _g = self.create_lock.lock().await;
        self.check_fork_room(row, image, count, false)?;
        let top = chain
            .last()
            .ok_or_else(|| Error::Snapshot("the fork's snapshot chain is empty".into()))?;
        let mut out: Vec<(Arc<Session>, ImageRow)> = Vec::new();
        for _ in 0..count {
            match self.insert_fork(row, image, chain, top, origin, &labels, owner) {
                Ok(made) => out.push(made),
                Err(e) => {
                    // None starts: those already made fail with this error
                    // (their holds go with their terminal state).
                    for (sess, _) in &out {
                        let _ = self.transition(
                            sess,
                            S::Failed,
                            reason::RESTORE_FAILED,
                            &e.to_string(),
                        );
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// One new session of `insert_forks`, PENDING, holding `top`.
    #[allow(clippy::too_many_arguments)]
    fn insert_fork(
        &self,
        row: &SessionRow,
        image: &ImageRow,
        chain: &[LayerRow],
        top: &LayerRow,
        origin: &ForkOrigin,
        labels: &Option<BTreeMap<String, String>>,
        owner: &str,
    ) -> Result<(Arc<Session>, ImageRow)> {
        {
            let id = uuid::Uuid::new_v4().to_string();
            let now = now_ms();
            self.layers.hold(&top.id, &session_holder(&id))?;
            let child = SessionRow {
                id: id.clone(),
                image_id: row.image_id.clone(),
                state: S::Unspecified as i32,
                execution_id: uuid::Uuid::new_v4().to_string(),
                created_at: now,
                dir: self.session_dir(&id),
                ttl_s: row.ttl_s,
                idle_s: row.idle_s,
                labels: labels.clone().unwrap_or_else(|| row.labels.clone()),
                last_activity: now,
                repository: row.repository.clone(),
                agent: row.agent.clone(),
                base_ref: row.base_ref.clone(),
                owner: owner.to_string(),
                io_limits: row.io_limits.clone(),
                resources: row.resources.clone(),
                base_layer: top.id.clone(),
                auto_resume: row.auto_resume,
                parent_session: row.id.clone(),
                // The fork's devices are the source's: its shares too.
                shares: row.shares.clone(),
                ..Default::default()
            };
            let sess = self.insert_session(child, image.clone());
            {
                let mut i = sess.lock();
                i.restore_from = Some(chain.to_vec());
                i.fork_of = Some(origin.clone());
            }
            if let Err(e) = self.transition(
                &sess,
                S::Pending,
                "forked",
                &format!("from session {}", row.id),
            ) {
                let _ = self.layers.release(Some(&top.id), &session_holder(&id));
                self.map().remove(&id);
                return Err(e);
            }
            Ok((sess, image.clone()))
        }
    }
}
