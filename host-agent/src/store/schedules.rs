//! The schedules table: one row per schedule, its session template kept as
//! the encoded CreateSessionRequest and its command as a JSON array.

use prost::Message;
use rusqlite::{params, OptionalExtension, Row};

use super::Store;
use crate::error::{Error, Result};
use crate::schedules::ScheduleRow;

const COLUMNS: &str = "id, owner, cron, timezone, template, run, overlap, catch_up, enabled, \
                       created_at, updated_at, owner_scope, fired_through";

/// A stored row as a schedule; a template or command that does not decode
/// (a database edited by hand) is an error naming the schedule.
fn schedule_from_row(r: &Row<'_>) -> rusqlite::Result<std::result::Result<ScheduleRow, String>> {
    let id: String = r.get(0)?;
    let template: Vec<u8> = r.get(4)?;
    let run: String = r.get(5)?;
    let decoded = proto::hostagent::CreateSessionRequest::decode(template.as_slice())
        .map_err(|e| format!("schedule {id:?}: its session template does not decode: {e}"))
        .and_then(|t| {
            serde_json::from_str::<Vec<String>>(&run)
                .map(|run| (t, run))
                .map_err(|e| format!("schedule {id:?}: its command does not decode: {e}"))
        });
    let (template, run) = match decoded {
        Ok(d) => d,
        Err(e) => return Ok(Err(e)),
    };
    Ok(Ok(ScheduleRow {
        id,
        owner: r.get(1)?,
        cron: r.get(2)?,
        timezone: r.get(3)?,
        template,
        run,
        overlap: r.get(6)?,
        catch_up: r.get(7)?,
        enabled: r.get::<_, i64>(8)? != 0,
        created_at: r.get(9)?,
        updated_at: r.get(10)?,
        owner_scope: r.get(11)?,
        fired_through: r.get(12)?,
    }))
}

fn values(s: &ScheduleRow) -> Result<(Vec<u8>, String)> {
    let run = serde_json::to_string(&s.run)
        .map_err(|e| Error::Schedule(format!("encoding schedule {:?}'s command: {e}", s.id)))?;
    Ok((s.template.encode_to_vec(), run))
}

impl Store {
    /// Inserts a schedule; `AlreadyExists` if its id is taken.
    pub fn insert_schedule(&self, s: &ScheduleRow) -> Result<()> {
        let (template, run) = values(s)?;
        let n = self.with(|c| {
            c.execute(
                &format!(
                    "INSERT OR IGNORE INTO schedules({COLUMNS}) \
                     VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12,?13)"
                ),
                params![
                    s.id,
                    s.owner,
                    s.cron,
                    s.timezone,
                    template,
                    run,
                    s.overlap,
                    s.catch_up,
                    s.enabled as i64,
                    s.created_at,
                    s.updated_at,
                    s.owner_scope,
                    s.fired_through
                ],
            )
        })?;
        if n == 0 {
            return Err(Error::AlreadyExists(format!(
                "schedule {:?} exists; update or delete it, or pick another id",
                s.id
            )));
        }
        Ok(())
    }

    /// Replaces schedule `s.id`'s fields but its owner and creation time;
    /// its cadence starts again from `s.fired_through` (fire times up to it
    /// are not fired). False when there is none.
    pub fn update_schedule(&self, s: &ScheduleRow) -> Result<bool> {
        let (template, run) = values(s)?;
        let n = self.with(|c| {
            c.execute(
                "UPDATE schedules SET cron=?2, timezone=?3, template=?4, run=?5, overlap=?6, \
                 catch_up=?7, enabled=?8, updated_at=?9, \
                 fired_through=MAX(fired_through, ?10) WHERE id=?1",
                params![
                    s.id,
                    s.cron,
                    s.timezone,
                    template,
                    run,
                    s.overlap,
                    s.catch_up,
                    s.enabled as i64,
                    s.updated_at,
                    s.fired_through
                ],
            )
        })?;
        Ok(n > 0)
    }

    /// One schedule.
    pub fn schedule(&self, id: &str) -> Result<Option<ScheduleRow>> {
        let row = self.with(|c| {
            c.query_row(
                &format!("SELECT {COLUMNS} FROM schedules WHERE id=?1"),
                [id],
                schedule_from_row,
            )
            .optional()
        })?;
        row.transpose().map_err(Error::Schedule)
    }

    /// Every schedule, by id.
    pub fn schedules(&self) -> Result<Vec<ScheduleRow>> {
        let rows = self.with(|c| {
            let mut st = c.prepare(&format!("SELECT {COLUMNS} FROM schedules ORDER BY id"))?;
            let rows = st.query_map([], schedule_from_row)?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
        })?;
        rows.into_iter()
            .collect::<std::result::Result<_, _>>()
            .map_err(Error::Schedule)
    }

    /// Deletes a schedule; false when there is none.
    pub fn delete_schedule(&self, id: &str) -> Result<bool> {
        Ok(self.with(|c| c.execute("DELETE FROM schedules WHERE id=?1", [id]))? > 0)
    }
}
