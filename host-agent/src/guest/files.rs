//! File requests on the guest channel (the Files API): each is a
//! [`FileCall`] with its own request id and a bounded queue of the guest's
//! responses.
//!
//! The reader never waits on a file call: what the guest sends for one goes
//! into its queue with `try_send`. The queue holds more than the credit the
//! call ever grants (see guest.proto), so a guest keeping to the protocol
//! never finds it full; one that overruns it loses the call (its queue is
//! closed, the caller sees an error) and the drop is counted. Exec output
//! and the rest of the channel keep flowing whatever a file call's client
//! does. Dropping a [`FileCall`] unroutes it and tells the guest to cancel.

use proto::guest::{file_request::Op, FileCancel, FileRequest, FileResponse};

use super::*;

/// File calls open at once on one channel; more are RESOURCE_EXHAUSTED.
pub const MAX_FILE_CALLS: usize = 16;
/// Most credit a call grants the guest (messages ahead of the client).
pub const MAX_FILE_WINDOW: u32 = 8;
/// Responses queued per call: the window, the final message and an error.
const FILE_QUEUE: usize = MAX_FILE_WINDOW as usize + 2;

/// The routes of open file calls.
#[derive(Default)]
pub(super) struct FileRoutes {
    calls: HashMap<u64, mpsc::Sender<FileResponse>>,
    next_id: u64,
}

/// One open file request.
pub struct FileCall {
    id: u64,
    rx: mpsc::Receiver<FileResponse>,
    out: mpsc::Sender<HostMessage>,
    shared: Arc<Shared>,
    finished: bool,
}

impl GuestConn {
    /// Opens a file request with `op`; the guest's responses arrive through
    /// the returned call.
    pub async fn file_call(&self, op: Op) -> Result<FileCall> {
        let (tx, rx) = mpsc::channel(FILE_QUEUE);
        let id = {
            let mut g = self.shared.routes();
            if g.closed {
                return Err(Error::Guest("the guest channel is closed".into()));
            }
            if g.files.calls.len() >= MAX_FILE_CALLS {
                return Err(Error::ResourceExhausted(format!(
                    "{MAX_FILE_CALLS} file calls are already running on this session; \
                     wait for one to end"
                )));
            }
            g.files.next_id += 1;
            let id = g.files.next_id;
            g.files.calls.insert(id, tx);
            id
        };
        let call = FileCall {
            id,
            rx,
            out: self.out.clone(),
            shared: self.shared.clone(),
            finished: false,
        };
        call.send(op).await?;
        Ok(call)
    }
}

impl FileCall {
    /// Sends more input for this request (a chunk, credit).
    pub async fn send(&self, op: Op) -> Result<()> {
        let m = kind(In::File(FileRequest {
            request_id: self.id,
            op: Some(op),
        }));
        match tokio::time::timeout(limits::SEND_TIMEOUT, self.out.send(m)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Error::Guest("the guest channel is closed".into())),
            Err(_) => Err(Error::Timeout(format!(
                "the guest has not read its channel for {:?}",
                limits::SEND_TIMEOUT
            ))),
        }
    }

    /// The next response, waiting at most `idle` (None: as long as it takes).
    pub async fn next(&mut self, idle: Option<Duration>) -> Result<FileResponse> {
        let got = match idle {
            Some(t) => tokio::time::timeout(t, self.rx.recv()).await.map_err(|_| {
                Error::Timeout(format!(
                    "guest-init did not answer the file request in {t:?}"
                ))
            })?,
            None => self.rx.recv().await,
        };
        got.ok_or_else(|| {
            Error::Guest(
                "the guest channel closed, or the guest sent more than the request's credit".into(),
            )
        })
    }

    /// Marks the request as ended by the guest (nothing to cancel).
    pub fn finished(&mut self) {
        self.finished = true;
    }
}

impl Drop for FileCall {
    fn drop(&mut self) {
        self.shared.routes().files.calls.remove(&self.id);
        if !self.finished {
            // Best effort: a guest that does not read loses only this.
            let _ = self.out.try_send(kind(In::File(FileRequest {
                request_id: self.id,
                op: Some(Op::Cancel(FileCancel {})),
            })));
        }
    }
}

impl Reader {
    /// Hands a file response to its call without waiting.
    pub(super) fn route_file(&self, f: FileResponse) {
        let id = f.request_id;
        let mut g = self.shared.routes();
        let Some(tx) = g.files.calls.get(&id) else {
            metrics::guest_dropped("file_unexpected");
            return;
        };
        if tx.try_send(f).is_err() {
            // Over its credit (or the caller is gone): the call ends.
            g.files.calls.remove(&id);
            metrics::guest_dropped("file_overrun");
        }
    }
}
