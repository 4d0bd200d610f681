//! The calls on a live session: pause, resume, snapshot, rollback to one
//! of its own snapshots, stop and delete.

use super::*;

impl Manager {
    /// Pauses a RUNNING session (`reason`: requested or idle).
    pub async fn pause(&self, id: &str, why: &str) -> Result<SessionRow> {
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let state = sess.row().state;
        if state == S::Paused as i32 {
            return Ok(sess.row());
        }
        if state != S::Running as i32 && state != S::Ready as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is {}; only a RUNNING session can be paused",
                state_name(state)
            )));
        }
        let vmm = sess
            .vmm()
            .ok_or_else(|| Error::Vmm(format!("session {id} has no vmm")))?;
        vmm.pause().await?;
        self.transition(&sess, S::Paused, why, "")?;
        Ok(sess.row())
    }

    /// Resumes a PAUSED session (one paused to disk: restored from its
    /// snapshot layers).
    pub async fn resume(self: &Arc<Self>, id: &str) -> Result<SessionRow> {
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let state = sess.row().state;
        if state == S::Running as i32 {
            return Ok(sess.row());
        }
        let row = sess.row();
        if state == S::Stopped as i32 && row.reason == reason::MOVED {
            return Err(Error::FailedPrecondition(format!(
                "session {id} was {} (MoveSession); resume it there (to move it back \
                 here, delete it here first with DeleteSession)",
                row.detail
            )));
        }
        if state != S::Paused as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is {}; only a PAUSED session can be resumed",
                state_name(state)
            )));
        }
        if sess.row().persisted {
            self.resume_from_disk(&sess, "resumed").await?;
            return Ok(sess.row());
        }
        let vmm = sess
            .vmm()
            .ok_or_else(|| Error::Vmm(format!("session {id} has no vmm")))?;
        vmm.resume().await?;
        self.transition(&sess, S::Running, "resumed", "")?;
        self.touch(&sess);
        Ok(sess.row())
    }

    /// Writes a full snapshot of the session (pausing it meanwhile) as a
    /// snapshot layer the session keeps until it is deleted; returns the
    /// session, the layer's directory and the pages written.
    pub async fn snapshot(&self, id: &str) -> Result<(SessionRow, String, u64)> {
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let state = sess.row().state;
        let was_running = state == S::Running as i32;
        if !was_running && state != S::Paused as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is {}; only a RUNNING or PAUSED session can be snapshotted",
                state_name(state)
            )));
        }
        if sess.row().persisted {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is paused to disk; resume it first"
            )));
        }
        // Kept until the session is deleted: bounded like pauses to disk.
        self.check_snapshot_room("delete sessions or their snapshots first")?;
        let vmm = sess
            .vmm()
            .ok_or_else(|| Error::Vmm(format!("session {id} has no vmm")))?;
        let run_host = supervisor::run_dirs(&PathBuf::from(sess.row().dir), vmm.jailed).0;
        if was_running {
            vmm.pause().await?;
            self.transition(&sess, S::Paused, "snapshot", "")?;
        }
        let snaps = crate::layers::snapshots_holder(id);
        let mut result = self
            .write_layer(&sess, &vmm, crate::layers::kind::SNAPSHOT, true, &[&snaps])
            .await;
        // The disk goes with the memory (its page cache is in it), copied while
        // paused, to a place the vmm cannot write.
        let has_disk = !sess.lock().image.rootfs.is_empty();
        if let (Ok(w), true) = (&result, has_disk) {
            let kept = snapshot_disk(&PathBuf::from(sess.row().dir), &w.layer.id);
            let copied = match kept.parent() {
                Some(p) => std::fs::create_dir_all(p)
                    .map_err(|e| Error::io(format!("creating {}", p.display()), e)),
                None => Ok(()),
            };
            let copied = match copied {
                Ok(()) => copy_disk(&run_host.join(VM_DISK), &kept, None).await,
                Err(e) => Err(e),
            };
            if let Err(e) = copied {
                let _ = std::fs::remove_file(&kept);
                // The layer stays the session's base (its vmm's memory
                // descends from it); only the rollback target goes.
                let _ = self.layers.release(Some(&w.layer.id), &snaps);
                result = Err(e);
            }
        }
        if was_running {
            vmm.resume().await?;
            self.transition(&sess, S::Running, "snapshot", "")?;
        }
        let w = result?;
        self.touch(&sess);
        Ok((sess.row(), w.layer.dir, w.pages))
    }

    /// Rolls a RUNNING or PAUSED session back to `snapshot_dir`, one of its own
    /// snapshots: the disk copy taken with it replaces the session's disk, a new
    /// vmm restores it under a new execution id. Everything that can be checked
    /// or prepared is done before the old vmm is killed; a failure after that
    /// leaves the session FAILED (`restore_failed`).
    pub async fn restore_session(
        self: &Arc<Self>,
        id: &str,
        snapshot_dir: &str,
    ) -> Result<SessionRow> {
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let state = sess.row().state;
        if state != S::Running as i32 && state != S::Paused as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is {}; only a RUNNING or PAUSED session can be restored from its snapshot",
                state_name(state)
            )));
        }
        if sess.row().persisted {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is paused to disk; resume it (ResumeSession) before rolling it \
                 back to one of its snapshots"
            )));
        }
        let old = sess
            .vmm()
            .ok_or_else(|| Error::Vmm(format!("session {id} has no vmm")))?;
        if old.jailed != self.cfg.jailed() || (old.jailed && old.jail_uid.is_none()) {
            // The snapshot was written by a vmm jailed (or not) as the session
            // started; a vmm of the other kind must not read it.
            return Err(Error::FailedPrecondition(format!(
                "session {id} runs {} but host-agent now runs {}; restart host-agent with the \
                 jail setting the session started with to restore it",
                if old.jailed { "jailed" } else { "unjailed" },
                if self.cfg.jailed() {
                    "jailed"
                } else {
                    "unjailed (--no-jail)"
                },
            )));
        }
        let dir = PathBuf::from(sess.row().dir);
        let (run_host, _) = supervisor::run_dirs(&dir, old.jailed);
        let layer = self.own_snapshot(id, snapshot_dir)?;
        let chain = self.layers.chain(&layer.id)?;
        let snapshot = PathBuf::from(&layer.dir);
        let name = layer.id.clone();
        let image = sess.lock().image.clone();
        // Stage the snapshot's disk copy where the vmm cannot reach it.
        let staged = dir.join(format!(".restore-{VM_DISK}"));
        if !image.rootfs.is_empty() {
            let kept = snapshot_disk(&dir, &name);
            if !kept.is_file() {
                return Err(Error::FailedPrecondition(format!(
                    "snapshot {} has no copy of the session's disk ({} is missing)",
                    snapshot.display(),
                    kept.display()
                )));
            }
            let owner = old.jail_uid.map(|u| (u, u));
            copy_disk(&kept, &staged, owner).await?;
        }

        self.transition(
            &sess,
            S::Restoring,
            "restore",
            &snapshot.display().to_string(),
        )?;
        let execution_id = uuid::Uuid::new_v4().to_string();
        {
            let mut i = sess.lock();
            // Let go of the old vmm first: its exit is not a crash.
            i.vmm = None;
            i.guest = None;
            i.row.execution_id = execution_id.clone();
            let last = old.sample_pid().and_then(read_sample);
            if let Some(m) = i.meter.as_mut() {
                if let Some(s) = last {
                    m.observe(s);
                }
                m.set_execution_id(&execution_id);
                m.new_process();
            }
        }
        old.kill();
        let _ = tokio::time::timeout(Duration::from_secs(10), old.wait()).await;
        let fail = |e: Error| {
            let _ = self.transition(&sess, S::Failed, reason::RESTORE_FAILED, &e.to_string());
            e
        };
        if !image.rootfs.is_empty() {
            // The old vmm is gone; a rename replaces whatever name is there.
            std::fs::rename(&staged, run_host.join(VM_DISK)).map_err(|e| {
                fail(Error::io(
                    format!("putting the snapshot's disk in {}", run_host.display()),
                    e,
                ))
            })?;
        }
        if self.cfg.vsock_device && image.guest_init {
            // The old vmm's socket: the new vmm binds its own at the same path.
            let _ = std::fs::remove_file(self.cfg.vsock_path(&run_host));
        }
        // The same uid as before: the run directory and its files are its.
        // The same network too: the namespace outlives the old vmm.
        // The same network and CPU cap: the namespace outlives the old vmm.
        let vmm = self
            .spawn_from_chain(&sess, &image, &chain, old.jail_uid)
            .await
            .map_err(fail)?;
        // Its memory descends from the snapshot from here on.
        let holder = crate::layers::session_holder(id);
        let old_base = sess.row().base_layer;
        self.layers.hold(&layer.id, &holder).map_err(fail)?;
        let recorded = {
            let mut i = sess.lock();
            i.vmm = Some(vmm.clone());
            i.row.vmm_pid = vmm.pid;
            i.row.vmm_start_ticks = vmm.start_ticks;
            i.row.fs_daemons = vmm.fs.encode();
            i.row.base_layer = layer.id.clone();
            self.store.put_session(&i.row)
        };
        if !old_base.is_empty() && old_base != layer.id {
            if let Err(e) = self.layers.release(Some(&old_base), &holder) {
                tracing::warn!(session = %id, error = %e, "letting go of the old snapshot layer");
            }
        }
        self.watch_exit(sess.clone(), vmm.clone());
        let started = match recorded {
            Ok(()) => {
                supervisor::wait_for_state(&vmm, VmState::Running, Duration::from_secs(60)).await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = started {
            vmm.kill();
            return Err(fail(e));
        }
        if image.guest_init {
            self.take_back_or_put_back(&sess, &vmm).await?;
        }
        self.transition(&sess, S::Ready, "restore", "")?;
        self.transition(&sess, S::Running, "restore", "")?;
        self.touch(&sess);
        Ok(sess.row())
    }

    /// Stops a session with `why` and waits until it is STOPPED (or FAILED).
    /// A guest-init session paused to disk is resumed first, so its branch
    /// comes back as usual (not on host-agent's shutdown).
    pub async fn stop(self: &Arc<Self>, id: &str, why: &str) -> Result<SessionRow> {
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let state = sess.row().state;
        if is_terminal(state) {
            return Ok(sess.row());
        }
        if sess.row().persisted && sess.guest_init() && why != reason::HOST_AGENT_SHUTDOWN {
            if let Err(e) = self.resume_from_disk(&sess, "stopping").await {
                tracing::warn!(session = %id, error = %e, "resuming to fetch the branch before the stop");
            }
            if is_terminal(sess.row().state) {
                return Ok(sess.row());
            }
        }
        // A stop for what the guest sent says what that was.
        let detail = sess
            .guest()
            .and_then(|g| g.violation())
            .filter(|v| v.reason == why)
            .map(|v| v.detail)
            .unwrap_or_default();
        // A channel lost to a host-agent restart is opened again, so the branch comes back.
        let conn = match self.guest_channel(&sess).await {
            Ok(c) => Some(c),
            Err(e) => {
                if sess.guest_init() {
                    tracing::warn!(session = %id, error = %e, "no guest channel to fetch the branch through");
                }
                None
            }
        };
        sess.lock().pending_stop = Some(why.to_string());
        self.transition(&sess, S::Stopping, why, &detail)?;
        if let Some(conn) = conn {
            match self.finish_guest(&sess, &conn).await {
                Ok((branch, head)) => {
                    let mut i = sess.lock();
                    i.row.branch = branch;
                    i.row.head_commit = head;
                    self.store.put_session(&i.row)?;
                }
                Err(e) => {
                    tracing::warn!(session = %id, error = %e, "fetching the session branch failed");
                    sess.lock().fetch_error = Some(e.to_string());
                }
            }
            sess.lock().guest = None;
        }
        let Some(vmm) = sess.vmm() else {
            self.transition(&sess, S::Stopped, why, "no vmm process")?;
            return Ok(sess.row());
        };
        if let Err(e) = vmm.stop().await {
            tracing::warn!(session = %id, error = %e, "control stop failed; killing the vmm");
            vmm.kill();
        }
        if !sess.wait_until(is_terminal, Duration::from_secs(10)).await {
            tracing::warn!(session = %id, "vmm did not exit after stop; killing it");
            vmm.kill();
            if !sess.wait_until(is_terminal, Duration::from_secs(10)).await {
                return Err(Error::Timeout(format!(
                    "session {id}: vmm pid {} did not exit after SIGKILL",
                    vmm.pid
                )));
            }
        }
        Ok(sess.row())
    }

    /// Deletes a STOPPED/FAILED session's files and record.
    pub async fn delete(&self, id: &str) -> Result<()> {
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let row = sess.row();
        if !is_terminal(row.state) {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is {}; stop it before deleting it",
                state_name(row.state)
            )));
        }
        if !row.dir.is_empty() {
            let _ = std::fs::remove_dir_all(&row.dir);
        }
        self.store.delete_session(id)?;
        self.map().remove(id);
        // Its snapshot layers go, unless a fork or an image still needs them.
        self.layers
            .release(None, &crate::layers::session_holder(id))?;
        self.layers
            .release(None, &crate::layers::snapshots_holder(id))?;
        Ok(())
    }
}

impl Manager {
    /// The snapshot layer of session `id` whose directory is `requested`
    /// (a snapshot_dir SnapshotSession returned for it, which it keeps).
    pub(super) fn own_snapshot(
        &self,
        id: &str,
        requested: &str,
    ) -> Result<crate::layers::LayerRow> {
        let not_ours = || {
            Error::invalid(format!(
                "snapshot_dir {requested:?} is not a snapshot of this session (use a snapshot_dir \
                 that SnapshotSession returned for it)"
            ))
        };
        for layer_id in self.store.held_by(&crate::layers::snapshots_holder(id))? {
            if let Some(layer) = self.store.layer(&layer_id)? {
                if layer.dir == requested {
                    return Ok(layer);
                }
            }
        }
        Err(not_ours())
    }
}

/// Where the copy of a session's disk taken with snapshot `name` is kept:
/// in the session's directory, out of reach of a jailed vmm.
pub(super) fn snapshot_disk(dir: &std::path::Path, name: &str) -> PathBuf {
    dir.join("snapshot-disks").join(format!("{name}.ext4"))
}
