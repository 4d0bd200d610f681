//! `hostagent.v1.Files`: stat, list, read, write, make a directory, remove,
//! rename and watch in a session's workspace, relayed to guest-init as
//! FileRequests (it checks the paths and does the work as the agent).
//!
//! Every call names the session and its current execution id, as Exec
//! does. Paths are checked here for what needs no file system (set, at most
//! 4096 bytes, no NUL) and again by the guest, which resolves them beneath
//! the workspace. Streams move in bounded pieces with credit (see
//! `guest::files`): at most `MAX_FILE_WINDOW` pieces wait for a slow
//! client, and a write sends the guest a chunk only when it has room.

mod convert;
mod streams;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use proto::guest::{
    file_request::Op, file_response::Result as R, FileMakeDir, FileRemove, FileRename, FileStat,
};
use proto::hostagent as pb;
use proto::hostagent::files_server::Files;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use super::exec::check_execution;
use crate::auth::layer::caller_of;
use crate::auth::Caller;
use crate::error::Error;
use crate::guest::GuestConn;
use crate::sessions::{state_name, Manager};
use convert::{guest_status, info_pb};

/// Longest wait for the guest's next answer within a call (a watch waits
/// for changes as long as its client stays).
pub const GUEST_IDLE: Duration = Duration::from_secs(60);
/// Longest path accepted.
pub const MAX_PATH_BYTES: usize = 4096;

/// The Files service.
pub struct FilesApi(pub Arc<Manager>);

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Checks a path field: set, at most [`MAX_PATH_BYTES`], no NUL.
pub fn check_path(field: &str, p: &str) -> Result<(), Status> {
    if p.is_empty() {
        return Err(
            Error::invalid(format!("{field} is required (`.` is the workspace root)")).into(),
        );
    }
    if p.len() > MAX_PATH_BYTES {
        return Err(Error::invalid(format!(
            "{field} is {} bytes; at most {MAX_PATH_BYTES}",
            p.len()
        ))
        .into());
    }
    if p.contains('\0') {
        return Err(Error::invalid(format!("{field} contains a NUL byte")).into());
    }
    Ok(())
}

impl FilesApi {
    /// The guest channel of a session the caller owns, at its current
    /// execution, RUNNING, with guest-init.
    pub async fn channel(
        &self,
        caller: &Caller,
        session_id: &str,
        execution_id: &str,
    ) -> Result<Arc<GuestConn>, Status> {
        if !check_execution(&self.0, caller, session_id, execution_id).await? {
            return Err(Error::FailedPrecondition(format!(
                "session {session_id} runs an image without guest-init; there is no agent to reach its files"
            ))
            .into());
        }
        let sess = self.0.session(session_id)?;
        let state = sess.row().state;
        if state != pb::SessionState::Running as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {session_id} is {}; files are reached only while RUNNING",
                state_name(state)
            ))
            .into());
        }
        Ok(self.0.guest_channel(&sess).await?)
    }

    /// Runs a one-answer request and returns the answer.
    async fn one(
        &self,
        caller: &Caller,
        session_id: &str,
        execution_id: &str,
        op: Op,
    ) -> Result<R, Status> {
        let conn = self.channel(caller, session_id, execution_id).await?;
        let mut call = conn.file_call(op).await?;
        let r = call.next(Some(GUEST_IDLE)).await?;
        call.finished();
        match r.result {
            Some(R::Error(e)) => Err(guest_status(e)),
            Some(r) => Ok(r),
            None => Err(Status::internal(
                "guest-init answered a file request with nothing",
            )),
        }
    }
}

fn unexpected(what: &str) -> Status {
    Status::internal(format!(
        "guest-init answered {what} with an unexpected message"
    ))
}

#[tonic::async_trait]
impl Files for FilesApi {
    type ListStream = BoxStream<pb::ListFilesResponse>;
    type ReadStream = BoxStream<pb::ReadFileResponse>;
    type WatchStream = BoxStream<pb::FileChange>;

    async fn stat(
        &self,
        req: Request<pb::StatFileRequest>,
    ) -> Result<Response<pb::FileInfo>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        check_path("path", &r.path)?;
        let op = Op::Stat(FileStat {
            path: r.path.into_bytes(),
        });
        match self
            .one(&caller, &r.session_id, &r.execution_id, op)
            .await?
        {
            R::Info(i) => Ok(Response::new(info_pb(i))),
            _ => Err(unexpected("Stat")),
        }
    }

    async fn make_dir(
        &self,
        req: Request<pb::MakeDirRequest>,
    ) -> Result<Response<pb::FileInfo>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        check_path("path", &r.path)?;
        let op = Op::MakeDir(FileMakeDir {
            path: r.path.into_bytes(),
            parents: r.parents,
            permissions: r.permissions,
        });
        match self
            .one(&caller, &r.session_id, &r.execution_id, op)
            .await?
        {
            R::Info(i) => Ok(Response::new(info_pb(i))),
            _ => Err(unexpected("MakeDir")),
        }
    }

    async fn remove(
        &self,
        req: Request<pb::RemoveFileRequest>,
    ) -> Result<Response<pb::RemoveFileResponse>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        check_path("path", &r.path)?;
        let op = Op::Remove(FileRemove {
            path: r.path.into_bytes(),
            recursive: r.recursive,
        });
        match self
            .one(&caller, &r.session_id, &r.execution_id, op)
            .await?
        {
            R::Done(d) => Ok(Response::new(pb::RemoveFileResponse { removed: d.count })),
            _ => Err(unexpected("Remove")),
        }
    }

    async fn rename(
        &self,
        req: Request<pb::RenameFileRequest>,
    ) -> Result<Response<pb::FileInfo>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        check_path("from", &r.from)?;
        check_path("to", &r.to)?;
        let op = Op::Rename(FileRename {
            from: r.from.into_bytes(),
            to: r.to.into_bytes(),
            overwrite: r.overwrite,
        });
        match self
            .one(&caller, &r.session_id, &r.execution_id, op)
            .await?
        {
            R::Info(i) => Ok(Response::new(info_pb(i))),
            _ => Err(unexpected("Rename")),
        }
    }

    async fn list(
        &self,
        req: Request<pb::ListFilesRequest>,
    ) -> Result<Response<Self::ListStream>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        check_path("path", &r.path)?;
        if r.depth > 64 {
            return Err(Error::invalid(format!("depth {} is deeper than 64", r.depth)).into());
        }
        let conn = self
            .channel(&caller, &r.session_id, &r.execution_id)
            .await?;
        Ok(Response::new(streams::list(conn, r).await?))
    }

    async fn read(
        &self,
        req: Request<pb::ReadFileRequest>,
    ) -> Result<Response<Self::ReadStream>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        check_path("path", &r.path)?;
        if r.offset > i64::MAX as u64 {
            return Err(Error::invalid(format!("offset {} is past any file", r.offset)).into());
        }
        let conn = self
            .channel(&caller, &r.session_id, &r.execution_id)
            .await?;
        Ok(Response::new(streams::read(conn, r).await?))
    }

    async fn watch(
        &self,
        req: Request<pb::WatchFilesRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        check_path("path", &r.path)?;
        let conn = self
            .channel(&caller, &r.session_id, &r.execution_id)
            .await?;
        Ok(Response::new(streams::watch(conn, r).await?))
    }

    async fn write(
        &self,
        req: Request<Streaming<pb::WriteFileRequest>>,
    ) -> Result<Response<pb::WriteFileResponse>, Status> {
        let caller = caller_of(&req)?;
        let mut input = req.into_inner();
        let start = match input.message().await? {
            Some(pb::WriteFileRequest {
                kind: Some(pb::write_file_request::Kind::Start(s)),
            }) => s,
            _ => {
                return Err(
                    Error::invalid("start: the first message of a write must be start").into(),
                )
            }
        };
        check_path("path", &start.path)?;
        let mode = match pb::WriteMode::try_from(start.mode) {
            Ok(pb::WriteMode::Create) => proto::guest::file_write::Mode::Create,
            Ok(pb::WriteMode::Truncate) => proto::guest::file_write::Mode::Truncate,
            Ok(pb::WriteMode::Append) => proto::guest::file_write::Mode::Append,
            _ => {
                return Err(Error::invalid(format!(
                    "mode {} is not CREATE, TRUNCATE or APPEND",
                    start.mode
                ))
                .into())
            }
        };
        if start.permissions & !0o1777 != 0 {
            return Err(Error::invalid(format!(
                "permissions {:#o} has bits other than 0o777 and sticky",
                start.permissions
            ))
            .into());
        }
        let conn = self
            .channel(&caller, &start.session_id, &start.execution_id)
            .await?;
        let call = conn
            .file_call(Op::Write(proto::guest::FileWrite {
                path: start.path.into_bytes(),
                mode: mode as i32,
                permissions: start.permissions,
            }))
            .await?;
        Ok(Response::new(streams::write(call, input).await?))
    }
}
