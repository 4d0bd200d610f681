//! `hostagent.v1.Usage`.

use std::sync::Arc;

use proto::hostagent as pb;
use proto::hostagent::usage_server::Usage;
use tonic::{Request, Response, Status};

use super::{check_session_id, usage_pb};
use crate::auth::layer::caller_of;
use crate::error::Error;
use crate::sessions::Manager;

/// The Usage service.
pub struct UsageApi(pub Arc<Manager>);

#[tonic::async_trait]
impl Usage for UsageApi {
    async fn list_usage(
        &self,
        req: Request<pb::ListUsageRequest>,
    ) -> Result<Response<pb::ListUsageResponse>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        if !r.session_id.is_empty() {
            check_session_id(&r.session_id)?;
        }
        if r.since_time < 0 {
            return Err(Error::invalid(format!("since_time {} is negative", r.since_time)).into());
        }
        if r.limit > 10_000 {
            return Err(
                Error::invalid(format!("limit {} is out of range 0..=10000", r.limit)).into(),
            );
        }
        let limit = if r.limit == 0 { 1000 } else { r.limit };
        let session = (!r.session_id.is_empty()).then_some(r.session_id.as_str());
        let records = self
            .0
            .store
            .usage_since(
                session,
                caller.owner_filter(),
                r.since_seq,
                r.since_time,
                limit,
            )?
            .iter()
            .map(usage_pb)
            .collect();
        Ok(Response::new(pb::ListUsageResponse { records }))
    }
}
