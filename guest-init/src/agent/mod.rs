//! The session agent: serves host-agent over a [`Transport`], one
//! connection at a time, and runs at most one session per connection.
//!
//! Per connection: the host sends Hello (protocol version 1) first; then
//! StartSession and the repository bundle; then Exec, StdinData, Signal,
//! EndTurn, Answer, FetchBranch and finally Shutdown. Frames that do not
//! decode, are too large, or arrive out of order are answered with an Error
//! and the connection goes on. When a connection closes, its session's turns
//! are killed (and audited) but the session is kept; the next connection may
//! take it over with ResumeSession, or replace it with StartSession.
//! Shutdown ends the session and makes [`serve`] return.
//!
//! Size: this file is over the project's 700-line guide. Splitting it by
//! responsibility (connection and dispatch, session start, exec and asks)
//! is the next planned redesign of guest-init and host-agent, done as one
//! change with its tests rather than piecemeal here.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proto::framing::FrameError;
use proto::guest::{
    answer::Reply, error::Code, exec_exited, guest_message::Kind as Out, host_message::Kind as In,
    output, AskRequest, AuditEvent, BundleChunk, Error as ErrorMsg, Exec, ExecExited, ExecRejected,
    ExecStarted, GuestMessage, Hello, HostMessage, KilledProcess, Output, Ready, ResumeSession,
    ShutdownStarted, StartSession, TurnEnded, PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use crate::audit::{AuditLog, Entry};
use crate::channel::framed::{FrameReader, FrameWriter};
use crate::channel::{Connection, Transport};
use crate::exec::{self, Spec};
use crate::policy::egress::{self, EgressPlan};
use crate::policy::rules::Action;
use crate::policy::secrets::{Redactor, Secrets};
use crate::policy::{ExecDecision, Policy};
use crate::privilege::{self, Identity};
use crate::reaper;
use crate::session;
use crate::turn::{Backend, Turns};
use crate::workspace;

/// Default time an `ask` waits for an Answer.
pub const DEFAULT_ASK_TIMEOUT: Duration = Duration::from_secs(300);

/// Size of Output and BundleChunk pieces.
const CHUNK: usize = 64 * 1024;

/// How the agent runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where the repository is cloned (`/workspace` in a guest).
    pub workspace: PathBuf,
    /// Private directory for the audit log and bundles (mode 0700).
    pub state_dir: PathBuf,
    /// Identity for agent commands (None: no drop, not root).
    pub identity: Option<Identity>,
    /// How turns are tracked.
    pub turn_backend: Backend,
    /// Install nftables rules and the hosts file for egress (PID 1 mode).
    pub apply_egress: bool,
    /// Where allowed host names are written (`/etc/hosts` in a guest).
    pub hosts_file: PathBuf,
    /// Maximum frame size in both directions.
    pub max_frame: usize,
    /// Move the system clock to the host's time sent with StartSession and
    /// ResumeSession (PID 1 in a guest only: elsewhere it is the host's clock).
    pub set_clock: bool,
}

/// Why [`serve`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The host sent Shutdown.
    Shutdown,
    /// The stop signal given to [`serve_until`] fired (e.g. SIGTERM).
    Signalled,
}

/// Serves connections until a Shutdown.
pub async fn serve(transport: &mut dyn Transport, cfg: Config) -> std::io::Result<Stop> {
    let (_keep, never) = tokio::sync::watch::channel(false);
    serve_until(transport, cfg, never).await
}

/// Like [`serve`], but also stops when `stop` turns true; the active
/// session is ended (turns killed, end audited) first.
pub async fn serve_until(
    transport: &mut dyn Transport,
    cfg: Config,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<Stop> {
    std::fs::create_dir_all(&cfg.state_dir)?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&cfg.state_dir, std::fs::Permissions::from_mode(0o700))?;
    }
    std::fs::create_dir_all(&cfg.workspace)?;
    let cfg = Arc::new(cfg);
    tracing::info!(listen = %transport.describe(), workspace = %cfg.workspace.display(), turns = cfg.turn_backend.name(), "session agent listening");
    // A session whose connection closed, kept for a ResumeSession.
    let mut detached: Option<Arc<Session>> = None;
    loop {
        let accepted = tokio::select! {
            a = transport.accept() => Some(a),
            _ = stop.wait_for(|s| *s) => None,
        };
        let Some(accepted) = accepted else {
            if let Some(s) = detached.take() {
                s.end("guest-init stopping (SIGTERM)").await;
            }
            return Ok(Stop::Signalled);
        };
        let conn = match accepted {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (why, kept) = handle_connection(conn, cfg.clone(), stop.clone(), detached.take()).await;
        if let Some(why) = why {
            return Ok(why);
        }
        detached = kept;
    }
}

type Outbox = mpsc::Sender<GuestMessage>;

fn msg(kind: Out) -> GuestMessage {
    GuestMessage { kind: Some(kind) }
}

/// An error to report on the channel.
#[derive(Debug)]
struct Failure {
    code: Code,
    message: String,
    exec_id: String,
}

impl From<Failure> for GuestMessage {
    fn from(f: Failure) -> Self {
        msg(Out::Error(ErrorMsg {
            code: f.code as i32,
            message: f.message,
            exec_id: f.exec_id,
        }))
    }
}

fn error(code: Code, message: impl Into<String>, exec_id: &str) -> Failure {
    Failure {
        code,
        message: message.into(),
        exec_id: exec_id.to_string(),
    }
}

/// A StartSession whose bundle is still arriving.
struct PendingStart {
    req: StartSession,
    path: PathBuf,
    file: tokio::fs::File,
    received: u64,
}

/// Serves one connection. `detached` is a session an earlier connection left;
/// it can be resumed here. Returns why guest-init should stop (if it should),
/// and the session to keep for the next connection if this one just closed.
async fn handle_connection(
    conn: Connection,
    cfg: Arc<Config>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    detached: Option<Arc<Session>>,
) -> (Option<Stop>, Option<Arc<Session>>) {
    let (rd, wr) = tokio::io::split(conn);
    let (tx, mut rx) = mpsc::channel::<GuestMessage>(1024);
    let max = cfg.max_frame;
    let writer = tokio::spawn(async move {
        let mut w = FrameWriter::new(wr, max);
        while let Some(m) = rx.recv().await {
            if let Err(e) = w.send(&m).await {
                tracing::warn!(error = %e, "dropping connection: write failed");
                break;
            }
        }
    });
    let mut reader = FrameReader::new(rd, cfg.max_frame);
    let mut conn = Conn {
        cfg,
        out: tx,
        hello: false,
        pending: None,
        session: None,
        detached,
    };
    let stop = tokio::select! {
        s = conn.run(&mut reader) => s,
        _ = stop.wait_for(|s| *s) => Some(Stop::Signalled),
    };
    let kept = match stop {
        Some(Stop::Shutdown) => {
            conn.end_session("shutdown").await;
            None
        }
        Some(Stop::Signalled) => {
            conn.end_session("guest-init stopping (SIGTERM)").await;
            None
        }
        None => conn.detach_session().await,
    };
    drop(conn);
    // Let queued messages go out, then drop the connection.
    let _ = tokio::time::timeout(Duration::from_secs(5), writer).await;
    (stop, kept)
}

struct Conn {
    cfg: Arc<Config>,
    out: Outbox,
    hello: bool,
    pending: Option<PendingStart>,
    session: Option<Arc<Session>>,
    /// A session an earlier connection left, until resumed or replaced.
    detached: Option<Arc<Session>>,
}

impl Conn {
    async fn send(&self, m: impl Into<GuestMessage>) {
        let _ = self.out.send(m.into()).await;
    }

    async fn run<R: AsyncRead + Unpin>(&mut self, reader: &mut FrameReader<R>) -> Option<Stop> {
        loop {
            let incoming = match reader.next().await {
                Ok(Some(i)) => i,
                Ok(None) => return None,
                Err(e) => {
                    tracing::warn!(error = %e, "connection read failed");
                    return None;
                }
            };
            let m = match incoming {
                Ok(HostMessage { kind: Some(k) }) => k,
                Ok(HostMessage { kind: None }) => {
                    self.send(error(Code::Malformed, "message has no known kind (empty frame, or a message type this guest does not know)", "")).await;
                    continue;
                }
                Err(e @ FrameError::Oversize { .. }) => {
                    self.send(error(
                        Code::Oversize,
                        format!("{e}; the frame was discarded"),
                        "",
                    ))
                    .await;
                    continue;
                }
                Err(e) => {
                    self.send(error(
                        Code::Malformed,
                        format!("{e}; the frame was discarded"),
                        "",
                    ))
                    .await;
                    continue;
                }
            };
            if !self.hello {
                match m {
                    In::Hello(h) if h.protocol_version == PROTOCOL_VERSION => {
                        self.hello = true;
                        self.send(msg(Out::Hello(Hello {
                            protocol_version: PROTOCOL_VERSION,
                            software: format!("guest-init {}", env!("CARGO_PKG_VERSION")),
                        })))
                        .await;
                    }
                    In::Hello(h) => {
                        self.send(error(
                            Code::UnsupportedVersion,
                            format!("host speaks protocol version {}, this guest speaks {PROTOCOL_VERSION}; closing", h.protocol_version),
                            "",
                        ))
                        .await;
                        return None;
                    }
                    _ => {
                        self.send(error(
                            Code::Protocol,
                            format!("send Hello with protocol_version {PROTOCOL_VERSION} first"),
                            "",
                        ))
                        .await
                    }
                }
                continue;
            }
            if let Some(stop) = self.dispatch(m).await {
                return Some(stop);
            }
        }
    }

    fn session(&self) -> Result<Arc<Session>, Failure> {
        self.session.clone().ok_or_else(|| {
            error(
                Code::Protocol,
                "no session: send StartSession and the repository bundle first",
                "",
            )
        })
    }

    async fn dispatch(&mut self, m: In) -> Option<Stop> {
        match m {
            In::Error(e) => {
                tracing::warn!(code = e.code, message = %e.message, "the host refused a message of this guest");
            }
            In::Hello(_) => {
                self.send(error(Code::Protocol, "Hello was already exchanged", ""))
                    .await
            }
            In::StartSession(req) => {
                if let Err(e) = self.start(req).await {
                    self.send(e).await;
                }
            }
            In::RepoChunk(c) => {
                if let Err(e) = self.repo_chunk(c.data, c.last).await {
                    self.send(e).await;
                }
            }
            In::Exec(e) => match self.session() {
                Ok(s) => {
                    tokio::spawn(s.exec(e));
                }
                Err(mut m) => {
                    m.exec_id = e.exec_id;
                    self.send(m).await
                }
            },
            In::Stdin(d) => match self.session() {
                Ok(s) => {
                    if let Err(m) = s.stdin(&d.exec_id, d.data, d.eof).await {
                        self.send(m).await;
                    }
                }
                Err(m) => self.send(m).await,
            },
            In::Signal(sig) => match self.session() {
                Ok(s) => {
                    if let Err(m) = s.signal(&sig.exec_id, sig.signal).await {
                        self.send(m).await;
                    }
                }
                Err(m) => self.send(m).await,
            },
            In::EndTurn(t) => match self.session() {
                Ok(s) => {
                    tokio::spawn(async move { s.end_turn(&t.turn_id).await });
                }
                Err(m) => self.send(m).await,
            },
            In::Answer(a) => match self.session() {
                Ok(s) => {
                    if let Err(m) = s.answer(&a.ask_id, a.reply) {
                        self.send(m).await;
                    }
                }
                Err(m) => self.send(m).await,
            },
            In::FetchBranch(_) => match self.session() {
                Ok(s) => {
                    tokio::spawn(async move { s.fetch_branch().await });
                }
                Err(m) => self.send(m).await,
            },
            In::ResumeSession(r) => {
                if let Err(e) = self.resume(&r).await {
                    self.send(e).await;
                }
            }
            In::Shutdown(_) => {
                self.end_session("shutdown").await;
                self.send(msg(Out::ShutdownStarted(ShutdownStarted {})))
                    .await;
                return Some(Stop::Shutdown);
            }
        }
        None
    }

    async fn start(&mut self, req: StartSession) -> Result<(), Failure> {
        if self.session.is_some() || self.pending.is_some() {
            return Err(error(
                Code::Protocol,
                "a session is already active or starting on this connection",
                "",
            ));
        }
        if let Some(old) = self.detached.take() {
            // The host starts over instead of resuming: the kept session's work goes.
            old.end("replaced by a new session; workspace cleared")
                .await;
            session::clear_dir(&self.cfg.workspace);
        }
        let bad = |m: String| error(Code::InvalidArgument, m, "");
        session::branch_for(&req.session_id).map_err(|e| bad(e.to_string()))?;
        session::check_ref(&req.base_ref).map_err(|e| bad(e.to_string()))?;
        crate::policy::rules_path(&req.agent).map_err(|e| bad(e.to_string()))?;
        if req.bundle_size == 0 || req.bundle_size > session::MAX_BUNDLE_BYTES {
            return Err(bad(format!(
                "bundle_size {} must be between 1 and {} bytes",
                req.bundle_size,
                session::MAX_BUNDLE_BYTES
            )));
        }
        for k in req.secrets.keys().chain(req.env.keys()) {
            if k.is_empty() || k.contains(['=', '\0']) {
                return Err(bad(format!(
                    "environment or secret name {k:?} is not a valid variable name"
                )));
            }
        }
        let path = session::bundle_path(&self.cfg.state_dir, &req.session_id);
        let file = tokio::fs::File::create(&path).await.map_err(|e| {
            error(
                Code::Internal,
                format!("cannot store the bundle at {}: {e}", path.display()),
                "",
            )
        })?;
        self.pending = Some(PendingStart {
            req,
            path,
            file,
            received: 0,
        });
        Ok(())
    }

    async fn repo_chunk(&mut self, data: Vec<u8>, last: bool) -> Result<(), Failure> {
        let Some(p) = self.pending.as_mut() else {
            return Err(error(
                Code::Protocol,
                "RepoChunk without a StartSession",
                "",
            ));
        };
        let fail = |pending: PendingStart, m: String| {
            let _ = std::fs::remove_file(&pending.path);
            error(Code::Repository, m, "")
        };
        p.received += data.len() as u64;
        if p.received > p.req.bundle_size {
            let got = p.received;
            let pending = self
                .pending
                .take()
                .ok_or_else(|| error(Code::Internal, "pending start vanished", ""))?;
            let want = pending.req.bundle_size;
            return Err(fail(pending, format!("repository bundle is larger than the declared {want} bytes (got {got}); session not started")));
        }
        if let Err(e) = p.file.write_all(&data).await {
            let pending = self
                .pending
                .take()
                .ok_or_else(|| error(Code::Internal, "pending start vanished", ""))?;
            return Err(fail(pending, format!("cannot store the bundle: {e}")));
        }
        if !last {
            return Ok(());
        }
        let pending = self
            .pending
            .take()
            .ok_or_else(|| error(Code::Internal, "pending start vanished", ""))?;
        if pending.received != pending.req.bundle_size {
            let m = format!(
                "repository bundle truncated: got {} of {} bytes; session not started",
                pending.received, pending.req.bundle_size
            );
            return Err(fail(pending, m));
        }
        let PendingStart {
            req,
            path,
            mut file,
            ..
        } = pending;
        let _ = file.flush().await;
        drop(file);
        let result = Session::open(req, &path, self.cfg.clone(), self.out.clone()).await;
        let _ = std::fs::remove_file(&path);
        let s = result?;
        self.session = Some(s);
        Ok(())
    }

    /// Re-attaches the session an earlier connection left to this one.
    async fn resume(&mut self, req: &ResumeSession) -> Result<(), Failure> {
        let session_id = req.session_id.as_str();
        if self.session.is_some() || self.pending.is_some() {
            return Err(error(
                Code::Protocol,
                "a session is already active or starting on this connection",
                "",
            ));
        }
        match self.detached.take() {
            Some(s) if s.id == session_id => {
                s.reattach(self.out.clone(), req).await;
                self.session = Some(s);
                Ok(())
            }
            kept => {
                let what = match &kept {
                    Some(s) => format!("the kept session is {:?}", s.id),
                    None => "no session is kept".to_string(),
                };
                self.detached = kept;
                Err(error(
                    Code::Protocol,
                    format!("cannot resume session {session_id:?}: {what}"),
                    "",
                ))
            }
        }
    }

    async fn end_session(&mut self, why: &str) {
        if let Some(p) = self.pending.take() {
            let _ = std::fs::remove_file(&p.path);
        }
        if let Some(s) = self.session.take() {
            s.end(why).await;
        }
        if let Some(s) = self.detached.take() {
            s.end(why).await;
        }
    }

    /// The connection closed: a started session is kept for a resume (its
    /// turns killed); a half-received start is dropped.
    async fn detach_session(&mut self) -> Option<Arc<Session>> {
        if let Some(p) = self.pending.take() {
            let _ = std::fs::remove_file(&p.path);
        }
        match self.session.take() {
            Some(s) => {
                s.detach().await;
                Some(s)
            }
            // Nobody resumed the earlier session on this connection; keep it.
            None => self.detached.take(),
        }
    }
}

/// A running command.
struct Running {
    pid: u32,
    stdin: Option<mpsc::Sender<(Vec<u8>, bool)>>,
}

/// One session's state.
pub struct Session {
    id: String,
    branch: String,
    policy: Policy,
    secrets: Secrets,
    env: BTreeMap<String, String>,
    ask_timeout: Duration,
    base_commit: String,
    cfg: Arc<Config>,
    /// The current connection's outbox; replaced when the session is resumed.
    out: Mutex<Outbox>,
    audit: tokio::sync::Mutex<AuditLog>,
    always: Mutex<HashSet<String>>,
    /// Pending asks: ask id -> (turn id, where the answer goes).
    asks: Mutex<HashMap<String, (String, oneshot::Sender<Reply>)>>,
    exec_ids: Mutex<HashSet<String>>,
    running: Mutex<HashMap<String, Running>>,
    turns: Mutex<Turns>,
    egress_denied: Mutex<u64>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means a panic in another task; the data is still usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Session {
    async fn open(
        req: StartSession,
        bundle: &std::path::Path,
        cfg: Arc<Config>,
        out: Outbox,
    ) -> Result<Arc<Self>, Failure> {
        // First, so the clone, the branch and the audit log carry the right time.
        let clock = cfg
            .set_clock
            .then(|| crate::clock::sync_to(req.host_time_unix_ns));
        let redactor = Redactor::new(
            &req.secrets
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        );
        let branch = session::branch_for(&req.session_id)
            .map_err(|e| error(Code::InvalidArgument, e.to_string(), ""))?;
        let ws = cfg.workspace.clone();
        let commit = session::clone_and_branch(bundle, &ws, &req.base_ref, &branch)
            .await
            .map_err(|e| {
                error(
                    Code::Repository,
                    redactor.redact(&format!("session not started: {e}")),
                    "",
                )
            })?;
        let fail = |code: Code, m: String| {
            session::clear_dir(&ws);
            error(
                code,
                redactor.redact(&format!("session not started: {m}")),
                "",
            )
        };
        // Policy comes from the base commit's objects, never the working tree.
        let mut files = HashMap::new();
        let rules_path =
            crate::policy::rules_path(&req.agent).map_err(|e| fail(Code::Policy, e.to_string()))?;
        for p in [rules_path.as_str(), crate::policy::manifest::MANIFEST_PATH] {
            let text = session::read_at(&ws, &commit, p)
                .await
                .map_err(|e| fail(Code::Policy, e.to_string()))?;
            files.insert(p.to_string(), text);
        }
        let policy = Policy::load(&req.agent, &commit, |p| Ok(files.get(p).cloned().flatten()))
            .map_err(|e| fail(Code::Policy, e.to_string()))?;
        let apply = cfg.apply_egress;
        let entries = policy.grant.egress.clone();
        let plan = tokio::task::spawn_blocking(move || {
            egress::plan(
                &entries,
                |host| if apply { resolve(host) } else { Vec::new() },
            )
        })
        .await
        .map_err(|e| fail(Code::Internal, e.to_string()))?
        .map_err(|e| fail(Code::Policy, e.to_string()))?;
        if let Some(id) = cfg.identity {
            privilege::chown_tree(&ws, id).map_err(|e| {
                fail(
                    Code::Internal,
                    format!("cannot give the workspace to uid {}: {e}", id.uid),
                )
            })?;
        }
        let log_path = cfg
            .state_dir
            .join(format!("audit-{}.jsonl", req.session_id));
        let audit = AuditLog::open(Some(&log_path), &req.session_id, redactor.clone())
            .map_err(|e| fail(Code::Internal, e.to_string()))?;
        let secrets = Secrets::scope(
            &policy.grant.secrets,
            &req.secret_allowlist,
            &req.secrets.into_iter().collect(),
        );
        let ask_timeout = match req.ask_timeout_ms {
            0 => DEFAULT_ASK_TIMEOUT,
            ms => Duration::from_millis(u64::from(ms)),
        };
        let s = Arc::new(Self {
            id: req.session_id.clone(),
            branch: branch.clone(),
            policy,
            secrets,
            env: req.env.into_iter().collect(),
            ask_timeout,
            turns: Mutex::new(Turns::new(cfg.turn_backend.clone())),
            base_commit: commit.clone(),
            cfg: cfg.clone(),
            out: Mutex::new(out),
            audit: tokio::sync::Mutex::new(audit),
            always: Mutex::new(HashSet::new()),
            asks: Mutex::new(HashMap::new()),
            exec_ids: Mutex::new(HashSet::new()),
            running: Mutex::new(HashMap::new()),
            egress_denied: Mutex::new(0),
        });
        s.audit(Entry {
            actor: "host",
            action: "session.start",
            resource: &format!("{} agent={} base={}", branch, req.agent, req.base_ref),
            decision: "",
            result: &format!("base commit {commit}"),
            turn_id: "",
        })
        .await;
        s.audit_clock(clock).await;
        if let Err(m) = s.apply_egress(&plan).await {
            s.audit(Entry {
                actor: "guest-init",
                action: "session.end",
                resource: &branch,
                result: &format!("egress rules could not be applied: {m}"),
                ..Default::default()
            })
            .await;
            session::clear_dir(&ws);
            return Err(error(Code::Policy, format!("session not started: {m}"), ""));
        }
        s.send_ready().await;
        Ok(s)
    }

    fn outbox(&self) -> Outbox {
        lock(&self.out).clone()
    }

    async fn send_ready(&self) {
        let backend = lock(&self.turns).backend().name().to_string();
        self.send(msg(Out::Ready(Ready {
            session_id: self.id.clone(),
            branch: self.branch.clone(),
            base_commit: self.base_commit.clone(),
            turn_backend: backend,
        })))
        .await;
    }

    /// Sends to a resumed session's new connection from now on: first the
    /// audit events after `audit_seen` (the host missed them), then Ready.
    async fn reattach(&self, out: Outbox, req: &ResumeSession) {
        let audit_seen = req.audit_seq_seen;
        let clock = self
            .cfg
            .set_clock
            .then(|| crate::clock::sync_to(req.host_time_unix_ns));
        let mut rolled_back = None;
        {
            // The new outbox is set while the log is held, so no new event can
            // reach the host before the ones it missed.
            let mut log = self.audit.lock().await;
            *lock(&self.out) = out;
            let own = log.seq();
            let lines = match log.lines() {
                Ok(lines) => lines,
                Err(e) => {
                    tracing::error!(error = %e, "cannot read the audit log back for the host");
                    self.send(error(
                        Code::Internal,
                        format!("audit events after seq {audit_seen} cannot be sent again: {e}"),
                        "",
                    ))
                    .await;
                    Vec::new()
                }
            };
            let at_host = lines.iter().find(|l| l.seq == audit_seen);
            let diverged = audit_seen > own
                || (audit_seen > 0
                    && !req.audit_hash_seen.is_empty()
                    && at_host.map(|l| l.hash.as_str()) != Some(req.audit_hash_seen.as_str()));
            if diverged {
                // Restored from a snapshot older than what the host has seen.
                rolled_back = Some(own);
                log.skip_to(audit_seen);
            } else {
                for l in lines.into_iter().filter(|l| l.seq > audit_seen) {
                    let _ = self
                        .outbox()
                        .send(msg(Out::AuditEvent(AuditEvent {
                            seq: l.seq,
                            json: l.json,
                        })))
                        .await;
                }
            }
        }
        if let Some(own) = rolled_back {
            self.audit(Entry {
                actor: "guest-init",
                action: "session.rolled_back",
                resource: &self.branch,
                result: &format!(
                    "resumed from a snapshot: the host holds events up to seq {audit_seen} that \
                     this guest's log (at seq {own}) does not have; this guest's events after the \
                     fork stay in its log only, numbering goes on after both"
                ),
                ..Default::default()
            })
            .await;
        }
        self.audit(Entry {
            actor: "host",
            action: "session.resumed",
            resource: &self.branch,
            ..Default::default()
        })
        .await;
        self.audit_clock(clock).await;
        tracing::info!(session = %self.id, "session resumed on a new connection");
        self.send_ready().await;
    }

    /// Records a clock step (or a failed one) from [`crate::clock::sync_to`].
    async fn audit_clock(&self, clock: Option<Result<Option<i128>, crate::clock::ClockError>>) {
        let result = match clock {
            Some(Ok(Some(delta))) => {
                format!("moved {} to the host's time", crate::clock::describe(delta))
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, "guest clock not set");
                e.to_string()
            }
            Some(Ok(None)) | None => return,
        };
        self.audit(Entry {
            actor: "guest-init",
            action: "clock.set",
            resource: "CLOCK_REALTIME",
            result: &result,
            ..Default::default()
        })
        .await;
    }

    /// Sends `m`; error messages are redacted, since they may quote input.
    async fn send(&self, m: impl Into<GuestMessage>) {
        let mut m = m.into();
        if let Some(Out::Error(e)) = &mut m.kind {
            e.message = self.secrets.redactor().redact(&e.message);
        }
        let _ = self.outbox().send(m).await;
    }

    /// Appends to the audit log and streams the line to the host, in order.
    async fn audit(&self, e: Entry<'_>) {
        let mut log = self.audit.lock().await;
        match log.append(e) {
            Ok((seq, json)) => {
                let _ = self
                    .outbox()
                    .send(msg(Out::AuditEvent(AuditEvent { seq, json })))
                    .await;
            }
            Err(err) => {
                tracing::error!(error = %err, "audit write failed");
                let _ = self
                    .outbox()
                    .send(
                        error(Code::Internal, format!("audit log write failed: {err}"), "").into(),
                    )
                    .await;
            }
        }
    }

    async fn apply_egress(&self, plan: &EgressPlan) -> Result<(), String> {
        for (ip, host) in &plan.refused {
            self.audit(Entry {
                actor: "guest-init",
                action: "egress.denied",
                resource: &format!("{host} -> {ip}"),
                decision: "deny",
                result: "private, loopback, link-local or metadata address not listed as a cidr",
                turn_id: "",
            })
            .await;
        }
        let summary = plan
            .allowed
            .iter()
            .map(|a| format!("{} ports {:?}", a.cidr, a.ports))
            .collect::<Vec<_>>()
            .join(", ");
        if !self.cfg.apply_egress {
            self.audit(Entry {
                actor: "guest-init",
                action: "egress.planned",
                resource: &summary,
                result: "not applied: serve mode without --apply-egress",
                ..Default::default()
            })
            .await;
            return Ok(());
        }
        std::fs::write(&self.cfg.hosts_file, egress::hosts_file(plan))
            .map_err(|e| format!("cannot write {}: {e}", self.cfg.hosts_file.display()))?;
        run_nft(&egress::nft_ruleset(plan)).await?;
        self.audit(Entry {
            actor: "guest-init",
            action: "egress.applied",
            resource: &summary,
            result: "nftables table inet guest_egress installed",
            ..Default::default()
        })
        .await;
        Ok(())
    }

    async fn reject(&self, exec_id: &str, turn_id: &str, reason: &str, rule: &str) {
        let reason = self.secrets.redactor().redact(reason);
        self.audit(Entry {
            turn_id,
            actor: "guest-init",
            action: "exec.rejected",
            resource: exec_id,
            decision: "deny",
            result: &reason,
        })
        .await;
        self.send(msg(Out::ExecRejected(ExecRejected {
            exec_id: exec_id.to_string(),
            reason,
            rule: rule.to_string(),
        })))
        .await;
    }

    async fn exec(self: Arc<Self>, e: Exec) {
        if e.exec_id.is_empty() || e.turn_id.is_empty() {
            self.send(error(
                Code::InvalidArgument,
                "Exec needs a non-empty exec_id and turn_id",
                &e.exec_id,
            ))
            .await;
            return;
        }
        if !lock(&self.exec_ids).insert(e.exec_id.clone()) {
            self.send(error(
                Code::InvalidArgument,
                format!("exec_id {:?} was already used in this session", e.exec_id),
                &e.exec_id,
            ))
            .await;
            return;
        }
        let cwd = match workspace::resolve_dir(&self.cfg.workspace, &e.cwd) {
            Ok(c) => c,
            Err(err) => {
                self.send(error(Code::InvalidArgument, err.to_string(), &e.exec_id))
                    .await;
                return;
            }
        };
        let always = lock(&self.always).clone();
        // The Exec's env is decided with its argv: PATH, LD_PRELOAD, GIT_* and
        // the like change what the command runs.
        let exec_env: BTreeMap<String, String> = e.env.clone().into_iter().collect();
        let ctx = crate::policy::ExecContext {
            workspace: &self.cfg.workspace,
            cwd: &cwd,
            env: &exec_env,
        };
        let decision = match self.policy.decide_exec(&e.argv, &ctx, &always) {
            Ok(d) => d,
            Err(err) => {
                self.send(error(
                    Code::InvalidArgument,
                    format!("cannot decide this command: {err}"),
                    &e.exec_id,
                ))
                .await;
                return;
            }
        };
        self.audit(Entry {
            turn_id: &e.turn_id,
            actor: "agent",
            action: "exec.decided",
            resource: &decision.subject,
            decision: decision.action.as_str(),
            result: &decision.rule,
        })
        .await;
        match decision.action {
            Action::Allow => {}
            Action::Deny => {
                self.reject(&e.exec_id, &e.turn_id, "denied by policy", &decision.rule)
                    .await;
                return;
            }
            Action::Ask => {
                if !self.ask(&e, &decision).await {
                    return;
                }
            }
        }
        self.run(e, cwd).await;
    }

    /// Holds the command for an Answer; true when it may run.
    async fn ask(&self, e: &Exec, decision: &ExecDecision) -> bool {
        let (subject, rule) = (decision.subject.as_str(), decision.rule.as_str());
        let ask_id = format!("ask-{}", e.exec_id);
        let (tx, rx) = oneshot::channel();
        lock(&self.asks).insert(ask_id.clone(), (e.turn_id.clone(), tx));
        self.audit(Entry {
            turn_id: &e.turn_id,
            actor: "guest-init",
            action: "ask.requested",
            resource: subject,
            decision: "ask",
            result: &ask_id,
        })
        .await;
        self.send(msg(Out::AskRequest(AskRequest {
            ask_id: ask_id.clone(),
            exec_id: e.exec_id.clone(),
            turn_id: e.turn_id.clone(),
            tool: crate::policy::EXEC_TOOL.into(),
            subject: subject.to_string(),
            rule: rule.to_string(),
            timeout_ms: u32::try_from(self.ask_timeout.as_millis()).unwrap_or(u32::MAX),
        })))
        .await;
        // Err(Elapsed): timed out; Ok(Err(_)): the turn or session ended.
        let outcome = tokio::time::timeout(self.ask_timeout, rx).await;
        lock(&self.asks).remove(&ask_id);
        let reply = match &outcome {
            Ok(Ok(r)) => Some(*r),
            _ => None,
        };
        let cancelled = matches!(outcome, Ok(Err(_)));
        let (word, ok) = match reply {
            Some(Reply::Once) => ("once", true),
            Some(Reply::Always) => ("always", true),
            Some(_) => ("reject", false),
            None if cancelled => ("cancelled", false),
            None => ("timeout", false),
        };
        self.audit(Entry {
            turn_id: &e.turn_id,
            actor: "host",
            action: "ask.answered",
            resource: subject,
            decision: word,
            result: &ask_id,
        })
        .await;
        if reply == Some(Reply::Always) {
            lock(&self.always).extend(decision.keys.iter().cloned());
        }
        if !ok {
            let reason = if cancelled {
                "the turn or session ended before the command was approved".to_string()
            } else if reply.is_none() {
                format!(
                    "approval timed out after {} ms",
                    self.ask_timeout.as_millis()
                )
            } else {
                "rejected by the control plane".to_string()
            };
            self.reject(&e.exec_id, &e.turn_id, &reason, rule).await;
        }
        ok
    }

    fn answer(&self, ask_id: &str, reply: i32) -> Result<(), Failure> {
        let reply = Reply::try_from(reply)
            .ok()
            .filter(|r| *r != Reply::Unspecified)
            .ok_or_else(|| {
                error(
                    Code::InvalidArgument,
                    format!("Answer reply {reply} is not once, always or reject"),
                    "",
                )
            })?;
        let (_, tx) = lock(&self.asks).remove(ask_id).ok_or_else(|| {
            error(
                Code::InvalidArgument,
                format!("no pending ask {ask_id:?} (answered already, timed out, or never asked)"),
                "",
            )
        })?;
        let _ = tx.send(reply);
        Ok(())
    }

    async fn run(&self, e: Exec, cwd: PathBuf) {
        let prepared = lock(&self.turns).prepare(&e.turn_id);
        let placement = match prepared {
            Ok(p) => p,
            Err(err) => {
                self.reject(
                    &e.exec_id,
                    &e.turn_id,
                    &format!("cannot create the turn's cgroup: {err}"),
                    "",
                )
                .await;
                return;
            }
        };
        let mut env = self.env.clone();
        env.extend(e.env.clone());
        for (k, v) in self.secrets.env() {
            env.insert(k.clone(), v.clone());
        }
        env.insert(crate::turn::TURN_ENV.to_string(), placement.tag.to_string());
        let spec = Spec {
            argv: e.argv.clone(),
            cwd,
            env,
            home: self.cfg.workspace.clone(),
            identity: self.cfg.identity,
            cgroup_procs: placement.cgroup_procs,
        };
        let mut child = match exec::spawn(&spec) {
            Ok(c) => c,
            Err(err) => {
                self.reject(&e.exec_id, &e.turn_id, &err.to_string(), "")
                    .await;
                return;
            }
        };
        let pid = child.id().unwrap_or(0);
        lock(&self.turns).add_root(&e.turn_id, pid);
        for name in self.secrets.names() {
            self.audit(Entry {
                turn_id: &e.turn_id,
                actor: "guest-init",
                action: "secret.delivered",
                resource: &name,
                decision: "allow",
                result: &e.exec_id,
            })
            .await;
        }
        let stdin_tx = {
            let mut stdin = child.stdin.take();
            let initial = e.stdin.clone();
            let (tx, mut rx) = mpsc::channel::<(Vec<u8>, bool)>(64);
            let keep = e.keep_stdin_open;
            tokio::spawn(async move {
                let Some(w) = stdin.as_mut() else { return };
                if !initial.is_empty() && w.write_all(&initial).await.is_err() {
                    return;
                }
                if !keep {
                    return;
                }
                while let Some((data, eof)) = rx.recv().await {
                    if w.write_all(&data).await.is_err() || eof {
                        return;
                    }
                }
            });
            e.keep_stdin_open.then_some(tx)
        };
        lock(&self.running).insert(
            e.exec_id.clone(),
            Running {
                pid,
                stdin: stdin_tx,
            },
        );
        self.send(msg(Out::ExecStarted(ExecStarted {
            exec_id: e.exec_id.clone(),
            pid,
        })))
        .await;
        self.audit(Entry {
            turn_id: &e.turn_id,
            actor: "agent",
            action: "exec.started",
            resource: &e.argv.join(" "),
            decision: "",
            result: &format!("pid {pid}"),
        })
        .await;
        let pumps = [
            child.stdout.take().map(|r| {
                tokio::spawn(pump(
                    r,
                    output::Stream::Stdout,
                    e.exec_id.clone(),
                    self.secrets.redactor().clone(),
                    self.outbox(),
                ))
            }),
            child.stderr.take().map(|r| {
                tokio::spawn(pump(
                    r,
                    output::Stream::Stderr,
                    e.exec_id.clone(),
                    self.secrets.redactor().clone(),
                    self.outbox(),
                ))
            }),
        ];
        let status = child.wait().await;
        reaper::release(Some(pid));
        // A daemonised descendant may keep the pipes open: wait briefly for
        // the output that is already there, then report the exit.
        for p in pumps.into_iter().flatten() {
            let abort = p.abort_handle();
            if tokio::time::timeout(Duration::from_millis(500), p)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
        lock(&self.running).remove(&e.exec_id);
        let (status, text) = match status {
            Ok(s) => {
                use std::os::unix::process::ExitStatusExt;
                match (s.code(), s.signal()) {
                    (Some(c), _) => (Some(exec_exited::Status::Code(c)), format!("exit {c}")),
                    (None, Some(sig)) => (
                        Some(exec_exited::Status::Signal(sig)),
                        format!("signal {sig}"),
                    ),
                    _ => (None, "unknown".to_string()),
                }
            }
            Err(err) => (None, format!("wait failed: {err}")),
        };
        self.send(msg(Out::ExecExited(ExecExited {
            exec_id: e.exec_id.clone(),
            status,
        })))
        .await;
        self.audit(Entry {
            turn_id: &e.turn_id,
            actor: "agent",
            action: "exec.exited",
            resource: &e.exec_id,
            decision: "",
            result: &text,
        })
        .await;
    }

    async fn stdin(&self, exec_id: &str, data: Vec<u8>, eof: bool) -> Result<(), Failure> {
        let tx = lock(&self.running)
            .get(exec_id)
            .map(|r| r.stdin.clone())
            .ok_or_else(|| {
                error(
                    Code::InvalidArgument,
                    format!("no running command {exec_id:?}"),
                    exec_id,
                )
            })?
            .ok_or_else(|| {
                error(
                    Code::InvalidArgument,
                    "stdin of this command is closed (start it with keep_stdin_open)",
                    exec_id,
                )
            })?;
        tx.send((data, eof)).await.map_err(|_| {
            error(
                Code::InvalidArgument,
                "stdin of this command is closed",
                exec_id,
            )
        })
    }

    async fn signal(&self, exec_id: &str, sig: i32) -> Result<(), Failure> {
        if !(1..=64).contains(&sig) {
            return Err(error(
                Code::InvalidArgument,
                format!("signal {sig} is not between 1 and 64"),
                exec_id,
            ));
        }
        let pid = lock(&self.running)
            .get(exec_id)
            .map(|r| r.pid)
            .ok_or_else(|| {
                error(
                    Code::InvalidArgument,
                    format!("no running command {exec_id:?}"),
                    exec_id,
                )
            })?;
        exec::signal_group(pid, sig).map_err(|e| {
            error(
                Code::Internal,
                format!("cannot signal {exec_id}: {e}"),
                exec_id,
            )
        })?;
        self.audit(Entry {
            actor: "host",
            action: "exec.signal",
            resource: exec_id,
            result: &format!("signal {sig}"),
            ..Default::default()
        })
        .await;
        Ok(())
    }

    async fn end_turn(&self, turn_id: &str) {
        // Commands of this turn still waiting for approval never run.
        lock(&self.asks).retain(|_, (turn, _)| turn != turn_id);
        let taken = lock(&self.turns).take(turn_id);
        let killed = match taken {
            Some((turn, others)) => {
                let managed: HashSet<u32> = reaper::managed().lock().clone();
                tokio::task::spawn_blocking(move || turn.kill(&managed, &others))
                    .await
                    .unwrap_or_default()
            }
            None => Vec::new(),
        };
        self.audit(Entry {
            turn_id,
            actor: "guest-init",
            action: "turn.killed",
            resource: &killed
                .iter()
                .map(|k| format!("{} {}", k.pid, k.command))
                .collect::<Vec<_>>()
                .join("; "),
            decision: "",
            result: &format!("killed {}", killed.len()),
        })
        .await;
        self.report_egress_denials(turn_id).await;
        self.send(msg(Out::TurnEnded(TurnEnded {
            turn_id: turn_id.to_string(),
            killed: killed
                .into_iter()
                .map(|k| KilledProcess {
                    pid: k.pid,
                    command: self.secrets.redactor().redact(&k.command),
                })
                .collect(),
        })))
        .await;
    }

    async fn report_egress_denials(&self, turn_id: &str) {
        if !self.cfg.apply_egress {
            return;
        }
        let Ok(out) = reaper::output(tokio::process::Command::new("nft").args([
            "list",
            "counter",
            "inet",
            egress::TABLE,
            "denied",
        ]))
        .await
        else {
            return;
        };
        let Some(now) = egress::parse_denied_packets(&String::from_utf8_lossy(&out.stdout)) else {
            return;
        };
        let before = std::mem::replace(&mut *lock(&self.egress_denied), now);
        if now > before {
            self.audit(Entry {
                turn_id,
                actor: "agent",
                action: "egress.denied",
                resource: "outbound packets",
                decision: "deny",
                result: &format!("{} packets denied", now - before),
            })
            .await;
        }
    }

    async fn fetch_branch(&self) {
        let mut child =
            match session::bundle_branch(&self.cfg.workspace, &self.branch, self.cfg.identity) {
                Ok(c) => c,
                Err(e) => {
                    self.send(error(
                        Code::Repository,
                        format!("cannot run git bundle: {e}"),
                        "",
                    ))
                    .await;
                    return;
                }
            };
        let bundle_pid = child.id();
        let mut stderr = child.stderr.take();
        let err_task = tokio::spawn(async move {
            let mut s = Vec::new();
            if let Some(r) = stderr.as_mut() {
                let _ = r.read_to_end(&mut s).await;
            }
            s
        });
        let mut data = Vec::new();
        if let Some(mut r) = child.stdout.take() {
            let _ = r.read_to_end(&mut data).await;
        }
        let status = child.wait().await;
        reaper::release(bundle_pid);
        let stderr = err_task.await.unwrap_or_default();
        if !status.is_ok_and(|s| s.success()) {
            self.send(error(
                Code::Repository,
                format!(
                    "git bundle create {} failed: {}",
                    self.branch,
                    String::from_utf8_lossy(&stderr).trim()
                ),
                "",
            ))
            .await;
            return;
        }
        let mut chunks = data.chunks(CHUNK).peekable();
        if chunks.peek().is_none() {
            self.send(msg(Out::BundleChunk(BundleChunk {
                data: Vec::new(),
                last: true,
            })))
            .await;
        }
        while let Some(c) = chunks.next() {
            let last = chunks.peek().is_none();
            self.send(msg(Out::BundleChunk(BundleChunk {
                data: c.to_vec(),
                last,
            })))
            .await;
        }
        self.audit(Entry {
            actor: "host",
            action: "branch.fetched",
            resource: &self.branch,
            result: &format!("{} bytes", data.len()),
            ..Default::default()
        })
        .await;
    }

    /// Kills every turn and records the end of the session.
    async fn end(&self, why: &str) {
        self.stop_turns().await;
        self.audit(Entry {
            actor: "guest-init",
            action: "session.end",
            resource: &self.branch,
            result: why,
            ..Default::default()
        })
        .await;
        tracing::info!(session = %self.id, why, "session ended");
    }

    /// The connection closed: kills every turn (nobody is left to read its
    /// output or answer its asks) and keeps the rest for a resume.
    async fn detach(&self) {
        self.stop_turns().await;
        self.audit(Entry {
            actor: "guest-init",
            action: "session.detached",
            resource: &self.branch,
            result: "connection closed; turns killed, session kept for ResumeSession",
            ..Default::default()
        })
        .await;
        // Let go of the closed connection's outbox, so its writer ends now; what is
        // audited until a resume stays in the log and is sent again then.
        *lock(&self.out) = mpsc::channel(1).0;
        tracing::info!(session = %self.id, "connection closed; session kept for a resume");
    }

    /// Ends every turn (killing its processes), sweeps orphans and drops pending asks.
    async fn stop_turns(&self) {
        let ids = lock(&self.turns).ids();
        for id in ids {
            self.end_turn(&id).await;
        }
        lock(&self.turns).remove_parent_if_idle();
        if *lock(&self.turns).backend() == Backend::ProcessTree {
            let managed: HashSet<u32> = reaper::managed().lock().clone();
            let swept = tokio::task::spawn_blocking(move || crate::turn::sweep_orphans(&managed))
                .await
                .unwrap_or_default();
            if !swept.is_empty() {
                self.audit(Entry {
                    actor: "guest-init",
                    action: "session.orphans_killed",
                    resource: &swept
                        .iter()
                        .map(|k| format!("{} {}", k.pid, k.command))
                        .collect::<Vec<_>>()
                        .join("; "),
                    result: &format!("killed {}", swept.len()),
                    ..Default::default()
                })
                .await;
            }
        }
        lock(&self.asks).clear();
    }
}

async fn pump(
    mut r: impl AsyncRead + Unpin,
    stream: output::Stream,
    exec_id: String,
    redactor: Redactor,
    out: Outbox,
) {
    let mut buf = vec![0u8; CHUNK];
    let mut red = redactor.stream();
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let data = red.push(&buf[..n]);
        if !data.is_empty() {
            let _ = out
                .send(msg(Out::Output(Output {
                    exec_id: exec_id.clone(),
                    stream: stream as i32,
                    data,
                })))
                .await;
        }
    }
    let rest = red.finish();
    if !rest.is_empty() {
        let _ = out
            .send(msg(Out::Output(Output {
                exec_id,
                stream: stream as i32,
                data: rest,
            })))
            .await;
    }
}

fn resolve(host: &str) -> Vec<std::net::IpAddr> {
    use std::net::ToSocketAddrs;
    (host, 0)
        .to_socket_addrs()
        .map(|it| it.map(|a| a.ip()).collect())
        .unwrap_or_default()
}

async fn run_nft(script: &str) -> Result<(), String> {
    let mut child = reaper::spawn(
        tokio::process::Command::new("nft")
            .args(["-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped()),
    )
    .map_err(|e| format!("cannot run nft (egress rules need nftables): {e}"))?;
    let pid = child.id();
    if let Some(mut w) = child.stdin.take() {
        w.write_all(script.as_bytes())
            .await
            .map_err(|e| format!("writing to nft: {e}"))?;
    }
    let out = child.wait_with_output().await;
    reaper::release(pid);
    let out = out.map_err(|e| format!("nft: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "nft refused the egress rules: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}
