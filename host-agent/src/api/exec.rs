//! `hostagent.v1.Exec`: a bidirectional stream relayed to guest-init.
//!
//! The first request must be `start`, naming the session and its current
//! execution id (a stale id is refused). Sessions of images without
//! guest-init have nobody to run commands and are refused with
//! FAILED_PRECONDITION.

use std::pin::Pin;
use std::sync::Arc;

use proto::hostagent as pb;
use proto::hostagent::exec_server::Exec;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use super::check_session_id;
use crate::error::Error;
use crate::sessions::Manager;

/// The Exec service.
pub struct ExecApi(pub Arc<Manager>);

type ExecStream = Pin<Box<dyn Stream<Item = Result<pb::ExecResponse, Status>> + Send>>;

/// Checks that `session_id` exists and `execution_id` is its current one;
/// returns whether its image runs guest-init.
pub fn check_execution(mgr: &Manager, session_id: &str, execution_id: &str) -> Result<bool, Error> {
    check_session_id(session_id)?;
    if execution_id.is_empty() {
        return Err(Error::invalid("execution_id is required"));
    }
    let sess = mgr.session(session_id)?;
    let row = sess.row();
    if row.execution_id != execution_id {
        return Err(Error::FailedPrecondition(format!(
            "execution_id {execution_id:?} is stale: session {session_id} is now execution {:?}",
            row.execution_id
        )));
    }
    mgr.touch(&sess);
    Ok(mgr
        .store
        .image(&row.image_id)?
        .is_some_and(|i| i.guest_init))
}

#[tonic::async_trait]
impl Exec for ExecApi {
    type ExecStream = ExecStream;

    async fn exec(
        &self,
        req: Request<Streaming<pb::ExecRequest>>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        let mut input = req.into_inner();
        let first = match input.next().await {
            Some(Ok(m)) => m,
            Some(Err(e)) => return Err(e),
            None => return Err(Error::invalid("empty exec stream: send start first").into()),
        };
        let Some(pb::exec_request::Kind::Start(start)) = first.kind else {
            return Err(Error::invalid("the first exec message must be start").into());
        };
        if start.argv.is_empty() || start.argv[0].is_empty() {
            return Err(Error::invalid("argv must name a program").into());
        }
        let guest_init = check_execution(&self.0, &start.session_id, &start.execution_id)?;
        if !guest_init {
            return Err(Error::FailedPrecondition(format!(
                "session {} runs an image without guest-init; there is no agent to run commands",
                start.session_id
            ))
            .into());
        }
        Err(Error::FailedPrecondition(
            "guest-init sessions need the vmm's vsock device, which this build does not have"
                .into(),
        )
        .into())
    }
}
