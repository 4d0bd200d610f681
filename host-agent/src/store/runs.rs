//! The schedule_runs table: one row per fire of a schedule (or delivery
//! of a trigger), written before anything is started for it, and changed
//! with a `schedule` event in the same transaction at every step, so the
//! record and what watchers saw never disagree.

use proto::hostagent as pb;
use rusqlite::{params, Connection, OptionalExtension, Row};

use super::insert_event;

use super::{EventRow, Store, EVENT_SCHEDULE};
use crate::error::Result;

/// One run as stored.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunRow {
    /// Per node, increasing (0 before it is recorded).
    pub id: u64,
    /// Its schedule (empty for a trigger without one).
    pub schedule_id: String,
    /// The trigger whose delivery started it (empty for a fire).
    pub trigger_id: String,
    /// The client its session belongs to.
    pub owner: String,
    /// The fire time it stands for, unix ms.
    pub fire_at: i64,
    /// "cron", "catch_up", "missed", "manual", "trigger", "wake_up".
    pub cause: String,
    /// Unique per node: `schedule:<id>:<fire_at>` or `trigger:<id>:<delivery>`.
    pub key: String,
    /// `pb::RunState`.
    pub state: i32,
    /// Its session, once it has one.
    pub session_id: String,
    /// The command's end, when it ran to one.
    pub exit: Option<pb::ExecExit>,
    /// Why it ended so (empty on success).
    pub reason: String,
    /// More on that, for an operator.
    pub detail: String,
    /// The session's branch after the stop.
    pub branch: String,
    /// Its head commit.
    pub head_commit: String,
    /// Unix ms.
    pub recorded_at: i64,
    /// Unix ms (0 until the session runs the command).
    pub started_at: i64,
    /// Unix ms (0 until it ended).
    pub ended_at: i64,
    /// The session's billed ms once it stopped.
    pub billed_ms: i64,
    /// Times its session's creation was tried.
    pub attempts: u32,
    /// Fire times it stands for.
    pub fires: u32,
    /// The last bytes of the command's output.
    pub output_tail: Vec<u8>,
    /// The delivery that started it (triggers).
    pub delivery_id: String,
    /// The delivery's body, until the run ends.
    pub body: Vec<u8>,
}

impl RunRow {
    /// Whether it is over (succeeded, failed or skipped).
    pub fn is_over(&self) -> bool {
        matches!(
            pb::RunState::try_from(self.state),
            Ok(pb::RunState::Succeeded | pb::RunState::Failed | pb::RunState::Skipped)
        )
    }

    /// The run as the API reports it.
    pub fn to_pb(&self) -> pb::ScheduleRun {
        pb::ScheduleRun {
            run_id: self.id,
            schedule_id: self.schedule_id.clone(),
            trigger_id: self.trigger_id.clone(),
            fire_at: self.fire_at,
            cause: self.cause.clone(),
            key: self.key.clone(),
            state: self.state,
            session_id: self.session_id.clone(),
            exit: self.exit.clone(),
            reason: self.reason.clone(),
            detail: self.detail.clone(),
            branch: self.branch.clone(),
            head_commit: self.head_commit.clone(),
            started_at: self.started_at,
            ended_at: self.ended_at,
            billed_seconds: self.billed_ms as f64 / 1000.0,
            attempts: self.attempts,
            fires: self.fires,
            output_tail: self.output_tail.clone(),
        }
    }

    /// Its event: `reason` with the run's detail.
    fn event(&self, reason: &str, at: i64) -> EventRow {
        EventRow {
            session_id: self.session_id.clone(),
            at,
            reason: reason.to_string(),
            detail: self.detail.clone(),
            kind: EVENT_SCHEDULE.into(),
            schedule_id: self.schedule_id.clone(),
            run_id: self.id,
            trigger_id: self.trigger_id.clone(),
            ..Default::default()
        }
    }
}

const COLUMNS: &str =
    "id, schedule_id, trigger_id, owner, fire_at, cause, key, state, session_id, \
     exit_kind, exit_value, exit_reason, reason, detail, branch, head_commit, recorded_at, \
     started_at, ended_at, billed_ms, attempts, fires, output_tail, delivery_id, body";

/// `exit_kind`: no end, an exit code, a signal.
const EXIT_NONE: i64 = 0;
const EXIT_CODE: i64 = 1;
const EXIT_SIGNAL: i64 = 2;

fn exit_columns(exit: &Option<pb::ExecExit>) -> (i64, i64, String) {
    use pb::exec_exit::Status;
    match exit {
        None => (EXIT_NONE, 0, String::new()),
        Some(e) => match e.status {
            Some(Status::Signal(s)) => (EXIT_SIGNAL, i64::from(s), e.reason.clone()),
            Some(Status::Code(c)) => (EXIT_CODE, i64::from(c), e.reason.clone()),
            None => (EXIT_CODE, 0, e.reason.clone()),
        },
    }
}

fn run_from_row(r: &Row<'_>) -> rusqlite::Result<RunRow> {
    use pb::exec_exit::Status;
    let exit_kind: i64 = r.get(9)?;
    let exit_value: i64 = r.get(10)?;
    let exit_reason: String = r.get(11)?;
    // The stored values came from i32s.
    let value = i32::try_from(exit_value).unwrap_or(i32::MIN);
    let exit = match exit_kind {
        EXIT_CODE => Some(Status::Code(value)),
        EXIT_SIGNAL => Some(Status::Signal(value)),
        _ => None,
    }
    .map(|status| pb::ExecExit {
        status: Some(status),
        reason: exit_reason,
    });
    Ok(RunRow {
        id: r.get::<_, i64>(0)? as u64,
        schedule_id: r.get(1)?,
        trigger_id: r.get(2)?,
        owner: r.get(3)?,
        fire_at: r.get(4)?,
        cause: r.get(5)?,
        key: r.get(6)?,
        state: r.get(7)?,
        session_id: r.get(8)?,
        exit,
        reason: r.get(12)?,
        detail: r.get(13)?,
        branch: r.get(14)?,
        head_commit: r.get(15)?,
        recorded_at: r.get(16)?,
        started_at: r.get(17)?,
        ended_at: r.get(18)?,
        billed_ms: r.get(19)?,
        attempts: r.get(20)?,
        fires: r.get(21)?,
        output_tail: r.get(22)?,
        delivery_id: r.get(23)?,
        body: r.get(24)?,
    })
}

fn insert_run(c: &Connection, run: &RunRow) -> rusqlite::Result<usize> {
    let (exit_kind, exit_value, exit_reason) = exit_columns(&run.exit);
    c.execute(
        &format!(
            "INSERT OR IGNORE INTO schedule_runs({}) VALUES \
             (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12,?13,?14,?15,?16,?17,?18,?19,?20,?21,?22,?23,?24)",
            &COLUMNS["id, ".len()..]
        ),
        params![
            run.schedule_id,
            run.trigger_id,
            run.owner,
            run.fire_at,
            run.cause,
            run.key,
            run.state,
            run.session_id,
            exit_kind,
            exit_value,
            exit_reason,
            run.reason,
            run.detail,
            run.branch,
            run.head_commit,
            run.recorded_at,
            run.started_at,
            run.ended_at,
            run.billed_ms,
            run.attempts,
            run.fires,
            run.output_tail,
            run.delivery_id,
            run.body
        ],
    )
}

/// What recording a run did.
#[derive(Debug)]
pub enum Recorded {
    /// It is recorded as this (with its id), and its event has this seq.
    New(RunRow, u64),
    /// Its key was recorded before: this is that run.
    Existing(RunRow),
}

impl Store {
    /// Records `run` (its id is assigned) with the event `reason`, and, for
    /// a schedule's fire, moves the schedule's `fired_through` up to
    /// `fired_through` — all in one transaction, so a fire time is either
    /// recorded with the schedule past it, or neither. A run whose key is
    /// taken is not recorded again: the earlier one is returned.
    pub fn record_run(
        &self,
        run: &RunRow,
        reason: &str,
        fired_through: Option<i64>,
    ) -> Result<Recorded> {
        self.with(|c| {
            let tx = c.transaction()?;
            if insert_run(&tx, run)? == 0 {
                let existing = tx.query_row(
                    &format!("SELECT {COLUMNS} FROM schedule_runs WHERE key=?1"),
                    [&run.key],
                    run_from_row,
                )?;
                tx.commit()?;
                return Ok(Recorded::Existing(existing));
            }
            let recorded = RunRow {
                id: tx.last_insert_rowid() as u64,
                ..run.clone()
            };
            if let Some(t) = fired_through {
                tx.execute(
                    "UPDATE schedules SET fired_through = MAX(fired_through, ?2) WHERE id=?1",
                    params![run.schedule_id, t],
                )?;
            }
            let seq = insert_event(&tx, &recorded.event(reason, run.recorded_at), &run.owner)?;
            tx.commit()?;
            Ok(Recorded::New(recorded, seq))
        })
    }

    /// Writes `run`'s changed fields with the event `reason`; returns the
    /// event's seq.
    pub fn update_run(&self, run: &RunRow, reason: &str, at: i64) -> Result<u64> {
        let (exit_kind, exit_value, exit_reason) = exit_columns(&run.exit);
        self.with(|c| {
            let tx = c.transaction()?;
            tx.execute(
                "UPDATE schedule_runs SET state=?2, session_id=?3, exit_kind=?4, exit_value=?5, \
                 exit_reason=?6, reason=?7, detail=?8, branch=?9, head_commit=?10, started_at=?11, \
                 ended_at=?12, billed_ms=?13, attempts=?14, output_tail=?15, body=?16 WHERE id=?1",
                params![
                    run.id as i64,
                    run.state,
                    run.session_id,
                    exit_kind,
                    exit_value,
                    exit_reason,
                    run.reason,
                    run.detail,
                    run.branch,
                    run.head_commit,
                    run.started_at,
                    run.ended_at,
                    run.billed_ms,
                    run.attempts,
                    run.output_tail,
                    run.body
                ],
            )?;
            let seq = insert_event(&tx, &run.event(reason, at), &run.owner)?;
            tx.commit()?;
            Ok(seq)
        })
    }

    /// One run.
    pub fn run(&self, id: u64) -> Result<Option<RunRow>> {
        self.with(|c| {
            c.query_row(
                &format!("SELECT {COLUMNS} FROM schedule_runs WHERE id=?1"),
                [id as i64],
                run_from_row,
            )
            .optional()
        })
    }

    /// The runs of a schedule (or, with `by_trigger`, of a trigger) with
    /// id below `before` (0: any), newest first, at most `limit`.
    pub fn runs(&self, of: &str, by_trigger: bool, before: u64, limit: u32) -> Result<Vec<RunRow>> {
        let column = if by_trigger {
            "trigger_id"
        } else {
            "schedule_id"
        };
        let before = if before == 0 {
            i64::MAX
        } else {
            before.min(i64::MAX as u64) as i64
        };
        self.with(|c| {
            // The column name is one of the two constants above.
            let mut st = c.prepare(&format!(
                "SELECT {COLUMNS} FROM schedule_runs WHERE {column}=?1 AND id < ?2 \
                 ORDER BY id DESC LIMIT ?3"
            ))?;
            let rows = st.query_map(params![of, before, limit], run_from_row)?;
            rows.collect()
        })
    }

    /// Runs that are not over (pending, queued, running), oldest first.
    pub fn open_runs(&self) -> Result<Vec<RunRow>> {
        self.with(|c| {
            let mut st = c.prepare(&format!(
                "SELECT {COLUMNS} FROM schedule_runs WHERE state IN (?1, ?2, ?3) ORDER BY id"
            ))?;
            let rows = st.query_map(
                params![
                    pb::RunState::Pending as i32,
                    pb::RunState::Queued as i32,
                    pb::RunState::Running as i32
                ],
                run_from_row,
            )?;
            rows.collect()
        })
    }

    /// The highest billed ms of a session's usage records (0: none).
    pub fn billed_ms(&self, session_id: &str) -> Result<i64> {
        self.with(|c| {
            c.query_row(
                "SELECT COALESCE(MAX(billed_ms), 0) FROM usage WHERE session_id=?1",
                [session_id],
                |r| r.get(0),
            )
        })
    }
}
