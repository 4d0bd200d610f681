//! A session's vmm ending: watching the process, and what its exit makes
//! of the session (STOPPED, FAILED with the reason and the vmm's last lines).

use super::*;

impl Manager {
    pub(super) fn watch_exit(self: &Arc<Self>, sess: Arc<Session>, vmm: Arc<VmmProcess>) {
        let mgr = self.clone();
        tokio::spawn(async move {
            let status = vmm.wait().await;
            mgr.on_exit(&sess, &vmm, status);
        });
    }

    pub(super) fn on_exit(&self, sess: &Session, vmm: &VmmProcess, status: ExitStatus) {
        let (state, pending) = {
            let i = sess.lock();
            // Ignore a vmm that is no longer this session's (also the one a
            // RestoreSession has let go of and is replacing).
            if i.vmm.as_ref().is_none_or(|v| v.pid != vmm.pid) {
                return;
            }
            (i.row.state, i.pending_stop.clone())
        };
        if is_terminal(state) {
            self.release(sess);
            return;
        }
        let detail = match status {
            ExitStatus::Code(_) | ExitStatus::Signal(_) => {
                let tail = vmm.log_tail();
                if tail.is_empty() {
                    status.to_string()
                } else {
                    format!("{status}: {tail}")
                }
            }
            ExitStatus::Unknown => status.to_string(),
        };
        let row = sess.row();
        let fetch_error = sess.lock().fetch_error.take();
        let detail = if let Some(e) = fetch_error {
            format!("branch not fetched: {e}; {detail}")
        } else if row.branch.is_empty() {
            detail
        } else {
            format!("branch {} at {}; {detail}", row.branch, row.head_commit)
        };
        let r = if state == S::Stopping as i32 {
            let why = pending.unwrap_or_else(|| reason::REQUESTED.to_string());
            self.transition(sess, S::Stopped, &why, &detail)
        } else {
            match status {
                ExitStatus::Code(0) => self
                    .transition(sess, S::Stopping, reason::GUEST_EXIT, &detail)
                    .and_then(|_| self.transition(sess, S::Stopped, reason::GUEST_EXIT, &detail)),
                ExitStatus::Code(1) => {
                    self.transition(sess, S::Failed, reason::GUEST_CRASH, &detail)
                }
                _ => self.transition(sess, S::Failed, reason::VMM_CRASH, &detail),
            }
        };
        if let Err(e) = r {
            tracing::error!(session = %sess.id, error = %e, "recording vmm exit");
        }
        self.release(sess);
    }

    /// Releases a finished session's sockets: its control socket, and its
    /// vsock socket where its vmm's vsock device made one (without the
    /// device, `guest_vsock_uds` names a socket someone else serves, such
    /// as a stand-in guest shared by every session: it stays).
    pub(super) fn release(&self, sess: &Session) {
        let run = self.run_dir(sess);
        let _ = std::fs::remove_file(run.join("control.sock"));
        if self.cfg.vsock_device {
            let _ = std::fs::remove_file(self.cfg.vsock_path(&run));
        }
    }

    /// Where the session's VM keeps its sockets, as the host sees it (inside
    /// the jail for a jailed vmm, whatever the configuration says now).
    pub(super) fn run_dir(&self, sess: &Session) -> PathBuf {
        let jailed = sess.vmm().map_or(self.cfg.jailed(), |v| v.jailed);
        supervisor::run_dirs(&PathBuf::from(sess.row().dir), jailed).0
    }
}
