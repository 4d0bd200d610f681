//! The session agent: serves host-agent over a [`Transport`], one
//! connection at a time, and runs at most one session per connection.
//!
//! Per connection: the host sends Hello (protocol version 1) first; then
//! StartSession and the repository bundle; then Exec, StdinData, Signal,
//! Resize, EndTurn, Answer, FetchBranch and finally Shutdown. Frames that do not
//! decode, are too large, or arrive out of order are answered with an Error
//! and the connection goes on. When a connection closes, its session's turns
//! are killed (and audited) but the session is kept; the next connection may
//! take it over with ResumeSession, or replace it with StartSession. In a
//! VM restored from another session's snapshot, ForkSession makes the kept
//! session (the parent) a new one.
//! Shutdown ends the session and makes [`serve`] return.
//!
//! By responsibility: `connection` (Hello, reading and dispatching frames,
//! StartSession, ResumeSession, ForkSession, Shutdown), `lifecycle` (a
//! session opened, reattached, audited, its branch fetched back, ended),
//! `fork` (a kept session made a new one), `commands` (Exec,
//! stdin, signals, turns), `terminal` (commands on a terminal: input,
//! resize, signals; timeouts), `approvals` (ask and Answer), `network` (the
//! egress rules). This file keeps the configuration, `serve`, and the
//! session's state.
//!
//! `files` serves FileRequest: the Files API's operations, as the agent.

mod approvals;
mod commands;
mod connection;
mod files;
mod fork;
mod lifecycle;
mod network;
mod terminal;

use connection::handle_connection;
use network::resolve;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proto::framing::FrameError;
use proto::guest::{
    answer::Reply, error::Code, exec_exited, guest_message::Kind as Out, host_message::Kind as In,
    output, AskRequest, AuditEvent, BundleChunk, Error as ErrorMsg, Exec, ExecExited, ExecRejected,
    ExecStarted, ForkSession, GuestMessage, Hello, HostMessage, KilledProcess, Output, Ready,
    ResumeSession, ShutdownStarted, StartSession, TurnEnded, PROTOCOL_VERSION,
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
    /// guest-init runs the machine (PID 1 in a guest): a session's size may
    /// take its vCPUs offline and grow its root filesystem.
    pub own_machine: bool,
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
    // A connection that arrived while another was served: it is served next.
    let mut next: Option<Connection> = None;
    loop {
        let conn = match next.take() {
            Some(c) => c,
            None => {
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
                match accepted {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                }
            }
        };
        let (why, kept) = serve_one(transport, conn, &cfg, &stop, detached.take(), &mut next).await;
        if let Some(why) = why {
            return Ok(why);
        }
        detached = kept;
    }
}

/// Serves `conn` while still accepting: a new connection from the host
/// supersedes it (put in `next`, and `conn` ends as if it had closed, its
/// session detached for the new one to resume). The host opens a new
/// channel only when it takes the old one for dead, and the old one may be
/// dead without this guest being told: a vsock connection reset by a
/// restored VM's transport-reset event reports only `EPOLLERR`, which wakes
/// no reader, so guest-init would otherwise wait on it forever and never
/// accept the host's new connection (seen with a real guest resumed from
/// disk).
async fn serve_one(
    transport: &mut dyn Transport,
    conn: Connection,
    cfg: &Arc<Config>,
    stop: &tokio::sync::watch::Receiver<bool>,
    detached: Option<Arc<Session>>,
    next: &mut Option<Connection>,
) -> (Option<Stop>, Option<Arc<Session>>) {
    let (supersede, superseded) = tokio::sync::oneshot::channel::<()>();
    let mut supersede = Some(supersede);
    let handler = handle_connection(conn, cfg.clone(), stop.clone(), detached, superseded);
    tokio::pin!(handler);
    loop {
        tokio::select! {
            r = &mut handler => return r,
            a = transport.accept(), if next.is_none() => match a {
                Ok(c) => {
                    tracing::info!("a new connection from the host supersedes the current one");
                    *next = Some(c);
                    if let Some(tx) = supersede.take() {
                        let _ = tx.send(());
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
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

/// A running command.
struct Running {
    pid: u32,
    stdin: Option<mpsc::Sender<(Vec<u8>, bool)>>,
    /// Its terminal, for a command started with `pty`.
    pty: Option<Arc<crate::pty::Master>>,
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
