//! One run, from its record to its end: a session from the template
//! (retried with backoff while the node is at capacity, within the retry
//! window), the trigger's body written into the workspace, the command run
//! as a turn and waited for, the session stopped (its branch fetched) and
//! the run's end recorded with the exit status, branch, head commit,
//! billed seconds and the tail of the output. A wake-up trigger's run
//! resumes its session instead, and pauses it again as it was.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use proto::hostagent as pb;

use super::scheduler::Scheduler;
use crate::api::sessions::create_params;
use crate::auth::{Caller, Scope};
use crate::error::{Error, Result};
use crate::execs::record::{End, ExecRecord};
use crate::sessions::{now_ms, state_name, CommandSpec};
use crate::store::RunRow;

/// A fire of the clock.
pub const CAUSE_CRON: &str = "cron";
/// One run standing for fire times missed while host-agent was down.
pub const CAUSE_CATCH_UP: &str = "catch_up";
/// The record of fire times missed and skipped (catch_up NONE).
pub const CAUSE_MISSED: &str = "missed";
/// RunScheduleNow.
pub const CAUSE_MANUAL: &str = "manual";
/// A RUN trigger's delivery.
pub const CAUSE_TRIGGER: &str = "trigger";
/// A WAKE_UP trigger's delivery.
pub const CAUSE_WAKE_UP: &str = "wake_up";
/// The stop reason of a run's session when its command ended.
pub const RUN_ENDED: &str = "run_ended";
/// The workspace file a trigger's request body is written to.
pub const BODY_FILE: &str = ".trigger-body";
/// Bytes of a command's output kept with its run.
pub const OUTPUT_TAIL: usize = 4096;
/// The first wait before a create refused for capacity is tried again
/// (doubling up to [`MAX_BACKOFF`]).
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// A run's command as it went: how it ended and the tail of its output,
/// or why it could not be run (reason, detail).
type Ran = std::result::Result<(Option<End>, Vec<u8>), (&'static str, String)>;

/// What a run does, as its schedule or trigger says now.
enum Plan {
    /// A new session from `template` as `owner`, `argv` run in it.
    NewSession {
        template: Box<pb::CreateSessionRequest>,
        argv: Vec<String>,
        owner: Caller,
    },
    /// `argv` run in the paused session `session_id`.
    WakeUp {
        session_id: String,
        argv: Vec<String>,
    },
}

/// The scope stored with a schedule or trigger (never more than sessions
/// unless it was stored as admin).
fn owner(name: &str, scope: &str) -> Caller {
    Caller {
        name: name.to_string(),
        scope: Scope::parse(scope).unwrap_or(Scope::Sessions),
    }
}

/// How the command ended, as the run records it: its state, reason and
/// detail.
fn outcome(end: Option<End>) -> (pb::RunState, Option<pb::ExecExit>, &'static str, String) {
    use pb::exec_exit::Status;
    match end {
        Some(End::Exited(e)) => match e.status {
            Some(Status::Code(0)) => (pb::RunState::Succeeded, Some(e), "", String::new()),
            Some(Status::Code(c)) => (
                pb::RunState::Failed,
                Some(e.clone()),
                "exit_code",
                format!("the command exited with code {c}{}", why(&e.reason)),
            ),
            Some(Status::Signal(s)) => (
                pb::RunState::Failed,
                Some(e.clone()),
                "signal",
                format!("the command was killed by signal {s}{}", why(&e.reason)),
            ),
            None => (
                pb::RunState::Failed,
                Some(e),
                "lost",
                "the guest reported an exit without a status".into(),
            ),
        },
        Some(End::Rejected(r)) => (
            pb::RunState::Failed,
            None,
            "rejected",
            format!("the command was not run: {r}"),
        ),
        Some(End::Failed(r) | End::Lost(r)) => (
            pb::RunState::Failed,
            None,
            "lost",
            format!("the command's end is unknown: {r}"),
        ),
        None => (
            pb::RunState::Failed,
            None,
            "lost",
            "the command's record ended without an end".into(),
        ),
    }
}

fn why(reason: &str) -> String {
    if reason.is_empty() {
        String::new()
    } else {
        format!(" ({reason})")
    }
}

/// Waits until `rec` ended and returns how, with the tail of its output.
async fn wait_for(rec: &Arc<ExecRecord>) -> (Option<End>, Vec<u8>) {
    let mut changed = rec.subscribe();
    while !rec.ended() {
        if changed.changed().await.is_err() {
            break;
        }
    }
    let st = rec.lock();
    let mut tail = Vec::new();
    let mut at = st.ring.end().saturating_sub(OUTPUT_TAIL as u64);
    while let Some(piece) = st.ring.read(at, OUTPUT_TAIL) {
        at = piece.offset + piece.data.len() as u64;
        tail.extend_from_slice(&piece.data);
    }
    let keep_from = tail.len().saturating_sub(OUTPUT_TAIL);
    (st.end.clone(), tail.split_off(keep_from))
}

impl Scheduler {
    /// What `run` does, from its trigger or schedule as they are now.
    fn plan(&self, run: &RunRow) -> Result<Plan> {
        let store = &self.mgr.store;
        let from_schedule = |id: &str| -> Result<Plan> {
            let s = store.schedule(id)?.ok_or_else(|| {
                Error::FailedPrecondition(format!("schedule {id:?} was deleted before its run"))
            })?;
            Ok(Plan::NewSession {
                template: Box::new(s.template),
                argv: s.run,
                owner: owner(&s.owner, &s.owner_scope),
            })
        };
        if run.trigger_id.is_empty() {
            return from_schedule(&run.schedule_id);
        }
        let t = store.trigger(&run.trigger_id)?.ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "trigger {:?} was deleted before its run",
                run.trigger_id
            ))
        })?;
        if t.kind == pb::TriggerKind::WakeUp as i32 {
            return Ok(Plan::WakeUp {
                session_id: t.session_id,
                argv: t.run,
            });
        }
        if !t.schedule_id.is_empty() {
            return from_schedule(&t.schedule_id);
        }
        Ok(Plan::NewSession {
            template: Box::new(t.template.unwrap_or_default()),
            argv: t.run,
            owner: owner(&t.owner, &t.owner_scope),
        })
    }

    /// Records a change of `run` with event `reason`.
    fn save(&self, run: &RunRow, reason: &str) -> Result<()> {
        let seq = self.mgr.store.update_run(run, reason, now_ms())?;
        self.mgr.events.committed(seq);
        Ok(())
    }

    /// Ends `run` as FAILED with `reason` and `detail`.
    fn fail(&self, run: &mut RunRow, reason: &str, detail: String) -> Result<()> {
        tracing::warn!(run = run.id, key = %run.key, reason, detail = %detail, "schedule run failed");
        run.state = pb::RunState::Failed as i32;
        run.reason = reason.into();
        run.detail = detail;
        run.ended_at = now_ms();
        run.body.clear();
        self.save(run, "failed")
    }

    /// Runs `run` to its end and records it. Errors are the store's only:
    /// everything else that goes wrong is the run's failure, recorded.
    pub(super) async fn execute(self: Arc<Self>, mut run: RunRow) -> Result<()> {
        let plan = match self.plan(&run) {
            Ok(p) => p,
            Err(e) => return self.fail(&mut run, "deleted", e.to_string()),
        };
        match plan {
            Plan::NewSession {
                template,
                argv,
                owner,
            } => self.in_new_session(run, *template, argv, owner).await,
            Plan::WakeUp { session_id, argv } => self.in_woken_session(run, session_id, argv).await,
        }
    }

    /// The environment a run's command gets.
    fn command_env(run: &RunRow) -> HashMap<String, String> {
        let mut env = HashMap::from([
            ("AGENTVM_RUN_ID".to_string(), run.id.to_string()),
            ("AGENTVM_FIRE_AT".to_string(), run.fire_at.to_string()),
            ("AGENTVM_RUN_CAUSE".to_string(), run.cause.clone()),
        ]);
        if !run.schedule_id.is_empty() {
            env.insert("AGENTVM_SCHEDULE_ID".into(), run.schedule_id.clone());
        }
        if !run.trigger_id.is_empty() {
            env.insert("AGENTVM_TRIGGER_ID".into(), run.trigger_id.clone());
            env.insert("AGENTVM_DELIVERY".into(), run.delivery_id.clone());
            env.insert("AGENTVM_TRIGGER_BODY".into(), BODY_FILE.into());
        }
        env
    }

    /// Writes the body (a trigger's) and runs `argv` in `session_id`,
    /// recording the run RUNNING first; returns how the command ended, or
    /// the reason and detail of a failure to run it.
    async fn run_command(
        &self,
        run: &mut RunRow,
        session_id: &str,
        argv: Vec<String>,
    ) -> Result<Ran> {
        let mgr = &self.mgr;
        let sess = match mgr.session(session_id) {
            Ok(s) => s,
            Err(e) => return Ok(Err(("session_gone", e.to_string()))),
        };
        if !run.trigger_id.is_empty() {
            let body = std::mem::take(&mut run.body);
            if let Err(e) = mgr.write_workspace_file(&sess, BODY_FILE, &body).await {
                return Ok(Err((
                    "body_not_written",
                    format!("the request body could not be written to {BODY_FILE}: {e}"),
                )));
            }
        }
        run.state = pb::RunState::Running as i32;
        run.started_at = now_ms();
        self.save(run, "started")?;
        let spec = CommandSpec {
            env: Self::command_env(run),
            turn_id: format!("run-{}", run.id),
            argv,
            ..Default::default()
        };
        match mgr.start_command(&sess, spec).await {
            Ok((rec, _conn)) => Ok(Ok(wait_for(&rec).await)),
            Err(e) => Ok(Err((
                "not_started",
                format!("the command could not be started: {e}"),
            ))),
        }
    }

    /// Creates the run's session, retrying refusals for capacity with
    /// backoff until the retry window (from the run's record) has passed.
    async fn create_session(
        &self,
        run: &mut RunRow,
        template: pb::CreateSessionRequest,
        owner: &Caller,
    ) -> Result<std::result::Result<String, (&'static str, String)>> {
        let mut params = match create_params(&self.mgr, owner, template) {
            Ok(p) => p,
            Err(e) => return Ok(Err(("create_failed", e.to_string()))),
        };
        // Not a client's key (those are "<client>:<key>", and client names
        // have no '/'): a retry after a restart gets the same session.
        params.idempotency_key = format!("host-agent/{}", run.key);
        let deadline = run.recorded_at.saturating_add(self.retry_window_ms);
        let mut backoff = FIRST_BACKOFF;
        // What the record said before the retries' notes (a catch-up's).
        let detail = run.detail.clone();
        loop {
            run.attempts += 1;
            match self.mgr.create(params.clone()).await {
                Ok(row) => {
                    run.detail = detail;
                    return Ok(Ok(row.id));
                }
                Err(Error::ResourceExhausted(m)) => {
                    let wait = i64::try_from(backoff.as_millis()).unwrap_or(i64::MAX);
                    if now_ms().saturating_add(wait) > deadline {
                        return Ok(Err((
                            "capacity",
                            format!(
                                "the node had no room for the run's session in {} attempt(s) \
                                 within the retry window of {} s: {m}",
                                run.attempts,
                                self.retry_window_ms / 1000
                            ),
                        )));
                    }
                    run.detail = format!(
                        "attempt {} refused for capacity, trying again in {} s: {m}",
                        run.attempts,
                        backoff.as_secs()
                    );
                    self.save(run, "retrying")?;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                Err(e) => return Ok(Err(("create_failed", e.to_string()))),
            }
        }
    }

    async fn in_new_session(
        &self,
        mut run: RunRow,
        template: pb::CreateSessionRequest,
        argv: Vec<String>,
        owner: Caller,
    ) -> Result<()> {
        let session_id = match self.create_session(&mut run, template, &owner).await? {
            Ok(id) => id,
            Err((reason, detail)) => return self.fail(&mut run, reason, detail),
        };
        run.session_id = session_id.clone();
        if argv.is_empty() {
            // No command: the run is the session's start; it lives on.
            run.state = pb::RunState::Succeeded as i32;
            run.started_at = now_ms();
            run.ended_at = run.started_at;
            run.body.clear();
            return self.save(&run, "succeeded");
        }
        let ran = self.run_command(&mut run, &session_id, argv).await?;
        let stopped = self.mgr.stop(&session_id, RUN_ENDED).await;
        match &stopped {
            Ok(row) => {
                run.branch = row.branch.clone();
                run.head_commit = row.head_commit.clone();
            }
            Err(e) => {
                tracing::warn!(run = run.id, session = %session_id, error = %e, "stopping a run's session")
            }
        }
        run.billed_ms = self.mgr.store.billed_ms(&session_id)?;
        self.finish(run, ran)
    }

    /// Records the run's end from how its command went.
    fn finish(&self, mut run: RunRow, ran: Ran) -> Result<()> {
        match ran {
            Ok((end, tail)) => {
                let (state, exit, reason, detail) = outcome(end);
                run.state = state as i32;
                run.exit = exit;
                run.reason = reason.into();
                // A success keeps what the record said (a catch-up's note).
                if !detail.is_empty() {
                    run.detail = detail;
                }
                run.output_tail = tail;
                run.ended_at = now_ms();
                run.body.clear();
                let event = if state == pb::RunState::Succeeded {
                    "succeeded"
                } else {
                    "failed"
                };
                tracing::info!(run = run.id, key = %run.key, session = %run.session_id, event, "schedule run ended");
                self.save(&run, event)
            }
            Err((reason, detail)) => self.fail(&mut run, reason, detail),
        }
    }

    async fn in_woken_session(
        &self,
        mut run: RunRow,
        session_id: String,
        argv: Vec<String>,
    ) -> Result<()> {
        run.session_id = session_id.clone();
        let mgr = self.mgr.clone();
        let row = match mgr.session(&session_id) {
            Ok(s) => s.row(),
            Err(e) => return self.fail(&mut run, "session_gone", e.to_string()),
        };
        let paused = row.state == pb::SessionState::Paused as i32;
        if !paused && row.state != pb::SessionState::Running as i32 {
            return self.fail(
                &mut run,
                "session_not_paused",
                format!(
                    "session {session_id} is {}; a wake-up trigger resumes a PAUSED session",
                    state_name(row.state)
                ),
            );
        }
        if paused {
            if let Err(e) = mgr.resume(&session_id).await {
                return self.fail(
                    &mut run,
                    "resume_failed",
                    format!("session {session_id} could not be resumed: {e}"),
                );
            }
        }
        let ran = self.run_command(&mut run, &session_id, argv).await?;
        // Put back as it was found.
        let back = if !paused {
            Ok(())
        } else if row.persisted {
            mgr.persist(&session_id, "wake_up_done").await.map(drop)
        } else {
            mgr.pause(&session_id, "wake_up_done").await.map(drop)
        };
        if let Err(e) = back {
            tracing::warn!(run = run.id, session = %session_id, error = %e, "pausing a woken session again");
        }
        self.finish(run, ran)
    }
}
