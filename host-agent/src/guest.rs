//! The guest channel: host side of the vmm's vsock, a Unix socket following
//! Firecracker's convention (connect, write `CONNECT <port>\n`, read
//! `OK <hostport>\n`, then a byte stream), speaking `guest.v1` in
//! length-prefixed frames (`proto::framing`).
//!
//! A [`GuestConn`] owns one connection: a writer task sends frames, a reader
//! task routes what the guest sends — exec output to the exec's stream, asks
//! to the pending list, audit events to the store (chained on the host:
//! `host_hash = sha256(prev_host_hash || json)`), everything else to the
//! control queue read by [`GuestConn::next_control`].

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proto::framing::{decode_payload, encode_frame, FrameDecoder, DEFAULT_MAX_FRAME};
use proto::guest::{
    guest_message::Kind as Out, host_message::Kind as In, AskRequest, GuestMessage, Hello,
    HostMessage, PROTOCOL_VERSION,
};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

use crate::error::{Error, Result};
use crate::sessions::now_ms;
use crate::store::{AuditRow, Store};

/// Connects to guest port `port` through the vsock Unix socket at `path`.
/// With `peer`, the socket must be served by that process (the VM's vmm).
pub async fn connect(path: &Path, port: u32, peer: Option<u32>) -> Result<UnixStream> {
    let mut stream = UnixStream::connect(path)
        .await
        .map_err(|e| Error::Guest(format!("vsock socket {}: {e}", path.display())))?;
    crate::supervisor::check_peer(&stream, peer, &format!("vsock socket {}", path.display()))?;
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .await
        .map_err(|e| Error::Guest(format!("vsock CONNECT: {e}")))?;
    let mut line = String::new();
    // Read byte by byte so no stream data after the line is buffered away.
    loop {
        let mut b = [0u8; 1];
        let n = stream
            .read(&mut b)
            .await
            .map_err(|e| Error::Guest(format!("vsock CONNECT reply: {e}")))?;
        if n == 0 || b[0] == b'\n' || line.len() > 64 {
            break;
        }
        line.push(b[0] as char);
    }
    if !line.starts_with("OK ") {
        return Err(Error::Guest(format!(
            "vsock CONNECT {port} refused: {line:?} (is guest-init listening?)"
        )));
    }
    Ok(stream)
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

/// A pending approval.
#[derive(Debug, Clone)]
pub struct PendingAsk {
    /// The guest's request.
    pub ask: AskRequest,
    /// When it arrived (Unix ms).
    pub asked_at: i64,
}

#[derive(Default)]
struct Routes {
    execs: HashMap<String, mpsc::UnboundedSender<GuestMessage>>,
    asks: BTreeMap<String, PendingAsk>,
    bundle: Vec<u8>,
    closed: bool,
}

/// One open guest channel.
pub struct GuestConn {
    out: mpsc::Sender<HostMessage>,
    routes: Arc<Mutex<Routes>>,
    control: tokio::sync::Mutex<mpsc::UnboundedReceiver<GuestMessage>>,
}

fn kind(m: In) -> HostMessage {
    HostMessage { kind: Some(m) }
}

impl GuestConn {
    /// Exchanges Hello on `stream` and starts the reader and writer tasks.
    /// Audit events of `session_id` are stored, chained, in `store`.
    pub async fn open(
        stream: UnixStream,
        session_id: &str,
        store: Option<Arc<Store>>,
    ) -> Result<GuestConn> {
        let (mut r, mut w) = stream.into_split();
        let hello = kind(In::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            software: format!("host-agent {}", env!("CARGO_PKG_VERSION")),
        }));
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
        let routes = Arc::new(Mutex::new(Routes::default()));
        let (ctl_tx, ctl_rx) = mpsc::unbounded_channel();
        let rt = routes.clone();
        let sid = session_id.to_string();
        let last = store
            .as_ref()
            .and_then(|s| s.last_audit(&sid).ok().flatten())
            .map(|a| (a.host_hash, a.guest_seq));
        let (mut prev_hash, mut last_seq) = last.unwrap_or_default();
        tokio::spawn(async move {
            let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME);
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                loop {
                    match dec.next_frame() {
                        Ok(Some(payload)) => {
                            let Ok(m) = decode_payload::<GuestMessage>(&payload) else {
                                continue;
                            };
                            route(
                                &rt,
                                &ctl_tx,
                                m,
                                &sid,
                                store.as_deref(),
                                &mut prev_hash,
                                &mut last_seq,
                            );
                        }
                        Ok(None) => break,
                        Err(_) => continue,
                    }
                }
                match r.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => dec.push(&buf[..n]),
                }
            }
            let mut g = rt.lock().unwrap_or_else(|p| p.into_inner());
            g.closed = true;
            g.execs.clear();
        });
        let conn = GuestConn {
            out: out_tx,
            routes,
            control: tokio::sync::Mutex::new(ctl_rx),
        };
        match conn.next_control(Duration::from_secs(30)).await? {
            GuestMessage {
                kind: Some(Out::Hello(h)),
            } if h.protocol_version == PROTOCOL_VERSION => Ok(conn),
            GuestMessage {
                kind: Some(Out::Error(e)),
            } => Err(Error::Guest(format!("guest refused Hello: {}", e.message))),
            other => Err(Error::Guest(format!(
                "expected Hello from the guest, got {other:?}"
            ))),
        }
    }

    fn routes(&self) -> std::sync::MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends one message.
    pub async fn send(&self, m: In) -> Result<()> {
        self.out
            .send(kind(m))
            .await
            .map_err(|_| Error::Guest("the guest channel is closed".into()))
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

    /// The next message not routed to an exec (Ready, Error, bundle end, ...).
    pub async fn next_control(&self, timeout: Duration) -> Result<GuestMessage> {
        let mut rx = self.control.lock().await;
        match tokio::time::timeout(timeout, rx.recv()).await {
            Ok(Some(m)) => Ok(m),
            Ok(None) => Err(Error::Guest("the guest closed the channel".into())),
            Err(_) => Err(Error::Timeout(format!(
                "guest did not answer in {timeout:?}"
            ))),
        }
    }

    /// Whether the guest (or the vsock under it) closed the channel.
    pub fn is_closed(&self) -> bool {
        self.routes().closed
    }

    /// Registers an exec's route; messages about `exec_id` arrive on the
    /// returned receiver.
    pub fn route_exec(&self, exec_id: &str) -> Result<mpsc::UnboundedReceiver<GuestMessage>> {
        let mut g = self.routes();
        if g.closed {
            return Err(Error::Guest("the guest channel is closed".into()));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        g.execs.insert(exec_id.to_string(), tx);
        Ok(rx)
    }

    /// Pending asks.
    pub fn asks(&self) -> Vec<PendingAsk> {
        self.routes().asks.values().cloned().collect()
    }

    /// Removes a pending ask, returning whether it was pending.
    pub fn take_ask(&self, ask_id: &str) -> bool {
        self.routes().asks.remove(ask_id).is_some()
    }

    /// Takes the bundle collected from BundleChunk messages.
    pub fn take_bundle(&self) -> Vec<u8> {
        std::mem::take(&mut self.routes().bundle)
    }
}

fn exec_id_of(m: &GuestMessage) -> Option<&str> {
    Some(match m.kind.as_ref()? {
        Out::ExecStarted(e) => &e.exec_id,
        Out::Output(o) => &o.exec_id,
        Out::ExecExited(e) => &e.exec_id,
        Out::ExecRejected(e) => &e.exec_id,
        Out::Error(e) if !e.exec_id.is_empty() => &e.exec_id,
        _ => return None,
    })
}

fn route(
    routes: &Mutex<Routes>,
    control: &mpsc::UnboundedSender<GuestMessage>,
    m: GuestMessage,
    session_id: &str,
    store: Option<&Store>,
    prev_hash: &mut String,
    last_seq: &mut u64,
) {
    let mut g = routes.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(id) = exec_id_of(&m).map(str::to_string) {
        let ends = matches!(
            m.kind,
            Some(Out::ExecExited(_) | Out::ExecRejected(_) | Out::Error(_))
        );
        if let Some(tx) = g.execs.get(&id) {
            let _ = tx.send(m);
        }
        if ends {
            g.execs.remove(&id);
            g.asks.retain(|_, a| a.ask.exec_id != id);
        }
        return;
    }
    match m.kind {
        Some(Out::AskRequest(a)) => {
            g.asks.insert(
                a.ask_id.clone(),
                PendingAsk {
                    ask: a,
                    asked_at: now_ms(),
                },
            );
        }
        // Events the host already holds (sent again after a resume) are skipped,
        // so each guest seq is chained and stored once.
        Some(Out::AuditEvent(a)) if a.seq <= *last_seq => {}
        Some(Out::AuditEvent(a)) => {
            *last_seq = a.seq;
            let mut h = Sha256::new();
            h.update(prev_hash.as_bytes());
            h.update(a.json.as_bytes());
            let hash = hex::encode(h.finalize());
            if let Some(store) = store {
                let row = AuditRow {
                    session_id: session_id.to_string(),
                    guest_seq: a.seq,
                    json: a.json,
                    host_hash: hash.clone(),
                    received_at: now_ms(),
                };
                if let Err(e) = store.insert_audit(&row) {
                    tracing::error!(session = session_id, error = %e, "storing audit event");
                }
            }
            *prev_hash = hash;
        }
        Some(Out::BundleChunk(c)) => {
            g.bundle.extend_from_slice(&c.data);
            if c.last {
                let _ = control.send(GuestMessage {
                    kind: Some(Out::BundleChunk(proto::guest::BundleChunk {
                        data: Vec::new(),
                        last: true,
                    })),
                });
            }
        }
        _ => {
            let _ = control.send(m);
        }
    }
}
