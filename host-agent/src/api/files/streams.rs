//! The streaming calls: List, Read and Watch (guest to client, credit
//! granted as the client takes messages) and Write (client to guest, a
//! chunk sent only with the guest's credit).

use proto::guest::{
    file_request::Op, file_response::Result as R, FileCredit, FileList, FileRead, FileWatch,
};
use proto::hostagent as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use super::convert::{call_status, change_pb, guest_status, info_pb};
use super::{BoxStream, GUEST_IDLE};
use crate::error::Error;
use crate::guest::{FileCall, GuestConn, MAX_FILE_WINDOW};

/// Most bytes one Write call carries (16 GiB, as guest-init allows).
pub const MAX_WRITE_BYTES: u64 = 16 << 30;

/// Relays a guest-to-client stream: `map` turns each response into zero
/// or more client messages and says whether it was the last; one credit is
/// granted back per response the client took.
fn relay<T, F>(mut call: FileCall, idle: Option<std::time::Duration>, mut map: F) -> BoxStream<T>
where
    T: Send + 'static,
    F: FnMut(R) -> Result<(Option<T>, bool), Status> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Result<T, Status>>(1);
    tokio::spawn(async move {
        loop {
            let next = tokio::select! {
                n = call.next(idle) => n,
                // The client went away: dropping `call` cancels the request.
                _ = tx.closed() => return,
            };
            let r = match next {
                Ok(r) => r.result,
                Err(e) => {
                    let _ = tx.send(Err(e.into())).await;
                    return;
                }
            };
            let (item, last) = match r {
                Some(R::Error(e)) => {
                    call.finished();
                    (Some(Err(guest_status(e))), true)
                }
                Some(r) => match map(r) {
                    Ok((m, last)) => (m.map(Ok), last),
                    Err(s) => (Some(Err(s)), true),
                },
                None => (None, false),
            };
            if last {
                call.finished();
            }
            if let Some(item) = item {
                if tx.send(item).await.is_err() {
                    return;
                }
            }
            if last {
                return;
            }
            let credit = Op::Credit(FileCredit { messages: 1 });
            if let Err(e) = call.send(credit).await {
                let _ = tx.send(Err(e.into())).await;
                return;
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

fn unexpected(what: &str) -> Status {
    Status::internal(format!("guest-init sent an unexpected message in a {what}"))
}

/// List: pages of entries.
pub async fn list(
    conn: std::sync::Arc<GuestConn>,
    r: pb::ListFilesRequest,
) -> Result<BoxStream<pb::ListFilesResponse>, Status> {
    let call = conn
        .file_call(Op::List(FileList {
            path: r.path.into_bytes(),
            depth: r.depth,
            window: MAX_FILE_WINDOW,
        }))
        .await?;
    Ok(relay(call, Some(GUEST_IDLE), |r| match r {
        R::Entries(e) => Ok((
            Some(pb::ListFilesResponse {
                entries: e.entries.into_iter().map(info_pb).collect(),
                truncated: e.truncated,
            }),
            e.last,
        )),
        _ => Err(unexpected("list")),
    }))
}

/// Read: the file's content in pieces.
pub async fn read(
    conn: std::sync::Arc<GuestConn>,
    r: pb::ReadFileRequest,
) -> Result<BoxStream<pb::ReadFileResponse>, Status> {
    let call = conn
        .file_call(Op::Read(FileRead {
            path: r.path.into_bytes(),
            offset: r.offset,
            length: r.length,
            window: MAX_FILE_WINDOW,
        }))
        .await?;
    Ok(relay(call, Some(GUEST_IDLE), |r| match r {
        // An empty last piece ends the stream without a message.
        R::Data(d) => Ok((
            (!d.data.is_empty()).then_some(pb::ReadFileResponse { data: d.data }),
            d.last,
        )),
        _ => Err(unexpected("read")),
    }))
}

/// Watch: WATCHING first, then changes until the client goes.
pub async fn watch(
    conn: std::sync::Arc<GuestConn>,
    r: pb::WatchFilesRequest,
) -> Result<BoxStream<pb::FileChange>, Status> {
    let call = conn
        .file_call(Op::Watch(FileWatch {
            path: r.path.into_bytes(),
            recursive: r.recursive,
            window: MAX_FILE_WINDOW,
        }))
        .await?;
    let mut first = true;
    Ok(relay(call, None, move |r| match r {
        R::Info(i) if first => {
            first = false;
            Ok((
                Some(pb::FileChange {
                    kind: pb::file_change::Kind::Watching as i32,
                    path: i.path,
                    to: String::new(),
                    is_dir: true,
                }),
                false,
            ))
        }
        R::Change(c) => Ok((Some(change_pb(c)), false)),
        _ => Err(unexpected("watch")),
    }))
}

/// Write: the client's data relayed with the guest's credit (see
/// [`FileCall::write`]); the end of the client's stream ends the file.
pub async fn write(
    mut call: FileCall,
    mut input: Streaming<pb::WriteFileRequest>,
) -> Result<pb::WriteFileResponse, Status> {
    let mut total = 0u64;
    loop {
        let (data, last) = match input.message().await? {
            Some(pb::WriteFileRequest {
                kind: Some(pb::write_file_request::Kind::Data(d)),
            }) => (d, false),
            Some(_) => {
                return Err(
                    Error::invalid("start: only the first message of a write is start").into(),
                )
            }
            None => (Vec::new(), true),
        };
        total += data.len() as u64;
        if total > MAX_WRITE_BYTES {
            return Err(Error::ResourceExhausted(format!(
                "data: a write carries at most {MAX_WRITE_BYTES} bytes; nothing was written"
            ))
            .into());
        }
        call.write(&data, last).await.map_err(call_status)?;
        if last {
            break;
        }
    }
    let d = call.write_result().await.map_err(call_status)?;
    Ok(pb::WriteFileResponse {
        bytes_written: d.count,
        info: d.info.map(info_pb),
    })
}
