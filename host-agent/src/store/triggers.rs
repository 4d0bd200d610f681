//! The triggers table (webhooks and what a delivery does) and the
//! trigger_deliveries table: every request to a trigger's webhook,
//! accepted or refused, kept a day. A delivery's run is recorded under the
//! key `trigger:<id>:<delivery id>`, unique, so a replay is a conflict
//! whatever the timing.

use prost::Message;
use rusqlite::{params, OptionalExtension, Row};

use super::Store;
use crate::error::{Error, Result};

/// How long deliveries are kept.
pub const DELIVERY_KEEP_MS: i64 = 24 * 3600 * 1000;
/// Most refused deliveries kept (the oldest go first): a flood of bad
/// requests cannot fill the disk.
pub const MAX_REFUSED_KEPT: i64 = 10_000;

/// A trigger as stored.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TriggerRow {
    /// Its id.
    pub id: String,
    /// The client that created it; its runs' sessions are that client's.
    pub owner: String,
    /// The scope its owner had when it was created.
    pub owner_scope: String,
    /// `pb::TriggerKind`, never unspecified.
    pub kind: i32,
    /// RUN: the schedule a delivery runs (empty: the trigger's template).
    pub schedule_id: String,
    /// RUN without a schedule: the session template.
    pub template: Option<proto::hostagent::CreateSessionRequest>,
    /// The command a delivery runs.
    pub run: Vec<String>,
    /// WAKE_UP: the session.
    pub session_id: String,
    /// Whether deliveries are taken.
    pub enabled: bool,
    /// The HMAC key (hex).
    pub secret: String,
    /// Unix ms.
    pub created_at: i64,
}

/// One delivery, as kept.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DeliveryRow {
    /// The trigger it was for (as the path named it).
    pub trigger_id: String,
    /// Its delivery id (as the request named it, cut).
    pub delivery_id: String,
    /// Unix ms.
    pub received_at: i64,
    /// The HTTP status answered.
    pub http_status: u16,
    /// "accepted", "bad_signature", ...
    pub outcome: String,
    /// Why, for an operator.
    pub detail: String,
    /// The run it started (accepted only).
    pub run_id: u64,
    /// The peer's address.
    pub remote: String,
}

/// The outcome of an accepted delivery.
pub const ACCEPTED: &str = "accepted";

const COLUMNS: &str = "id, owner, owner_scope, kind, schedule_id, template, run, session_id, \
                       enabled, secret, created_at";

fn trigger_from_row(r: &Row<'_>) -> rusqlite::Result<std::result::Result<TriggerRow, String>> {
    let id: String = r.get(0)?;
    let template: Vec<u8> = r.get(5)?;
    let run: String = r.get(6)?;
    let template = if template.is_empty() {
        None
    } else {
        match proto::hostagent::CreateSessionRequest::decode(template.as_slice()) {
            Ok(t) => Some(t),
            Err(e) => {
                return Ok(Err(format!(
                    "trigger {id:?}: its session template does not decode: {e}"
                )))
            }
        }
    };
    let run = match serde_json::from_str::<Vec<String>>(&run) {
        Ok(r) => r,
        Err(e) => {
            return Ok(Err(format!(
                "trigger {id:?}: its command does not decode: {e}"
            )))
        }
    };
    Ok(Ok(TriggerRow {
        id,
        owner: r.get(1)?,
        owner_scope: r.get(2)?,
        kind: r.get(3)?,
        schedule_id: r.get(4)?,
        template,
        run,
        session_id: r.get(7)?,
        enabled: r.get::<_, i64>(8)? != 0,
        secret: r.get(9)?,
        created_at: r.get(10)?,
    }))
}

fn delivery_from_row(r: &Row<'_>) -> rusqlite::Result<DeliveryRow> {
    Ok(DeliveryRow {
        trigger_id: r.get(0)?,
        delivery_id: r.get(1)?,
        received_at: r.get(2)?,
        http_status: r.get(3)?,
        outcome: r.get(4)?,
        detail: r.get(5)?,
        run_id: r.get::<_, i64>(6)? as u64,
        remote: r.get(7)?,
    })
}

impl Store {
    /// Inserts a trigger; `AlreadyExists` if its id is taken.
    pub fn insert_trigger(&self, t: &TriggerRow) -> Result<()> {
        let run = serde_json::to_string(&t.run)
            .map_err(|e| Error::Schedule(format!("encoding trigger {:?}'s command: {e}", t.id)))?;
        let template = t
            .template
            .as_ref()
            .map(|t| t.encode_to_vec())
            .unwrap_or_default();
        let n = self.with(|c| {
            c.execute(
                &format!(
                    "INSERT OR IGNORE INTO triggers({COLUMNS}) \
                     VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11)"
                ),
                params![
                    t.id,
                    t.owner,
                    t.owner_scope,
                    t.kind,
                    t.schedule_id,
                    template,
                    run,
                    t.session_id,
                    t.enabled as i64,
                    t.secret,
                    t.created_at
                ],
            )
        })?;
        if n == 0 {
            return Err(Error::AlreadyExists(format!(
                "trigger {:?} exists; delete it, or pick another id",
                t.id
            )));
        }
        Ok(())
    }

    /// One trigger.
    pub fn trigger(&self, id: &str) -> Result<Option<TriggerRow>> {
        let row = self.with(|c| {
            c.query_row(
                &format!("SELECT {COLUMNS} FROM triggers WHERE id=?1"),
                [id],
                trigger_from_row,
            )
            .optional()
        })?;
        row.transpose().map_err(Error::Schedule)
    }

    /// Every trigger, by id.
    pub fn triggers(&self) -> Result<Vec<TriggerRow>> {
        let rows = self.with(|c| {
            let mut st = c.prepare(&format!("SELECT {COLUMNS} FROM triggers ORDER BY id"))?;
            let rows = st.query_map([], trigger_from_row)?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
        })?;
        rows.into_iter()
            .collect::<std::result::Result<_, _>>()
            .map_err(Error::Schedule)
    }

    /// Deletes a trigger (its deliveries stay their day); false when there
    /// is none.
    pub fn delete_trigger(&self, id: &str) -> Result<bool> {
        Ok(self.with(|c| c.execute("DELETE FROM triggers WHERE id=?1", [id]))? > 0)
    }

    /// Keeps a delivery (trimming those past their day, and the oldest
    /// refused ones beyond [`MAX_REFUSED_KEPT`]).
    pub fn record_delivery(&self, d: &DeliveryRow) -> Result<()> {
        self.with(|c| {
            let tx = c.transaction()?;
            insert_delivery(&tx, d)?;
            trim(&tx, d.received_at)?;
            tx.commit()
        })
    }

    /// A trigger's deliveries, newest first, at most `limit`.
    pub fn deliveries(&self, trigger: &str, limit: u32) -> Result<Vec<DeliveryRow>> {
        self.with(|c| {
            let mut st = c.prepare(
                "SELECT trigger_id, delivery_id, received_at, http_status, outcome, detail, \
                 run_id, remote FROM trigger_deliveries WHERE trigger_id=?1 \
                 ORDER BY seq DESC LIMIT ?2",
            )?;
            let rows = st.query_map(params![trigger, limit], delivery_from_row)?;
            rows.collect()
        })
    }
}

fn insert_delivery(c: &rusqlite::Connection, d: &DeliveryRow) -> rusqlite::Result<usize> {
    c.execute(
        "INSERT INTO trigger_deliveries(trigger_id, delivery_id, received_at, http_status, \
         outcome, detail, run_id, remote) VALUES (?1,?2,?3,?4,?5,?6,?7,?8)",
        params![
            d.trigger_id,
            d.delivery_id,
            d.received_at,
            d.http_status,
            d.outcome,
            d.detail,
            d.run_id as i64,
            d.remote
        ],
    )
}

/// Drops deliveries past their day, and refused ones beyond the cap.
fn trim(c: &rusqlite::Connection, now: i64) -> rusqlite::Result<()> {
    c.execute(
        "DELETE FROM trigger_deliveries WHERE received_at < ?1",
        [now - DELIVERY_KEEP_MS],
    )?;
    c.execute(
        "DELETE FROM trigger_deliveries WHERE outcome <> ?1 AND seq <= \
         (SELECT seq FROM trigger_deliveries WHERE outcome <> ?1 ORDER BY seq DESC \
          LIMIT 1 OFFSET ?2)",
        params![ACCEPTED, MAX_REFUSED_KEPT],
    )?;
    Ok(())
}
