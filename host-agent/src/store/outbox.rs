//! The fleet export's outbox: every event, ask, usage record and audit
//! record committed while the export is on gets an outbox row in the same
//! transaction, so what JetStream has not acknowledged is never lost, and
//! is published in commit order.
//!
//! The rows are written by SQLite triggers on the `events`, `usage` and
//! `audit` tables (schema.rs) rather than by each insert in host-agent: the
//! same transaction by construction, and no insert path can forget it. A
//! row refers to its record (which is never deleted) instead of copying it.

use rusqlite::{params, OptionalExtension};

use super::{audit_row, event_from_row, usage_from_row, Store, EVENT_COLS, USAGE_COLS};
use super::{AuditRow, EventRow, UsageRow};
use crate::error::Result;

/// What the outbox holds, by JetStream subject's last token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutboxKind {
    /// A lifecycle or schedule event.
    Events,
    /// A usage record.
    Usage,
    /// An ask's event (`ask`, `ask_answered`, `ask_unanswered`), also in
    /// events.
    Asks,
    /// A guest audit record.
    Audit,
}

impl OutboxKind {
    /// Every kind.
    pub const ALL: [OutboxKind; 4] = [
        OutboxKind::Events,
        OutboxKind::Usage,
        OutboxKind::Asks,
        OutboxKind::Audit,
    ];

    /// Its name in the outbox, in subjects and message ids.
    pub fn name(self) -> &'static str {
        match self {
            OutboxKind::Events => "events",
            OutboxKind::Usage => "usage",
            OutboxKind::Asks => "asks",
            OutboxKind::Audit => "audit",
        }
    }

    fn parse(s: &str) -> Option<OutboxKind> {
        OutboxKind::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// A record waiting to be published.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// An event (kinds events and asks).
    Event(EventRow),
    /// A usage record.
    Usage(UsageRow),
    /// An audit record.
    Audit(AuditRow),
}

/// One outbox row with its record.
#[derive(Debug, Clone, PartialEq)]
pub struct Outgoing {
    /// The outbox's seq: per node, increasing in commit order.
    pub seq: u64,
    /// Which subject it goes to.
    pub kind: OutboxKind,
    /// The record; None when it is gone (never expected: records are not
    /// deleted), so the row can be dropped.
    pub record: Option<Record>,
}

impl Store {
    /// Turns the outbox on (records committed from now on get a row) or
    /// off (rows already there stay until published).
    pub fn set_outbox(&self, on: bool) -> Result<()> {
        self.with(|c| {
            if on {
                c.execute("INSERT OR IGNORE INTO outbox_on VALUES (1)", [])?;
            } else {
                c.execute("DELETE FROM outbox_on", [])?;
            }
            Ok(())
        })
    }

    /// Waits until an outbox row may have been written since the last wait
    /// (a permit is kept when none was waiting).
    pub async fn outbox_written(&self) {
        self.outbox_ready.notified().await;
    }

    /// The oldest `limit` outbox rows with their records, in seq order.
    pub fn outbox_pending(&self, limit: u32) -> Result<Vec<Outgoing>> {
        self.with(|c| {
            let mut st = c.prepare_cached(
                "SELECT seq, kind, ref_seq, ref_session FROM outbox ORDER BY seq LIMIT ?1",
            )?;
            let rows: Vec<(i64, String, i64, String)> = st
                .query_map([limit], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
                })?
                .collect::<rusqlite::Result<_>>()?;
            let mut out = Vec::with_capacity(rows.len());
            for (seq, kind, ref_seq, ref_session) in rows {
                let Some(kind) = OutboxKind::parse(&kind) else {
                    // Written by a newer host-agent: not ours to publish.
                    out.push(Outgoing {
                        seq: seq as u64,
                        kind: OutboxKind::Events,
                        record: None,
                    });
                    continue;
                };
                let record = match kind {
                    OutboxKind::Events | OutboxKind::Asks => c
                        .prepare_cached(&format!("SELECT {EVENT_COLS} FROM events WHERE seq=?1"))?
                        .query_row([ref_seq], event_from_row)
                        .optional()?
                        .map(Record::Event),
                    OutboxKind::Usage => c
                        .prepare_cached(&format!("SELECT {USAGE_COLS} FROM usage WHERE seq=?1"))?
                        .query_row([ref_seq], usage_from_row)
                        .optional()?
                        .map(Record::Usage),
                    OutboxKind::Audit => c
                        .prepare_cached(
                            "SELECT session_id, guest_seq, json, host_hash, received_at FROM audit \
                             WHERE session_id=?1 AND guest_seq=?2",
                        )?
                        .query_row(params![ref_session, ref_seq], audit_row)
                        .optional()?
                        .map(Record::Audit),
                };
                out.push(Outgoing {
                    seq: seq as u64,
                    kind,
                    record,
                });
            }
            Ok(out)
        })
    }

    /// Drops the rows up to `seq` (JetStream acknowledged them); with
    /// `kind`, only that kind's.
    pub fn outbox_trim(&self, through: u64, kind: Option<OutboxKind>) -> Result<u64> {
        let n = self.with(|c| {
            c.execute(
                "DELETE FROM outbox WHERE seq <= ?1 AND (?2 IS NULL OR kind = ?2)",
                params![
                    i64::try_from(through).unwrap_or(i64::MAX),
                    kind.map(OutboxKind::name)
                ],
            )
        })?;
        Ok(n as u64)
    }

    /// Rows waiting, and the oldest one's commit time (unix ms; 0 when
    /// none).
    pub fn outbox_backlog(&self) -> Result<(u64, i64)> {
        self.with(|c| {
            c.query_row(
                "SELECT COUNT(*), COALESCE(MIN(at), 0) FROM outbox",
                [],
                |r| Ok((r.get::<_, i64>(0)? as u64, r.get(1)?)),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SessionRow;

    fn session(id: &str) -> SessionRow {
        SessionRow {
            id: id.into(),
            owner: "o".into(),
            ..Default::default()
        }
    }

    fn event(id: &str, reason: &str) -> EventRow {
        EventRow {
            session_id: id.into(),
            reason: reason.into(),
            kind: crate::store::EVENT_SESSION.into(),
            ..Default::default()
        }
    }

    fn usage(id: &str) -> UsageRow {
        UsageRow {
            session_id: id.into(),
            ..Default::default()
        }
    }

    trait Append {
        fn append_event(&self, ev: &EventRow) -> Result<u64>;
    }
    impl Append for Store {
        fn append_event(&self, ev: &EventRow) -> Result<u64> {
            self.transition(&session(&ev.session_id), ev)
        }
    }

    #[test]
    fn records_get_outbox_rows_only_while_the_export_is_on_and_in_commit_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("db")).unwrap();
        store.insert_usage(&usage("s1")).unwrap();
        assert!(store.outbox_pending(10).unwrap().is_empty());
        store.set_outbox(true).unwrap();
        let ev = store.append_event(&event("s1", "created")).unwrap();
        let ask = store.append_event(&event("s1", "ask")).unwrap();
        let u = store.insert_usage(&usage("s1")).unwrap();
        store
            .insert_audit(&AuditRow {
                session_id: "s1".into(),
                guest_seq: 7,
                json: "{}".into(),
                host_hash: "h".into(),
                received_at: 5,
            })
            .unwrap();
        // The same audit record again is ignored, and gets no second row.
        store
            .insert_audit(&AuditRow {
                session_id: "s1".into(),
                guest_seq: 7,
                json: "{}".into(),
                host_hash: "h".into(),
                received_at: 5,
            })
            .unwrap();
        let rows = store.outbox_pending(10).unwrap();
        let kinds: Vec<_> = rows.iter().map(|r| r.kind).collect();
        assert_eq!(
            kinds,
            [
                OutboxKind::Events,
                OutboxKind::Events,
                OutboxKind::Asks,
                OutboxKind::Usage,
                OutboxKind::Audit
            ]
        );
        assert!(rows.windows(2).all(|w| w[0].seq < w[1].seq));
        let seqs: Vec<u64> = rows
            .iter()
            .map(|r| match &r.record {
                Some(Record::Event(e)) => e.seq,
                Some(Record::Usage(u)) => u.seq,
                Some(Record::Audit(a)) => a.guest_seq,
                None => panic!("record missing"),
            })
            .collect();
        assert_eq!(seqs, [ev, ask, ask, u, 7]);
        assert_eq!(store.outbox_backlog().unwrap().0, 5);
        // Trimming one kind leaves the others.
        assert_eq!(
            store.outbox_trim(u64::MAX, Some(OutboxKind::Asks)).unwrap(),
            1
        );
        assert_eq!(store.outbox_trim(rows[1].seq, None).unwrap(), 2);
        let left: Vec<_> = store
            .outbox_pending(10)
            .unwrap()
            .into_iter()
            .map(|r| r.kind)
            .collect();
        assert_eq!(left, [OutboxKind::Usage, OutboxKind::Audit]);
        // Off: new records get no rows; the waiting ones stay.
        store.set_outbox(false).unwrap();
        store.append_event(&event("s1", "stopped")).unwrap();
        assert_eq!(store.outbox_pending(10).unwrap().len(), 2);
    }

    #[test]
    fn the_outbox_survives_reopening_the_database() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        {
            let store = Store::open(&path).unwrap();
            store.set_outbox(true).unwrap();
            store.append_event(&event("s1", "created")).unwrap();
        }
        let store = Store::open(&path).unwrap();
        assert_eq!(store.outbox_pending(10).unwrap().len(), 1);
    }
}
