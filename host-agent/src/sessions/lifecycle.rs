//! The lifecycle state machine: the states' names, the transitions
//! allowed between them, the reasons a session stops or pauses, and
//! `Manager::transition`, which writes each change with its event.

use super::*;

/// Stop and pause reasons, as they appear in events and sessions.
pub mod reason {
    /// A client asked.
    pub const REQUESTED: &str = "requested";
    /// The session's TTL passed.
    pub const TTL_EXPIRED: &str = "ttl_expired";
    /// The node's maximum session lifetime passed.
    pub const MAX_LIFETIME: &str = "max_lifetime";
    /// No activity for the idle timeout (a pause, not a stop).
    pub const IDLE: &str = "idle";
    /// The guest reset or powered off (vmm exit 0).
    pub const GUEST_EXIT: &str = "guest_exit";
    /// The guest or VM failed (vmm exit 1).
    pub const GUEST_CRASH: &str = "guest_crash";
    /// The vmm process died (signal, unexpected code, or gone on re-attach).
    pub const VMM_CRASH: &str = "vmm_crash";
    /// host-agent stopped its sessions on shutdown.
    pub const HOST_AGENT_SHUTDOWN: &str = "host_agent_shutdown";
    /// The restore did not reach READY.
    pub const RESTORE_FAILED: &str = "restore_failed";
    /// A resume from disk whose guest did not take the session back: the
    /// VM went back to disk as it was (RESTORING -> PAUSED), nothing lost.
    pub const RESUME_FAILED: &str = "resume_failed";
    /// host-agent restarted while the session was being restored.
    pub const HOST_AGENT_RESTART: &str = "host_agent_restart";
    /// The session moved to another node (MoveSession): its STOPPED here,
    /// and the event that records its arrival there.
    pub const MOVED: &str = "moved";
    /// Stops for what the guest sent (audit over its limit or out of order).
    pub use crate::guest::reason::{AUDIT_LIMIT, AUDIT_OUT_OF_ORDER};
}

pub use crate::clock::now_ms;

/// Name of a state for messages ("RUNNING").
pub fn state_name(s: i32) -> &'static str {
    match S::try_from(s).unwrap_or(S::Unspecified) {
        S::Unspecified => "NONE",
        S::Pending => "PENDING",
        S::Restoring => "RESTORING",
        S::Ready => "READY",
        S::Running => "RUNNING",
        S::Paused => "PAUSED",
        S::Stopping => "STOPPING",
        S::Stopped => "STOPPED",
        S::Failed => "FAILED",
    }
}

/// Whether `s` is STOPPED or FAILED.
pub fn is_terminal(s: i32) -> bool {
    s == S::Stopped as i32 || s == S::Failed as i32
}

pub(super) fn allowed(from: i32, to: i32) -> bool {
    use S::*;
    let (Ok(f), Ok(t)) = (S::try_from(from), S::try_from(to)) else {
        return false;
    };
    matches!(
        (f, t),
        (Unspecified, Pending)
            | (Pending, Restoring)
            | (Restoring, Ready)
            // A resume from disk whose guest did not come back, put back.
            | (Restoring, Paused)
            | (Ready, Running)
            | (Ready | Running, Paused)
            | (Paused, Running)
            | (Running | Paused, Restoring)
            | (Pending | Restoring | Ready | Running | Paused, Stopping)
            | (Stopping, Stopped)
            | (
                Pending | Restoring | Ready | Running | Paused | Stopping,
                Failed
            )
    )
}

pub(super) fn billable(s: i32) -> bool {
    s == S::Ready as i32 || s == S::Running as i32 || s == S::Stopping as i32
}

impl Manager {
    /// Moves `sess` to `to`, persisting the row and the event together.
    pub(super) fn transition(
        &self,
        sess: &Session,
        to: S,
        reason: &str,
        detail: &str,
    ) -> Result<()> {
        let to = to as i32;
        let mut guard = sess.lock();
        let inner = &mut *guard;
        let from = inner.row.state;
        if !allowed(from, to) {
            return Err(Error::FailedPrecondition(format!(
                "session {} is {}; it cannot become {}",
                sess.id,
                state_name(from),
                state_name(to)
            )));
        }
        let now = now_ms();
        inner.row.state = to;
        if is_terminal(to) {
            // The session is over: its uid may go to another VM, and its
            // network goes (a vmm still in the namespace keeps it alive
            // until it exits; the node's end of the veth goes at once).
            self.jail_uids.release(inner.row.jail_uid);
            // Exposed ports close with their connections, and are not
            // opened again after a restart; the resolver stops.
            inner.exposed.clear();
            super::ports::forget_exposed(Path::new(&inner.row.dir));
            drop(inner.dns.take());
            if let (Some(vm), Some(node)) = (inner.network.take(), self.network.clone()) {
                let release = move || node.release(&vm);
                match tokio::runtime::Handle::try_current() {
                    Ok(rt) => drop(rt.spawn_blocking(release)),
                    Err(_) => release(),
                }
            }
        }
        if matches!(
            S::try_from(to),
            Ok(S::Paused | S::Stopping | S::Stopped | S::Failed)
        ) {
            inner.row.reason = reason.to_string();
            inner.row.detail = detail.to_string();
        }
        let pid = inner.vmm.as_ref().and_then(|v| v.sample_pid());
        if to == S::Ready as i32 {
            if let (Some(m), Some(s)) = (inner.meter.as_mut(), pid.and_then(read_sample)) {
                // A restored session's new process: its counters start here.
                m.baseline(s);
            }
        }
        if to == S::Ready as i32 && inner.meter.is_none() {
            let mut m = Meter::start(&sess.id, &inner.row.execution_id, inner.image.mem_mib, now);
            if let Some(s) = pid.and_then(read_sample) {
                m.baseline(s);
            }
            inner.meter = Some(m);
            if inner.row.ready_at == 0 {
                inner.row.ready_at = now;
            }
        }
        let mut final_usage = None;
        let reading = inner.net_reading.take();
        if let Some(m) = inner.meter.as_mut() {
            if let Some(r) = reading {
                m.absorb_net(r);
            }
            if to == S::Stopping as i32 {
                if let Some(s) = pid.and_then(read_sample) {
                    m.observe(s);
                }
            }
            if is_terminal(to) {
                if !m.is_finished() {
                    final_usage = Some(m.finish(now, None));
                }
            } else {
                m.set_billable(now, billable(to));
            }
        }
        if is_terminal(to) {
            inner.row.ended_at = now;
        }
        let ev = EventRow {
            seq: 0,
            session_id: sess.id.clone(),
            execution_id: inner.row.execution_id.clone(),
            at: now,
            from,
            to,
            reason: reason.to_string(),
            detail: detail.to_string(),
            kind: crate::store::EVENT_SESSION.into(),
            ..Default::default()
        };
        let seq = match self.store.transition(&inner.row, &ev) {
            Ok(seq) => seq,
            Err(e) => {
                inner.row.state = from;
                return Err(e);
            }
        };
        if let Some(u) = final_usage {
            self.store.insert_usage(&u)?;
        }
        drop(guard);
        if is_terminal(to) {
            // Over: nothing will restore it, so its snapshot layers go
            // unless forks or images still descend from them.
            for holder in [
                crate::layers::session_holder(&sess.id),
                crate::layers::snapshots_holder(&sess.id),
            ] {
                if let Err(e) = self.layers.release(None, &holder) {
                    tracing::warn!(session = %sess.id, error = %e, "letting go of its snapshot layers");
                }
            }
        }
        tracing::info!(session = %sess.id, seq, from = state_name(from), to = state_name(to), reason, detail, "transition");
        self.events.committed(seq);
        sess.state.send_replace(to);
        Ok(())
    }
}

impl Manager {
    /// Records an event of `sess` that changes no state (from = to = its
    /// state now), such as a change of its network policy.
    pub(super) fn note(&self, sess: &Session, reason: &str, detail: &str) -> Result<()> {
        // Held while the event is written, as a transition holds it: the
        // row written with it is the row as it is.
        let inner = sess.lock();
        let state = inner.row.state;
        let ev = EventRow {
            seq: 0,
            session_id: sess.id.clone(),
            execution_id: inner.row.execution_id.clone(),
            at: now_ms(),
            from: state,
            to: state,
            reason: reason.to_string(),
            detail: detail.to_string(),
            kind: crate::store::EVENT_SESSION.into(),
            ..Default::default()
        };
        let seq = self.store.transition(&inner.row, &ev)?;
        drop(inner);
        self.events.committed(seq);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [S; 9] = [
        S::Unspecified,
        S::Pending,
        S::Restoring,
        S::Ready,
        S::Running,
        S::Paused,
        S::Stopping,
        S::Stopped,
        S::Failed,
    ];

    #[test]
    fn the_transitions_allowed_are_exactly_the_lifecycle() {
        let allowed_pairs: Vec<(&str, &str)> = ALL
            .iter()
            .flat_map(|f| ALL.iter().map(move |t| (*f, *t)))
            .filter(|(f, t)| allowed(*f as i32, *t as i32))
            .map(|(f, t)| (state_name(f as i32), state_name(t as i32)))
            .collect();
        let expected = [
            ("NONE", "PENDING"),
            ("PENDING", "RESTORING"),
            ("PENDING", "STOPPING"),
            ("PENDING", "FAILED"),
            ("RESTORING", "READY"),
            ("RESTORING", "STOPPING"),
            ("RESTORING", "FAILED"),
            // A resume from disk whose guest did not take the session back.
            ("RESTORING", "PAUSED"),
            ("READY", "RUNNING"),
            ("READY", "PAUSED"),
            ("READY", "STOPPING"),
            ("READY", "FAILED"),
            ("RUNNING", "RESTORING"),
            ("RUNNING", "PAUSED"),
            ("RUNNING", "STOPPING"),
            ("RUNNING", "FAILED"),
            ("PAUSED", "RESTORING"),
            ("PAUSED", "RUNNING"),
            ("PAUSED", "STOPPING"),
            ("PAUSED", "FAILED"),
            ("STOPPING", "STOPPED"),
            ("STOPPING", "FAILED"),
        ];
        let mut got = allowed_pairs.clone();
        let mut want = expected.to_vec();
        got.sort();
        want.sort();
        assert_eq!(got, want);
        // Nothing leaves an ended session, and unknown numbers go nowhere.
        for t in ALL {
            assert!(!allowed(S::Stopped as i32, t as i32));
            assert!(!allowed(S::Failed as i32, t as i32));
        }
        assert!(!allowed(99, S::Pending as i32));
        assert!(!allowed(S::Pending as i32, -1));
    }

    #[test]
    fn only_ready_running_and_stopping_are_billed_and_only_the_ends_are_terminal() {
        let billed: Vec<&str> = ALL
            .iter()
            .filter(|s| billable(**s as i32))
            .map(|s| state_name(*s as i32))
            .collect();
        assert_eq!(billed, ["READY", "RUNNING", "STOPPING"]);
        let ends: Vec<&str> = ALL
            .iter()
            .filter(|s| is_terminal(**s as i32))
            .map(|s| state_name(*s as i32))
            .collect();
        assert_eq!(ends, ["STOPPED", "FAILED"]);
    }
}
