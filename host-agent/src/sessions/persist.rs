//! Sessions and their snapshot layers: writing a layer from a session's
//! vmm (a diff over the layer its memory descends from, or a full
//! snapshot), pausing a session to disk, and restoring it from its chain.

use super::*;
use crate::layers::{kind, session_holder, LayerRow, NewLayer, MAX_DIFF_CHAIN};

/// A layer written from a session's vmm.
pub(super) struct Written {
    /// The new layer (the session's base from now on).
    pub layer: LayerRow,
    /// Pages of guest memory it holds.
    pub pages: u64,
    /// How long the vmm took to write it.
    pub vmm_ms: f64,
}

impl Manager {
    /// Has `sess`'s paused `vmm` write a snapshot and takes it in as a layer
    /// of `kind`, held by the session (as its base) and by `also`: a diff
    /// over the session's base, or a full snapshot when `full`, when the
    /// base is unknown (a session from before layers) or when its chain is
    /// [`MAX_DIFF_CHAIN`] long. The old base is let go (its layers stay
    /// while anything else needs them). On failure nothing changes but a
    /// removed partial snapshot.
    pub(super) async fn write_layer(
        &self,
        sess: &Session,
        vmm: &VmmProcess,
        layer_kind: &str,
        full: bool,
        also: &[&str],
    ) -> Result<Written> {
        let row = sess.row();
        let (run_host, run_inside) = supervisor::run_dirs(Path::new(&row.dir), vmm.jailed);
        let snaps = run_host.join("snapshots");
        let owner = vmm.jail_uid.filter(|_| vmm.jailed).map(|u| (u, u));
        crate::safe_fs::ensure_dir(&snaps, owner)
            .map_err(|e| Error::io(format!("preparing {}", snaps.display()), e))?;
        let base = match row.base_layer.as_str() {
            "" => None,
            id => self.layers.chain(id).ok().map(|c| (c.len(), c)),
        };
        let full = full || sess.lock().full_layer_next;
        let parent = match base {
            Some((depth, chain)) if !full && depth < MAX_DIFF_CHAIN => chain.last().cloned(),
            _ => None,
        };
        let name = format!("{}-{}", now_ms(), uuid::Uuid::new_v4().simple());
        let snap_kind = if parent.is_some() {
            SnapshotKind::Diff
        } else {
            SnapshotKind::Full
        };
        let reply = vmm
            .snapshot(&run_inside.join("snapshots").join(&name), snap_kind)
            .await;
        let written = snaps.join(&name);
        // From here a failure leaves the vmm's dirty tracking where this
        // write left it, unknown to the layers: the next layer is full.
        let failed = |e: Error| {
            sess.lock().full_layer_next = true;
            let _ = std::fs::remove_dir_all(&written);
            e
        };
        let reply = reply.map_err(failed)?;
        let holder = session_holder(&sess.id);
        let mut holders = vec![holder.as_str()];
        holders.extend_from_slice(also);
        let release: Vec<(&str, &str)> = if row.base_layer.is_empty() {
            vec![]
        } else {
            vec![(holder.as_str(), row.base_layer.as_str())]
        };
        let layer = self
            .layers
            .adopt(
                &written,
                NewLayer {
                    kind: layer_kind,
                    parent: parent.as_ref(),
                    owner_session: &sess.id,
                    holders: &holders,
                    release: &release,
                },
            )
            .map_err(failed)?;
        {
            let mut i = sess.lock();
            i.row.base_layer = layer.id.clone();
            i.full_layer_next = false;
            self.store.put_session(&i.row)?;
        }
        // A full snapshot frees the old chain unless something else holds it.
        self.layers.collect(false)?;
        tracing::info!(
            session = %sess.id,
            layer = %layer.id,
            kind = layer_kind,
            parent = %layer.parent,
            bytes = layer.bytes,
            pages = reply.pages_written,
            "snapshot layer written"
        );
        Ok(Written {
            pages: reply.pages_written,
            vmm_ms: reply.ms,
            layer,
        })
    }

    /// A new vmm restoring `chain` for session `sess` (in its directory, as
    /// its jail `uid`, in its network namespace, under its CPU cap): the
    /// replacement of its vmm on a rollback or a resume from disk, with
    /// fresh virtiofsd processes for its shares. Not adopted yet.
    pub(super) async fn spawn_from_chain(
        &self,
        sess: &Session,
        image: &ImageRow,
        chain: &[LayerRow],
        uid: Option<u32>,
    ) -> Result<Arc<VmmProcess>> {
        let row = sess.row();
        let dir = PathBuf::from(&row.dir);
        let netns = sess.lock().network.as_ref().map(|n| n.netns.clone());
        let (args, mut jail) = restore_launch(
            &self.cfg,
            image,
            &dir,
            false,
            Source::Chain(chain),
            uid,
            netns.as_deref(),
        );
        if let (Some(jail), Some(size)) =
            (jail.as_mut(), resources::Resources::decode(&row.resources))
        {
            jail.cpu_max = size.cpu_max();
        }
        let mut command = args.into();
        let fs = self
            .launch_shares(&dir, uid, &self.shares_of(sess), &mut command)
            .await?;
        supervisor::spawn(
            &self.vmm_path,
            &dir,
            command,
            jail.as_ref(),
            netns.as_deref(),
            fs,
        )
        .map(Arc::new)
    }

    /// Refuses a new session snapshot layer (RESOURCE_EXHAUSTED, saying
    /// `then`) once the node's session layers take `snapshot_quota_mib`.
    pub(super) fn check_snapshot_room(&self, then: &str) -> Result<()> {
        let quota = self.cfg.snapshot_quota_mib << 20;
        if quota == 0 {
            return Ok(());
        }
        let used = self.layers.session_bytes()?;
        if used >= quota {
            return Err(Error::ResourceExhausted(format!(
                "node snapshot storage: {} MiB of the {} MiB quota (snapshot_quota_mib) are \
                 used; {then}",
                used >> 20,
                quota >> 20
            )));
        }
        Ok(())
    }

    /// Pauses session `id` to disk (`why`: requested or idle): a layer of
    /// its memory is written, its vmm stopped; the session stays PAUSED
    /// with `persisted` set, its disk and network where they are.
    pub async fn persist(&self, id: &str, why: &str) -> Result<SessionRow> {
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let row = sess.row();
        if row.persisted {
            return Ok(row);
        }
        let state = row.state;
        let running = state == S::Running as i32 || state == S::Ready as i32;
        if !running && state != S::Paused as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is {}; only a RUNNING or PAUSED session can be paused to disk",
                state_name(state)
            )));
        }
        self.check_snapshot_room("delete sessions or their snapshots first")?;
        let vmm = sess
            .vmm()
            .ok_or_else(|| Error::Vmm(format!("session {id} has no vmm")))?;
        let t0 = Instant::now();
        let written = self.to_disk(&sess, &vmm, running).await?;
        let detail = format!(
            "persisted: layer {} ({} bytes, {} pages; written in {:.0} ms) in {} ms",
            written.layer.id,
            written.layer.bytes,
            written.pages,
            written.vmm_ms,
            t0.elapsed().as_millis()
        );
        if running {
            self.transition(&sess, S::Paused, why, &detail)?;
        } else {
            self.note(&sess, "persisted", &detail)?;
        }
        Ok(sess.row())
    }

    /// Writes a pause layer of session `sess`'s `vmm` (paused first when
    /// `running`), then stops the vmm: the session is `persisted`, with no
    /// vmm, its disk and network where they are. The state is the caller's
    /// to set. A layer that cannot be written leaves the vmm as it was.
    async fn to_disk(
        &self,
        sess: &Session,
        vmm: &Arc<VmmProcess>,
        running: bool,
    ) -> Result<Written> {
        if running {
            vmm.pause().await?;
        }
        let written = match self.write_layer(sess, vmm, kind::PAUSE, false, &[]).await {
            Ok(w) => w,
            Err(e) => {
                if running {
                    vmm.resume().await?;
                }
                return Err(e);
            }
        };
        // The vmm goes: let go of it first, so its exit is not a crash.
        let recorded = {
            let mut i = sess.lock();
            let kept = (i.vmm.take(), i.guest.take(), i.row.clone());
            i.row.vmm_pid = 0;
            i.row.vmm_start_ticks = 0;
            i.row.fs_daemons.clear();
            i.row.persisted = true;
            if let (Some(m), Some(s)) = (i.meter.as_mut(), vmm.sample_pid().and_then(read_sample)) {
                m.observe(s);
            }
            let put = self.store.put_session(&i.row);
            if put.is_err() {
                // Not recorded: the session keeps its vmm, which runs on.
                (i.vmm, i.guest, i.row) = kept;
            }
            put
        };
        if let Err(e) = recorded {
            if running {
                vmm.resume().await?;
            }
            return Err(e);
        }
        if vmm.stop().await.is_err() {
            vmm.kill();
        }
        if tokio::time::timeout(Duration::from_secs(10), vmm.wait())
            .await
            .is_err()
        {
            vmm.kill();
            let _ = tokio::time::timeout(Duration::from_secs(10), vmm.wait()).await;
        }
        let run = supervisor::run_dirs(Path::new(&sess.row().dir), vmm.jailed).0;
        let _ = std::fs::remove_file(run.join("control.sock"));
        Ok(written)
    }

    /// Restores session `sess` (PAUSED to disk; its op lock held) from its
    /// layers: RESTORING -> READY -> RUNNING with reason `why` and a new
    /// execution id, the guest taken back over a new channel. A chain that
    /// does not restore (a missing layer, a damaged file, a vmm that fails)
    /// makes the session FAILED (restore_failed) with what went wrong.
    pub(super) async fn resume_from_disk(
        self: &Arc<Self>,
        sess: &Arc<Session>,
        why: &str,
    ) -> Result<()> {
        let row = sess.row();
        let image = sess.lock().image.clone();
        let jailed = row.jail_uid != 0;
        if jailed != self.cfg.jailed() {
            return Err(Error::FailedPrecondition(format!(
                "session {} was paused to disk by a {} vmm but host-agent now runs {}; restart \
                 host-agent with the jail setting the session started with to resume it",
                row.id,
                if jailed { "jailed" } else { "unjailed" },
                if self.cfg.jailed() {
                    "jailed"
                } else {
                    "unjailed (--no-jail)"
                },
            )));
        }
        let size = resources::Resources::decode(&row.resources);
        let mem = size.map_or(image.mem_mib, |s| s.mem_mib);
        let (_, mem_used) = self.used_resources();
        let mem_limit = self.memory_limit_mib();
        if mem_limit > 0 && mem_used + u64::from(mem) > mem_limit {
            return Err(Error::ResourceExhausted(format!(
                "node memory: {mem_used} MiB of {mem_limit} MiB are committed to live sessions; \
                 resuming session {} needs {mem} MiB more",
                row.id
            )));
        }
        let t0 = Instant::now();
        self.transition(sess, S::Restoring, why, "")?;
        let fail = |e: Error| {
            let _ = self.transition(sess, S::Failed, reason::RESTORE_FAILED, &e.to_string());
            e
        };
        let chain = self.layers.chain(&row.base_layer).map_err(fail)?;
        let execution_id = uuid::Uuid::new_v4().to_string();
        {
            let mut i = sess.lock();
            if let Some(m) = i.meter.as_mut() {
                m.set_execution_id(&execution_id);
                m.new_process();
            }
            i.row.execution_id = execution_id;
        }
        let dir = PathBuf::from(&row.dir);
        let run_host = supervisor::run_dirs(&dir, jailed).0;
        if self.cfg.vsock_device && image.guest_init {
            // The old vmm's socket: the new vmm binds its own at the same path.
            let _ = std::fs::remove_file(self.cfg.vsock_path(&run_host));
        }
        let uid = jailed.then_some(row.jail_uid);
        let vmm = self
            .spawn_from_chain(sess, &image, &chain, uid)
            .await
            .map_err(fail)?;
        let recorded = {
            let mut i = sess.lock();
            i.vmm = Some(vmm.clone());
            i.row.vmm_pid = vmm.pid;
            i.row.vmm_start_ticks = vmm.start_ticks;
            i.row.fs_daemons = vmm.fs.encode();
            i.row.persisted = false;
            self.store.put_session(&i.row)
        };
        let started = match recorded {
            Ok(()) => {
                supervisor::wait_for_state(&vmm, VmState::Running, Duration::from_secs(60)).await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = started {
            // Not watched yet: its exit is this failure, not a crash.
            drop_vmm(sess, &vmm);
            return Err(fail(e));
        }
        if image.guest_init {
            self.take_back_or_put_back(sess, &vmm).await?;
        }
        self.watch_exit(sess.clone(), vmm.clone());
        let detail = format!(
            "from {} snapshot layer(s) in {} ms",
            chain.len(),
            t0.elapsed().as_millis()
        );
        self.transition(sess, S::Ready, why, &detail)?;
        self.transition(sess, S::Running, why, &detail)?;
        metrics::restore_latency(t0.elapsed());
        self.touch(sess);
        Ok(())
    }

    /// Session `sess` (RESTORING), just restored from its own snapshot
    /// into `vmm`: READY means guest-init answered, so the guest takes the
    /// session back (ResumeSession) before the session is READY. A guest
    /// that does not has run meanwhile (its disk may have changed since the
    /// snapshot), so its VM goes back to disk as it is now and the session
    /// is PAUSED (`persisted`, reason `resume_failed`), nothing lost; only
    /// a vmm that exited, or one that cannot be put back, makes it FAILED
    /// (`restore_failed`). Either way the error is returned.
    pub(super) async fn take_back_or_put_back(
        &self,
        sess: &Session,
        vmm: &Arc<VmmProcess>,
    ) -> Result<()> {
        let Err(e) = self.guest_after_restore(sess, vmm).await else {
            return Ok(());
        };
        let put_back = match vmm.exit_status() {
            Some(_) => Err(e.to_string()),
            None => self
                .to_disk(sess, vmm, true)
                .await
                .map_err(|p| format!("{e}; putting it back on disk failed too: {p}")),
        };
        match put_back {
            Ok(w) => {
                let detail = format!(
                    "{e}; the VM is back on disk as it was (layer {})",
                    w.layer.id
                );
                self.transition(sess, S::Paused, reason::RESUME_FAILED, &detail)?;
            }
            Err(detail) => {
                drop_vmm(sess, vmm);
                self.transition(sess, S::Failed, reason::RESTORE_FAILED, &detail)?;
            }
        }
        Err(e)
    }

    /// The guest channel of session `sess`, whose `vmm` was just restored
    /// from a snapshot of the session's own VM: guest-init takes the session
    /// back on a new connection within `guest_ready_timeout_seconds`. A vmm
    /// that exits meanwhile fails it at once, with its last lines.
    pub(super) async fn guest_after_restore(&self, sess: &Session, vmm: &VmmProcess) -> Result<()> {
        let timeout = Duration::from_secs(self.cfg.guest_ready_timeout_seconds);
        tokio::select! {
            r = self.reopen_guest(sess, timeout) => r.map(|_| ()).map_err(|e| {
                Error::Guest(format!("guest-init did not take the session back after the restore: {e}"))
            }),
            status = vmm.wait() => Err(Error::Vmm(format!("{status}: {}", vmm.log_tail()))),
        }
    }

    /// Session `id` ready for a call that reaches its guest: a session
    /// paused to disk with `auto_resume` is resumed first (the caller has
    /// checked the call's execution id against the persisted one: the call
    /// was aimed at it); one without is refused.
    pub async fn wake_for_call(self: &Arc<Self>, id: &str) -> Result<()> {
        let sess = self.session(id)?;
        let row = sess.row();
        if !row.persisted {
            return Ok(());
        }
        if !row.auto_resume {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is paused to disk; call ResumeSession first (or create sessions \
                 with auto_resume)"
            )));
        }
        let _op = sess.op.lock().await;
        if sess.row().persisted {
            self.resume_from_disk(&sess, "auto_resume").await?;
        }
        Ok(())
    }
}

/// Kills `vmm` and lets go of it: session `sess` keeps no half-running VM.
fn drop_vmm(sess: &Session, vmm: &VmmProcess) {
    vmm.kill();
    let mut i = sess.lock();
    i.vmm = None;
    i.guest = None;
    i.row.vmm_pid = 0;
    i.row.vmm_start_ticks = 0;
    i.row.fs_daemons.clear();
}
