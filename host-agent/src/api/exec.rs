//! `hostagent.v1.Exec`: a bidirectional stream relayed to guest-init, and
//! EndTurn.
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

use super::owned_session;
use crate::auth::layer::caller_of;
use crate::auth::Caller;
use crate::error::Error;
use crate::sessions::{state_name, Manager};
use proto::guest::{
    exec_exited, guest_message::Kind as Out, host_message::Kind as In, output, Exec as GExec,
    Signal as GSignal, StdinData,
};

/// The Exec service.
pub struct ExecApi(pub Arc<Manager>);

type ExecStream = Pin<Box<dyn Stream<Item = Result<pb::ExecResponse, Status>> + Send>>;

/// Checks that `session_id` exists, is `caller`'s to see, and that
/// `execution_id` is its current one; returns whether its image runs
/// guest-init.
pub fn check_execution(
    mgr: &Manager,
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
        let guest_init = check_execution(&self.0, &caller, &start.session_id, &start.execution_id)?;
        if !guest_init {
            return Err(Error::FailedPrecondition(format!(
                "session {} runs an image without guest-init; there is no agent to run commands",
                start.session_id
            ))
            .into());
        }
        let sess = self.0.session(&start.session_id)?;
        let state = sess.row().state;
        if state != pb::SessionState::Running as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {} is {}; commands run only while RUNNING",
                start.session_id,
                state_name(state)
            ))
            .into());
        }
        // Opens the channel again if a host-agent restart (or a broken vsock) lost it.
        let conn = self.0.guest_channel(&sess).await?;
        let exec_id = uuid::Uuid::new_v4().to_string();
        let rx = conn.route_exec(&exec_id)?;
        let turn_id = if start.turn_id.is_empty() {
            format!("turn-{exec_id}")
        } else {
            start.turn_id.clone()
        };
        conn.send(In::Exec(GExec {
            exec_id: exec_id.clone(),
            turn_id,
            argv: start.argv.clone(),
            cwd: start.cwd.clone().into_bytes(),
            env: start.env.clone(),
            stdin: Vec::new(),
            keep_stdin_open: start.keep_stdin_open,
        }))
        .await?;
        let conn2 = conn.clone();
        let id2 = exec_id.clone();
        // Input is forwarded once the guest has started the command (it
        // refuses stdin for a command it has not started yet).
        let (started_tx, mut started_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            if started_rx.wait_for(|s| *s).await.is_err() {
                return;
            }
            while let Some(Ok(req)) = input.next().await {
                let m = match req.kind {
                    Some(pb::exec_request::Kind::Stdin(data)) => In::Stdin(StdinData {
                        exec_id: id2.clone(),
                        data,
                        eof: false,
                    }),
                    Some(pb::exec_request::Kind::StdinEof(_)) => In::Stdin(StdinData {
                        exec_id: id2.clone(),
                        data: Vec::new(),
                        eof: true,
                    }),
                    Some(pb::exec_request::Kind::Signal(signal)) => In::Signal(GSignal {
                        exec_id: id2.clone(),
                        signal,
                    }),
                    _ => continue,
                };
                if conn2.send(m).await.is_err() {
                    return;
                }
            }
        });
        let session_id = start.session_id.clone();
        let out = tokio_stream::wrappers::ReceiverStream::new(rx).filter_map(move |m| {
            use pb::exec_response::Kind as R;
            let kind = match m.kind? {
                Out::ExecStarted(e) => {
                    let _ = started_tx.send(true);
                    R::Started(format!("{} {}", e.exec_id, e.pid))
                }
                Out::Output(o) => {
                    if o.stream == output::Stream::Stderr as i32 {
                        R::Stderr(o.data)
                    } else {
                        R::Stdout(o.data)
                    }
                }
                Out::ExecExited(e) => R::Exit(pb::ExecExit {
                    status: e.status.map(|s| match s {
                        exec_exited::Status::Code(c) => pb::exec_exit::Status::Code(c),
                        exec_exited::Status::Signal(n) => pb::exec_exit::Status::Signal(n),
                    }),
                }),
                Out::ExecRejected(r) => R::Rejected(if r.rule.is_empty() {
                    r.reason
                } else {
                    format!("{} ({})", r.reason, r.rule)
                }),
                Out::AskRequest(a) => R::Ask(pb::Ask {
                    ask_id: a.ask_id,
                    session_id: session_id.clone(),
                    exec_id: a.exec_id,
                    turn_id: a.turn_id,
                    tool: a.tool,
                    subject: a.subject,
                    rule: a.rule,
                    asked_at: crate::sessions::now_ms(),
                }),
                Out::Error(e) => {
                    return Some(Err(Status::aborted(format!("guest-init: {}", e.message))))
                }
                _ => return None,
            };
            Some(Ok(pb::ExecResponse { kind: Some(kind) }))
        });
        Ok(Response::new(Box::pin(out)))
    }
}
