//! FileRequest: the Files API's operations run for the host, each on a
//! thread as the agent ([`crate::files::fsid`]), with credit-based flow
//! control (see guest.proto) and mutations audited (`file.write`,
//! `file.mkdir`, `file.remove`, `file.rename`: paths and sizes, never
//! contents). Requests belong to the connection: closing it cancels them.

use std::os::fd::OwnedFd;

use proto::guest::{
    file_error::Code as FCode, file_request::Op, file_response::Result as R, FileChunk, FileCredit,
    FileDone, FileEntries, FileError as FileErrorMsg, FileRequest, FileResponse,
};
use tokio::sync::Semaphore;

use super::connection::Conn;
use super::*;
use crate::files::{self, fsid, ops, path::Workspace, watch::Watcher, write::Writer, FileError};

/// Open requests per connection; more are RESOURCE_EXHAUSTED.
pub const MAX_OPEN_REQUESTS: usize = 16;
/// Chunks the host may send ahead of a write.
pub const WRITE_WINDOW: u32 = 8;
/// Most credit a read, list or watch holds.
const MAX_WINDOW: u32 = 64;
/// Entries per listing page.
const LIST_PAGE: usize = 1000;
/// About the most bytes of entries per listing page (frames are at most 4 MiB).
const LIST_PAGE_BYTES: usize = 1 << 20;

/// An open request's inputs.
struct Open {
    credit: Option<Arc<Semaphore>>,
    window: usize,
    chunks: Option<mpsc::Sender<FileChunk>>,
    /// Dropped to stop a watch.
    _stop: Option<OwnedFd>,
}

impl Drop for Open {
    fn drop(&mut self) {
        // A reader or watcher waiting for credit stops.
        if let Some(c) = &self.credit {
            c.close();
        }
    }
}

/// The connection's open file requests.
#[derive(Default)]
pub(super) struct FileOps {
    open: Arc<Mutex<HashMap<u64, Open>>>,
}

fn reply(id: u64, r: R) -> GuestMessage {
    msg(Out::File(FileResponse {
        request_id: id,
        result: Some(r),
    }))
}

fn failed(id: u64, e: FileError) -> GuestMessage {
    reply(
        id,
        R::Error(FileErrorMsg {
            code: e.code as i32,
            field: e.field.to_string(),
            message: e.message,
        }),
    )
}

fn window(w: u32) -> Result<u32, FileError> {
    match w {
        1..=MAX_WINDOW => Ok(w),
        _ => Err(FileError::invalid(
            "window",
            format!("{w} is not between 1 and {MAX_WINDOW}"),
        )),
    }
}

impl Conn {
    /// Handles one FileRequest without waiting on any file operation.
    pub(super) async fn file(&mut self, r: FileRequest) {
        let id = r.request_id;
        let Some(op) = r.op else {
            self.send(failed(id, FileError::invalid("op", "no operation")))
                .await;
            return;
        };
        match op {
            Op::Credit(c) => {
                if let Some(o) = lock(&self.files.open).get(&id) {
                    if let Some(sem) = &o.credit {
                        let room = o.window.saturating_sub(sem.available_permits());
                        sem.add_permits((c.messages as usize).min(room));
                    }
                }
            }
            Op::Cancel(_) => {
                lock(&self.files.open).remove(&id);
            }
            Op::Chunk(c) => {
                let tx = lock(&self.files.open)
                    .get(&id)
                    .and_then(|o| o.chunks.clone());
                let refused = match tx {
                    None => Some(format!("request {id} is not an open write")),
                    Some(tx) => match tx.try_send(c) {
                        Ok(()) => None,
                        Err(_) => Some(format!(
                            "request {id} sent a chunk beyond its credit ({WRITE_WINDOW} chunks)"
                        )),
                    },
                };
                if let Some(m) = refused {
                    // The write is dropped, so its temporary file goes.
                    lock(&self.files.open).remove(&id);
                    self.send(failed(
                        id,
                        FileError::new(FCode::InvalidArgument, "chunk", m),
                    ))
                    .await;
                }
            }
            op => {
                if let Err(e) = self.file_start(id, op) {
                    self.send(failed(id, e)).await;
                }
            }
        }
    }

    fn file_start(&mut self, id: u64, op: Op) -> Result<(), FileError> {
        let s = self
            .session()
            .map_err(|f| FileError::new(FCode::FailedPrecondition, "", f.message))?;
        let mut open = Open {
            credit: None,
            window: 0,
            chunks: None,
            _stop: None,
        };
        let w = match &op {
            Op::List(l) => Some(window(l.window)?),
            Op::Read(r) => Some(window(r.window)?),
            Op::Watch(w) => Some(window(w.window)?),
            _ => None,
        };
        if let Some(w) = w {
            open.credit = Some(Arc::new(Semaphore::new(w as usize)));
            open.window = w as usize;
        }
        let mut chunks = None;
        if matches!(op, Op::Write(_)) {
            let (tx, rx) = mpsc::channel(WRITE_WINDOW as usize);
            open.chunks = Some(tx);
            chunks = Some(rx);
        }
        let mut stop = None;
        if matches!(op, Op::Watch(_)) {
            let (rd, wr) = files::watch::stop_pipe()?;
            open._stop = Some(wr);
            stop = Some(rd);
        }
        let credit = open.credit.clone();
        {
            let mut g = lock(&self.files.open);
            if g.contains_key(&id) {
                return Err(FileError::invalid(
                    "request_id",
                    format!("{id} is already an open request"),
                ));
            }
            if g.len() >= MAX_OPEN_REQUESTS {
                return Err(FileError::new(
                    FCode::ResourceExhausted,
                    "",
                    format!(
                        "{MAX_OPEN_REQUESTS} file requests are open on this connection already"
                    ),
                ));
            }
            g.insert(id, open);
        }
        let task = Task {
            id,
            s,
            out: self.out.clone(),
            open: self.files.open.clone(),
            credit,
        };
        tokio::spawn(task.run(op, chunks, stop));
        Ok(())
    }
}

/// One request being served.
struct Task {
    id: u64,
    s: Arc<Session>,
    out: Outbox,
    open: Arc<Mutex<HashMap<u64, Open>>>,
    credit: Option<Arc<Semaphore>>,
}

impl Task {
    async fn run(self, op: Op, chunks: Option<mpsc::Receiver<FileChunk>>, stop: Option<OwnedFd>) {
        let result = match op {
            Op::Stat(r) => {
                self.with_ws(move |ws| {
                    let rel = ws.check("path", &r.path)?;
                    ops::stat(ws, &rel, "path").map(R::Info)
                })
                .await
            }
            Op::MakeDir(r) => {
                let shown = String::from_utf8_lossy(&r.path).into_owned();
                let res = self
                    .with_ws(move |ws| {
                        let mode = files::write::check_permissions(r.permissions, 0o755)?;
                        let rel = ws.check("path", &r.path)?;
                        ops::make_dir(ws, &rel, r.parents, mode).map(R::Info)
                    })
                    .await;
                self.audit("file.mkdir", &shown, &outcome(&res, |_| "created".into()))
                    .await;
                res
            }
            Op::Remove(r) => {
                let shown = String::from_utf8_lossy(&r.path).into_owned();
                let res = self
                    .with_ws(move |ws| {
                        let rel = ws.check("path", &r.path)?;
                        ops::remove(ws, &rel, r.recursive).map(|n| {
                            R::Done(FileDone {
                                count: n,
                                info: None,
                            })
                        })
                    })
                    .await;
                self.audit(
                    "file.remove",
                    &shown,
                    &outcome(&res, |r| match r {
                        R::Done(d) => format!("removed {} entries", d.count),
                        _ => String::new(),
                    }),
                )
                .await;
                res
            }
            Op::Rename(r) => {
                let shown = format!(
                    "{} -> {}",
                    String::from_utf8_lossy(&r.from),
                    String::from_utf8_lossy(&r.to)
                );
                let res = self
                    .with_ws(move |ws| {
                        let from = ws.check("from", &r.from)?;
                        let to = ws.check("to", &r.to)?;
                        ops::rename(ws, &from, &to, r.overwrite).map(R::Info)
                    })
                    .await;
                self.audit("file.rename", &shown, &outcome(&res, |_| "renamed".into()))
                    .await;
                res
            }
            Op::List(r) => self.list(r).await,
            Op::Read(r) => self.read(r).await,
            Op::Write(w) => match chunks {
                Some(rx) => self.write(w, rx).await,
                None => Err(FileError::new(FCode::Internal, "", "write without chunks")),
            },
            Op::Watch(w) => match stop {
                Some(stop) => self.watch(w, stop).await,
                None => Err(FileError::new(FCode::Internal, "", "watch without a stop")),
            },
            Op::Credit(_) | Op::Cancel(_) | Op::Chunk(_) => Ok(None),
        };
        let still_open = lock(&self.open).remove(&self.id).is_some();
        match result {
            Ok(Some(r)) => self.send(reply(self.id, r)).await,
            Ok(None) => {}
            // A cancelled request is not answered.
            Err(e) if still_open => self.send(failed(self.id, e)).await,
            Err(_) => {}
        }
    }

    async fn send(&self, m: GuestMessage) {
        let _ = self.out.send(m).await;
    }

    async fn audit(&self, action: &str, resource: &str, result: &str) {
        self.s
            .audit(Entry {
                actor: "agent",
                action,
                resource,
                result,
                ..Default::default()
            })
            .await;
    }

    /// Runs `f` on the workspace as the agent.
    async fn with_ws<F>(&self, f: F) -> Result<Option<R>, FileError>
    where
        F: FnOnce(&Workspace) -> Result<R, FileError> + Send + 'static,
    {
        let dir = self.s.cfg.workspace.clone();
        fsid::run_as(self.s.cfg.identity, move || f(&Workspace::open(&dir)?))
            .await
            .map(Some)
    }

    /// Takes one credit; false when the request was cancelled.
    fn take_credit(credit: &Semaphore, rt: &tokio::runtime::Handle) -> bool {
        match rt.block_on(credit.acquire()) {
            Ok(p) => {
                p.forget();
                true
            }
            Err(_) => false,
        }
    }

    async fn list(&self, r: proto::guest::FileList) -> Result<Option<R>, FileError> {
        let (entries, truncated) = match self
            .with_ws(move |ws| {
                let rel = ws.check("path", &r.path)?;
                let (e, t) = ops::list(ws, &rel, r.depth)?;
                Ok(R::Entries(FileEntries {
                    entries: e,
                    last: true,
                    truncated: t,
                }))
            })
            .await?
        {
            Some(R::Entries(e)) => (e.entries, e.truncated),
            _ => return Ok(None),
        };
        let Some(credit) = self.credit.clone() else {
            return Ok(None);
        };
        // Pages of at most LIST_PAGE entries and about LIST_PAGE_BYTES
        // encoded (an entry's path and link target can be 4 KiB each).
        let mut pages: Vec<Vec<proto::guest::FileInfo>> = vec![Vec::new()];
        let mut bytes = 0;
        for e in entries {
            let len = proto::Message::encoded_len(&e);
            let full =
                pages.last().is_some_and(|p| p.len() >= LIST_PAGE) || bytes + len > LIST_PAGE_BYTES;
            if full && pages.last().is_some_and(|p| !p.is_empty()) {
                pages.push(Vec::new());
                bytes = 0;
            }
            bytes += len;
            if let Some(p) = pages.last_mut() {
                p.push(e);
            }
        }
        let n = pages.len();
        for (i, page) in pages.into_iter().enumerate() {
            let Ok(p) = credit.acquire().await else {
                return Ok(None);
            };
            p.forget();
            let last = i + 1 == n;
            let page = R::Entries(FileEntries {
                entries: page,
                last,
                truncated: last && truncated,
            });
            if last {
                return Ok(Some(page));
            }
            self.send(reply(self.id, page)).await;
        }
        Ok(None)
    }

    async fn read(&self, r: proto::guest::FileRead) -> Result<Option<R>, FileError> {
        let Some(credit) = self.credit.clone() else {
            return Ok(None);
        };
        let (dir, identity, out, id) = (
            self.s.cfg.workspace.clone(),
            self.s.cfg.identity,
            self.out.clone(),
            self.id,
        );
        let rt = tokio::runtime::Handle::current();
        fsid::run_as(identity, move || {
            use std::os::unix::fs::FileExt;
            let ws = Workspace::open(&dir)?;
            let rel = ws.check("path", &r.path)?;
            let (file, size) = ops::open_read(&ws, &rel)?;
            let end = match r.length {
                0 => size,
                n => r.offset.saturating_add(n).min(size),
            };
            let mut at = r.offset.min(end);
            let mut buf = vec![0u8; files::READ_CHUNK];
            loop {
                let want = ((end - at) as usize).min(buf.len());
                let mut n = 0;
                while n < want {
                    match file.read_at(&mut buf[n..want], at + n as u64) {
                        Ok(0) => break,
                        Ok(k) => n += k,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(FileError::os("path", &rel.shown(), "read", e)),
                    }
                }
                at += n as u64;
                // A file that shrank meanwhile ends early.
                let last = at >= end || n < want;
                if !Self::take_credit(&credit, &rt) {
                    return Ok(None);
                }
                let data = FileChunk {
                    data: buf[..n].to_vec(),
                    last,
                };
                if last {
                    return Ok(Some(R::Data(data)));
                }
                if out.blocking_send(reply(id, R::Data(data))).is_err() {
                    return Ok(None);
                }
            }
        })
        .await
    }

    async fn write(
        &self,
        w: proto::guest::FileWrite,
        mut rx: mpsc::Receiver<FileChunk>,
    ) -> Result<Option<R>, FileError> {
        let shown = String::from_utf8_lossy(&w.path).into_owned();
        let mode = proto::guest::file_write::Mode::try_from(w.mode)
            .unwrap_or(proto::guest::file_write::Mode::Unspecified);
        let (dir, identity, out, id) = (
            self.s.cfg.workspace.clone(),
            self.s.cfg.identity,
            self.out.clone(),
            self.id,
        );
        let res = fsid::run_as(identity, move || {
            let ws = Workspace::open(&dir)?;
            let rel = ws.check("path", &w.path)?;
            let mut writer = Writer::open(&ws, &rel, mode, w.permissions)?;
            let credit = |n| reply(id, R::Credit(FileCredit { messages: n }));
            let _ = out.blocking_send(credit(WRITE_WINDOW));
            loop {
                let Some(c) = rx.blocking_recv() else {
                    // Cancelled: the temporary file goes with `writer`.
                    return Err(FileError::new(
                        FCode::FailedPrecondition,
                        "",
                        format!("cancelled after {} bytes", writer.written()),
                    ));
                };
                if c.data.len() > files::MAX_CHUNK {
                    return Err(FileError::invalid(
                        "chunk",
                        format!(
                            "{} bytes; chunks are at most {}",
                            c.data.len(),
                            files::MAX_CHUNK
                        ),
                    ));
                }
                writer.write(&c.data)?;
                if c.last {
                    let (n, info) = writer.finish(&ws)?;
                    return Ok(R::Done(FileDone {
                        count: n,
                        info: Some(info),
                    }));
                }
                let _ = out.blocking_send(credit(1));
            }
        })
        .await
        .map(Some);
        let mode_name = mode
            .as_str_name()
            .trim_start_matches("MODE_")
            .to_lowercase();
        self.audit(
            "file.write",
            &shown,
            &outcome(&res, |r| match r {
                R::Done(d) => format!("{mode_name}: wrote {} bytes", d.count),
                _ => String::new(),
            }),
        )
        .await;
        res
    }

    async fn watch(
        &self,
        w: proto::guest::FileWatch,
        stop: OwnedFd,
    ) -> Result<Option<R>, FileError> {
        let Some(credit) = self.credit.clone() else {
            return Ok(None);
        };
        let (dir, identity, out, id) = (
            self.s.cfg.workspace.clone(),
            self.s.cfg.identity,
            self.out.clone(),
            self.id,
        );
        let rt = tokio::runtime::Handle::current();
        fsid::run_as(identity, move || {
            let ws = Workspace::open(&dir)?;
            let rel = ws.check("path", &w.path)?;
            let watcher = Watcher::new(&ws, &rel, w.recursive)?;
            drop(ws);
            if !Self::take_credit(&credit, &rt) {
                return Ok(None);
            }
            if out
                .blocking_send(reply(id, R::Info(watcher.root().clone())))
                .is_err()
            {
                return Ok(None);
            }
            // Waiting for credit holds the kernel's queue, which is bounded
            // and reports an overflow when it fills.
            watcher.run(&stop, |c| {
                Self::take_credit(&credit, &rt)
                    && out.blocking_send(reply(id, R::Change(c))).is_ok()
            });
            Ok(None)
        })
        .await
    }
}

/// The audit `result` of an operation.
fn outcome(res: &Result<Option<R>, FileError>, ok: impl Fn(&R) -> String) -> String {
    match res {
        Ok(Some(r)) => ok(r),
        Ok(None) => "cancelled".into(),
        Err(e) => format!("failed: {e}"),
    }
}
