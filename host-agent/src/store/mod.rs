//! The node's state in an embedded SQLite database: images, sessions,
//! lifecycle events, usage records, audit records and idempotency keys.
//!
//! Every write is one statement or one transaction, so a SIGKILL at any point
//! leaves a consistent database. The journal is WAL with `synchronous=NORMAL`:
//! a committed transaction survives the process being killed (it is in the
//! WAL file); only a power loss or kernel crash may lose the last few
//! commits.

use std::path::Path;
use std::sync::Mutex;

use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::error::{Error, Result};
use schema::{migrate, SCHEMA};

mod layers;
mod listing;
mod moves;
mod outbox;
mod rows;
mod runs;
mod schedules;
mod schema;
mod triggers;

pub use layers::LayerRow;
pub use listing::{Cursor, EventFilter, SessionQuery};
pub use outbox::{OutboxKind, Outgoing, Record};
pub use rows::{AuditRow, EventRow, ImageRow, SessionRow, UsageRow, EVENT_SCHEDULE, EVENT_SESSION};
pub use runs::{Recorded, RunRow};
pub use triggers::{DeliveryRow, TriggerRow, ACCEPTED};

/// Owner recorded for sessions created before owners existed (database
/// migration); only admin clients see them.
pub const LEGACY_OWNER: &str = "legacy";

/// The database. Calls are short and synchronous; the mutex serializes them.
pub struct Store {
    conn: Mutex<Connection>,
    /// Woken when an outbox row is written (the fleet exporter waits on it).
    outbox_ready: std::sync::Arc<tokio::sync::Notify>,
}

pub(super) fn audit_row(r: &Row<'_>) -> rusqlite::Result<AuditRow> {
    Ok(AuditRow {
        session_id: r.get(0)?,
        guest_seq: r.get::<_, i64>(1)? as u64,
        json: r.get(2)?,
        host_hash: r.get(3)?,
        received_at: r.get(4)?,
    })
}

fn image_from_row(r: &Row<'_>) -> rusqlite::Result<ImageRow> {
    Ok(ImageRow {
        id: r.get(0)?,
        kernel: r.get(1)?,
        rootfs: r.get(2)?,
        cmdline: r.get(3)?,
        mem_mib: r.get(4)?,
        vcpus: r.get(5)?,
        guest_init: r.get(6)?,
        golden_dir: r.get(7)?,
        created_at: r.get(8)?,
        golden_built_at: r.get(9)?,
        initrd: r.get(10)?,
        io_limits: r.get(11)?,
        source_session: r.get(12)?,
        shares: r.get(13)?,
    })
}

const IMAGE_COLS: &str = "id, kernel, rootfs, cmdline, mem_mib, vcpus, guest_init, golden_dir, \
    created_at, golden_built_at, initrd, io_limits, source_session, shares";

const SESSION_COLS: &str = "id, image_id, state, execution_id, reason, detail, created_at, \
    ready_at, ended_at, vmm_pid, vmm_start_ticks, dir, ttl_s, idle_s, labels, branch, \
    head_commit, last_activity, repository, agent, base_ref, owner, jail_uid, io_limits, \
    vm_addresses, resources, base_layer, persisted, auto_resume, parent_session, shares, \
    fs_daemons";

fn session_from_row(r: &Row<'_>) -> rusqlite::Result<SessionRow> {
    let labels: String = r.get(14)?;
    Ok(SessionRow {
        id: r.get(0)?,
        image_id: r.get(1)?,
        state: r.get(2)?,
        execution_id: r.get(3)?,
        reason: r.get(4)?,
        detail: r.get(5)?,
        created_at: r.get(6)?,
        ready_at: r.get(7)?,
        ended_at: r.get(8)?,
        vmm_pid: r.get(9)?,
        vmm_start_ticks: r.get::<_, i64>(10)? as u64,
        dir: r.get(11)?,
        ttl_s: r.get::<_, i64>(12)? as u64,
        idle_s: r.get::<_, i64>(13)? as u64,
        // Labels are always written by `put_session` as a JSON object.
        labels: serde_json::from_str(&labels).unwrap_or_default(),
        branch: r.get(15)?,
        head_commit: r.get(16)?,
        last_activity: r.get(17)?,
        repository: r.get(18)?,
        agent: r.get(19)?,
        base_ref: r.get(20)?,
        owner: r.get(21)?,
        jail_uid: r.get::<_, i64>(22)? as u32,
        io_limits: r.get(23)?,
        vm_addresses: r.get(24)?,
        resources: r.get(25)?,
        base_layer: r.get(26)?,
        persisted: r.get(27)?,
        auto_resume: r.get(28)?,
        parent_session: r.get(29)?,
        shares: r.get(30)?,
        fs_daemons: r.get(31)?,
    })
}

pub(super) const USAGE_COLS: &str = "seq, session_id, execution_id, interval_start, interval_end, \
    billed_ms, vcpu_ns, mem_alloc, mem_res, disk, final, raw_cpu_ns, raw_disk, \
    net_rx_bytes, net_rx_packets, net_tx_bytes, net_tx_packets, net_denied, dns_denied, \
    snapshot_gib_ms";

pub(super) fn usage_from_row(r: &Row<'_>) -> rusqlite::Result<UsageRow> {
    Ok(UsageRow {
        seq: r.get::<_, i64>(0)? as u64,
        session_id: r.get(1)?,
        execution_id: r.get(2)?,
        interval_start: r.get(3)?,
        interval_end: r.get(4)?,
        billed_ms: r.get(5)?,
        vcpu_ns: r.get::<_, i64>(6)? as u64,
        mem_alloc_gib_ms: r.get(7)?,
        mem_resident_gib_ms: r.get(8)?,
        disk_bytes: r.get::<_, i64>(9)? as u64,
        is_final: r.get(10)?,
        raw_cpu_ns: r.get::<_, i64>(11)? as u64,
        raw_disk: r.get::<_, i64>(12)? as u64,
        net: crate::accounting::NetIo {
            rx_bytes: r.get::<_, i64>(13)? as u64,
            rx_packets: r.get::<_, i64>(14)? as u64,
            tx_bytes: r.get::<_, i64>(15)? as u64,
            tx_packets: r.get::<_, i64>(16)? as u64,
            denied_packets: r.get::<_, i64>(17)? as u64,
            dns_denied: r.get::<_, i64>(18)? as u64,
        },
        snapshot_gib_ms: r.get(19)?,
    })
}

/// The columns [`event_from_row`] reads, in its order.
pub(super) const EVENT_COLS: &str =
    "seq, session_id, execution_id, at, from_state, to_state, reason, detail, \
     kind, schedule_id, run_id, trigger_id";

pub(super) fn event_from_row(r: &Row<'_>) -> rusqlite::Result<EventRow> {
    Ok(EventRow {
        seq: r.get::<_, i64>(0)? as u64,
        session_id: r.get(1)?,
        execution_id: r.get(2)?,
        at: r.get(3)?,
        from: r.get(4)?,
        to: r.get(5)?,
        reason: r.get(6)?,
        detail: r.get(7)?,
        kind: r.get(8)?,
        schedule_id: r.get(9)?,
        run_id: r.get::<_, i64>(10)? as u64,
        trigger_id: r.get(11)?,
    })
}

/// Appends `ev` (of a session's lifecycle or a schedule's run; its kind
/// says which) for `owner`; returns its seq.
pub(super) fn insert_event(c: &Connection, ev: &EventRow, owner: &str) -> rusqlite::Result<u64> {
    c.execute(
        "INSERT INTO events(session_id, execution_id, at, from_state, to_state, reason, detail, \
         owner, kind, schedule_id, run_id, trigger_id) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12)",
        params![
            ev.session_id,
            ev.execution_id,
            ev.at,
            ev.from,
            ev.to,
            ev.reason,
            ev.detail,
            owner,
            ev.kind,
            ev.schedule_id,
            ev.run_id as i64,
            ev.trigger_id
        ],
    )?;
    Ok(c.last_insert_rowid() as u64)
}

/// Writes session row `s` and appends its event `ev` (in the caller's
/// transaction); returns the event's seq.
pub(super) fn put_session_with_event(
    c: &Connection,
    s: &SessionRow,
    ev: &EventRow,
) -> rusqlite::Result<u64> {
    put_session(c, s)?;
    let seq = insert_event(c, ev, &s.owner)?;
    if !s.labels.is_empty() {
        // Written with the session's first event, for watchers filtering
        // by label (labels never change).
        c.execute(
            "INSERT OR IGNORE INTO session_labels VALUES (?1, ?2)",
            params![s.id, labels_json(&s.labels)],
        )?;
    }
    Ok(seq)
}

impl Store {
    /// Opens (creating if needed) the database at `path`.
    pub fn open(path: &Path) -> Result<Store> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        conn.execute_batch(SCHEMA)?;
        migrate(&conn)?;
        conn.execute_batch("PRAGMA synchronous=NORMAL;")?;
        let outbox_ready = std::sync::Arc::new(tokio::sync::Notify::new());
        let ready = outbox_ready.clone();
        // Called inside the writing statement, before its commit; the
        // exporter reads through this same connection, so it sees the row
        // only once the writer has released the connection.
        conn.update_hook(Some(
            move |action: rusqlite::hooks::Action, _db: &str, table: &str, _row: i64| {
                if action == rusqlite::hooks::Action::SQLITE_INSERT && table == "outbox" {
                    ready.notify_one();
                }
            },
        ));
        Ok(Store {
            conn: Mutex::new(conn),
            outbox_ready,
        })
    }

    fn with<T>(&self, f: impl FnOnce(&mut Connection) -> rusqlite::Result<T>) -> Result<T> {
        // A poisoned lock means a panic mid-call; SQLite itself stays
        // consistent (each call is atomic), so carry on with the connection.
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        Ok(f(&mut conn)?)
    }

    /// Inserts an image; `AlreadyExists` if the id is taken.
    pub fn insert_image(&self, img: &ImageRow) -> Result<()> {
        let n = self.with(|c| {
            c.execute(
                "INSERT OR IGNORE INTO images(id, kernel, rootfs, cmdline, mem_mib, vcpus, \
                 guest_init, golden_dir, created_at, golden_built_at, initrd, io_limits, \
                 source_session, shares) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12,?13,?14)",
                params![
                    img.id,
                    img.kernel,
                    img.rootfs,
                    img.cmdline,
                    img.mem_mib,
                    img.vcpus,
                    img.guest_init,
                    img.golden_dir,
                    img.created_at,
                    img.golden_built_at,
                    img.initrd,
                    img.io_limits,
                    img.source_session,
                    img.shares
                ],
            )
        })?;
        if n == 0 {
            return Err(Error::AlreadyExists(format!(
                "image {:?} is already registered; delete it first or pick another id",
                img.id
            )));
        }
        Ok(())
    }

    /// Records an image's golden snapshot.
    pub fn set_golden(&self, id: &str, dir: &str, at: i64) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE images SET golden_dir=?2, golden_built_at=?3 WHERE id=?1",
                params![id, dir, at],
            )
        })?;
        Ok(())
    }

    /// Looks an image up.
    pub fn image(&self, id: &str) -> Result<Option<ImageRow>> {
        self.with(|c| {
            c.query_row(
                &format!("SELECT {IMAGE_COLS} FROM images WHERE id=?1"),
                [id],
                image_from_row,
            )
            .optional()
        })
    }

    /// All images by id.
    pub fn images(&self) -> Result<Vec<ImageRow>> {
        self.with(|c| {
            let mut st = c.prepare(&format!("SELECT {IMAGE_COLS} FROM images ORDER BY id"))?;
            let rows = st.query_map([], image_from_row)?;
            rows.collect()
        })
    }

    /// Deletes an image record.
    pub fn delete_image(&self, id: &str) -> Result<bool> {
        Ok(self.with(|c| c.execute("DELETE FROM images WHERE id=?1", [id]))? > 0)
    }

    /// Inserts or replaces a session row.
    pub fn put_session(&self, s: &SessionRow) -> Result<()> {
        self.with(|c| put_session(c, s))
    }

    /// Writes a session row and appends its event in one transaction;
    /// returns the event's seq.
    pub fn transition(&self, s: &SessionRow, ev: &EventRow) -> Result<u64> {
        self.with(|c| {
            let tx = c.transaction()?;
            let seq = put_session_with_event(&tx, s, ev)?;
            tx.commit()?;
            Ok(seq)
        })
    }

    /// Looks a session up.
    pub fn session(&self, id: &str) -> Result<Option<SessionRow>> {
        self.with(|c| {
            c.query_row(
                &format!("SELECT {SESSION_COLS} FROM sessions WHERE id=?1"),
                [id],
                session_from_row,
            )
            .optional()
        })
    }

    /// All sessions, oldest first.
    pub fn sessions(&self) -> Result<Vec<SessionRow>> {
        self.with(|c| {
            let mut st = c.prepare(&format!(
                "SELECT {SESSION_COLS} FROM sessions ORDER BY created_at, id"
            ))?;
            let rows = st.query_map([], session_from_row)?;
            rows.collect()
        })
    }

    /// Removes a session row (events and usage stay).
    pub fn delete_session(&self, id: &str) -> Result<()> {
        self.with(|c| c.execute("DELETE FROM sessions WHERE id=?1", [id]))?;
        Ok(())
    }

    /// Events with seq > `since` that `filter` lets through, at most
    /// `limit`.
    pub fn events_since(
        &self,
        since: u64,
        filter: &EventFilter,
        limit: u32,
    ) -> Result<Vec<EventRow>> {
        let labels = (!filter.labels.is_empty()).then(|| labels_json(&filter.labels));
        let kinds = (!filter.kinds.is_empty())
            .then(|| serde_json::Value::from(filter.kinds.clone()).to_string());
        self.with(|c| {
            let mut st = c.prepare(&format!(
                "SELECT seq, session_id, execution_id, at, from_state, to_state, reason, detail, \
                 kind, schedule_id, run_id, trigger_id \
                 FROM events WHERE seq > ?1 AND (?2 IS NULL OR session_id = ?2) \
                 AND (?4 IS NULL OR owner = ?4) AND (?5 IS NULL OR {}) \
                 AND (?6 IS NULL OR kind IN (SELECT value FROM json_each(?6))) \
                 ORDER BY seq LIMIT ?3",
                listing::EVENT_HAS_LABELS
            ))?;
            let rows = st.query_map(
                params![
                    since as i64,
                    filter.session,
                    limit,
                    filter.owner,
                    labels,
                    kinds
                ],
                event_from_row,
            )?;
            rows.collect()
        })
    }

    /// The highest event seq, 0 when none.
    pub fn last_event_seq(&self) -> Result<u64> {
        self.with(|c| {
            c.query_row("SELECT COALESCE(MAX(seq), 0) FROM events", [], |r| {
                r.get::<_, i64>(0)
            })
        })
        .map(|v| v as u64)
    }

    /// Appends a usage record; returns its seq.
    pub fn insert_usage(&self, u: &UsageRow) -> Result<u64> {
        self.with(|c| insert_usage(c, u))
    }

    /// The latest usage record of a session.
    pub fn last_usage(&self, session: &str) -> Result<Option<UsageRow>> {
        self.with(|c| {
            c.query_row(
                &format!(
                    "SELECT {USAGE_COLS} FROM usage WHERE session_id=?1 ORDER BY seq DESC LIMIT 1"
                ),
                [session],
                usage_from_row,
            )
            .optional()
        })
    }

    /// Usage records with seq > `since_seq` and interval_end > `since_time`,
    /// optionally of one session and of one owner's sessions.
    pub fn usage_since(
        &self,
        session: Option<&str>,
        owner: Option<&str>,
        since_seq: u64,
        since_time: i64,
        limit: u32,
    ) -> Result<Vec<UsageRow>> {
        self.with(|c| {
            let mut st = c.prepare(&format!(
                "SELECT {USAGE_COLS} FROM usage WHERE seq > ?1 AND interval_end > ?2 \
                 AND (?3 IS NULL OR session_id = ?3) AND (?5 IS NULL OR owner = ?5) \
                 ORDER BY seq LIMIT ?4"
            ))?;
            let rows = st.query_map(
                params![since_seq as i64, since_time, session, limit, owner],
                usage_from_row,
            )?;
            rows.collect()
        })
    }

    /// Appends an audit record.
    pub fn insert_audit(&self, a: &AuditRow) -> Result<()> {
        self.with(|c| {
            c.execute(
                "INSERT OR IGNORE INTO audit VALUES (?1,?2,?3,?4,?5)",
                params![
                    a.session_id,
                    a.guest_seq as i64,
                    a.json,
                    a.host_hash,
                    a.received_at
                ],
            )
        })?;
        Ok(())
    }

    /// Audit records of a session after `since` (guest seq).
    pub fn audit_since(&self, session: &str, since: u64) -> Result<Vec<AuditRow>> {
        self.with(|c| {
            let mut st = c.prepare(
                "SELECT session_id, guest_seq, json, host_hash, received_at FROM audit \
                 WHERE session_id=?1 AND guest_seq > ?2 ORDER BY guest_seq",
            )?;
            let rows = st.query_map(params![session, since as i64], audit_row)?;
            rows.collect()
        })
    }

    /// The session's audit records after guest seq `since`, in order, up to
    /// about `max_bytes` of JSON (always at least one record when any is
    /// left); true when more records follow.
    pub fn audit_page(
        &self,
        session: &str,
        since: u64,
        max_bytes: usize,
    ) -> Result<(Vec<AuditRow>, bool)> {
        self.with(|c| {
            let mut st = c.prepare(
                "SELECT session_id, guest_seq, json, host_hash, received_at FROM audit \
                 WHERE session_id=?1 AND guest_seq > ?2 ORDER BY guest_seq",
            )?;
            let mut rows = st.query_map(params![session, since as i64], audit_row)?;
            let mut page = Vec::new();
            let mut bytes = 0usize;
            for row in rows.by_ref() {
                let row = row?;
                bytes = bytes.saturating_add(row.json.len() + row.host_hash.len());
                if !page.is_empty() && bytes > max_bytes {
                    return Ok((page, true));
                }
                page.push(row);
            }
            Ok((page, false))
        })
    }

    /// Bytes of audit JSON stored for the session.
    pub fn audit_bytes(&self, session: &str) -> Result<u64> {
        self.with(|c| {
            c.query_row(
                "SELECT COALESCE(SUM(LENGTH(CAST(json AS BLOB))), 0) FROM audit WHERE session_id=?1",
                [session],
                |r| r.get::<_, i64>(0),
            )
        })
        .map(|n| u64::try_from(n).unwrap_or(0))
    }

    /// The session's audit record with the highest guest seq, if any.
    pub fn last_audit(&self, session: &str) -> Result<Option<AuditRow>> {
        self.with(|c| {
            c.query_row(
                "SELECT session_id, guest_seq, json, host_hash, received_at FROM audit \
                 WHERE session_id=?1 ORDER BY guest_seq DESC LIMIT 1",
                [session],
                audit_row,
            )
            .optional()
        })
    }

    /// Looks up an idempotency key: `(method, fingerprint, response)`.
    pub fn idempotent(&self, key: &str) -> Result<Option<(String, String, Vec<u8>)>> {
        self.with(|c| {
            c.query_row(
                "SELECT method, fingerprint, response FROM idempotency WHERE key=?1",
                [key],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()
        })
    }

    /// Records an idempotency key's response; returns false if the key was
    /// already recorded (the first response stands).
    pub fn put_idempotent(
        &self,
        key: &str,
        method: &str,
        fingerprint: &str,
        response: &[u8],
        at: i64,
    ) -> Result<bool> {
        Ok(self.with(|c| {
            c.execute(
                "INSERT OR IGNORE INTO idempotency VALUES (?1,?2,?3,?4,?5)",
                params![key, method, fingerprint, response, at],
            )
        })? > 0)
    }
}

/// Labels as stored: a JSON object.
/// Inserts usage record `u` (owned as its session is); returns its seq.
fn insert_usage(c: &Connection, u: &UsageRow) -> rusqlite::Result<u64> {
    c.execute(
        "INSERT INTO usage(session_id, execution_id, interval_start, interval_end, billed_ms, \
         vcpu_ns, mem_alloc, mem_res, disk, final, raw_cpu_ns, raw_disk, \
         net_rx_bytes, net_rx_packets, net_tx_bytes, net_tx_packets, net_denied, \
         dns_denied, snapshot_gib_ms, owner) \
         VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12,?13,?14,?15,?16,?17,?18,?19, \
         COALESCE((SELECT owner FROM sessions WHERE id = ?1), 'legacy'))",
        params![
            u.session_id,
            u.execution_id,
            u.interval_start,
            u.interval_end,
            u.billed_ms,
            u.vcpu_ns as i64,
            u.mem_alloc_gib_ms,
            u.mem_resident_gib_ms,
            u.disk_bytes as i64,
            u.is_final,
            u.raw_cpu_ns as i64,
            u.raw_disk as i64,
            u.net.rx_bytes as i64,
            u.net.rx_packets as i64,
            u.net.tx_bytes as i64,
            u.net.tx_packets as i64,
            u.net.denied_packets as i64,
            u.net.dns_denied as i64,
            u.snapshot_gib_ms
        ],
    )?;
    Ok(c.last_insert_rowid() as u64)
}

fn labels_json(labels: &std::collections::BTreeMap<String, String>) -> String {
    // A map of strings always serializes.
    serde_json::to_string(labels).unwrap_or_else(|_| "{}".into())
}

fn put_session(c: &Connection, s: &SessionRow) -> rusqlite::Result<()> {
    let labels = labels_json(&s.labels);
    c.execute(
        &format!(
            "INSERT OR REPLACE INTO sessions({SESSION_COLS}) VALUES \
             (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12,?13,?14,?15,?16,?17,?18,?19,?20,?21,?22,?23,?24,?25,?26,\
             ?27,?28,?29,?30,?31,?32)"
        ),
        params![
            s.id,
            s.image_id,
            s.state,
            s.execution_id,
            s.reason,
            s.detail,
            s.created_at,
            s.ready_at,
            s.ended_at,
            s.vmm_pid,
            s.vmm_start_ticks as i64,
            s.dir,
            s.ttl_s as i64,
            s.idle_s as i64,
            labels,
            s.branch,
            s.head_commit,
            s.last_activity,
            s.repository,
            s.agent,
            s.base_ref,
            s.owner,
            i64::from(s.jail_uid),
            s.io_limits,
            s.vm_addresses,
            s.resources,
            s.base_layer,
            s.persisted,
            s.auto_resume,
            s.parent_session,
            s.shares,
            s.fs_daemons
        ],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests;
