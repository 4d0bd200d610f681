//! `hostagent.v1.Schedules`: schedules kept in the database. Creating,
//! changing and deleting one takes the sessions scope (its runs create
//! sessions as the caller); reading, the read scope. A caller sees its own
//! schedules; an admin sees every client's.

use std::sync::Arc;

use proto::hostagent as pb;
use proto::hostagent::schedules_server::Schedules;
use tonic::{Request, Response, Status};

use super::sessions::create_params;
use crate::auth::layer::caller_of;
use crate::auth::{Caller, Scope};
use crate::error::{Error, Result};
use crate::schedules::triggers::check_trigger_id;
use crate::schedules::{check_id, ScheduleRow, Scheduler};
use crate::sessions::{now_ms, Manager};
use crate::store::TriggerRow;

/// The Schedules service.
pub struct SchedulesApi {
    /// The node's sessions.
    pub mgr: Arc<Manager>,
    /// The node's scheduler (told of every change).
    pub sched: Arc<Scheduler>,
}

/// Checks a session template for `caller` as CreateSession would (and its
/// image registered); with a command to run, the image must run guest-init.
fn check_session(
    mgr: &Manager,
    caller: &Caller,
    t: &pb::CreateSessionRequest,
    runs_command: bool,
) -> Result<()> {
    create_params(mgr, caller, t.clone())?;
    let Some(image) = mgr.store.image(&t.image_id)? else {
        return Err(Error::invalid(format!(
            "image_id {:?} is not registered on this node",
            t.image_id
        )));
    };
    if runs_command && !image.guest_init {
        return Err(Error::invalid(format!(
            "image_id {:?} runs no guest-init, so nothing can run the command; leave run empty \
             or use a guest-init image",
            t.image_id
        )));
    }
    Ok(())
}

/// Checks `s` for `caller`, its template as CreateSession would check it.
fn checked(mgr: &Manager, caller: &Caller, s: pb::Schedule) -> Result<ScheduleRow> {
    let runs_command = !s.run.is_empty();
    ScheduleRow::from_request(s, caller, now_ms(), |t| {
        check_session(mgr, caller, t, runs_command)
    })
}

/// Most runs or deliveries in one answer.
const MAX_PAGE: u32 = 1000;

fn page_size(n: u32) -> u32 {
    if n == 0 {
        100
    } else {
        n.min(MAX_PAGE)
    }
}

/// Trigger `id` if `caller` may see it.
fn owned_trigger(mgr: &Manager, caller: &Caller, id: &str) -> Result<TriggerRow> {
    check_trigger_id(id)?;
    mgr.store
        .trigger(id)?
        .filter(|t| caller.owns(&t.owner))
        .ok_or_else(|| Error::not_found("trigger", id))
}

/// The request's schedule, which it must have.
fn given(s: Option<pb::Schedule>) -> Result<pb::Schedule> {
    s.ok_or_else(|| Error::invalid("schedule: missing"))
}

/// Schedule `id` if `caller` may see it (NOT_FOUND otherwise, as for one
/// that does not exist).
fn owned(mgr: &Manager, caller: &Caller, id: &str) -> Result<ScheduleRow> {
    check_id(id)?;
    mgr.store
        .schedule(id)?
        .filter(|s| caller.owns(&s.owner))
        .ok_or_else(|| Error::not_found("schedule", id))
}

#[tonic::async_trait]
impl Schedules for SchedulesApi {
    async fn create_schedule(
        &self,
        req: Request<pb::CreateScheduleRequest>,
    ) -> Result<Response<pb::Schedule>, Status> {
        let caller = caller_of(&req)?;
        let row = checked(&self.mgr, &caller, given(req.into_inner().schedule)?)?;
        self.mgr.store.insert_schedule(&row)?;
        self.sched.schedules_changed();
        tracing::info!(schedule = %row.id, owner = %row.owner, cron = %row.cron, timezone = %row.timezone, "schedule created");
        Ok(Response::new(row.to_pb(now_ms())))
    }

    async fn get_schedule(
        &self,
        req: Request<pb::ScheduleRef>,
    ) -> Result<Response<pb::Schedule>, Status> {
        let caller = caller_of(&req)?;
        let row = owned(&self.mgr, &caller, &req.into_inner().schedule_id)?;
        Ok(Response::new(row.to_pb(now_ms())))
    }

    async fn list_schedules(
        &self,
        req: Request<pb::ListSchedulesRequest>,
    ) -> Result<Response<pb::ListSchedulesResponse>, Status> {
        let caller = caller_of(&req)?;
        let now = now_ms();
        let schedules = self
            .mgr
            .store
            .schedules()?
            .into_iter()
            .filter(|s| caller.owns(&s.owner))
            .map(|s| s.to_pb(now))
            .collect();
        Ok(Response::new(pb::ListSchedulesResponse { schedules }))
    }

    async fn update_schedule(
        &self,
        req: Request<pb::UpdateScheduleRequest>,
    ) -> Result<Response<pb::Schedule>, Status> {
        let caller = caller_of(&req)?;
        let s = given(req.into_inner().schedule)?;
        let old = owned(&self.mgr, &caller, &s.schedule_id)?;
        // The template is checked as its owner's: the runs are theirs, with
        // no more than the scope it had (an admin's change gives it no more).
        let owner = Caller {
            name: old.owner.clone(),
            scope: Scope::parse(&old.owner_scope)
                .unwrap_or(Scope::Sessions)
                .min(caller.scope),
        };
        let row = ScheduleRow {
            created_at: old.created_at,
            ..checked(&self.mgr, &owner, s)?
        };
        if !self.mgr.store.update_schedule(&row)? {
            return Err(Error::not_found("schedule", &row.id).into());
        }
        self.sched.schedules_changed();
        tracing::info!(schedule = %row.id, cron = %row.cron, timezone = %row.timezone, enabled = row.enabled, "schedule updated");
        Ok(Response::new(row.to_pb(now_ms())))
    }

    async fn delete_schedule(
        &self,
        req: Request<pb::ScheduleRef>,
    ) -> Result<Response<pb::DeleteScheduleResponse>, Status> {
        let caller = caller_of(&req)?;
        let row = owned(&self.mgr, &caller, &req.into_inner().schedule_id)?;
        self.mgr.store.delete_schedule(&row.id)?;
        self.sched.schedules_changed();
        tracing::info!(schedule = %row.id, "schedule deleted");
        Ok(Response::new(pb::DeleteScheduleResponse {}))
    }
    async fn run_schedule_now(
        &self,
        req: Request<pb::RunScheduleNowRequest>,
    ) -> Result<Response<pb::ScheduleRun>, Status> {
        let caller = caller_of(&req)?;
        let row = owned(&self.mgr, &caller, &req.into_inner().schedule_id)?;
        let run = self.sched.run_now(&row)?;
        tracing::info!(schedule = %row.id, run = run.id, "schedule run now");
        Ok(Response::new(run.to_pb()))
    }

    async fn list_runs(
        &self,
        req: Request<pb::ListRunsRequest>,
    ) -> Result<Response<pb::ListRunsResponse>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        let (of, by_trigger) = match (r.schedule_id.is_empty(), r.trigger_id.is_empty()) {
            (false, true) => {
                owned(&self.mgr, &caller, &r.schedule_id)?;
                (r.schedule_id, false)
            }
            (true, false) => {
                owned_trigger(&self.mgr, &caller, &r.trigger_id)?;
                (r.trigger_id, true)
            }
            _ => {
                return Err(Error::invalid(
                    "name one of schedule_id and trigger_id: the runs of which",
                )
                .into())
            }
        };
        let limit = page_size(r.page_size);
        let rows = self
            .mgr
            .store
            .runs(&of, by_trigger, r.before_run_id, limit)?;
        let next = if rows.len() == limit as usize {
            rows.last().map_or(0, |r| r.id)
        } else {
            0
        };
        Ok(Response::new(pb::ListRunsResponse {
            runs: rows.iter().map(|r| r.to_pb()).collect(),
            next_before_run_id: next,
        }))
    }

    async fn create_trigger(
        &self,
        req: Request<pb::CreateTriggerRequest>,
    ) -> Result<Response<pb::Trigger>, Status> {
        let caller = caller_of(&req)?;
        let t = req
            .into_inner()
            .trigger
            .ok_or_else(|| Error::invalid("trigger: missing"))?;
        let runs_command = !t.run.is_empty();
        let mgr = &self.mgr;
        let row = TriggerRow::from_request(
            t,
            &caller,
            now_ms(),
            |s| check_session(mgr, &caller, s, runs_command),
            |id| owned(mgr, &caller, id).map(drop),
            |id| {
                let sess = super::owned_session(mgr, &caller, id)?;
                Ok(sess.guest_init())
            },
        )?;
        self.mgr.store.insert_trigger(&row)?;
        tracing::info!(trigger = %row.id, owner = %row.owner, kind = row.kind, "trigger created");
        Ok(Response::new(row.to_pb(true)))
    }

    async fn get_trigger(
        &self,
        req: Request<pb::TriggerRef>,
    ) -> Result<Response<pb::Trigger>, Status> {
        let caller = caller_of(&req)?;
        let row = owned_trigger(&self.mgr, &caller, &req.into_inner().trigger_id)?;
        Ok(Response::new(row.to_pb(false)))
    }

    async fn list_triggers(
        &self,
        req: Request<pb::ListTriggersRequest>,
    ) -> Result<Response<pb::ListTriggersResponse>, Status> {
        let caller = caller_of(&req)?;
        let triggers = self
            .mgr
            .store
            .triggers()?
            .into_iter()
            .filter(|t| caller.owns(&t.owner))
            .map(|t| t.to_pb(false))
            .collect();
        Ok(Response::new(pb::ListTriggersResponse { triggers }))
    }

    async fn delete_trigger(
        &self,
        req: Request<pb::TriggerRef>,
    ) -> Result<Response<pb::DeleteTriggerResponse>, Status> {
        let caller = caller_of(&req)?;
        let row = owned_trigger(&self.mgr, &caller, &req.into_inner().trigger_id)?;
        self.mgr.store.delete_trigger(&row.id)?;
        tracing::info!(trigger = %row.id, "trigger deleted");
        Ok(Response::new(pb::DeleteTriggerResponse {}))
    }

    async fn list_trigger_deliveries(
        &self,
        req: Request<pb::ListTriggerDeliveriesRequest>,
    ) -> Result<Response<pb::ListTriggerDeliveriesResponse>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        let row = owned_trigger(&self.mgr, &caller, &r.trigger_id)?;
        let deliveries = self
            .mgr
            .store
            .deliveries(&row.id, page_size(r.page_size))?
            .into_iter()
            .map(|d| pb::TriggerDelivery {
                trigger_id: d.trigger_id,
                delivery_id: d.delivery_id,
                received_at: d.received_at,
                http_status: u32::from(d.http_status),
                outcome: d.outcome,
                detail: d.detail,
                run_id: d.run_id,
                remote: d.remote,
            })
            .collect();
        Ok(Response::new(pb::ListTriggerDeliveriesResponse {
            deliveries,
        }))
    }
}
