//! `hostagent.v1.Exec`: a bidirectional stream relayed to guest-init,
//! EndTurn, and (in [`super::attach`]) Attach and ListExecs.
//!
//! The first request must be `start`, naming the session and its current
//! execution id (a stale id is refused). Sessions of images without
//! guest-init have nobody to run commands and are refused with
//! FAILED_PRECONDITION. The command's output goes into its record
//! ([`crate::execs`]); the stream is one reader of it, so the command
//! outlives the stream.

use std::pin::Pin;
use std::sync::Arc;

use proto::hostagent as pb;
use proto::hostagent::exec_server::Exec;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use super::owned_session;
use crate::auth::layer::caller_of;
use crate::auth::Caller;
use crate::error::Error;
use crate::execs::attach::{self, Opening};
use crate::sessions::{CommandSpec, Manager};
use proto::guest::TerminalSize as GTerminalSize;

/// The Exec service.
pub struct ExecApi(pub Arc<Manager>);

type ExecStream = Pin<Box<dyn Stream<Item = Result<pb::ExecResponse, Status>> + Send>>;

/// Checks that `session_id` exists, is `caller`'s to see, and that
/// `execution_id` is its current one; returns whether its image runs
/// guest-init. A session paused to disk with `auto_resume` is resumed
/// (under a new execution id: the call goes on, aimed at it).
pub async fn check_execution(
    mgr: &Arc<Manager>,
    caller: &Caller,
    session_id: &str,
    execution_id: &str,
) -> Result<bool, Error> {
    let sess = owned_session(mgr, caller, session_id)?;
    if execution_id.is_empty() {
        return Err(Error::invalid("execution_id is required"));
    }
    let row = sess.row();
    if row.execution_id != execution_id {
        return Err(Error::FailedPrecondition(format!(
            "execution_id {execution_id:?} is stale: session {session_id} is now execution {:?}",
            row.execution_id
        )));
    }
    mgr.wake_for_call(session_id).await?;
    mgr.touch(&sess);
    Ok(mgr
        .store
        .image(&row.image_id)?
        .is_some_and(|i| i.guest_init))
}

#[tonic::async_trait]
impl Exec for ExecApi {
    type ExecStream = ExecStream;

    async fn end_turn(
        &self,
        req: Request<pb::EndTurnRequest>,
    ) -> Result<Response<pb::EndTurnResponse>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        owned_session(&self.0, &caller, &r.session_id)?;
        let killed = self.0.end_turn(&r.session_id, &r.turn_id).await?;
        Ok(Response::new(pb::EndTurnResponse {
            session_id: r.session_id,
            turn_id: r.turn_id,
            killed: killed
                .into_iter()
                .map(|k| pb::KilledProcess {
                    pid: k.pid,
                    command: k.command,
                })
                .collect(),
        }))
    }

    async fn exec(
        &self,
        req: Request<Streaming<pb::ExecRequest>>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        let caller = caller_of(&req)?;
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
        super::attach::check_start(&start)?;
        let guest_init =
            check_execution(&self.0, &caller, &start.session_id, &start.execution_id).await?;
        if !guest_init {
            return Err(Error::FailedPrecondition(format!(
                "session {} runs an image without guest-init; there is no agent to run commands",
                start.session_id
            ))
            .into());
        }
        let sess = self.0.session(&start.session_id)?;
        let (rec, conn) = self
            .0
            .start_command(
                &sess,
                CommandSpec {
                    argv: start.argv.clone(),
                    cwd: start.cwd.clone(),
                    env: start.env.clone(),
                    turn_id: start.turn_id.clone(),
                    pty: start.pty.map(|p| GTerminalSize {
                        rows: p.rows,
                        cols: p.cols,
                    }),
                    keep_stdin_open: start.keep_stdin_open,
                    timeout_ms: start.timeout_ms,
                },
            )
            .await?;
        let (out, fail) = attach::open(rec.clone(), Opening::Exec);
        // Input is forwarded once the guest has started the command; when
        // this stream drops, the command goes on (Attach reaches it again).
        tokio::spawn(attach::forward_input(rec, conn, input, fail));
        Ok(Response::new(Box::pin(out)))
    }

    type AttachStream = ExecStream;

    async fn attach(
        &self,
        req: Request<Streaming<pb::ExecRequest>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let out = super::attach::attach(&self.0, req).await?;
        Ok(Response::new(Box::pin(out)))
    }

    async fn list_execs(
        &self,
        req: Request<pb::ListExecsRequest>,
    ) -> Result<Response<pb::ListExecsResponse>, Status> {
        super::attach::list_execs(&self.0, req).map(Response::new)
    }
}
