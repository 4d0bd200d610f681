//! The per-interval work over every session: usage samples, and the TTL,
//! node lifetime and idle limits.

use super::*;
use crate::config::IdlePause;

impl Manager {
    /// Writes one usage record for every metered, unfinished session.
    pub fn sample_usage(&self) {
        let now = now_ms();
        for sess in self.all() {
            // Read before the session's lock is taken (the layer records
            // are the database's).
            let snapshot_bytes = self.layers.bytes_of_session(&sess.id);
            let mut i = sess.lock();
            let pid = i.vmm.as_ref().and_then(|v| v.sample_pid());
            let reading = net_usage::take_reading(&mut i);
            let Some(m) = i.meter.as_mut() else { continue };
            if m.is_finished() {
                continue;
            }
            if let Some(r) = reading {
                m.absorb_net(r);
            }
            match snapshot_bytes {
                Ok(b) => m.set_snapshot_bytes(now, b),
                Err(e) => {
                    tracing::warn!(session = %sess.id, error = %e, "reading its snapshot storage")
                }
            }
            let row = m.record(now, pid.and_then(read_sample));
            if let Err(e) = self.store.insert_usage(&row) {
                tracing::error!(session = %sess.id, error = %e, "writing usage record");
            }
        }
    }

    /// Checks TTL, max lifetime and idle timeout; stops or pauses sessions.
    pub fn enforce_limits(self: &Arc<Self>) {
        let now = now_ms();
        for sess in self.all() {
            let action = {
                let mut i = sess.lock();
                let r = &i.row;
                let live = r.state == S::Running as i32 || r.state == S::Paused as i32;
                if !live || i.enforcing {
                    continue;
                }
                let ttl_due = r.ttl_s > 0 && now >= r.created_at + (r.ttl_s as i64) * 1000;
                let life = self.cfg.max_lifetime_seconds;
                let life_due = life > 0 && now >= r.created_at + (life as i64) * 1000;
                let idle_due = r.state == S::Running as i32
                    && r.idle_s > 0
                    && now >= r.last_activity + (r.idle_s as i64) * 1000;
                let violation = i.guest.as_ref().and_then(|g| g.violation());
                let action = if let Some(v) = &violation {
                    tracing::warn!(session = %sess.id, reason = v.reason, detail = %v.detail, "stopping the session for what its guest sent");
                    Some(v.reason)
                } else if ttl_due {
                    Some(reason::TTL_EXPIRED)
                } else if life_due {
                    Some(reason::MAX_LIFETIME)
                } else if idle_due {
                    Some(reason::IDLE)
                } else {
                    None
                };
                if action.is_some() {
                    i.enforcing = true;
                }
                action
            };
            let Some(why) = action else { continue };
            let mgr = self.clone();
            tokio::spawn(async move {
                let r = if why == reason::IDLE && mgr.cfg.idle_pause == IdlePause::Disk {
                    mgr.persist(&sess.id, why).await.map(|_| ())
                } else if why == reason::IDLE {
                    mgr.pause(&sess.id, why).await.map(|_| ())
                } else {
                    mgr.stop(&sess.id, why).await.map(|_| ())
                };
                if let Err(e) = r {
                    tracing::warn!(session = %sess.id, reason = why, error = %e, "limit action failed");
                }
                sess.lock().enforcing = false;
            });
        }
    }
}
