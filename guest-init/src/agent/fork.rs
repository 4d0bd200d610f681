//! ForkSession: a VM restored from a snapshot of another session's VM
//! becomes a new session. Its memory, guest-init's session state included,
//! is the parent's; the kept (detached) session is the parent, and the
//! fork makes a new [`Session`] of it:
//!
//! * the parent's commands are killed and its pending asks dropped (their
//!   callers are the parent's); its late events stay in the parent's log;
//! * the repository goes on the branch `session/<new id>` at HEAD, working
//!   tree and index untouched ([`session::fork_branch`]);
//! * a new audit chain begins, its first record `session.forked` naming the
//!   parent, the host's last event of the parent (seq and hash, as sent) and
//!   the guest's own last one;
//! * the CRNG is reseeded and the machine renamed after the new session,
//!   the clock stepped (as StartSession does);
//! * the policy, secrets, environment, ask timeout, egress rules and the
//!   session's size stay the parent's; approvals (`always`) and exec ids
//!   start empty, as in any new session.

use super::lifecycle::{fresh_machine, open_audit};
use super::*;

/// How long a fork waits for the parent's killed commands to report their
/// exit (into the parent's log) before it names that log's last event.
const SETTLE: Duration = Duration::from_secs(2);

impl Session {
    /// Makes session `req.session_id` of this one (the parent, kept from
    /// an earlier connection), speaking on `out`; answers Ready there.
    /// This session is left as it was when the request is refused (bad
    /// fields), and otherwise when the fork fails before its new branch
    /// (its commands killed, though).
    pub(super) async fn fork(&self, out: Outbox, req: &ForkSession) -> Result<Arc<Self>, Failure> {
        let bad = |m: String| error(Code::InvalidArgument, m, "");
        let branch = session::branch_for(&req.session_id).map_err(|e| bad(e.to_string()))?;
        if req.session_id == self.id {
            return Err(bad(format!(
                "a fork needs a session id of its own: {:?} is the parent's",
                req.session_id
            )));
        }
        if !is_hash(&req.parent_audit_hash) {
            return Err(bad(format!(
                "parent_audit_hash {:?} is neither empty nor 64 hexadecimal digits",
                req.parent_audit_hash
            )));
        }
        // First, so the branch and the audit log carry the right time.
        let clock = self
            .cfg
            .set_clock
            .then(|| crate::clock::sync_to(req.host_time_unix_ns));
        self.stop_turns().await;
        self.settle().await;
        // Before anything of the new session runs: its own random state and name.
        let fresh = fresh_machine(&self.cfg, &req.session_id, &req.entropy, true)
            .map_err(|e| error(Code::Internal, format!("session not forked: {e}"), ""))?;
        let redactor = self.secrets.redactor().clone();
        let audit = open_audit(&self.cfg, &req.session_id, redactor.clone())
            .map_err(|e| error(Code::Internal, format!("session not forked: {e}"), ""))?;
        let commit = session::fork_branch(&self.cfg.workspace, &req.session_id, self.cfg.identity)
            .await
            .map_err(|e| {
                error(
                    Code::Repository,
                    redactor.redact(&format!("session not forked: {e}")),
                    "",
                )
            })?;
        // The parent's chain as this guest holds it (perhaps beyond the host's).
        let (own_seq, own_hash) = {
            let log = self.audit.lock().await;
            let hash = if log.seq() == 0 { "" } else { log.last_hash() };
            (log.seq(), hash.to_string())
        };
        let turns = {
            let mut turns = lock(&self.turns);
            let backend = turns.backend().clone();
            std::mem::replace(&mut *turns, Turns::new(backend))
        };
        let s = Arc::new(Self {
            id: req.session_id.clone(),
            branch: branch.clone(),
            policy: self.policy.clone(),
            secrets: self.secrets.clone(),
            env: self.env.clone(),
            ask_timeout: self.ask_timeout,
            base_commit: commit.clone(),
            cfg: self.cfg.clone(),
            out: Mutex::new(out),
            audit: tokio::sync::Mutex::new(audit),
            always: Mutex::new(HashSet::new()),
            asks: Mutex::new(HashMap::new()),
            exec_ids: Mutex::new(HashSet::new()),
            running: Mutex::new(HashMap::new()),
            turns: Mutex::new(turns),
            // The nftables counter goes on counting: only later denials are new.
            egress_denied: Mutex::new(*lock(&self.egress_denied)),
        });
        s.audit(Entry {
            actor: "host",
            action: "session.forked",
            resource: &format!("{branch} agent={} base={commit}", s.policy.agent),
            result: &format!(
                "parent_session_id={} parent_audit_seq={} parent_audit_hash={} \
                 guest_audit_seq={own_seq} guest_audit_hash={own_hash}",
                self.id, req.parent_audit_seq, req.parent_audit_hash
            ),
            ..Default::default()
        })
        .await;
        s.audit_clock(clock).await;
        s.audit_fresh(fresh).await;
        tracing::info!(session = %s.id, parent = %self.id, base = %commit, "session forked");
        s.send_ready().await;
        Ok(s)
    }

    /// Waits (at most [`SETTLE`]) until none of this session's commands is
    /// left running.
    async fn settle(&self) {
        let give_up = tokio::time::Instant::now() + SETTLE;
        while !lock(&self.running).is_empty() && tokio::time::Instant::now() < give_up {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// An audit event's hash as the host names it: empty (none), or 64
/// hexadecimal digits.
fn is_hash(h: &str) -> bool {
    h.is_empty() || (h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::is_hash;

    #[test]
    fn a_parent_hash_is_empty_or_a_sha256_in_hex() {
        assert!(is_hash(""));
        assert!(is_hash(&"0a".repeat(32)));
        assert!(!is_hash("not-a-hash"));
        assert!(!is_hash(&"0".repeat(63)));
        assert!(!is_hash(&"g".repeat(64)));
    }
}
