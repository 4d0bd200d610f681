//! Streams attached to a command (the Exec stream that started it, and
//! Attach streams): replay from an offset, live output, asks, then the end;
//! and the input they forward (stdin, signals, resizes), checked here
//! before it reaches the guest.

use std::sync::Arc;

use proto::guest::{host_message::Kind as In, Resize, Signal, StdinData, TerminalSize};
use proto::hostagent as pb;
use proto::hostagent::exec_response::Kind as R;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tonic::Status;

use super::record::{End, ExecRecord};
use super::ring::{Stream, MAX_CHUNK};
use crate::guest::GuestConn;

/// Responses queued per attached stream for its client.
const QUEUE: usize = 4;
/// Largest terminal dimension accepted (as guest-init's).
pub const MAX_TERMINAL_DIMENSION: u32 = 4096;

/// The response stream handed to tonic.
pub type Responses = tokio_stream::wrappers::ReceiverStream<Result<pb::ExecResponse, Status>>;

/// How a stream starts.
pub enum Opening {
    /// The Exec stream: `started` when the guest starts the command, then
    /// all output from offset 0.
    Exec,
    /// An Attach stream: this `attached` first, replay from its
    /// start_offset; the command's asks from `asks_after` on.
    Attach(pb::ExecAttached),
}

/// Attaches a stream to `rec`. Returns the responses, and where input
/// checks send a Status that ends the stream (the command goes on).
pub fn open(rec: Arc<ExecRecord>, opening: Opening) -> (Responses, mpsc::Sender<Status>) {
    let (tx, rx) = mpsc::channel(QUEUE);
    let (fail_tx, fail_rx) = mpsc::channel(1);
    let (cursor, started_sent, asks_seen, first) = match opening {
        Opening::Exec => (0, false, 0, None),
        Opening::Attach(a) => {
            let asks = rec.lock().last_ask;
            (a.start_offset, true, asks, Some(a))
        }
    };
    let id = rec.attach(cursor);
    tokio::spawn(serve(
        Attached {
            rec,
            id,
            cursor,
            started_sent,
            asks_seen,
        },
        first,
        tx,
        fail_rx,
    ));
    (Responses::new(rx), fail_tx)
}

struct Attached {
    rec: Arc<ExecRecord>,
    id: u64,
    cursor: u64,
    started_sent: bool,
    asks_seen: u64,
}

impl Drop for Attached {
    fn drop(&mut self) {
        self.rec.detach(self.id);
    }
}

enum Step {
    Send(R, u64),
    End(Option<R>, Option<Status>),
    Wait,
}

impl Attached {
    fn next(&mut self) -> Step {
        let st = self.rec.lock();
        if !self.started_sent {
            if let Some(pid) = st.pid {
                self.started_sent = true;
                return Step::Send(R::Started(format!("{} {pid}", self.rec.meta.exec_id)), 0);
            }
        }
        if let Some((n, ask)) = st.asks.iter().find(|(n, _)| *n > self.asks_seen) {
            self.asks_seen = *n;
            return Step::Send(R::Ask(ask.clone()), 0);
        }
        if let Some(p) = st.ring.read(self.cursor, MAX_CHUNK) {
            self.cursor = p.offset + p.data.len() as u64;
            let kind = match p.stream {
                Stream::Stdout => R::Stdout(p.data),
                Stream::Stderr => R::Stderr(p.data),
            };
            return Step::Send(kind, p.offset);
        }
        match &st.end {
            None => Step::Wait,
            Some(End::Exited(e)) => Step::End(Some(R::Exit(e.clone())), None),
            Some(End::Rejected(r)) => Step::End(Some(R::Rejected(r.clone())), None),
            Some(End::Failed(m)) => Step::End(None, Some(Status::aborted(m.clone()))),
            // As before reattach: a stream whose channel closed just ends.
            Some(End::Lost(_)) => Step::End(None, None),
        }
    }
}

async fn serve(
    mut a: Attached,
    first: Option<pb::ExecAttached>,
    tx: mpsc::Sender<Result<pb::ExecResponse, Status>>,
    mut fail: mpsc::Receiver<Status>,
) {
    let rec = a.rec.clone();
    let response = |kind: R, offset: u64| {
        let pid = match &kind {
            R::Started(_) => rec.lock().pid.unwrap_or(0),
            R::Attached(at) => at.pid,
            _ => 0,
        };
        pb::ExecResponse {
            kind: Some(kind),
            offset,
            exec_id: rec.meta.exec_id.clone(),
            pid,
        }
    };
    if let Some(first) = first {
        if tx.send(Ok(response(R::Attached(first), 0))).await.is_err() {
            return;
        }
    }
    loop {
        let mut changed = a.rec.subscribe();
        match a.next() {
            Step::Send(kind, offset) => {
                let m = response(kind, offset);
                tokio::select! {
                    r = tx.send(Ok(m)) => if r.is_err() { return },
                    Some(s) = fail.recv() => { let _ = tx.send(Err(s)).await; return }
                }
                a.rec.advance(a.id, a.cursor);
            }
            Step::End(kind, status) => {
                if let Some(kind) = kind {
                    let _ = tx.send(Ok(response(kind, 0))).await;
                }
                if let Some(s) = status {
                    let _ = tx.send(Err(s)).await;
                }
                return;
            }
            Step::Wait => {
                tokio::select! {
                    r = changed.changed() => if r.is_err() { return },
                    _ = tx.closed() => return,
                    Some(s) = fail.recv() => { let _ = tx.send(Err(s)).await; return }
                }
            }
        }
    }
}

/// Checks a terminal size from a client; `field` names it in the error.
pub fn check_terminal(size: &pb::TerminalSize, field: &str) -> Result<(), String> {
    for (name, v) in [("rows", size.rows), ("cols", size.cols)] {
        if v == 0 || v > MAX_TERMINAL_DIMENSION {
            return Err(format!(
                "{field}.{name} is {v}; a terminal has 1 to {MAX_TERMINAL_DIMENSION} {name}"
            ));
        }
    }
    Ok(())
}

/// Forwards a stream's input to command `rec` once the guest started it,
/// until the input ends or the command does. Input the command cannot take
/// ends the stream with INVALID_ARGUMENT through `fail` (the command goes
/// on).
pub async fn forward_input(
    rec: Arc<ExecRecord>,
    conn: Arc<GuestConn>,
    mut input: tonic::Streaming<pb::ExecRequest>,
    fail: mpsc::Sender<Status>,
) {
    use pb::exec_request::Kind as K;
    // The guest refuses input for a command it has not started yet.
    loop {
        let mut changed = rec.subscribe();
        {
            let st = rec.lock();
            if st.end.is_some() {
                return;
            }
            if st.pid.is_some() {
                break;
            }
        }
        if changed.changed().await.is_err() {
            return;
        }
    }
    let exec_id = rec.meta.exec_id.clone();
    let refuse = |m: String| {
        let _ = fail.try_send(Status::invalid_argument(m));
    };
    while let Some(Ok(req)) = input.next().await {
        if rec.ended() {
            return;
        }
        let m = match req.kind {
            Some(K::Stdin(_)) | Some(K::StdinEof(_)) if !rec.meta.stdin_open => {
                return refuse(
                    "stdin: this command's stdin is closed (start it with keep_stdin_open or pty)"
                        .into(),
                )
            }
            Some(K::Stdin(_)) | Some(K::StdinEof(_))
                if rec.lock().stdin_closed && !rec.meta.pty =>
            {
                return refuse("stdin: this command's stdin was closed by stdin_eof".into())
            }
            Some(K::Stdin(data)) => In::Stdin(StdinData {
                exec_id: exec_id.clone(),
                data,
                eof: false,
            }),
            Some(K::StdinEof(_)) => {
                rec.lock().stdin_closed = true;
                In::Stdin(StdinData {
                    exec_id: exec_id.clone(),
                    data: Vec::new(),
                    eof: true,
                })
            }
            Some(K::Signal(signal)) => {
                if !(1..=64).contains(&signal) {
                    return refuse(format!("signal {signal} is not between 1 and 64"));
                }
                In::Signal(Signal {
                    exec_id: exec_id.clone(),
                    signal,
                })
            }
            Some(K::Resize(size)) => {
                if !rec.meta.pty {
                    return refuse(
                        "resize: this command has no terminal (start it with pty)".into(),
                    );
                }
                if let Err(e) = check_terminal(&size, "resize") {
                    return refuse(e);
                }
                In::Resize(Resize {
                    exec_id: exec_id.clone(),
                    size: Some(TerminalSize {
                        rows: size.rows,
                        cols: size.cols,
                    }),
                })
            }
            Some(K::Start(_)) | Some(K::Attach(_)) => {
                return refuse("start and attach may only be the first message of a stream".into())
            }
            None => continue,
        };
        if conn.send(m).await.is_err() {
            return;
        }
    }
}
