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
use crate::auth::Caller;
use crate::error::{Error, Result};
use crate::schedules::{check_id, ScheduleRow};
use crate::sessions::{now_ms, Manager};

/// The Schedules service.
pub struct SchedulesApi(pub Arc<Manager>);

/// Checks `s` for `caller`, its template as CreateSession would check it
/// (and its image registered).
fn checked(mgr: &Manager, caller: &Caller, s: pb::Schedule) -> Result<ScheduleRow> {
    ScheduleRow::from_request(s, &caller.name, now_ms(), |t| {
        create_params(mgr, caller, t.clone())?;
        if mgr.store.image(&t.image_id)?.is_none() {
            return Err(Error::invalid(format!(
                "image_id {:?} is not registered on this node",
                t.image_id
            )));
        }
        Ok(())
    })
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
        let row = checked(&self.0, &caller, given(req.into_inner().schedule)?)?;
        self.0.store.insert_schedule(&row)?;
        tracing::info!(schedule = %row.id, owner = %row.owner, cron = %row.cron, timezone = %row.timezone, "schedule created");
        Ok(Response::new(row.to_pb(now_ms())))
    }

    async fn get_schedule(
        &self,
        req: Request<pb::ScheduleRef>,
    ) -> Result<Response<pb::Schedule>, Status> {
        let caller = caller_of(&req)?;
        let row = owned(&self.0, &caller, &req.into_inner().schedule_id)?;
        Ok(Response::new(row.to_pb(now_ms())))
    }

    async fn list_schedules(
        &self,
        req: Request<pb::ListSchedulesRequest>,
    ) -> Result<Response<pb::ListSchedulesResponse>, Status> {
        let caller = caller_of(&req)?;
        let now = now_ms();
        let schedules = self
            .0
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
        let old = owned(&self.0, &caller, &s.schedule_id)?;
        // The template is checked as its owner's: the runs are theirs.
        let owner = Caller {
            name: old.owner.clone(),
            ..caller.clone()
        };
        let row = ScheduleRow {
            created_at: old.created_at,
            ..checked(&self.0, &owner, s)?
        };
        if !self.0.store.update_schedule(&row)? {
            return Err(Error::not_found("schedule", &row.id).into());
        }
        tracing::info!(schedule = %row.id, cron = %row.cron, timezone = %row.timezone, enabled = row.enabled, "schedule updated");
        Ok(Response::new(row.to_pb(now_ms())))
    }

    async fn delete_schedule(
        &self,
        req: Request<pb::ScheduleRef>,
    ) -> Result<Response<pb::DeleteScheduleResponse>, Status> {
        let caller = caller_of(&req)?;
        let row = owned(&self.0, &caller, &req.into_inner().schedule_id)?;
        self.0.store.delete_schedule(&row.id)?;
        tracing::info!(schedule = %row.id, "schedule deleted");
        Ok(Response::new(pb::DeleteScheduleResponse {}))
    }
}
