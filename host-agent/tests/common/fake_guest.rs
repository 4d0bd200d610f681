//! A scripted stand-in for guest-init on the vsock Unix socket (the CONNECT
//! handshake of `test_harness::vsock_shim`, then guest.v1 frames), to play
//! well-behaved and hostile guests. Its behaviour is chosen by the
//! session's agent name:
//!
//! * `good`: Ready; every Exec prints `ok\n` and exits 0;
//! * `slow-<ms>`: as `good`, each Exec taking `<ms>` milliseconds;
//! * `fail`: as `good`, each Exec exiting 3;
//! * `flood`: Ready; on [`FakeGuest::go`], 4 MiB frames nobody asked for
//!   (bundle chunks, oversize and surplus control messages); on Exec, asks
//!   (oversize, then more than the host keeps), then [`FLOOD_OUTPUT`] 4 MiB
//!   output frames, then exit 0;
//! * `audit-flood`: on go, 4 MiB audit events with increasing seq, forever;
//! * `bad-seq`: on go, audit event seq 1, then seq `u64::MAX`, then seq 2.
//! * `vanish-once`: at a session's first StartSession, hangs up and, 100 ms
//!   later, kills the session's vmm (a guest whose VM died: the channel
//!   closes before the exit is reaped); as `good` from then on.
//! * `hang-up-once`: at a session's first StartSession, hangs up (a
//!   guest-init that died in a VM that runs on); as `good` from then on.
//!
//! FetchBranch is answered with the bundle file set by
//! [`FakeGuest::set_branch_bundle`] for that session (an Error without one),
//! Shutdown with ShutdownStarted. Bundles received at StartSession are kept,
//! and so are the Exec requests and the files written (Files API writes).
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use prost::Message;
use proto::framing::{encode_frame, FrameDecoder, DEFAULT_MAX_FRAME};
use proto::guest::{
    guest_message::Kind as Out, host_message::Kind as In, output, AskRequest, AuditEvent,
    BundleChunk, Error as GuestError, ExecExited, ExecStarted, GuestMessage, Hello, HostMessage,
    Output, Ready, ShutdownStarted, StartSession, TurnEnded,
};
use test_harness::vsock_shim;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot, watch};

/// Output frames the `flood` guest writes for one exec.
pub const FLOOD_OUTPUT: u64 = 96;
/// Unrequested bundle chunks the `flood` guest writes.
pub const FLOOD_BUNDLE: u64 = 160;
/// Oversize control messages and oversize asks the `flood` guest writes (each).
pub const FLOOD_BIG: u64 = 64;
/// Small asks (distinct ids) the `flood` guest writes for one exec.
pub const FLOOD_SMALL_ASKS: u64 = 500;

/// Payload bytes that fit one 4 MiB frame with room for the message around them.
pub const BIG: usize = DEFAULT_MAX_FRAME - 256;

/// What the fake guest saw and did, shared with the test.
#[derive(Default)]
pub struct Seen {
    /// StartSession requests by session id.
    pub starts: Mutex<HashMap<String, StartSession>>,
    /// Repository bundles received, by session id.
    pub repo_bundles: Mutex<HashMap<String, PathBuf>>,
    /// Branch bundles to answer FetchBranch with, by session id.
    pub branch_bundles: Mutex<HashMap<String, PathBuf>>,
    /// Errors the host sent, by session id.
    pub host_errors: Mutex<HashMap<String, Vec<GuestError>>>,
    /// Output frames written by the flood guest.
    pub output_written: AtomicU64,
    /// Phases the flood guests completed ("unrequested", "output", ...).
    pub phases: Mutex<Vec<String>>,
    /// Exec requests, with their session id, in the order they came.
    pub execs: Mutex<Vec<(String, proto::guest::Exec)>>,
    /// Files written, by (session id, path): their last content.
    pub files: Mutex<HashMap<(String, String), Vec<u8>>>,
    /// Sessions whose `vanish-once` or `hang-up-once` guest hung up, with
    /// their vmm's pids then.
    pub vanished: Mutex<HashMap<String, Vec<u32>>>,
}

/// The fake guest: serves `sock` until dropped.
pub struct FakeGuest {
    pub dir: tempfile::TempDir,
    pub seen: Arc<Seen>,
    go: watch::Sender<bool>,
    phase: watch::Sender<u64>,
}

impl FakeGuest {
    /// Starts serving on `<dir>/vsock.sock`.
    pub fn start() -> FakeGuest {
        let dir = tempfile::tempdir().expect("tempdir");
        let listener = UnixListener::bind(dir.path().join("vsock.sock")).expect("bind");
        let seen = Arc::new(Seen::default());
        let (go, go_rx) = watch::channel(false);
        let (phase, _) = watch::channel(0u64);
        let ctx = Ctx {
            seen: seen.clone(),
            go: go_rx,
            phase: phase.clone(),
            dir: dir.path().to_path_buf(),
        };
        tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    return;
                };
                let ctx = ctx.clone();
                tokio::spawn(async move {
                    let _ = serve(conn, ctx).await;
                });
            }
        });
        FakeGuest {
            dir,
            seen,
            go,
            phase,
        }
    }

    /// The vsock socket path, for `--guest-vsock-uds`.
    pub fn sock(&self) -> String {
        self.dir.path().join("vsock.sock").display().to_string()
    }

    /// Starts the hostile guests' floods.
    pub fn go(&self) {
        self.go.send_replace(true);
    }

    /// Answers FetchBranch of `session` with the bundle at `path`.
    pub fn set_branch_bundle(&self, session: &str, path: PathBuf) {
        self.seen
            .branch_bundles
            .lock()
            .unwrap()
            .insert(session.to_string(), path);
    }

    /// Waits until a flood guest finished phase `name`.
    pub async fn wait_phase(&self, name: &str) {
        let mut rx = self.phase.subscribe();
        loop {
            if self.phase_done(name) {
                return;
            }
            rx.changed().await.expect("fake guest alive");
        }
    }

    /// Whether a flood guest finished phase `name`.
    pub fn phase_done(&self, name: &str) -> bool {
        self.seen.phases.lock().unwrap().iter().any(|p| p == name)
    }

    /// Errors the host sent to `session`'s guest.
    pub fn host_errors(&self, session: &str) -> Vec<GuestError> {
        self.seen
            .host_errors
            .lock()
            .unwrap()
            .get(session)
            .cloned()
            .unwrap_or_default()
    }
}

#[derive(Clone)]
struct Ctx {
    seen: Arc<Seen>,
    go: watch::Receiver<bool>,
    phase: watch::Sender<u64>,
    dir: PathBuf,
}

impl Ctx {
    fn done(&self, name: &str) {
        self.seen.phases.lock().unwrap().push(name.to_string());
        self.phase.send_modify(|n| *n += 1);
    }
}

/// A frame for the writer task; `Mark` fires once everything before it is written.
enum Frame {
    Data(Vec<u8>, bool),
    Mark(oneshot::Sender<()>),
}

fn frame(kind: Out) -> Vec<u8> {
    encode_frame(&GuestMessage { kind: Some(kind) }, DEFAULT_MAX_FRAME).expect("frame fits")
}

#[derive(Clone)]
struct Tx(mpsc::Sender<Frame>);

impl Tx {
    async fn send(&self, kind: Out) {
        let _ = self.0.send(Frame::Data(frame(kind), false)).await;
    }
    async fn raw(&self, f: Vec<u8>, output: bool) {
        let _ = self.0.send(Frame::Data(f, output)).await;
    }
    /// Waits until everything sent so far is written to the socket.
    async fn flushed(&self) {
        let (tx, rx) = oneshot::channel();
        if self.0.send(Frame::Mark(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
}

async fn serve(mut conn: tokio::net::UnixStream, ctx: Ctx) -> std::io::Result<()> {
    // Any port: this guest listens on every one.
    vsock_shim::read_connect(&mut conn).await?;
    vsock_shim::answer_ok(&mut conn, 1).await?;
    let (mut r, mut w) = conn.into_split();
    let seen = ctx.seen.clone();
    let (tx, mut rx) = mpsc::channel::<Frame>(1);
    let writer = tokio::spawn(async move {
        while let Some(f) = rx.recv().await {
            match f {
                Frame::Data(d, output) => {
                    if w.write_all(&d).await.is_err() {
                        return;
                    }
                    if output {
                        seen.output_written.fetch_add(1, Ordering::SeqCst);
                    }
                }
                Frame::Mark(done) => {
                    let _ = done.send(());
                }
            }
        }
    });
    let tx = Tx(tx);
    // When the host hangs up, the writer goes too (and the floods with it).
    let _writer = AbortOnDrop(writer);
    let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME);
    let mut buf = vec![0u8; 64 * 1024];
    let mut session: Option<StartSession> = None;
    let mut repo: Vec<u8> = Vec::new();
    let mut writes: HashMap<u64, (String, Vec<u8>)> = HashMap::new();
    loop {
        while let Ok(Some(p)) = dec.next_frame() {
            let Ok(HostMessage { kind: Some(m) }) = HostMessage::decode(p.as_slice()) else {
                continue;
            };
            if let In::File(f) = m {
                file(f, &ctx, &tx, &session, &mut writes).await;
                continue;
            }
            if handle(m, &ctx, &tx, &mut session, &mut repo).await == Flow::HangUp {
                return Ok(());
            }
        }
        let n = r.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        dec.push(&buf[..n]);
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Whether the connection goes on after a message.
#[derive(PartialEq)]
enum Flow {
    Continue,
    HangUp,
}

/// The processes whose command line names session `sid`'s directory (its
/// vmm, or its jailer), with their children (a jailed vmm).
fn session_vmm_pids(sid: &str) -> Vec<u32> {
    let needle = format!("/sessions/{sid}/");
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        if String::from_utf8_lossy(&cmd).contains(&needle) {
            let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .unwrap_or_default();
            out.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok()),
            );
            out.push(pid);
        }
    }
    out
}

async fn handle(
    m: In,
    ctx: &Ctx,
    tx: &Tx,
    session: &mut Option<StartSession>,
    repo: &mut Vec<u8>,
) -> Flow {
    let sid = session
        .as_ref()
        .map(|s| s.session_id.clone())
        .unwrap_or_default();
    let agent = session
        .as_ref()
        .map(|s| s.agent.clone())
        .unwrap_or_default();
    match m {
        In::Hello(_) => {
            tx.send(Out::Hello(Hello {
                protocol_version: proto::guest::PROTOCOL_VERSION,
                software: "fake guest".into(),
            }))
            .await
        }
        In::StartSession(s) => {
            ctx.seen
                .starts
                .lock()
                .unwrap()
                .insert(s.session_id.clone(), s.clone());
            let first = !ctx
                .seen
                .vanished
                .lock()
                .unwrap()
                .contains_key(&s.session_id);
            if ["vanish-once", "hang-up-once"].contains(&s.agent.as_str()) && first {
                let pids = session_vmm_pids(&s.session_id);
                assert!(!pids.is_empty(), "no vmm names session {}", s.session_id);
                ctx.seen
                    .vanished
                    .lock()
                    .unwrap()
                    .insert(s.session_id.clone(), pids.clone());
                if s.agent == "hang-up-once" {
                    return Flow::HangUp;
                }
                tokio::spawn(async move {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    for pid in pids {
                        // SAFETY: kill(2) with a pid and a signal number; no memory involved.
                        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                    }
                });
                return Flow::HangUp;
            }
            *session = Some(s);
        }
        In::RepoChunk(c) => {
            repo.extend_from_slice(&c.data);
            if c.last {
                let path = ctx.dir.join(format!("{sid}.repo.bundle"));
                std::fs::write(&path, std::mem::take(repo)).expect("saving the bundle");
                ctx.seen
                    .repo_bundles
                    .lock()
                    .unwrap()
                    .insert(sid.clone(), path);
                tx.send(Out::Ready(Ready {
                    session_id: sid.clone(),
                    branch: format!("session/{sid}"),
                    ..Default::default()
                }))
                .await;
                let (ctx, tx) = (ctx.clone(), tx.clone());
                tokio::spawn(async move { after_ready(&agent, &ctx, &tx).await });
            }
        }
        In::Exec(e) => {
            ctx.seen
                .execs
                .lock()
                .unwrap()
                .push((sid.clone(), e.clone()));
            let tx = tx.clone();
            let ctx = ctx.clone();
            tokio::spawn(async move { exec(&agent, &e.exec_id, &ctx, &tx).await });
        }
        In::FetchBranch(_) => {
            let path = ctx.seen.branch_bundles.lock().unwrap().get(&sid).cloned();
            let Some(path) = path else {
                tx.send(Out::Error(GuestError {
                    code: 6,
                    message: "no branch bundle in this fake guest".into(),
                    exec_id: String::new(),
                }))
                .await;
                return Flow::Continue;
            };
            let data = std::fs::read(path).expect("reading the branch bundle");
            let mut chunks = data.chunks(64 * 1024).peekable();
            while let Some(c) = chunks.next() {
                tx.send(Out::BundleChunk(BundleChunk {
                    data: c.to_vec(),
                    last: chunks.peek().is_none(),
                }))
                .await;
            }
        }
        In::Shutdown(_) => tx.send(Out::ShutdownStarted(ShutdownStarted {})).await,
        In::Error(e) => {
            ctx.seen
                .host_errors
                .lock()
                .unwrap()
                .entry(sid)
                .or_default()
                .push(e);
        }
        _ => {}
    }
    Flow::Continue
}

/// A Files API request: writes are taken (credit for every chunk, the
/// content kept when the last one comes); anything else is refused.
async fn file(
    f: proto::guest::FileRequest,
    ctx: &Ctx,
    tx: &Tx,
    session: &Option<StartSession>,
    writes: &mut HashMap<u64, (String, Vec<u8>)>,
) {
    use proto::guest::{file_request::Op, file_response::Result as R};
    let sid = session
        .as_ref()
        .map(|s| s.session_id.clone())
        .unwrap_or_default();
    let answer = |result: R| {
        Out::File(proto::guest::FileResponse {
            request_id: f.request_id,
            result: Some(result),
        })
    };
    match f.op {
        Some(Op::Write(w)) => {
            let path = String::from_utf8_lossy(&w.path).into_owned();
            writes.insert(f.request_id, (path, Vec::new()));
            tx.send(answer(R::Credit(proto::guest::FileCredit { messages: 16 })))
                .await;
        }
        Some(Op::Chunk(c)) => {
            let Some((_, data)) = writes.get_mut(&f.request_id) else {
                return;
            };
            data.extend_from_slice(&c.data);
            if !c.last {
                tx.send(answer(R::Credit(proto::guest::FileCredit { messages: 1 })))
                    .await;
                return;
            }
            let (path, data) = writes.remove(&f.request_id).unwrap_or_default();
            let count = data.len() as u64;
            ctx.seen.files.lock().unwrap().insert((sid, path), data);
            tx.send(answer(R::Done(proto::guest::FileDone {
                count,
                info: None,
            })))
            .await;
        }
        Some(Op::Cancel(_)) => {
            writes.remove(&f.request_id);
        }
        _ => {
            tx.send(answer(R::Error(proto::guest::FileError {
                code: 12,
                message: "the fake guest only writes files".into(),
                ..Default::default()
            })))
            .await
        }
    }
}

async fn wait_go(ctx: &Ctx) {
    let mut go = ctx.go.clone();
    let _ = go.wait_for(|g| *g).await;
}

async fn after_ready(agent: &str, ctx: &Ctx, tx: &Tx) {
    match agent {
        "flood" => {
            wait_go(ctx).await;
            let chunk = frame(Out::BundleChunk(BundleChunk {
                data: vec![7; BIG],
                last: false,
            }));
            for _ in 0..FLOOD_BUNDLE {
                tx.raw(chunk.clone(), false).await;
            }
            let junk = frame(Out::TurnEnded(TurnEnded {
                turn_id: "t".repeat(BIG),
                killed: Vec::new(),
            }));
            for _ in 0..FLOOD_BIG {
                tx.raw(junk.clone(), false).await;
            }
            for i in 0..1000 {
                tx.send(Out::TurnEnded(TurnEnded {
                    turn_id: format!("turn-{i}"),
                    killed: Vec::new(),
                }))
                .await;
            }
            tx.flushed().await;
            ctx.done("unrequested");
        }
        "audit-flood" => {
            wait_go(ctx).await;
            let json = format!("{{\"pad\":\"{}\"}}", "a".repeat(BIG - 64));
            for seq in 1.. {
                let f = frame(Out::AuditEvent(AuditEvent {
                    seq,
                    json: json.clone(),
                }));
                if tx.0.send(Frame::Data(f, false)).await.is_err() {
                    return;
                }
            }
        }
        "bad-seq" => {
            wait_go(ctx).await;
            for seq in [1, u64::MAX, 2] {
                tx.send(Out::AuditEvent(AuditEvent {
                    seq,
                    json: format!("{{\"seq\":{seq}}}"),
                }))
                .await;
            }
            tx.flushed().await;
            ctx.done("bad-seq");
        }
        _ => {}
    }
}

async fn exec(agent: &str, exec_id: &str, ctx: &Ctx, tx: &Tx) {
    tx.send(Out::ExecStarted(ExecStarted {
        exec_id: exec_id.to_string(),
        pid: 1,
        ..Default::default()
    }))
    .await;
    if agent == "flood" {
        let big_ask = frame(Out::AskRequest(AskRequest {
            ask_id: "big".into(),
            exec_id: exec_id.to_string(),
            subject: "s".repeat(BIG),
            ..Default::default()
        }));
        for _ in 0..FLOOD_BIG {
            tx.raw(big_ask.clone(), false).await;
        }
        for i in 0..FLOOD_SMALL_ASKS {
            tx.send(Out::AskRequest(AskRequest {
                ask_id: format!("ask-{i}"),
                exec_id: exec_id.to_string(),
                subject: "ls".into(),
                ..Default::default()
            }))
            .await;
        }
        tx.flushed().await;
        ctx.done("asks");
        let out = frame(Out::Output(Output {
            exec_id: exec_id.to_string(),
            stream: output::Stream::Stdout as i32,
            data: vec![b'x'; BIG],
        }));
        for _ in 0..FLOOD_OUTPUT {
            tx.raw(out.clone(), true).await;
        }
        tx.flushed().await;
        ctx.done("output");
    } else {
        if let Some(ms) = agent
            .strip_prefix("slow-")
            .and_then(|ms| ms.parse::<u64>().ok())
        {
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
        tx.send(Out::Output(Output {
            exec_id: exec_id.to_string(),
            stream: output::Stream::Stdout as i32,
            data: b"ok\n".to_vec(),
        }))
        .await;
    }
    let code = if agent == "fail" { 3 } else { 0 };
    tx.send(Out::ExecExited(ExecExited {
        exec_id: exec_id.to_string(),
        status: Some(proto::guest::exec_exited::Status::Code(code)),
        ..Default::default()
    }))
    .await;
}
