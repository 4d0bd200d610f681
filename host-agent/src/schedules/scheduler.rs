//! The scheduler: the clock that fires schedules, the lanes that apply a
//! schedule's overlap rule, and what is done after a restart.
//!
//! A fire is recorded (a run row, under the key `schedule:<id>:<fire
//! time>`, with the schedule's `fired_through` moved past it, in one
//! transaction) before anything is started for it, so a crash never fires
//! one time twice and never loses one:
//!
//! * fire times after host-agent started are fired as they come;
//! * fire times between a schedule's `fired_through` and host-agent's
//!   start were missed while it was down: `catch_up` NONE records one
//!   SKIPPED run standing for all of them, ONCE one run that is started;
//! * runs found PENDING or QUEUED at start are started again (their
//!   session's creation is idempotent under the run's key); runs found
//!   RUNNING had their command cut off by the restart: they are FAILED
//!   (`host_agent_restarted`) and their session is stopped.
//!
//! A lane is what overlap is counted in: a schedule's runs (whatever
//! started them), a schedule-less trigger's, or the runs of a wake-up
//! trigger's session (one at a time).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use proto::hostagent as pb;
use tokio::sync::Notify;

use super::{Cadence, ScheduleRow};
use crate::error::Result;
use crate::sessions::{now_ms, Manager};
use crate::store::{Recorded, RunRow};

/// Most runs a QUEUE lane holds waiting; fires beyond are skipped
/// (`queue_full`).
pub const MAX_QUEUED: usize = 8;
/// Most missed fire times counted for one catch-up (the record says "at
/// least" beyond).
pub const MAX_MISSED_COUNTED: usize = 100_000;
/// The longest the clock sleeps without looking at the schedules again.
const IDLE_TICK: Duration = Duration::from_secs(30);

/// What a lane does with a new run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlap {
    /// Skipped while another runs.
    Skip,
    /// Waits for the one running.
    Queue,
    /// Runs beside it.
    Allow,
}

impl Overlap {
    /// A schedule's `pb::Overlap` (unspecified is SKIP).
    pub fn of(overlap: i32) -> Overlap {
        match pb::Overlap::try_from(overlap) {
            Ok(pb::Overlap::Queue) => Overlap::Queue,
            Ok(pb::Overlap::Allow) => Overlap::Allow,
            _ => Overlap::Skip,
        }
    }
}

#[derive(Default)]
struct Lane {
    running: usize,
    queued: VecDeque<RunRow>,
}

/// The node's scheduler (one per host-agent).
pub struct Scheduler {
    pub(super) mgr: Arc<Manager>,
    /// When this host-agent started, unix ms: fire times before it (and
    /// after a schedule's `fired_through`) were missed.
    started_at: i64,
    /// How long a run refused for capacity is retried, from its record.
    pub(super) retry_window_ms: i64,
    lanes: Mutex<HashMap<String, Lane>>,
    changed: Notify,
}

/// The lane of a schedule's runs.
pub fn schedule_lane(id: &str) -> String {
    format!("schedule:{id}")
}

impl Scheduler {
    /// Starts the scheduler of `mgr`'s node: the runs a previous
    /// host-agent left open are dealt with, then the clock runs until the
    /// process ends.
    pub fn start(mgr: Arc<Manager>, retry_window: Duration) -> Result<Arc<Scheduler>> {
        let sched = Arc::new(Scheduler {
            mgr,
            started_at: now_ms(),
            retry_window_ms: i64::try_from(retry_window.as_millis()).unwrap_or(i64::MAX),
            lanes: Mutex::new(HashMap::new()),
            changed: Notify::new(),
        });
        sched.recover()?;
        tokio::spawn(sched.clone().clock());
        Ok(sched)
    }

    /// Wakes the clock: a schedule was created, changed or deleted.
    pub fn schedules_changed(&self) {
        self.changed.notify_one();
    }

    fn lanes(&self) -> MutexGuard<'_, HashMap<String, Lane>> {
        // A panic while holding it leaves counts that are still counts.
        self.lanes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records `run` in `lane` under `overlap`: SKIPPED (`overlap`, or
    /// `queue_full`) when the lane is busy and the rule says so, QUEUED
    /// behind the running one, or PENDING and started. `fired_through`
    /// moves the schedule's cursor in the same transaction. Returns the run
    /// and whether it is new: one whose key was recorded before is returned
    /// as it is, and nothing is started.
    pub fn admit(
        self: &Arc<Self>,
        lane: &str,
        overlap: Overlap,
        mut run: RunRow,
        fired_through: Option<i64>,
    ) -> Result<(RunRow, bool)> {
        let mut lanes = self.lanes();
        let l = lanes.entry(lane.to_string()).or_default();
        let busy = l.running > 0;
        let (state, reason, detail) = match overlap {
            Overlap::Skip if busy => (
                pb::RunState::Skipped,
                "overlap",
                format!("{} run(s) of this lane still running", l.running),
            ),
            Overlap::Queue if busy && l.queued.len() >= MAX_QUEUED => (
                pb::RunState::Skipped,
                "queue_full",
                format!("{MAX_QUEUED} runs already wait behind the running one"),
            ),
            Overlap::Queue if busy => (pb::RunState::Queued, "", String::new()),
            _ => (pb::RunState::Pending, "", String::new()),
        };
        run.state = state as i32;
        if state == pb::RunState::Skipped {
            run.reason = reason.into();
            run.detail = detail;
            run.ended_at = run.recorded_at;
            run.body.clear();
        }
        let event = match state {
            pb::RunState::Skipped => "skipped",
            pb::RunState::Queued => "queued",
            _ => "fired",
        };
        let (recorded, seq) = match self.mgr.store.record_run(&run, event, fired_through)? {
            Recorded::Existing(r) => return Ok((r, false)),
            Recorded::New(r, seq) => (r, seq),
        };
        match state {
            pb::RunState::Pending => l.running += 1,
            pb::RunState::Queued => l.queued.push_back(recorded.clone()),
            _ => {}
        }
        drop(lanes);
        self.mgr.events.committed(seq);
        tracing::info!(run = recorded.id, key = %recorded.key, cause = %recorded.cause, event, "schedule run recorded");
        if state == pb::RunState::Pending {
            self.spawn_run(lane.to_string(), recorded.clone());
        }
        Ok((recorded, true))
    }

    /// Runs `run` in the background; when it ends, the lane's next queued
    /// run starts.
    fn spawn_run(self: &Arc<Self>, lane: String, run: RunRow) {
        let sched = self.clone();
        tokio::spawn(async move {
            let id = run.id;
            if let Err(e) = sched.clone().execute(run).await {
                tracing::error!(run = id, error = %e, "a schedule run could not be recorded");
            }
            sched.lane_done(&lane);
        });
    }

    fn lane_done(self: &Arc<Self>, lane: &str) {
        let next = {
            let mut lanes = self.lanes();
            let Some(l) = lanes.get_mut(lane) else {
                return;
            };
            l.running = l.running.saturating_sub(1);
            let next = if l.running == 0 {
                l.queued.pop_front()
            } else {
                None
            };
            if next.is_some() {
                l.running += 1;
            } else if l.running == 0 && l.queued.is_empty() {
                lanes.remove(lane);
            }
            next
        };
        if let Some(run) = next {
            self.spawn_run(lane.to_string(), run);
        }
    }

    /// After a restart: runs left RUNNING are failed (their command's end
    /// is unknown) and their sessions stopped; PENDING ones start again,
    /// QUEUED ones queue again in their order.
    fn recover(self: &Arc<Self>) -> Result<()> {
        for mut run in self.mgr.store.open_runs()? {
            let lane = self.lane_of(&run);
            match pb::RunState::try_from(run.state) {
                Ok(pb::RunState::Running) => {
                    run.state = pb::RunState::Failed as i32;
                    run.reason = "host_agent_restarted".into();
                    run.detail = "host-agent restarted while the run's command ran; its end is \
                                  unknown (the session was stopped and its branch fetched)"
                        .into();
                    run.ended_at = now_ms();
                    run.body.clear();
                    let seq = self.mgr.store.update_run(&run, "failed", run.ended_at)?;
                    self.mgr.events.committed(seq);
                    if run.cause != super::runner::CAUSE_WAKE_UP && !run.session_id.is_empty() {
                        let (mgr, sid) = (self.mgr.clone(), run.session_id.clone());
                        tokio::spawn(async move {
                            if let Err(e) = mgr.stop(&sid, super::runner::RUN_ENDED).await {
                                tracing::warn!(session = %sid, error = %e, "stopping the session of a run cut off by the restart");
                            }
                        });
                    }
                }
                Ok(pb::RunState::Queued) => {
                    let mut lanes = self.lanes();
                    let l = lanes.entry(lane.clone()).or_default();
                    if l.running == 0 {
                        l.running += 1;
                        drop(lanes);
                        self.spawn_run(lane, run);
                    } else {
                        l.queued.push_back(run);
                    }
                }
                _ => {
                    self.lanes().entry(lane.clone()).or_default().running += 1;
                    self.spawn_run(lane, run);
                }
            }
        }
        Ok(())
    }

    /// The lane a recorded run counts in.
    pub(super) fn lane_of(&self, run: &RunRow) -> String {
        if !run.schedule_id.is_empty() {
            return schedule_lane(&run.schedule_id);
        }
        if run.cause == super::runner::CAUSE_WAKE_UP {
            if let Ok(Some(t)) = self.mgr.store.trigger(&run.trigger_id) {
                return format!("session:{}", t.session_id);
            }
        }
        format!("trigger:{}", run.trigger_id)
    }

    /// A run of `s` now (RunScheduleNow), as a fire would be.
    pub fn run_now(self: &Arc<Self>, s: &ScheduleRow) -> Result<RunRow> {
        let mut at = now_ms();
        // Keys are unique per node: a call in the same ms as a fire (or
        // another call) takes the next ms.
        loop {
            let run = new_run(s, at, super::runner::CAUSE_MANUAL, 1);
            let (run, new) =
                self.admit(&schedule_lane(&s.id), Overlap::of(s.overlap), run, None)?;
            if new {
                return Ok(run);
            }
            at += 1;
        }
    }

    /// The clock: records each enabled schedule's due fire times (and its
    /// missed ones, once), then sleeps until the next fire time or a change.
    async fn clock(self: Arc<Self>) {
        loop {
            let next = match self.tick() {
                Ok(n) => n,
                Err(e) => {
                    tracing::error!(error = %e, "the scheduler could not read or record its schedules; trying again");
                    Some(now_ms() + 1000)
                }
            };
            let idle = IDLE_TICK.as_millis() as i64;
            let wait_ms = next.map_or(idle, |n| (n - now_ms()).clamp(0, idle));
            let notified = self.changed.notified();
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(wait_ms as u64)) => {}
                _ = notified => {}
            }
        }
    }

    /// One look at every schedule: returns the earliest next fire time.
    fn tick(self: &Arc<Self>) -> Result<Option<i64>> {
        let now = now_ms();
        let mut next: Option<i64> = None;
        for s in self.mgr.store.schedules()? {
            if !s.enabled {
                continue;
            }
            let cadence = match Cadence::parse(&s.cron, &s.timezone) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(schedule = %s.id, error = %e, "a stored schedule does not parse");
                    continue;
                }
            };
            if let Err(e) = self.fire_due(&s, &cadence, now) {
                tracing::error!(schedule = %s.id, error = %e, "recording a fire");
            }
            if let Some(n) = cadence.next_after(now) {
                next = Some(next.map_or(n, |m: i64| m.min(n)));
            }
        }
        Ok(next)
    }

    /// Records schedule `s`'s fire times in `(fired_through, now]`.
    fn fire_due(self: &Arc<Self>, s: &ScheduleRow, cadence: &Cadence, now: i64) -> Result<()> {
        let lane = schedule_lane(&s.id);
        let overlap = Overlap::of(s.overlap);
        let mut cursor = s.fired_through;
        if cursor < self.started_at - 1 {
            let missed = cadence.between(cursor, self.started_at - 1, MAX_MISSED_COUNTED);
            if let (Some(&first), Some(&last)) = (missed.first(), missed.last()) {
                let n = missed.len();
                let count = if n >= MAX_MISSED_COUNTED {
                    format!("at least {n}")
                } else {
                    n.to_string()
                };
                let detail = format!(
                    "{count} fire time(s) from {} to {} passed while host-agent was down",
                    rfc3339(first),
                    rfc3339(last)
                );
                let fires = u32::try_from(n).unwrap_or(u32::MAX);
                // Every time up to the start is dealt with by this one record.
                let through = Some(self.started_at - 1);
                if s.catch_up == pb::CatchUp::Once as i32 {
                    let mut run = new_run(s, last, super::runner::CAUSE_CATCH_UP, fires);
                    run.detail = detail;
                    self.admit(&lane, overlap, run, through)?;
                } else {
                    let mut run = new_run(s, last, super::runner::CAUSE_MISSED, fires);
                    run.state = pb::RunState::Skipped as i32;
                    run.reason = "missed".into();
                    run.detail = format!("{detail}; catch_up NONE skips them");
                    run.ended_at = run.recorded_at;
                    if let Recorded::New(_, seq) =
                        self.mgr.store.record_run(&run, "missed", through)?
                    {
                        self.mgr.events.committed(seq);
                    }
                }
            }
            cursor = cursor.max(self.started_at - 1);
        }
        for t in cadence.between(cursor, now, 1000) {
            self.admit(
                &lane,
                overlap,
                new_run(s, t, super::runner::CAUSE_CRON, 1),
                Some(t),
            )?;
        }
        Ok(())
    }
}

/// A new run of schedule `s` for fire time `at`.
pub(super) fn new_run(s: &ScheduleRow, at: i64, cause: &str, fires: u32) -> RunRow {
    RunRow {
        schedule_id: s.id.clone(),
        owner: s.owner.clone(),
        fire_at: at,
        cause: cause.into(),
        key: format!("schedule:{}:{at}", s.id),
        recorded_at: now_ms(),
        fires,
        ..Default::default()
    }
}

/// A unix ms time as RFC 3339 (UTC), for messages.
fn rfc3339(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_else(|| format!("{ms} ms"))
}
