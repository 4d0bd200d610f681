//! `host-agent triggers create|get|list|delete|deliveries|runs`: webhook
//! triggers through the Schedules service. What is valid (the id, what the
//! trigger names, the session template) is checked by host-agent.

use clap::Subcommand;
use proto::hostagent as pb;
use proto::hostagent::schedules_client::SchedulesClient;
use serde_json::{json, Value};
use tonic::transport::Channel;

use super::labels::LabelArgs;
use super::schedules::print_runs;
use super::snapshots::utc;
use super::{status as st, Bearer};
use crate::cli::output::{or_dash, print_all, Output, Record};

/// `triggers create`'s arguments.
#[derive(clap::Args)]
pub struct CreateArgs {
    /// Its id (generated when not given).
    #[arg(long, default_value = "")]
    id: String,
    /// A run from this schedule's template, command and overlap.
    #[arg(long, value_name = "SCHEDULE_ID", conflicts_with_all = ["image", "wake_up"])]
    schedule: Option<String>,
    /// A run in a new session restored from this image (the trigger's own
    /// template).
    #[arg(long, conflicts_with = "wake_up")]
    image: Option<String>,
    /// Host repository the sessions work on (guest-init images; with
    /// --image).
    #[arg(long, default_value = "", requires = "image")]
    repository: String,
    /// Agent whose rules apply (guest-init images; with --image).
    #[arg(long, default_value = "", requires = "image")]
    agent: String,
    /// Branch, tag or commit the session branch starts from (with --image).
    #[arg(long, default_value = "", requires = "image")]
    base_ref: String,
    /// Each run's session TTL in seconds (0: the node's; with --image).
    #[arg(long, default_value_t = 0, requires = "image")]
    ttl: u64,
    #[command(flatten)]
    labels: LabelArgs,
    /// Resume this paused session, run the command in it, pause it again.
    #[arg(long, value_name = "SESSION_ID")]
    wake_up: Option<String>,
    /// Create it disabled (deliveries are refused with 423).
    #[arg(long)]
    disabled: bool,
    /// The command a delivery runs (after `--`).
    #[arg(last = true)]
    run: Vec<String>,
}

/// The `triggers` subcommands.
#[derive(Subcommand)]
pub enum TriggersCmd {
    /// Create a trigger; prints it with its secret, the HMAC key, which is
    /// never shown again.
    Create(Box<CreateArgs>),
    /// Show a trigger.
    Get { id: String },
    /// List triggers.
    List,
    /// Delete a trigger.
    Delete { id: String },
    /// A trigger's deliveries, accepted or refused, newest first.
    Deliveries {
        /// Trigger id.
        id: String,
        /// Most deliveries shown (0: host-agent's default, 100).
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// The runs a trigger's deliveries started, newest first (the next
    /// page's --before on stderr).
    Runs {
        /// Trigger id.
        id: String,
        /// Most runs shown (0: host-agent's default, 100).
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Only runs with a run id below this (0: from the newest).
        #[arg(long, value_name = "RUN_ID", default_value_t = 0)]
        before: u64,
    },
}

/// Runs `triggers <cmd>`.
pub async fn run(ch: Channel, bearer: Bearer, out: Output, c: TriggersCmd) -> Result<(), String> {
    let mut cl = SchedulesClient::with_interceptor(ch, bearer);
    let shown = match c {
        TriggersCmd::Create(args) => {
            let trigger = trigger(*args)?;
            cl.create_trigger(pb::CreateTriggerRequest {
                trigger: Some(trigger),
            })
            .await
            .map_err(st)?
            .into_inner()
        }
        TriggersCmd::Get { id } => cl
            .get_trigger(pb::TriggerRef { trigger_id: id })
            .await
            .map_err(st)?
            .into_inner(),
        TriggersCmd::List => {
            let all = cl
                .list_triggers(pb::ListTriggersRequest {})
                .await
                .map_err(st)?
                .into_inner()
                .triggers;
            print_all(&all, out);
            return Ok(());
        }
        TriggersCmd::Delete { id } => {
            cl.delete_trigger(pb::TriggerRef { trigger_id: id })
                .await
                .map_err(st)?;
            return Ok(());
        }
        TriggersCmd::Deliveries { id, limit } => {
            let all = cl
                .list_trigger_deliveries(pb::ListTriggerDeliveriesRequest {
                    trigger_id: id,
                    page_size: limit,
                })
                .await
                .map_err(st)?
                .into_inner()
                .deliveries;
            print_all(&all, out);
            return Ok(());
        }
        TriggersCmd::Runs { id, limit, before } => {
            let req = pb::ListRunsRequest {
                schedule_id: String::new(),
                trigger_id: id,
                page_size: limit,
                before_run_id: before,
            };
            return print_runs(&mut cl, req, out).await;
        }
    };
    print_all(&[shown], out);
    Ok(())
}

/// The trigger `triggers create` asks for: WAKE_UP with --wake-up, RUN
/// otherwise (from --schedule, or the inline template of --image).
fn trigger(args: CreateArgs) -> Result<pb::Trigger, String> {
    let CreateArgs {
        id,
        schedule,
        image,
        repository,
        agent,
        base_ref,
        ttl,
        labels,
        wake_up,
        disabled,
        run,
    } = args;
    let labels = labels.map()?;
    // Labels without --image still go in a template, for host-agent to
    // refuse rather than for them to be dropped here.
    let session = (image.is_some() || !labels.is_empty()).then(|| pb::CreateSessionRequest {
        image_id: image.unwrap_or_default(),
        repository_path: repository,
        agent,
        base_ref,
        limits: Some(pb::Limits {
            ttl_seconds: ttl,
            idle_timeout_seconds: 0,
        }),
        labels,
        ..Default::default()
    });
    let kind = if wake_up.is_some() {
        pb::TriggerKind::WakeUp
    } else {
        pb::TriggerKind::Run
    };
    Ok(pb::Trigger {
        trigger_id: id,
        kind: kind as i32,
        schedule_id: schedule.unwrap_or_default(),
        session,
        run,
        session_id: wake_up.unwrap_or_default(),
        enabled: !disabled,
        ..Default::default()
    })
}

/// `pb::TriggerKind` `kind`'s name without the `TRIGGER_KIND_` prefix
/// (unspecified is RUN).
fn kind_name(kind: i32) -> &'static str {
    match pb::TriggerKind::try_from(kind) {
        Ok(pb::TriggerKind::WakeUp) => "WAKE_UP",
        Ok(_) => "RUN",
        Err(_) => "UNKNOWN",
    }
}

impl Record for pb::Trigger {
    fn headers() -> &'static [&'static str] {
        &["TRIGGER", "KIND", "TARGET", "ENABLED", "PATH", "SECRET"]
    }
    fn cells(&self) -> Vec<String> {
        // What a delivery acts on: the session to wake, the schedule, or
        // the inline template's image.
        let target = if !self.session_id.is_empty() {
            self.session_id.clone()
        } else if !self.schedule_id.is_empty() {
            self.schedule_id.clone()
        } else {
            self.session
                .as_ref()
                .map(|s| s.image_id.clone())
                .unwrap_or_default()
        };
        vec![
            self.trigger_id.clone(),
            kind_name(self.kind).into(),
            or_dash(&target),
            self.enabled.to_string(),
            or_dash(&self.path),
            or_dash(&self.secret),
        ]
    }
    fn json(&self) -> Value {
        json!({
            "trigger_id": self.trigger_id,
            "kind": kind_name(self.kind),
            "schedule_id": self.schedule_id,
            "image_id": self.session.as_ref().map(|s| s.image_id.clone()).unwrap_or_default(),
            "run": self.run,
            "session_id": self.session_id,
            "enabled": self.enabled,
            "secret": self.secret,
            "owner": self.owner,
            "created_at": self.created_at,
            "path": self.path,
        })
    }
}

impl Record for pb::TriggerDelivery {
    fn headers() -> &'static [&'static str] {
        &[
            "RECEIVED", "DELIVERY", "STATUS", "OUTCOME", "RUN", "REMOTE", "DETAIL",
        ]
    }
    fn cells(&self) -> Vec<String> {
        vec![
            utc(self.received_at),
            or_dash(&self.delivery_id),
            self.http_status.to_string(),
            or_dash(&self.outcome),
            if self.run_id == 0 {
                "-".into()
            } else {
                self.run_id.to_string()
            },
            or_dash(&self.remote),
            or_dash(&self.detail),
        ]
    }
    fn json(&self) -> Value {
        json!({
            "trigger_id": self.trigger_id,
            "delivery_id": self.delivery_id,
            "received_at": self.received_at,
            "http_status": self.http_status,
            "outcome": self.outcome,
            "detail": self.detail,
            "run_id": self.run_id,
            "remote": self.remote,
        })
    }
}
