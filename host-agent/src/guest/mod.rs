//! The guest channel: host side of the vmm's vsock, a Unix socket following
//! Firecracker's convention (connect, write `CONNECT <port>\n`, read
//! `OK <hostport>\n`, then a byte stream), speaking `guest.v1` in
//! length-prefixed frames (`proto::framing`).
//!
//! A [`GuestConn`] owns one connection: a writer task sends frames, a reader
//! task routes what the guest sends — exec output to the exec's stream, asks
//! to the pending list, audit events to the store (chained on the host:
//! `host_hash = sha256(prev_host_hash || json)`), bundle chunks to the
//! branch fetch in progress, file responses to their file call
//! ([`FileCall`]), everything else to the control queue read by
//! [`GuestConn::next_control`].
//!
//! The guest is not trusted: everything it can make host-agent hold is
//! bounded ([`limits`]). Messages nobody asked for, or over a limit, are
//! dropped and counted (`hostagent_guest_messages_dropped_total`). Exec
//! output is not dropped: when an exec's client does not read, the reader
//! stops reading the channel, so the guest's writes block.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prost::Message as _;
use proto::framing::{decode_payload, encode_frame, FrameDecoder, FrameError, DEFAULT_MAX_FRAME};
use proto::guest::{
    answer::Reply, error::Code, guest_message::Kind as Out, host_message::Kind as In, Answer,
    AskRequest, AuditEvent, BundleChunk, Error as GuestError, FetchBranch, GuestMessage,
    HostMessage,
};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{broadcast, mpsc, watch};

use crate::clock::now_ms;
use crate::error::{Error, Result};
use crate::metrics;
use crate::store::{AuditRow, Store};

mod audit;
mod files;
pub mod limits;
mod reader;

use audit::AuditChain;
pub use files::{FileCall, FileCallError, MAX_FILE_CALLS, MAX_FILE_WINDOW, WRITE_CHUNK};
use reader::Reader;

/// The stop reasons of [`Violation`]s, as they appear in events.
pub mod reason {
    /// The guest sent more audit than `max_audit_bytes_per_session`.
    pub const AUDIT_LIMIT: &str = "audit_limit";
    /// The guest sent an audit event out of sequence (a gap, a repeat, or
    /// going backwards).
    pub const AUDIT_OUT_OF_ORDER: &str = "audit_out_of_order";
}

/// Why a session must be stopped because of what its guest sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The stop reason (`audit_limit`, `audit_out_of_order`).
    pub reason: &'static str,
    /// What happened, for the event's detail.
    pub detail: String,
}

/// Connects to guest port `port` through the vsock Unix socket at `path`.
/// With `peer`, the socket must be served by that process (the VM's vmm).
pub async fn connect(path: &Path, port: u32, peer: Option<u32>) -> Result<UnixStream> {
    vmm_api::vsock::connect_async(path, port, peer)
        .await
        .map_err(|e| Error::Guest(e.to_string()))
}

/// Connects, retrying until `timeout` (the guest may still be starting).
pub async fn connect_retry(
    path: &Path,
    port: u32,
    peer: Option<u32>,
    timeout: Duration,
) -> Result<UnixStream> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match connect(path, port, peer).await {
            Ok(s) => return Ok(s),
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Opens a guest channel within `timeout` through `once(left, hello)`, one
/// connection that may take `left` to connect and `hello` for the guest's
/// Hello. A connection that timed out waiting for the Hello, or that the
/// guest closed before it, is given up for a new one (each waits
/// `hello_attempt`; one that would leave less than another attempt's time
/// waits to the deadline) until `timeout` has passed; other errors end at
/// once.
pub async fn open_retrying<F, Fut>(
    timeout: Duration,
    hello_attempt: Duration,
    mut once: F,
) -> Result<GuestConn>
where
    F: FnMut(Duration, Duration) -> Fut,
    Fut: std::future::Future<Output = Result<GuestConn>>,
{
    const PAUSE: Duration = Duration::from_millis(100);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let hello = if left < 2 * hello_attempt + PAUSE {
            left
        } else {
            hello_attempt
        };
        match once(left, hello).await {
            Err(e @ (Error::Timeout(_) | Error::GuestGone(_)))
                if tokio::time::Instant::now() + PAUSE < deadline =>
            {
                tracing::warn!(error = %e, "no Hello from the guest on this connection; opening another");
                tokio::time::sleep(PAUSE).await;
            }
            r => return r,
        }
    }
}

/// A pending approval.
#[derive(Debug, Clone)]
pub struct PendingAsk {
    /// The guest's request.
    pub ask: AskRequest,
    /// When it arrived (Unix ms).
    pub asked_at: i64,
}

/// What became of an ask, for the session's events (the reader sends these;
/// the session manager records them).
#[derive(Debug, Clone)]
pub enum AskNotice {
    /// The guest asked.
    Asked(PendingAsk),
    /// The command waiting on an ask ended before anyone answered it (the
    /// guest's approval timeout, the turn or session ending): `why` is the
    /// guest's reason.
    Unanswered {
        /// The ask.
        ask: PendingAsk,
        /// Why its command ended.
        why: String,
    },
}

/// Per-session audit settings for [`GuestConn::open`].
#[derive(Clone)]
pub struct AuditSink {
    /// Where events are stored.
    pub store: Arc<Store>,
    /// Most bytes of audit JSON stored for the session; the event that
    /// would pass it stops the session (`audit_limit`).
    pub max_bytes: u64,
}

#[derive(Default)]
struct Routes {
    execs: HashMap<String, mpsc::Sender<GuestMessage>>,
    asks: BTreeMap<String, PendingAsk>,
    /// Set while a FetchBranch is outstanding.
    bundle: Option<mpsc::Sender<BundleChunk>>,
    /// Open file calls ([`files`]).
    files: files::FileRoutes,
    closed: bool,
}

/// State shared by the connection's tasks and its users.
struct Shared {
    routes: Mutex<Routes>,
    /// Set by [`GuestConn::drop_exec_output`]: output is dropped, not waited for.
    draining: watch::Sender<bool>,
    /// The reader is waiting for an exec's client to take output.
    backpressured: AtomicBool,
    violation: watch::Sender<Option<Violation>>,
}

impl Shared {
    fn routes(&self) -> std::sync::MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One open guest channel.
pub struct GuestConn {
    out: mpsc::Sender<HostMessage>,
    shared: Arc<Shared>,
    control: tokio::sync::Mutex<broadcast::Receiver<GuestMessage>>,
    notices: Mutex<Option<mpsc::Receiver<AskNotice>>>,
}

fn kind(m: In) -> HostMessage {
    HostMessage { kind: Some(m) }
}

impl GuestConn {
    /// Exchanges Hello on `stream` and starts the reader and writer tasks;
    /// fails with [`Error::Timeout`] when the guest's Hello has not come in
    /// `hello_timeout`. Audit events of `session_id` are stored, chained,
    /// through `audit`.
    pub async fn open(
        stream: UnixStream,
        session_id: &str,
        audit: Option<AuditSink>,
        hello_timeout: Duration,
    ) -> Result<GuestConn> {
        let (r, mut w) = stream.into_split();
        let hello = proto::hello::host_hello(format!("host-agent {}", env!("CARGO_PKG_VERSION")));
        let frame = encode_frame(&hello, DEFAULT_MAX_FRAME)
            .map_err(|e| Error::Guest(format!("encoding Hello: {e}")))?;
        w.write_all(&frame)
            .await
            .map_err(|e| Error::Guest(format!("sending Hello: {e}")))?;
        let (out_tx, mut out_rx) = mpsc::channel::<HostMessage>(64);
        tokio::spawn(async move {
            while let Some(m) = out_rx.recv().await {
                let Ok(frame) = encode_frame(&m, DEFAULT_MAX_FRAME) else {
                    continue;
                };
                if w.write_all(&frame).await.is_err() {
                    return;
                }
            }
        });
        let shared = Arc::new(Shared {
            routes: Mutex::new(Routes::default()),
            draining: watch::channel(false).0,
            backpressured: AtomicBool::new(false),
            violation: watch::channel(None).0,
        });
        let (ctl_tx, ctl_rx) = broadcast::channel(limits::CONTROL_QUEUE);
        let (notice_tx, notice_rx) = mpsc::channel(limits::ASK_NOTICE_QUEUE);
        let chain = match audit {
            Some(sink) => Some(AuditChain::load(sink, session_id)?),
            None => None,
        };
        let reader = Reader {
            shared: shared.clone(),
            control: ctl_tx,
            // Weak: dropping the GuestConn must still end the writer (and so
            // close the channel for the guest).
            out: out_tx.downgrade(),
            audit: chain,
            session_id: session_id.to_string(),
            notices: notice_tx,
        };
        tokio::spawn(reader.run(r));
        let conn = GuestConn {
            out: out_tx,
            shared,
            control: tokio::sync::Mutex::new(ctl_rx),
            notices: Mutex::new(Some(notice_rx)),
        };
        let first = conn.next_control(hello_timeout).await?;
        proto::hello::accept_guest_hello(first).map_err(|e| Error::Guest(e.to_string()))?;
        Ok(conn)
    }

    /// Sends one message; fails when the guest has not made room for it in
    /// [`limits::SEND_TIMEOUT`].
    pub async fn send(&self, m: In) -> Result<()> {
        match tokio::time::timeout(limits::SEND_TIMEOUT, self.out.send(kind(m))).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Error::GuestGone("the guest channel is closed".into())),
            Err(_) => Err(Error::Timeout(format!(
                "the guest has not read its channel for {:?}",
                limits::SEND_TIMEOUT
            ))),
        }
    }

    /// The next control message before `deadline`: a guest that keeps
    /// sending other messages cannot hold a caller past it.
    pub async fn next_control_before(
        &self,
        deadline: tokio::time::Instant,
    ) -> Result<GuestMessage> {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout(
                "the guest did not answer in time (other messages kept coming)".into(),
            ));
        }
        self.next_control(left).await
    }

    /// The next message not routed elsewhere (Ready, Error, ...).
    pub async fn next_control(&self, timeout: Duration) -> Result<GuestMessage> {
        let mut rx = self.control.lock().await;
        let recv = async {
            loop {
                match rx.recv().await {
                    Ok(m) => return Ok(m),
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        metrics::guest_dropped_n("control_queue_full", n);
                    }
                    Err(broadcast::error::RecvError::Closed) => {
                        return Err(Error::GuestGone("the guest closed the channel".into()))
                    }
                }
            }
        };
        match tokio::time::timeout(timeout, recv).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout(format!(
                "guest did not answer in {timeout:?}"
            ))),
        }
    }

    /// Whether the guest (or the vsock under it) closed the channel.
    pub fn is_closed(&self) -> bool {
        self.shared.routes().closed
    }

    /// Whether the reader is waiting for an exec's client to take output
    /// (and so not reading the channel).
    pub fn is_backpressured(&self) -> bool {
        self.shared.backpressured.load(Ordering::Relaxed)
    }

    /// The first violation the guest committed, once there is one.
    pub fn violation(&self) -> Option<Violation> {
        self.shared.violation.borrow().clone()
    }

    /// Registers an exec's route; messages about `exec_id` arrive on the
    /// returned receiver (at most [`limits::EXEC_OUTPUT_QUEUE`] waiting).
    pub fn route_exec(&self, exec_id: &str) -> Result<mpsc::Receiver<GuestMessage>> {
        let mut g = self.shared.routes();
        if g.closed {
            return Err(Error::GuestGone("the guest channel is closed".into()));
        }
        let (tx, rx) = mpsc::channel(limits::EXEC_OUTPUT_QUEUE);
        g.execs.insert(exec_id.to_string(), tx);
        Ok(rx)
    }

    /// Turns true when exec output is no longer waited for
    /// ([`Self::drop_exec_output`]).
    pub fn exec_output_dropped(&self) -> watch::Receiver<bool> {
        self.shared.draining.subscribe()
    }

    /// Ends every exec's stream and drops exec output from now on, so the
    /// channel is read again whatever the clients do (before Stop).
    pub fn drop_exec_output(&self) {
        self.shared.draining.send_replace(true);
        self.shared.routes().execs.clear();
    }

    /// Pending asks.
    pub fn asks(&self) -> Vec<PendingAsk> {
        self.shared.routes().asks.values().cloned().collect()
    }

    /// Removes a pending ask, returning whether it was pending.
    pub fn take_ask(&self, ask_id: &str) -> bool {
        self.shared.routes().asks.remove(ask_id).is_some()
    }

    /// What becomes of this channel's asks, in order: taken once, by whoever
    /// records the session's events.
    pub fn take_ask_notices(&self) -> Option<mpsc::Receiver<AskNotice>> {
        self.notices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// Asks the guest for the session branch (FetchBranch) and writes the
    /// bundle it streams back to `file`, at most `max_bytes`. Chunks are
    /// accepted only while this runs. `idle` bounds the wait for each chunk.
    /// Returns the bundle's size.
    pub async fn fetch_branch(
        &self,
        file: &mut tokio::fs::File,
        max_bytes: u64,
        idle: Duration,
    ) -> Result<u64> {
        let (tx, mut rx) = mpsc::channel(limits::BUNDLE_QUEUE);
        self.shared.routes().bundle = Some(tx);
        let result = self.receive_bundle(&mut rx, file, max_bytes, idle).await;
        self.shared.routes().bundle = None;
        result
    }

    async fn receive_bundle(
        &self,
        rx: &mut mpsc::Receiver<BundleChunk>,
        file: &mut tokio::fs::File,
        max_bytes: u64,
        idle: Duration,
    ) -> Result<u64> {
        self.send(In::FetchBranch(FetchBranch {})).await?;
        let mut written = 0u64;
        // Only chunks extend the wait, and not past the overall bound.
        let end = tokio::time::Instant::now() + limits::BUNDLE_TIMEOUT;
        let mut deadline = (tokio::time::Instant::now() + idle).min(end);
        loop {
            let chunk = tokio::select! {
                c = rx.recv() => c,
                m = self.next_control_before(deadline) => match m?.kind {
                    Some(Out::Error(e)) => {
                        return Err(Error::Guest(format!(
                            "guest-init could not bundle the branch: {}",
                            e.message
                        )))
                    }
                    _ => continue,
                },
            };
            let Some(chunk) = chunk else {
                return Err(Error::GuestGone(
                    "the guest closed the channel while sending the branch".into(),
                ));
            };
            deadline = (tokio::time::Instant::now() + idle).min(end);
            written += chunk.data.len() as u64;
            if written > max_bytes {
                return Err(Error::ResourceExhausted(format!(
                    "the guest's branch bundle is larger than the limit of {max_bytes} bytes \
                     (max_branch_bundle_bytes); the branch was not fetched"
                )));
            }
            file.write_all(&chunk.data)
                .await
                .map_err(|e| Error::io("writing the branch bundle", e))?;
            if chunk.last {
                file.flush()
                    .await
                    .map_err(|e| Error::io("writing the branch bundle", e))?;
                return Ok(written);
            }
        }
    }
}

#[cfg(test)]
mod tests;
