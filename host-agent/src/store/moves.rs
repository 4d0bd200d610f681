//! A session moved here from another node (MoveSession), recorded at once.

use rusqlite::params;

use super::{insert_usage, put_session_with_event, Store};
use crate::error::Result;
use crate::store::{AuditRow, EventRow, SessionRow, UsageRow};

impl Store {
    /// Records session `s`, moved here from another node, in one
    /// transaction: its row with event `ev` (which says so), its audit
    /// records as they were there (their hashes chain on, so the chain its
    /// guest continues here is one), and `usage`, its last usage record
    /// there, whose cumulative counters its next records here continue.
    ///
    /// The audit and usage rows are the other node's records, exported by
    /// it already: they get no outbox rows here (those the triggers write
    /// are deleted in the same transaction), so the fleet's streams hold
    /// each once. The event is this node's, and exported as any other.
    /// Returns the event's seq.
    pub fn insert_moved_session(
        &self,
        s: &SessionRow,
        ev: &EventRow,
        audit: &[AuditRow],
        usage: Option<&UsageRow>,
    ) -> Result<u64> {
        self.with(|c| {
            let tx = c.transaction()?;
            let seq = put_session_with_event(&tx, s, ev)?;
            let outbox_before: i64 =
                tx.query_row("SELECT COALESCE(MAX(seq), 0) FROM outbox", [], |r| r.get(0))?;
            for a in audit {
                tx.execute(
                    // Replacing what a node the session left earlier kept
                    // of its chain (moved back after DeleteSession there).
                    "INSERT OR REPLACE INTO audit VALUES (?1,?2,?3,?4,?5)",
                    params![
                        a.session_id,
                        a.guest_seq as i64,
                        a.json,
                        a.host_hash,
                        a.received_at
                    ],
                )?;
            }
            if let Some(u) = usage {
                insert_usage(&tx, u)?;
            }
            tx.execute(
                "DELETE FROM outbox WHERE seq > ?1 AND kind IN ('audit', 'usage')",
                [outbox_before],
            )?;
            tx.commit()?;
            Ok(seq)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_moved_session_is_recorded_whole_and_only_its_event_is_exported() {
        let t = tempfile::tempdir().unwrap();
        let store = Store::open(&t.path().join("db")).unwrap();
        store.set_outbox(true).unwrap();
        let s = SessionRow {
            id: "s".into(),
            owner: "alice".into(),
            execution_id: "e".into(),
            ..Default::default()
        };
        let ev = EventRow {
            session_id: "s".into(),
            execution_id: "e".into(),
            reason: "moved".into(),
            kind: crate::store::EVENT_SESSION.into(),
            ..Default::default()
        };
        let audit: Vec<AuditRow> = (1..=3)
            .map(|n| AuditRow {
                session_id: "s".into(),
                guest_seq: n,
                json: format!("{{\"n\":{n}}}"),
                host_hash: format!("h{n}"),
                received_at: n as i64,
            })
            .collect();
        let usage = UsageRow {
            session_id: "s".into(),
            execution_id: "e".into(),
            interval_end: 10,
            billed_ms: 5000,
            ..Default::default()
        };
        store
            .insert_moved_session(&s, &ev, &audit, Some(&usage))
            .unwrap();
        assert_eq!(store.session("s").unwrap().unwrap(), s);
        assert_eq!(store.audit_since("s", 0).unwrap(), audit);
        let last = store.last_usage("s").unwrap().unwrap();
        assert_eq!((last.billed_ms, last.interval_end), (5000, 10));
        assert_eq!(store.outbox_backlog().unwrap().0, 1, "the event only");
        // The session's next records are exported as usual.
        store.insert_usage(&usage).unwrap();
        assert_eq!(store.outbox_backlog().unwrap().0, 2);
    }
}
