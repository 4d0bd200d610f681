//! A restarted host-agent: re-attaching to the vmm processes that still
//! run (with their networks, resolvers and exposed ports), failing the
//! sessions whose VM is gone, and stopping every session on shutdown when
//! configured to.

use super::*;

impl Manager {
    /// Loads sessions from the database and re-attaches to their vmm
    /// processes; sessions whose vmm is gone become FAILED (vmm_crash).
    pub async fn recover(self: &Arc<Self>) -> Result<()> {
        Pool::clean_leftovers(&self.pool_dir());
        // Before any session is looked at: their layers are checked against
        // the files, and what nothing needs is deleted.
        self.layers.check_at_start(&self.store.images()?)?;
        let rows = self.store.sessions()?;
        // Every uid a session that is not over holds stays its own, before
        // anything (the warm pool included) is handed one.
        for row in rows.iter().filter(|r| !is_terminal(r.state)) {
            self.jail_uids.mark_used(row.jail_uid);
        }
        for row in rows {
            let image = match self.store.image(&row.image_id)? {
                Some(i) => i,
                None => ImageRow {
                    id: row.image_id.clone(),
                    ..Default::default()
                },
            };
            // The session's VMs run with its own limits (the image's with
            // its overrides), as recorded when it was created.
            let image = ImageRow {
                io_limits: row.io_limits.clone(),
                ..image
            };
            let state = row.state;
            let sess = self.insert_session(row.clone(), image.clone());
            if is_terminal(state) {
                continue;
            }
            if let (Some(node), true) = (&self.network, has_network(&image)) {
                let network = Self::session_netns(node, Path::new(&row.dir));
                // A network without its kept policy (a crash before it was
                // written cannot leave one: it is written first) is given
                // nothing, rather than guessed at.
                let (allow, deny, hosts) =
                    Self::kept_policy(Path::new(&row.dir)).unwrap_or_default();
                {
                    let mut i = sess.lock();
                    i.network = network;
                    i.net_allow = allow;
                    i.net_deny = deny;
                    i.net_hosts = hosts;
                }
                // The resolver died with the old process; its port is free.
                if let Err(e) = self.start_resolver(&sess).await {
                    tracing::warn!(session = %sess.id, error = %e, "restarting the session's DNS resolver");
                }
            }
            if let Err(e) = self.recover_one(&sess, row, &image).await {
                tracing::error!(session = %sess.id, error = %e, "re-attaching session");
            }
            // Before the API answers: a client's next call finds them.
            self.reopen_exposed(&sess).await;
        }
        // A create interrupted by a crash may have started a vmm it never recorded.
        let live: std::collections::HashSet<u32> = self
            .store
            .sessions()?
            .iter()
            .filter(|r| !is_terminal(r.state))
            .map(|r| r.vmm_pid)
            .collect();
        supervisor::kill_orphans(&self.cfg.state_dir.join("sessions"), &live);
        // virtiofsd processes whose VM is gone (its vmm's exit ends them,
        // but one whose vmm never connected waits forever), or that a crash
        // left unrecorded (warm VMs' among them).
        let serving: std::collections::HashSet<u32> = self
            .all()
            .iter()
            .filter_map(|s| s.vmm())
            .flat_map(|v| v.fs.pids())
            .collect();
        let killed = crate::shares::virtiofsd::kill_orphans(&self.cfg.state_dir, &serving);
        if killed > 0 {
            tracing::info!(killed, "killed virtiofsd processes no VM uses");
        }
        if let Some(node) = &self.network {
            // Networks of VMs that are gone, or that a crash left unrecorded,
            // and those of warm VMs (not kept across a restart: killed above
            // with their pool directories; no session owns their namespace).
            let owned: std::collections::HashSet<String> = self
                .all()
                .iter()
                .filter_map(|s| s.lock().network.as_ref().map(|n| n.netns.clone()))
                .collect();
            let removed = node.remove_orphans(&owned);
            if removed > 0 {
                tracing::info!(removed, "removed VM network namespaces no session owns");
            }
        }
        Ok(())
    }

    /// The network of the session in `dir` found after a restart. A session
    /// that took a warm VM keeps the namespace made for the VM, named after
    /// its pool directory, and recorded in the directory that became the
    /// session's ([`crate::pool::NETNS_FILE`]). The record is read rather
    /// than the namespace renamed at CreateSession: iproute2 has no rename
    /// (attaching a second name and deleting the first would cost two more
    /// commands on CreateSession's path, and a crash between them would
    /// leave both names).
    /// Any other session's namespace is named after its own directory.
    fn session_netns(node: &NodeNetwork, dir: &Path) -> Option<VmNetwork> {
        match std::fs::read_to_string(dir.join(crate::pool::NETNS_FILE)) {
            Ok(name) => node.adopt_named(name.trim()),
            Err(_) => node.adopt_existing(&vmm_api::command::jail_id(dir)),
        }
    }

    pub(super) async fn recover_one(
        self: &Arc<Self>,
        sess: &Arc<Session>,
        row: SessionRow,
        image: &ImageRow,
    ) -> Result<()> {
        let sess = sess.clone();
        let state = row.state;
        if let Some(last) = self.store.last_usage(&row.id)? {
            if !last.is_final {
                sess.lock().meter = Some(Meter::resume_from(&last, image.mem_mib, billable(state)));
            }
        } else if row.ready_at > 0 {
            let mut m = Meter::start(&row.id, &row.execution_id, image.mem_mib, row.ready_at);
            m.set_billable(row.ready_at, billable(state));
            sess.lock().meter = Some(m);
        }
        if row.persisted {
            // Paused to disk: no vmm to find. A crash between writing its
            // layer and recording the pause leaves it RUNNING on record
            // (its vmm, stopping then, is killed as an orphan below).
            if state == S::Running as i32 || state == S::Ready as i32 {
                self.transition(&sess, S::Paused, "reconciled", "paused to disk")?;
            }
            return Ok(());
        }
        let vmm = supervisor::attach(
            row.vmm_pid,
            row.vmm_start_ticks,
            &PathBuf::from(&row.dir),
            &row.fs_daemons,
        );
        let Some(vmm) = vmm else {
            let detail = "vmm process gone while host-agent was not running";
            if state == S::Stopping as i32 {
                self.transition(&sess, S::Stopped, &row.reason, detail)?;
            } else {
                self.transition(&sess, S::Failed, reason::VMM_CRASH, detail)?;
            }
            return Ok(());
        };
        let vmm = Arc::new(vmm);
        sess.lock().vmm = Some(vmm.clone());
        self.watch_exit(sess.clone(), vmm.clone());
        let status = vmm.status().await;
        let vm_state = status.as_ref().ok().map(|v| v.state);
        tracing::info!(session = %row.id, pid = vmm.pid, state = state_name(state), vm = ?vm_state, "re-attached");
        match (S::try_from(state).unwrap_or(S::Unspecified), vm_state) {
            (S::Running, Some(VmState::Running)) if image.guest_init => {
                // The old channel died with the old process; take the guest's session back
                // now rather than on the first exec (a failure is retried then).
                let mgr = self.clone();
                let sess = sess.clone();
                tokio::spawn(async move {
                    if let Err(e) = mgr.guest_channel(&sess).await {
                        tracing::warn!(session = %sess.id, error = %e, "re-opening the guest channel after a restart");
                    }
                });
            }
            (S::Running, Some(VmState::Running)) | (S::Paused, Some(VmState::Paused)) => {}
            (S::Ready, Some(VmState::Running)) => {
                self.transition(&sess, S::Running, "reconciled", "")?;
            }
            (S::Running | S::Ready, Some(VmState::Paused)) => {
                self.transition(&sess, S::Paused, "reconciled", "vmm was paused")?;
            }
            (S::Paused, Some(VmState::Running)) => {
                // The pause was not recorded as done; make it so.
                vmm.pause().await?;
            }
            (S::Stopping, _) => {
                let why = row.reason.clone();
                sess.lock().pending_stop = Some(why);
                if vmm.stop().await.is_err() {
                    vmm.kill();
                }
            }
            _ if vmm.exit_status().is_some() => {
                // It exited meanwhile; the exit watcher records it.
            }
            _ => {
                // PENDING/RESTORING (the Create call died with the old
                // process) or an unreachable vmm: fail the session.
                let detail = match &status {
                    Err(e) => format!("after restart: {e}"),
                    Ok(_) => "host-agent restarted during restore".to_string(),
                };
                vmm.kill();
                self.transition(&sess, S::Failed, reason::HOST_AGENT_RESTART, &detail)?;
            }
        }
        Ok(())
    }

    /// Stops every live session with reason `host_agent_shutdown`.
    pub async fn stop_all(self: &Arc<Self>) {
        for sess in self.all() {
            if !is_terminal(sess.row().state) {
                if let Err(e) = self.stop(&sess.id, reason::HOST_AGENT_SHUTDOWN).await {
                    tracing::warn!(session = %sess.id, error = %e, "stop on shutdown");
                }
            }
        }
    }
}
