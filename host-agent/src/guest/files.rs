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

use proto::guest::{
    file_request::Op, file_response::Result as R, FileCancel, FileChunk, FileDone, FileError,
    FileRequest, FileResponse,
};

use super::*;

/// File calls open at once on one channel; more are RESOURCE_EXHAUSTED.
pub const MAX_FILE_CALLS: usize = 16;
/// Most credit a call grants the guest (messages ahead of the client).
pub const MAX_FILE_WINDOW: u32 = 8;
/// Responses queued per call: the window, the final message and an error.
const FILE_QUEUE: usize = MAX_FILE_WINDOW as usize + 2;
/// Largest chunk a write sends the guest.
pub const WRITE_CHUNK: usize = 256 * 1024;
/// How long a write waits for the guest's credit or answer.
pub const WRITE_IDLE: Duration = Duration::from_secs(60);

/// Why a file call failed.
#[derive(Debug, thiserror::Error)]
pub enum FileCallError {
    /// guest-init refused or failed the operation (its code and field).
    #[error("guest-init: {}: {}", .0.field, .0.message)]
    Refused(FileError),
    /// The channel failed, timed out, or the guest broke the protocol.
    #[error(transparent)]
    Channel(#[from] Error),
}

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
    /// Chunks the guest has room for (a write).
    credit: u32,
}

impl GuestConn {
    /// Opens a file request with `op`; the guest's responses arrive through
    /// the returned call.
    pub async fn file_call(&self, op: Op) -> Result<FileCall> {
        let (tx, rx) = mpsc::channel(FILE_QUEUE);
        let id = {
            let mut g = self.shared.routes();
            if g.closed {
                return Err(Error::GuestGone("the guest channel is closed".into()));
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
            credit: 0,
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
            Ok(Err(_)) => Err(Error::GuestGone("the guest channel is closed".into())),
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

    /// A write's next answer: credit is counted, an error ends the call.
    async fn write_answer(&mut self) -> Result<Option<FileDone>, FileCallError> {
        match self.next(Some(WRITE_IDLE)).await?.result {
            Some(R::Credit(c)) => {
                // More than the guest's window is never needed.
                self.credit = self.credit.saturating_add(c.messages).min(64);
                Ok(None)
            }
            Some(R::Done(d)) => {
                self.finished = true;
                Ok(Some(d))
            }
            Some(R::Error(e)) => {
                self.finished = true;
                Err(FileCallError::Refused(e))
            }
            _ => Err(
                Error::Guest("guest-init answered a write with an unexpected message".into())
                    .into(),
            ),
        }
    }

    /// Sends `data` to an open write in chunks of at most [`WRITE_CHUNK`],
    /// each once the guest has room for it; `last` ends the file (an empty
    /// last chunk is sent if needed).
    pub async fn write(&mut self, data: &[u8], last: bool) -> Result<(), FileCallError> {
        let mut pieces: Vec<&[u8]> = data.chunks(WRITE_CHUNK).collect();
        if pieces.is_empty() && last {
            pieces.push(&[]);
        }
        let n = pieces.len();
        for (i, piece) in pieces.into_iter().enumerate() {
            while self.credit == 0 {
                if self.write_answer().await?.is_some() {
                    return Err(Error::Guest(
                        "guest-init ended the write before its last chunk".into(),
                    )
                    .into());
                }
            }
            self.credit -= 1;
            self.send(Op::Chunk(FileChunk {
                data: piece.to_vec(),
                last: last && i + 1 == n,
            }))
            .await?;
        }
        Ok(())
    }

    /// After the last chunk: the guest's answer (bytes written, the file).
    pub async fn write_result(&mut self) -> Result<FileDone, FileCallError> {
        loop {
            if let Some(d) = self.write_answer().await? {
                return Ok(d);
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use proto::guest::{FileChunk, FileRead, Hello};

    fn frame(kind: Out) -> Vec<u8> {
        encode_frame(&GuestMessage { kind: Some(kind) }, DEFAULT_MAX_FRAME).unwrap()
    }

    #[tokio::test]
    async fn a_guest_over_its_credit_loses_the_call_but_never_stalls_the_channel() {
        let (host, mut guest) = UnixStream::pair().unwrap();
        guest
            .write_all(&frame(Out::Hello(Hello {
                protocol_version: proto::guest::PROTOCOL_VERSION,
                software: "fake".into(),
            })))
            .await
            .unwrap();
        let conn = GuestConn::open(host, "s", None, Duration::from_secs(30))
            .await
            .unwrap();
        let mut call = conn
            .file_call(Op::Read(FileRead {
                path: b"f".to_vec(),
                window: 1,
                ..Default::default()
            }))
            .await
            .unwrap();
        // Far more than the call's queue, nobody reading it, then a control
        // message: the reader must get to it.
        let mut flood = Vec::new();
        for _ in 0..(FILE_QUEUE * 4) {
            flood.extend(frame(Out::File(FileResponse {
                request_id: 1,
                result: Some(R::Data(FileChunk {
                    data: vec![0; 1024],
                    last: false,
                })),
            })));
        }
        flood.extend(frame(Out::Error(proto::guest::Error {
            message: "after the flood".into(),
            ..Default::default()
        })));
        guest.write_all(&flood).await.unwrap();
        let ctl = conn.next_control(Duration::from_secs(30)).await.unwrap();
        assert!(matches!(ctl.kind, Some(Out::Error(e)) if e.message == "after the flood"));
        // The call got what fitted, then ended.
        let mut got = 0;
        while call.next(Some(Duration::from_secs(30))).await.is_ok() {
            got += 1;
        }
        assert_eq!(got, FILE_QUEUE);
        assert!(conn.shared.routes().files.calls.is_empty());
        // Responses for calls nobody opened are dropped.
        guest
            .write_all(&frame(Out::File(FileResponse {
                request_id: 99,
                result: None,
            })))
            .await
            .unwrap();
    }
}
