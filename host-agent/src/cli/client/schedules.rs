//! `host-agent schedules create|get|list|enable|disable|delete|run-now|runs`:
//! schedules and their runs through the Schedules service. What is valid
//! (the cron expression, the zone, the session template) is checked by
//! host-agent.

use clap::{Subcommand, ValueEnum};
use proto::hostagent as pb;
use proto::hostagent::schedules_client::SchedulesClient;
use serde_json::{json, Value};
use tonic::transport::Channel;

use super::labels::LabelArgs;
use super::snapshots::utc;
use super::{status as st, Bearer};
use crate::cli::output::{or_dash, print_all, Output, Record};

/// What a fire does while the previous run still runs.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum OverlapArg {
    /// Skip the fire (recorded as skipped).
    Skip,
    /// Wait for the running one.
    Queue,
    /// Run side by side.
    Allow,
}

/// What to do about fires missed while host-agent was down.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum CatchUpArg {
    /// Skip them.
    None,
    /// One run for all of them.
    Once,
}

/// `schedules create`'s arguments.
#[derive(clap::Args)]
pub struct CreateArgs {
    /// Its id (generated when not given).
    #[arg(long, default_value = "")]
    id: String,
    /// Cron expression: five fields, or six with seconds first
    /// ("0 9 * * MON").
    #[arg(long)]
    cron: String,
    /// IANA time zone the expression is read in (default UTC).
    #[arg(long, default_value = "")]
    timezone: String,
    /// Image each run's session is restored from.
    #[arg(long)]
    image: String,
    /// Host repository the sessions work on (guest-init images).
    #[arg(long, default_value = "")]
    repository: String,
    /// Agent whose rules apply (guest-init images).
    #[arg(long, default_value = "")]
    agent: String,
    /// Branch, tag or commit the session branch starts from.
    #[arg(long, default_value = "")]
    base_ref: String,
    /// Each run's session TTL in seconds (0: the node's).
    #[arg(long, default_value_t = 0)]
    ttl: u64,
    #[command(flatten)]
    labels: LabelArgs,
    #[arg(long, value_enum, default_value = "skip")]
    overlap: OverlapArg,
    #[arg(long, value_enum, default_value = "none")]
    catch_up: CatchUpArg,
    /// Create it disabled.
    #[arg(long)]
    disabled: bool,
    /// The command each run executes in its session (after `--`).
    #[arg(last = true)]
    run: Vec<String>,
}

/// The `schedules` subcommands.
#[derive(Subcommand)]
pub enum SchedulesCmd {
    /// Create a schedule; prints it with its next fire time.
    Create(Box<CreateArgs>),
    /// Show a schedule.
    Get { id: String },
    /// List schedules.
    List,
    /// Let a schedule fire.
    Enable { id: String },
    /// Stop a schedule from firing (it is kept).
    Disable { id: String },
    /// Delete a schedule.
    Delete { id: String },
    /// Run a schedule now, as a fire would (its overlap applies); prints
    /// the run as recorded (PENDING, or SKIPPED).
    RunNow { id: String },
    /// A schedule's runs, newest first (the next page's --before on
    /// stderr).
    Runs {
        /// Schedule id.
        id: String,
        /// Most runs shown (0: host-agent's default, 100).
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Only runs with a run id below this (0: from the newest).
        #[arg(long, value_name = "RUN_ID", default_value_t = 0)]
        before: u64,
    },
}

/// The Schedules client as the subcommands hold it.
pub(super) type Client =
    SchedulesClient<tonic::service::interceptor::InterceptedService<Channel, Bearer>>;

/// Runs `schedules <cmd>`.
pub async fn run(ch: Channel, bearer: Bearer, out: Output, c: SchedulesCmd) -> Result<(), String> {
    let mut cl = SchedulesClient::with_interceptor(ch, bearer);
    let shown = match c {
        SchedulesCmd::Create(args) => {
            let CreateArgs {
                id,
                cron,
                timezone,
                image,
                repository,
                agent,
                base_ref,
                ttl,
                labels,
                overlap,
                catch_up,
                disabled,
                run,
            } = *args;
            let schedule = pb::Schedule {
                schedule_id: id,
                cron,
                timezone,
                session: Some(pb::CreateSessionRequest {
                    image_id: image,
                    repository_path: repository,
                    agent,
                    base_ref,
                    limits: Some(pb::Limits {
                        ttl_seconds: ttl,
                        idle_timeout_seconds: 0,
                    }),
                    labels: labels.map()?,
                    ..Default::default()
                }),
                run,
                overlap: match overlap {
                    OverlapArg::Skip => pb::Overlap::Skip,
                    OverlapArg::Queue => pb::Overlap::Queue,
                    OverlapArg::Allow => pb::Overlap::Allow,
                } as i32,
                catch_up: match catch_up {
                    CatchUpArg::None => pb::CatchUp::None,
                    CatchUpArg::Once => pb::CatchUp::Once,
                } as i32,
                enabled: !disabled,
                ..Default::default()
            };
            cl.create_schedule(pb::CreateScheduleRequest {
                schedule: Some(schedule),
            })
            .await
            .map_err(st)?
            .into_inner()
        }
        SchedulesCmd::Get { id } => cl
            .get_schedule(pb::ScheduleRef { schedule_id: id })
            .await
            .map_err(st)?
            .into_inner(),
        SchedulesCmd::List => {
            let all = cl
                .list_schedules(pb::ListSchedulesRequest {})
                .await
                .map_err(st)?
                .into_inner()
                .schedules;
            print_all(&all, out);
            return Ok(());
        }
        SchedulesCmd::Enable { id } => set_enabled(&mut cl, id, true).await?,
        SchedulesCmd::Disable { id } => set_enabled(&mut cl, id, false).await?,
        SchedulesCmd::Delete { id } => {
            cl.delete_schedule(pb::ScheduleRef { schedule_id: id })
                .await
                .map_err(st)?;
            return Ok(());
        }
        SchedulesCmd::RunNow { id } => {
            let run = cl
                .run_schedule_now(pb::RunScheduleNowRequest { schedule_id: id })
                .await
                .map_err(st)?
                .into_inner();
            print_all(&[run], out);
            return Ok(());
        }
        SchedulesCmd::Runs { id, limit, before } => {
            let req = pb::ListRunsRequest {
                schedule_id: id,
                trigger_id: String::new(),
                page_size: limit,
                before_run_id: before,
            };
            return print_runs(&mut cl, req, out).await;
        }
    };
    print_all(&[shown], out);
    Ok(())
}

/// `schedules runs` and `triggers runs`: one page of runs, the next page's
/// `--before` on stderr.
pub(super) async fn print_runs(
    cl: &mut Client,
    req: pb::ListRunsRequest,
    out: Output,
) -> Result<(), String> {
    let page = cl.list_runs(req).await.map_err(st)?.into_inner();
    print_all(&page.runs, out);
    if page.next_before_run_id != 0 {
        eprintln!("next_before_run_id: {}", page.next_before_run_id);
    }
    Ok(())
}

/// Reads schedule `id` and writes it back with `enabled`.
async fn set_enabled(cl: &mut Client, id: String, enabled: bool) -> Result<pb::Schedule, String> {
    let s = cl
        .get_schedule(pb::ScheduleRef { schedule_id: id })
        .await
        .map_err(st)?
        .into_inner();
    Ok(cl
        .update_schedule(pb::UpdateScheduleRequest {
            schedule: Some(pb::Schedule { enabled, ..s }),
        })
        .await
        .map_err(st)?
        .into_inner())
}

impl Record for pb::Schedule {
    fn headers() -> &'static [&'static str] {
        &[
            "SCHEDULE",
            "CRON",
            "TIMEZONE",
            "IMAGE",
            "ENABLED",
            "NEXT FIRE",
            "RUN",
        ]
    }
    fn cells(&self) -> Vec<String> {
        vec![
            self.schedule_id.clone(),
            self.cron.clone(),
            if self.timezone.is_empty() {
                "UTC".into()
            } else {
                self.timezone.clone()
            },
            self.session
                .as_ref()
                .map(|s| s.image_id.clone())
                .unwrap_or_default(),
            self.enabled.to_string(),
            utc(self.next_fire_at),
            if self.run.is_empty() {
                "-".into()
            } else {
                self.run.join(" ")
            },
        ]
    }
    fn json(&self) -> Value {
        let overlap = pb::Overlap::try_from(self.overlap).map_or("", |o| o.as_str_name());
        let catch_up = pb::CatchUp::try_from(self.catch_up).map_or("", |c| c.as_str_name());
        json!({
            "schedule_id": self.schedule_id,
            "cron": self.cron,
            "timezone": self.timezone,
            "image_id": self.session.as_ref().map(|s| s.image_id.clone()).unwrap_or_default(),
            "run": self.run,
            "overlap": overlap,
            "catch_up": catch_up,
            "enabled": self.enabled,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "next_fire_at": self.next_fire_at,
            "owner": self.owner,
        })
    }
}

/// A run's exit as the table shows it: "code N", "signal N", or "-".
fn exit_cell(e: Option<&pb::ExecExit>) -> String {
    match e.and_then(|e| e.status.as_ref()) {
        Some(pb::exec_exit::Status::Code(c)) => format!("code {c}"),
        Some(pb::exec_exit::Status::Signal(n)) => format!("signal {n}"),
        None => "-".into(),
    }
}

impl Record for pb::ScheduleRun {
    fn headers() -> &'static [&'static str] {
        &[
            "RUN", "FIRE AT", "CAUSE", "STATE", "SESSION", "EXIT", "REASON", "BRANCH", "HEAD",
            "BILLED S",
        ]
    }
    fn cells(&self) -> Vec<String> {
        vec![
            self.run_id.to_string(),
            utc(self.fire_at),
            or_dash(&self.cause),
            host_agent::schedules::run_state_name(self.state).into(),
            or_dash(&self.session_id),
            exit_cell(self.exit.as_ref()),
            or_dash(&self.reason),
            or_dash(&self.branch),
            or_dash(&self.head_commit.chars().take(12).collect::<String>()),
            format!("{:.1}", self.billed_seconds),
        ]
    }
    fn json(&self) -> Value {
        let exit = self.exit.as_ref().map(|e| {
            let (code, signal) = match e.status {
                Some(pb::exec_exit::Status::Code(c)) => (Some(c), None),
                Some(pb::exec_exit::Status::Signal(n)) => (None, Some(n)),
                None => (None, None),
            };
            json!({"code": code, "signal": signal, "reason": e.reason})
        });
        json!({
            "run_id": self.run_id,
            "schedule_id": self.schedule_id,
            "trigger_id": self.trigger_id,
            "fire_at": self.fire_at,
            "cause": self.cause,
            "key": self.key,
            "state": host_agent::schedules::run_state_name(self.state),
            "session_id": self.session_id,
            "exit": exit,
            "reason": self.reason,
            "detail": self.detail,
            "branch": self.branch,
            "head_commit": self.head_commit,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "billed_seconds": self.billed_seconds,
            "attempts": self.attempts,
            "fires": self.fires,
            "output_tail": String::from_utf8_lossy(&self.output_tail),
        })
    }
}
