//! Sessions: the lifecycle state machine, one supervised vmm per session,
//! limits, usage sampling and re-attach after a restart.
//!
//! `PENDING → RESTORING → READY → RUNNING ⇄ PAUSED → STOPPING → STOPPED`,
//! and `FAILED` from any live state. Every transition is written with its
//! event in one SQLite transaction, then signalled to watchers.
//!
//! Size: this file is over the project's 700-line guide. Splitting the
//! manager by responsibility (lifecycle, guest sessions, limits and usage,
//! one typed vmm client) is the next planned redesign, done as one change
//! with its tests rather than piecemeal here.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proto::guest::{
    guest_message::Kind as Out, host_message::Kind as In, RepoChunk, ResumeSession, Shutdown,
    StartSession,
};
use proto::hostagent::SessionState as S;
use serde_json::json;
use tokio::sync::watch;

use crate::accounting::{read_sample, Meter};
use crate::config::{Config, DEFAULT_IMAGE_ROOT, DEFAULT_REPOSITORY_ROOT};
use crate::error::{Error, Result};
use crate::events::EventBus;
use crate::guest::{self, GuestConn};
use crate::jail_uids::JailUids;
use crate::metrics;
use crate::path_roots::PathRoots;
use crate::pool::{copy_disk, prepare_disk, restore_launch, Pool, Source, VM_DISK};
use crate::repo::Repo;
use crate::store::{EventRow, ImageRow, SessionRow, Store};
use crate::supervisor::{self, ExitStatus, VmmProcess};

/// Stop and pause reasons, as they appear in events and sessions.
pub mod reason {
    /// A client asked.
    pub const REQUESTED: &str = "requested";
    /// The session's TTL passed.
    pub const TTL_EXPIRED: &str = "ttl_expired";
    /// The node's maximum session lifetime passed.
    pub const MAX_LIFETIME: &str = "max_lifetime";
    /// No activity for the idle timeout (a pause, not a stop).
    pub const IDLE: &str = "idle";
    /// The guest reset or powered off (vmm exit 0).
    pub const GUEST_EXIT: &str = "guest_exit";
    /// The guest or VM failed (vmm exit 1).
    pub const GUEST_CRASH: &str = "guest_crash";
    /// The vmm process died (signal, unexpected code, or gone on re-attach).
    pub const VMM_CRASH: &str = "vmm_crash";
    /// host-agent stopped its sessions on shutdown.
    pub const HOST_AGENT_SHUTDOWN: &str = "host_agent_shutdown";
    /// The restore did not reach READY.
    pub const RESTORE_FAILED: &str = "restore_failed";
    /// host-agent restarted while the session was being restored.
    pub const HOST_AGENT_RESTART: &str = "host_agent_restart";
    /// The guest sent more audit than `max_audit_bytes_per_session`.
    pub const AUDIT_LIMIT: &str = "audit_limit";
    /// The guest sent an audit event out of sequence (a gap, a repeat, or
    /// going backwards).
    pub const AUDIT_OUT_OF_ORDER: &str = "audit_out_of_order";
}

/// Current time in Unix milliseconds.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Name of a state for messages ("RUNNING").
pub fn state_name(s: i32) -> &'static str {
    match S::try_from(s).unwrap_or(S::Unspecified) {
        S::Unspecified => "NONE",
        S::Pending => "PENDING",
        S::Restoring => "RESTORING",
        S::Ready => "READY",
        S::Running => "RUNNING",
        S::Paused => "PAUSED",
        S::Stopping => "STOPPING",
        S::Stopped => "STOPPED",
        S::Failed => "FAILED",
    }
}

/// Whether `s` is STOPPED or FAILED.
pub fn is_terminal(s: i32) -> bool {
    s == S::Stopped as i32 || s == S::Failed as i32
}

fn allowed(from: i32, to: i32) -> bool {
    use S::*;
    let (Ok(f), Ok(t)) = (S::try_from(from), S::try_from(to)) else {
        return false;
    };
    matches!(
        (f, t),
        (Unspecified, Pending)
            | (Pending, Restoring)
            | (Restoring, Ready)
            | (Ready, Running)
            | (Ready | Running, Paused)
            | (Paused, Running)
            | (Running | Paused, Restoring)
            | (Pending | Restoring | Ready | Running | Paused, Stopping)
            | (Stopping, Stopped)
            | (
                Pending | Restoring | Ready | Running | Paused | Stopping,
                Failed
            )
    )
}

fn billable(s: i32) -> bool {
    s == S::Ready as i32 || s == S::Running as i32 || s == S::Stopping as i32
}

/// What Create needs.
#[derive(Debug, Clone, Default)]
pub struct CreateParams {
    /// Image to restore.
    pub image_id: String,
    /// Idempotency key, may be empty.
    pub idempotency_key: String,
    /// TTL seconds (0 = node default).
    pub ttl_s: u64,
    /// Idle timeout seconds (0 = node default).
    pub idle_s: u64,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Host repository for guest-init images.
    pub repository: String,
    /// Agent name for guest-init images.
    pub agent: String,
    /// Base ref for guest-init images.
    pub base_ref: String,
    /// The client creating the session (its owner).
    pub owner: String,
}

impl CreateParams {
    fn fingerprint(&self) -> String {
        format!(
            "{:?}",
            (
                &self.image_id,
                self.ttl_s,
                self.idle_s,
                &self.labels,
                &self.repository,
                &self.agent,
                &self.base_ref
            )
        )
    }
}

struct Inner {
    row: SessionRow,
    image: ImageRow,
    vmm: Option<Arc<VmmProcess>>,
    meter: Option<Meter>,
    pending_stop: Option<String>,
    enforcing: bool,
    guest: Option<Arc<GuestConn>>,
    /// Why the branch was not fetched at Stop, for the STOPPED event.
    fetch_error: Option<String>,
}

/// One session in memory.
pub struct Session {
    /// Session id.
    pub id: String,
    op: tokio::sync::Mutex<()>,
    /// Held while the guest channel is being re-opened, so it is opened once.
    guest_open: tokio::sync::Mutex<()>,
    inner: Mutex<Inner>,
    state: watch::Sender<i32>,
}

impl Session {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A copy of the persisted row.
    pub fn row(&self) -> SessionRow {
        self.lock().row.clone()
    }

    fn vmm(&self) -> Option<Arc<VmmProcess>> {
        self.lock().vmm.clone()
    }

    /// The open guest channel (guest-init sessions after READY).
    pub fn guest(&self) -> Option<Arc<GuestConn>> {
        self.lock().guest.clone()
    }

    /// Whether the session's image runs guest-init.
    pub fn guest_init(&self) -> bool {
        self.lock().image.guest_init
    }

    async fn wait_until(&self, pred: impl Fn(i32) -> bool, timeout: Duration) -> bool {
        let mut rx = self.state.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|s| pred(*s)))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

/// The node's sessions, images and their vmm processes.
pub struct Manager {
    /// Configuration.
    pub cfg: Config,
    /// The database.
    pub store: Arc<Store>,
    /// Event notification.
    pub events: EventBus,
    /// The vmm binary.
    pub vmm_path: PathBuf,
    /// Warm VMs.
    pub pool: Pool,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    create_lock: tokio::sync::Mutex<()>,
    /// Serializes golden snapshot builds.
    pub golden_lock: tokio::sync::Mutex<()>,
    /// Where RegisterImage's files may lie.
    pub image_roots: PathRoots,
    /// Where CreateSession's repository may lie.
    pub repository_roots: PathRoots,
    /// uids of jailed VMs.
    pub jail_uids: Arc<JailUids>,
}

impl Manager {
    /// Opens the state directory and database.
    pub fn new(cfg: Config) -> Result<Arc<Manager>> {
        for sub in ["", "sessions", "images", "pool"] {
            let d = cfg.state_dir.join(sub);
            std::fs::create_dir_all(&d)
                .map_err(|e| Error::io(format!("creating {}", d.display()), e))?;
        }
        if cfg.allowed_image_roots.is_none() || cfg.allowed_repository_roots.is_none() {
            for sub in [DEFAULT_IMAGE_ROOT, DEFAULT_REPOSITORY_ROOT] {
                let d = cfg.state_dir.join(sub);
                std::fs::create_dir_all(&d)
                    .map_err(|e| Error::io(format!("creating {}", d.display()), e))?;
            }
        }
        let image_roots = PathRoots::new(
            "allowed_image_roots",
            "allowed-image-root",
            &cfg.image_roots(),
        )?;
        let repository_roots = PathRoots::new(
            "allowed_repository_roots",
            "allowed-repository-root",
            &cfg.repository_roots(),
        )?;
        let store = Arc::new(Store::open(&cfg.state_dir.join("host-agent.db"))?);
        let events = EventBus::new(&store)?;
        let vmm_path = cfg.vmm_path();
        let jail_uids = Arc::new(JailUids::new(cfg.jail.uid_range));
        Ok(Arc::new(Manager {
            cfg,
            store,
            events,
            vmm_path,
            pool: Pool::new(jail_uids.clone()),
            jail_uids,
            sessions: Mutex::new(HashMap::new()),
            create_lock: tokio::sync::Mutex::new(()),
            golden_lock: tokio::sync::Mutex::new(()),
            image_roots,
            repository_roots,
        }))
    }

    /// A uid for a new jailed VM, or `None` when VMs run unjailed.
    pub fn allocate_jail_uid(&self) -> Result<Option<u32>> {
        if self.cfg.jailed() {
            self.jail_uids.allocate().map(Some)
        } else {
            Ok(None)
        }
    }

    /// Where warm VMs live.
    pub fn pool_dir(&self) -> PathBuf {
        self.cfg.state_dir.join("pool")
    }

    /// Where an image's files live.
    pub fn image_dir(&self, id: &str) -> PathBuf {
        self.cfg.state_dir.join("images").join(id)
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Session>>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn all(&self) -> Vec<Arc<Session>> {
        self.map().values().cloned().collect()
    }

    /// The session `id`, or NotFound.
    pub fn session(&self, id: &str) -> Result<Arc<Session>> {
        self.map()
            .get(id)
            .cloned()
            .ok_or_else(|| Error::not_found("session", id))
    }

    /// Live sessions (not STOPPED/FAILED).
    pub fn live_count(&self) -> usize {
        self.all()
            .iter()
            .filter(|s| !is_terminal(s.lock().row.state))
            .count()
    }

    /// Live sessions' (vCPUs, memory MiB).
    pub fn used_resources(&self) -> (u32, u64) {
        self.all()
            .iter()
            .map(|s| s.lock())
            .filter(|i| !is_terminal(i.row.state))
            .fold((0, 0), |(c, m), i| {
                (c + i.image.vcpus, m + u64::from(i.image.mem_mib))
            })
    }

    /// Sessions whose guest channel is not read because an exec's client
    /// does not take its output.
    pub fn guest_backpressured(&self) -> usize {
        self.all()
            .iter()
            .filter(|s| s.guest().is_some_and(|g| g.is_backpressured()))
            .count()
    }

    /// Sessions per state name.
    pub fn count_by_state(&self) -> Vec<(&'static str, usize)> {
        let mut counts: BTreeMap<&'static str, usize> = BTreeMap::new();
        for s in 1..=8 {
            counts.insert(state_name(s), 0);
        }
        for s in self.all() {
            *counts.entry(state_name(s.lock().row.state)).or_default() += 1;
        }
        counts.into_iter().collect()
    }

    /// (billed seconds, vCPU seconds) summed over sessions in memory.
    pub fn usage_totals(&self) -> (f64, f64) {
        let mut t = (0.0, 0.0);
        for s in self.all() {
            if let Ok(Some(u)) = self.store.last_usage(&s.id) {
                t.0 += u.billed_ms as f64 / 1000.0;
                t.1 += u.vcpu_ns as f64 / 1e9;
            }
        }
        t
    }

    /// Sessions, optionally filtered.
    pub fn list(&self, state: i32, image: &str) -> Vec<SessionRow> {
        let mut rows: Vec<SessionRow> = self
            .all()
            .iter()
            .map(|s| s.row())
            .filter(|r| {
                (state == 0 || r.state == state) && (image.is_empty() || r.image_id == image)
            })
            .collect();
        rows.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        rows
    }

    /// Whether a live session uses `image`.
    pub fn image_in_use(&self, image: &str) -> bool {
        self.all().iter().any(|s| {
            let i = s.lock();
            i.row.image_id == image && !is_terminal(i.row.state)
        })
    }

    /// Records API activity on a session (for the idle timeout).
    pub fn touch(&self, sess: &Session) {
        let mut i = sess.lock();
        i.row.last_activity = now_ms();
        if !is_terminal(i.row.state) {
            if let Err(e) = self.store.put_session(&i.row) {
                tracing::warn!(session = %sess.id, error = %e, "cannot record activity");
            }
        }
    }

    /// Moves `sess` to `to`, persisting the row and the event together.
    fn transition(&self, sess: &Session, to: S, reason: &str, detail: &str) -> Result<()> {
        let to = to as i32;
        let mut guard = sess.lock();
        let inner = &mut *guard;
        let from = inner.row.state;
        if !allowed(from, to) {
            return Err(Error::FailedPrecondition(format!(
                "session {} is {}; it cannot become {}",
                sess.id,
                state_name(from),
                state_name(to)
            )));
        }
        let now = now_ms();
        inner.row.state = to;
        if is_terminal(to) {
            // The session is over: its uid may go to another VM.
            self.jail_uids.release(inner.row.jail_uid);
        }
        if matches!(
            S::try_from(to),
            Ok(S::Paused | S::Stopping | S::Stopped | S::Failed)
        ) {
            inner.row.reason = reason.to_string();
            inner.row.detail = detail.to_string();
        }
        let pid = inner.vmm.as_ref().and_then(|v| v.sample_pid());
        if to == S::Ready as i32 {
            if let (Some(m), Some(s)) = (inner.meter.as_mut(), pid.and_then(read_sample)) {
                // A restored session's new process: its counters start here.
                m.baseline(s);
            }
        }
        if to == S::Ready as i32 && inner.meter.is_none() {
            let mut m = Meter::start(&sess.id, &inner.row.execution_id, inner.image.mem_mib, now);
            if let Some(s) = pid.and_then(read_sample) {
                m.baseline(s);
            }
            inner.meter = Some(m);
            if inner.row.ready_at == 0 {
                inner.row.ready_at = now;
            }
        }
        let mut final_usage = None;
        if let Some(m) = inner.meter.as_mut() {
            if to == S::Stopping as i32 {
                if let Some(s) = pid.and_then(read_sample) {
                    m.observe(s);
                }
            }
            if is_terminal(to) {
                if !m.is_finished() {
                    final_usage = Some(m.finish(now, None));
                }
            } else {
                m.set_billable(now, billable(to));
            }
        }
        if is_terminal(to) {
            inner.row.ended_at = now;
        }
        let ev = EventRow {
            seq: 0,
            session_id: sess.id.clone(),
            execution_id: inner.row.execution_id.clone(),
            at: now,
            from,
            to,
            reason: reason.to_string(),
            detail: detail.to_string(),
        };
        let seq = match self.store.transition(&inner.row, &ev) {
            Ok(seq) => seq,
            Err(e) => {
                inner.row.state = from;
                return Err(e);
            }
        };
        if let Some(u) = final_usage {
            self.store.insert_usage(&u)?;
        }
        drop(guard);
        tracing::info!(session = %sess.id, seq, from = state_name(from), to = state_name(to), reason, detail, "transition");
        self.events.committed(seq);
        sess.state.send_replace(to);
        Ok(())
    }

    fn insert_session(&self, row: SessionRow, image: ImageRow) -> Arc<Session> {
        let (state, _) = watch::channel(row.state);
        let sess = Arc::new(Session {
            id: row.id.clone(),
            op: tokio::sync::Mutex::new(()),
            guest_open: tokio::sync::Mutex::new(()),
            inner: Mutex::new(Inner {
                row,
                image,
                vmm: None,
                meter: None,
                pending_stop: None,
                enforcing: false,
                guest: None,
                fetch_error: None,
            }),
            state,
        });
        self.map().insert(sess.id.clone(), sess.clone());
        sess
    }

    /// Creates a session from an image's golden snapshot (or a warm VM) and
    /// returns it RUNNING. A retry with the same idempotency key returns the
    /// same session.
    pub async fn create(self: &Arc<Self>, p: CreateParams) -> Result<SessionRow> {
        let image = self
            .store
            .image(&p.image_id)?
            .ok_or_else(|| Error::not_found("image", &p.image_id))?;
        let fp = p.fingerprint();
        let sess = {
            let _g = self.create_lock.lock().await;
            if !p.idempotency_key.is_empty() {
                if let Some((method, f, resp)) = self.store.idempotent(&p.idempotency_key)? {
                    if method != "CreateSession" || f != fp {
                        return Err(Error::invalid(format!(
                            "idempotency key {:?} was used for a different request ({method})",
                            p.idempotency_key
                        )));
                    }
                    let id = String::from_utf8_lossy(&resp).to_string();
                    drop(_g);
                    return self.settled(&id).await;
                }
            }
            if image.golden_dir.is_empty() {
                return Err(Error::FailedPrecondition(format!(
                    "image {:?} has no golden snapshot yet; call BuildGoldenSnapshot first",
                    image.id
                )));
            }
            if image.guest_init
                && (p.repository.is_empty() || p.agent.is_empty() || p.base_ref.is_empty())
            {
                return Err(Error::invalid(format!(
                    "image {:?} runs guest-init: repository_path, agent and base_ref are required",
                    image.id
                )));
            }
            if image.guest_init
                && !std::path::Path::new(&p.repository).join(".git").exists()
                && !std::path::Path::new(&p.repository).join("HEAD").exists()
            {
                return Err(Error::invalid(format!(
                    "repository_path {:?} is not a git repository on this node",
                    p.repository
                )));
            }
            let live = self.live_count();
            if live >= self.cfg.max_sessions as usize {
                return Err(Error::ResourceExhausted(format!(
                    "node is at its limit of {} live sessions; stop or delete one first",
                    self.cfg.max_sessions
                )));
            }
            let (_, mem_used) = self.used_resources();
            let host_mem = crate::api::node::host_memory_mib();
            if host_mem > 0 && mem_used + u64::from(image.mem_mib) > host_mem {
                return Err(Error::ResourceExhausted(format!(
                    "node memory: {mem_used} MiB of {host_mem} MiB are allocated to live \
                     sessions; image {:?} needs {} MiB more",
                    image.id, image.mem_mib
                )));
            }
            let id = uuid::Uuid::new_v4().to_string();
            let now = now_ms();
            let row = SessionRow {
                id: id.clone(),
                image_id: image.id.clone(),
                state: S::Unspecified as i32,
                execution_id: uuid::Uuid::new_v4().to_string(),
                created_at: now,
                dir: self
                    .cfg
                    .state_dir
                    .join("sessions")
                    .join(&id)
                    .display()
                    .to_string(),
                ttl_s: if p.ttl_s > 0 {
                    p.ttl_s
                } else {
                    self.cfg.default_ttl_seconds
                },
                idle_s: if p.idle_s > 0 {
                    p.idle_s
                } else {
                    self.cfg.default_idle_timeout_seconds
                },
                labels: p.labels.clone(),
                last_activity: now,
                repository: p.repository.clone(),
                agent: p.agent.clone(),
                base_ref: p.base_ref.clone(),
                owner: p.owner.clone(),
                ..Default::default()
            };
            if !p.idempotency_key.is_empty() {
                self.store.put_idempotent(
                    &p.idempotency_key,
                    "CreateSession",
                    &fp,
                    id.as_bytes(),
                    now,
                )?;
            }
            let sess = self.insert_session(row, image.clone());
            self.transition(&sess, S::Pending, "created", "")?;
            sess
        };
        let _op = sess.op.lock().await;
        self.start(&sess, &image).await?;
        Ok(sess.row())
    }

    /// Waits until the session `id` is past restoring, then returns it.
    async fn settled(&self, id: &str) -> Result<SessionRow> {
        let sess = self.session(id)?;
        sess.wait_until(
            |s| s != S::Pending as i32 && s != S::Restoring as i32 && s != S::Unspecified as i32,
            Duration::from_secs(120),
        )
        .await;
        Ok(sess.row())
    }

    async fn start(self: &Arc<Self>, sess: &Arc<Session>, image: &ImageRow) -> Result<()> {
        self.transition(sess, S::Restoring, "restore", "")?;
        let t0 = Instant::now();
        let dir = PathBuf::from(sess.row().dir);
        let result = self.start_vm(sess, image, &dir).await;
        let source = match result {
            Ok(source) => source,
            Err(e) => {
                if let Some(v) = sess.vmm() {
                    v.kill();
                }
                let _ = self.transition(sess, S::Failed, reason::RESTORE_FAILED, &e.to_string());
                return Err(e);
            }
        };
        metrics::restore_latency(t0.elapsed());
        self.transition(sess, S::Ready, "guest_running", &source)?;
        self.transition(sess, S::Running, "started", &source)?;
        Ok(())
    }

    /// Gets the session a running VM whose guest is ready: a warm VM if the
    /// pool has one, else one restored from the golden snapshot. Returns
    /// where it came from, for the READY and RUNNING events.
    ///
    /// A warm VM is prepared ahead on speculation; one that fails when taken
    /// (killed, out of memory, a guest that does not come back) costs the
    /// session a restore from the golden snapshot, not its start. A VM
    /// restored from the golden snapshot whose vmm exits before its guest is
    /// ready (a guest fault) is restored once more. Each such failure is
    /// logged with the vmm's last lines, counted, and said in the result;
    /// any other failure (no disk, no uid, no vmm binary, a guest that
    /// refuses the session) ends the attempt at once.
    async fn start_vm(
        self: &Arc<Self>,
        sess: &Arc<Session>,
        image: &ImageRow,
        dir: &Path,
    ) -> Result<String> {
        let mut failures = Vec::new();
        if let Some(vm) = self.pool.take(&image.id, dir) {
            match self.try_vm(sess, image, vm, true).await {
                Ok(()) => return Ok("from a warm VM".into()),
                Err((e, _)) => {
                    metrics::warm_fallback();
                    tracing::warn!(
                        session = %sess.id,
                        error = %e,
                        "the warm VM failed when taken; restoring from the golden snapshot"
                    );
                    failures.push(format!("the warm VM failed: {e}"));
                }
            }
        }
        let mut retried = false;
        loop {
            let vm = self.spawn_cold(sess, image, dir).await?;
            match self.try_vm(sess, image, vm, false).await {
                Ok(()) => break,
                Err((e, true)) if !retried => {
                    retried = true;
                    metrics::restore_retry();
                    tracing::warn!(
                        session = %sess.id,
                        error = %e,
                        "the restored VM exited before its guest was ready; restoring once more"
                    );
                    failures.push(format!("a restore failed: {e}"));
                }
                Err((e, _)) => return Err(e),
            }
        }
        Ok(if failures.is_empty() {
            "from the golden snapshot".into()
        } else {
            format!("from the golden snapshot ({})", failures.join("; "))
        })
    }

    /// Makes `vmm` the session's and records it.
    fn adopt_vmm(&self, sess: &Session, vmm: &Arc<VmmProcess>) -> Result<()> {
        let mut i = sess.lock();
        i.vmm = Some(vmm.clone());
        i.row.vmm_pid = vmm.pid;
        i.row.vmm_start_ticks = vmm.start_ticks;
        i.row.jail_uid = vmm.jail_uid.unwrap_or(0);
        self.store.put_session(&i.row)
    }

    /// Brings up the session on `vm` (`resume` for a warm VM restored
    /// paused), then its guest channel. The vmm is watched only once this
    /// has worked. If it fails, the VM is killed, its directory emptied and
    /// its uid given back, so the caller can try another; the flag says
    /// whether the vmm had exited by itself.
    async fn try_vm(
        self: &Arc<Self>,
        sess: &Arc<Session>,
        image: &ImageRow,
        vm: VmmProcess,
        resume: bool,
    ) -> std::result::Result<(), (Error, bool)> {
        let vmm = Arc::new(vm);
        let attempt = async {
            self.adopt_vmm(sess, &vmm)?;
            if resume {
                vmm.control(json!({"op":"resume"})).await?;
            }
            supervisor::wait_for_state(&vmm, "running", Duration::from_secs(60)).await?;
            if image.guest_init {
                let conn = self.start_guest(sess).await?;
                sess.lock().guest = Some(Arc::new(conn));
            }
            Ok::<(), Error>(())
        };
        let result = tokio::select! {
            r = attempt => r,
            status = vmm.wait() => Err(Error::Vmm(format!("{status}: {}", vmm.log_tail()))),
        };
        let Err(e) = result else {
            self.watch_exit(sess.clone(), vmm);
            return Ok(());
        };
        let exited = vmm.exit_status().is_some();
        {
            let mut i = sess.lock();
            i.vmm = None;
            i.guest = None;
            i.row.vmm_pid = 0;
            i.row.vmm_start_ticks = 0;
            // The uid goes back to the range below, not with the session
            // (were it to fail, it would be released twice).
            i.row.jail_uid = 0;
        }
        vmm.kill();
        let _ = tokio::time::timeout(Duration::from_secs(10), vmm.wait()).await;
        let _ = std::fs::remove_dir_all(&vmm.dir);
        if let Some(uid) = vmm.jail_uid {
            self.jail_uids.release(uid);
        }
        Err((e, exited))
    }

    /// A new vmm restoring the golden snapshot into `dir`, not yet adopted.
    async fn spawn_cold(
        self: &Arc<Self>,
        sess: &Arc<Session>,
        image: &ImageRow,
        dir: &Path,
    ) -> Result<VmmProcess> {
        let uid = self.allocate_jail_uid()?;
        // Recorded at once: a failure before the vmm is adopted fails the
        // session, which gives the uid back.
        {
            let mut i = sess.lock();
            i.row.jail_uid = uid.unwrap_or(0);
            self.store.put_session(&i.row)?;
        }
        prepare_disk(image, dir, uid).await?;
        let (args, jail) = restore_launch(&self.cfg, image, dir, false, Source::Golden, uid);
        supervisor::spawn(&self.vmm_path, dir, &args, jail.as_ref())
    }

    /// Connects to the session's guest-init over vsock and exchanges Hello.
    async fn connect_guest(&self, sess: &Session, timeout: Duration) -> Result<GuestConn> {
        // A socket of the vmm's own vsock device must be served by that vmm.
        // Without that process (exited, not started yet) nothing is connected to.
        let peer = if self.cfg.vsock_device {
            Some(sess.vmm().and_then(|v| v.sample_pid()).ok_or_else(|| {
                Error::Guest(format!(
                    "session {} has no running vmm to reach its guest through",
                    sess.id
                ))
            })?)
        } else {
            None
        };
        let stream = guest::connect_retry(
            &self.cfg.vsock_path(&self.run_dir(sess)),
            self.cfg.guest_port,
            peer,
            timeout,
        )
        .await?;
        let audit = guest::AuditSink {
            store: self.store.clone(),
            max_bytes: self.cfg.max_audit_bytes_per_session,
        };
        GuestConn::open(stream, &sess.id, Some(audit)).await
    }

    /// Opens the guest channel and starts the session in guest-init:
    /// StartSession, the repository as a git bundle, then waits for Ready.
    async fn start_guest(&self, sess: &Session) -> Result<GuestConn> {
        let row = sess.row();
        let timeout = Duration::from_secs(self.cfg.guest_ready_timeout_seconds);
        let conn = self.connect_guest(sess, timeout).await?;
        // Only the base ref (and what it needs) goes in: never the other
        // branches of the repository, other sessions' among them.
        let repo = Repo::open(&row.repository)?;
        let dir = PathBuf::from(&row.dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let path = dir.join("repo.bundle");
        let sent = async {
            let base = repo.write_base_bundle(&row.base_ref, &path).await?;
            conn.send(In::StartSession(StartSession {
                host_time_unix_ns: unix_now_ns(),
                session_id: sess.id.clone(),
                agent: row.agent.clone(),
                base_ref: base.base_ref.clone(),
                bundle_size: base.size,
                ..Default::default()
            }))
            .await?;
            send_file_chunks(&conn, &path).await
        }
        .await;
        let _ = std::fs::remove_file(&path);
        sent?;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match conn.next_control_before(deadline).await?.kind {
                Some(Out::Ready(_)) => return Ok(conn),
                Some(Out::Error(e)) => {
                    return Err(Error::Guest(format!(
                        "guest-init refused the session: {}",
                        e.message
                    )))
                }
                _ => continue,
            }
        }
    }

    /// The session's guest channel. One this process did not open (host-agent
    /// restarted) or one that closed is opened again: guest-init keeps the
    /// session across connections and takes it back on ResumeSession.
    pub async fn guest_channel(&self, sess: &Session) -> Result<Arc<GuestConn>> {
        if let Some(c) = sess.guest().filter(|c| !c.is_closed()) {
            return Ok(c);
        }
        if !sess.guest_init() {
            return Err(Error::FailedPrecondition(format!(
                "session {} runs no guest-init, so it has no guest channel",
                sess.id
            )));
        }
        let _open = sess.guest_open.lock().await;
        if let Some(c) = sess.guest().filter(|c| !c.is_closed()) {
            return Ok(c);
        }
        let state = sess.row().state;
        if state != S::Running as i32 && state != S::Ready as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {} is {}; its guest channel is opened again only while RUNNING",
                sess.id,
                state_name(state)
            )));
        }
        let timeout = Duration::from_secs(10);
        let conn = self.connect_guest(sess, timeout).await?;
        // The last event held, by seq and by the guest's own hash of it, so a
        // guest rolled back to an older snapshot can tell.
        let last = self.store.last_audit(&sess.id)?;
        let audit_seq_seen = last.as_ref().map_or(0, |a| a.guest_seq);
        let audit_hash_seen = last
            .and_then(|a| serde_json::from_str::<serde_json::Value>(&a.json).ok())
            .and_then(|v| v.get("hash").and_then(|h| h.as_str()).map(str::to_string))
            .unwrap_or_default();
        conn.send(In::ResumeSession(ResumeSession {
            session_id: sess.id.clone(),
            audit_seq_seen,
            audit_hash_seen,
            host_time_unix_ns: unix_now_ns(),
        }))
        .await?;
        // One deadline for the whole wait: other messages do not extend it.
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match conn.next_control_before(deadline).await?.kind {
                Some(Out::Ready(_)) => break,
                Some(Out::Error(e)) => {
                    return Err(Error::Guest(format!(
                        "guest-init could not resume session {}: {}",
                        sess.id, e.message
                    )))
                }
                _ => continue,
            }
        }
        let conn = Arc::new(conn);
        sess.lock().guest = Some(conn.clone());
        tracing::info!(session = %sess.id, "guest channel opened again (ResumeSession)");
        Ok(conn)
    }

    /// Fetches the session branch back into the host repository under
    /// `refs/heads/session/<id>`, then shuts the guest session down.
    /// Returns (branch, head commit).
    async fn finish_guest(&self, sess: &Session, conn: &GuestConn) -> Result<(String, String)> {
        let row = sess.row();
        let branch = format!("session/{}", sess.id);
        // Clients that stopped reading their exec's output hold the channel no longer.
        conn.drop_exec_output();
        let path = PathBuf::from(&row.dir).join("branch.bundle");
        let fetched = async {
            let mut file = crate::repo::create_new(&path).await?;
            conn.fetch_branch(
                &mut file,
                self.cfg.max_branch_bundle_bytes,
                Duration::from_secs(60),
            )
            .await?;
            drop(file);
            let repo = Repo::open(&row.repository)?;
            let full = format!("refs/heads/{branch}");
            repo.fetch_bundle(&path, &full, &full).await?;
            let head = repo.run(&["rev-parse", "--verify", &full]).await?;
            Ok::<_, Error>(String::from_utf8_lossy(&head).trim().to_string())
        }
        .await;
        let _ = std::fs::remove_file(&path);
        let head = fetched?;
        let _ = conn.send(In::Shutdown(Shutdown {})).await;
        let _ = conn.next_control(Duration::from_secs(5)).await;
        Ok((branch, head))
    }

    fn watch_exit(self: &Arc<Self>, sess: Arc<Session>, vmm: Arc<VmmProcess>) {
        let mgr = self.clone();
        tokio::spawn(async move {
            let status = vmm.wait().await;
            mgr.on_exit(&sess, &vmm, status);
        });
    }

    fn on_exit(&self, sess: &Session, vmm: &VmmProcess, status: ExitStatus) {
        let (state, pending) = {
            let i = sess.lock();
            // Ignore a vmm that is no longer this session's (also the one a
            // RestoreSession has let go of and is replacing).
            if i.vmm.as_ref().is_none_or(|v| v.pid != vmm.pid) {
                return;
            }
            (i.row.state, i.pending_stop.clone())
        };
        if is_terminal(state) {
            self.release(sess);
            return;
        }
        let detail = match status {
            ExitStatus::Code(_) | ExitStatus::Signal(_) => {
                let tail = vmm.log_tail();
                if tail.is_empty() {
                    status.to_string()
                } else {
                    format!("{status}: {tail}")
                }
            }
            ExitStatus::Unknown => status.to_string(),
        };
        let row = sess.row();
        let fetch_error = sess.lock().fetch_error.take();
        let detail = if let Some(e) = fetch_error {
            format!("branch not fetched: {e}; {detail}")
        } else if row.branch.is_empty() {
            detail
        } else {
            format!("branch {} at {}; {detail}", row.branch, row.head_commit)
        };
        let r = if state == S::Stopping as i32 {
            let why = pending.unwrap_or_else(|| reason::REQUESTED.to_string());
            self.transition(sess, S::Stopped, &why, &detail)
        } else {
            match status {
                ExitStatus::Code(0) => self
                    .transition(sess, S::Stopping, reason::GUEST_EXIT, &detail)
                    .and_then(|_| self.transition(sess, S::Stopped, reason::GUEST_EXIT, &detail)),
                ExitStatus::Code(1) => {
                    self.transition(sess, S::Failed, reason::GUEST_CRASH, &detail)
                }
                _ => self.transition(sess, S::Failed, reason::VMM_CRASH, &detail),
            }
        };
        if let Err(e) = r {
            tracing::error!(session = %sess.id, error = %e, "recording vmm exit");
        }
        self.release(sess);
    }

    /// Releases a finished session's sockets.
    fn release(&self, sess: &Session) {
        let run = self.run_dir(sess);
        let _ = std::fs::remove_file(run.join("control.sock"));
        let _ = std::fs::remove_file(self.cfg.vsock_path(&run));
    }

    /// Where the session's VM keeps its sockets, as the host sees it (inside
    /// the jail for a jailed vmm, whatever the configuration says now).
    fn run_dir(&self, sess: &Session) -> PathBuf {
        let jailed = sess.vmm().map_or(self.cfg.jailed(), |v| v.jailed);
        supervisor::run_dirs(&PathBuf::from(sess.row().dir), jailed).0
    }

    /// Pauses a RUNNING session (`reason`: requested or idle).
    pub async fn pause(&self, id: &str, why: &str) -> Result<SessionRow> {
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let state = sess.row().state;
        if state == S::Paused as i32 {
            return Ok(sess.row());
        }
        if state != S::Running as i32 && state != S::Ready as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is {}; only a RUNNING session can be paused",
                state_name(state)
            )));
        }
        let vmm = sess
            .vmm()
            .ok_or_else(|| Error::Vmm(format!("session {id} has no vmm")))?;
        vmm.control(json!({"op":"pause"})).await?;
        self.transition(&sess, S::Paused, why, "")?;
        Ok(sess.row())
    }

    /// Resumes a PAUSED session.
    pub async fn resume(&self, id: &str) -> Result<SessionRow> {
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let state = sess.row().state;
        if state == S::Running as i32 {
            return Ok(sess.row());
        }
        if state != S::Paused as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is {}; only a PAUSED session can be resumed",
                state_name(state)
            )));
        }
        let vmm = sess
            .vmm()
            .ok_or_else(|| Error::Vmm(format!("session {id} has no vmm")))?;
        vmm.control(json!({"op":"resume"})).await?;
        self.transition(&sess, S::Running, "resumed", "")?;
        self.touch(&sess);
        Ok(sess.row())
    }

    /// Writes a full snapshot of the session (pausing it meanwhile); returns
    /// the session, the snapshot directory and the pages written.
    pub async fn snapshot(&self, id: &str) -> Result<(SessionRow, String, u64)> {
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let state = sess.row().state;
        let was_running = state == S::Running as i32;
        if !was_running && state != S::Paused as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is {}; only a RUNNING or PAUSED session can be snapshotted",
                state_name(state)
            )));
        }
        let vmm = sess
            .vmm()
            .ok_or_else(|| Error::Vmm(format!("session {id} has no vmm")))?;
        // A jailed vmm writes into its own run directory; both names of the place
        // follow. Prepared before the pause, so a failure here changes nothing.
        let (run_host, run_inside) =
            supervisor::run_dirs(&PathBuf::from(sess.row().dir), vmm.jailed);
        let snaps = run_host.join("snapshots");
        let owner = vmm.jail_uid.filter(|_| vmm.jailed).map(|u| (u, u));
        crate::safe_fs::ensure_dir(&snaps, owner)
            .map_err(|e| Error::io(format!("preparing {}", snaps.display()), e))?;
        if was_running {
            vmm.control(json!({"op":"pause"})).await?;
            self.transition(&sess, S::Paused, "snapshot", "")?;
        }
        let name = format!("{}-{}", now_ms(), uuid::Uuid::new_v4().simple());
        let dir = snaps.join(&name);
        let mut result = vmm
            .control(json!({"op":"snapshot","dir":run_inside.join("snapshots").join(&name),"kind":"full"}))
            .await;
        // The disk goes with the memory (its page cache is in it), copied while
        // paused, to a place the vmm cannot write.
        if result.is_ok() && !sess.lock().image.rootfs.is_empty() {
            let kept = snapshot_disk(&PathBuf::from(sess.row().dir), &name);
            let copied = match kept.parent() {
                Some(p) => std::fs::create_dir_all(p)
                    .map_err(|e| Error::io(format!("creating {}", p.display()), e)),
                None => Ok(()),
            };
            let copied = match copied {
                Ok(()) => copy_disk(&run_host.join(VM_DISK), &kept, None).await,
                Err(e) => Err(e),
            };
            if let Err(e) = copied {
                let _ = std::fs::remove_file(&kept);
                let _ = std::fs::remove_dir_all(&dir);
                result = Err(e);
            }
        }
        if was_running {
            vmm.control(json!({"op":"resume"})).await?;
            self.transition(&sess, S::Running, "snapshot", "")?;
        }
        let v = result?;
        let pages = v.get("pages_written").and_then(|p| p.as_u64()).unwrap_or(0);
        self.touch(&sess);
        Ok((sess.row(), dir.display().to_string(), pages))
    }

    /// Rolls a RUNNING or PAUSED session back to `snapshot_dir`, one of its own
    /// snapshots: the disk copy taken with it replaces the session's disk, a new
    /// vmm restores it under a new execution id. Everything that can be checked
    /// or prepared is done before the old vmm is killed; a failure after that
    /// leaves the session FAILED (`restore_failed`).
    pub async fn restore_session(
        self: &Arc<Self>,
        id: &str,
        snapshot_dir: &str,
    ) -> Result<SessionRow> {
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let state = sess.row().state;
        if state != S::Running as i32 && state != S::Paused as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is {}; only a RUNNING or PAUSED session can be restored from its snapshot",
                state_name(state)
            )));
        }
        let old = sess
            .vmm()
            .ok_or_else(|| Error::Vmm(format!("session {id} has no vmm")))?;
        if old.jailed != self.cfg.jailed() || (old.jailed && old.jail_uid.is_none()) {
            // The snapshot was written by a vmm jailed (or not) as the session
            // started; a vmm of the other kind must not read it.
            return Err(Error::FailedPrecondition(format!(
                "session {id} runs {} but host-agent now runs {}; restart host-agent with the \
                 jail setting the session started with to restore it",
                if old.jailed { "jailed" } else { "unjailed" },
                if self.cfg.jailed() {
                    "jailed"
                } else {
                    "unjailed (--no-jail)"
                },
            )));
        }
        let dir = PathBuf::from(sess.row().dir);
        let (run_host, _) = supervisor::run_dirs(&dir, old.jailed);
        let snapshot = own_snapshot(&run_host.join("snapshots"), snapshot_dir)?;
        let name = snapshot
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let image = sess.lock().image.clone();
        // Stage the snapshot's disk copy where the vmm cannot reach it.
        let staged = dir.join(format!(".restore-{VM_DISK}"));
        if !image.rootfs.is_empty() {
            let kept = snapshot_disk(&dir, &name);
            if !kept.is_file() {
                return Err(Error::FailedPrecondition(format!(
                    "snapshot {} has no copy of the session's disk ({} is missing)",
                    snapshot.display(),
                    kept.display()
                )));
            }
            let owner = old.jail_uid.map(|u| (u, u));
            copy_disk(&kept, &staged, owner).await?;
        }

        self.transition(
            &sess,
            S::Restoring,
            "restore",
            &snapshot.display().to_string(),
        )?;
        let execution_id = uuid::Uuid::new_v4().to_string();
        {
            let mut i = sess.lock();
            // Let go of the old vmm first: its exit is not a crash.
            i.vmm = None;
            i.guest = None;
            i.row.execution_id = execution_id.clone();
            let last = old.sample_pid().and_then(read_sample);
            if let Some(m) = i.meter.as_mut() {
                if let Some(s) = last {
                    m.observe(s);
                }
                m.set_execution_id(&execution_id);
                m.new_process();
            }
        }
        old.kill();
        let _ = tokio::time::timeout(Duration::from_secs(10), old.wait()).await;
        let fail = |e: Error| {
            let _ = self.transition(&sess, S::Failed, reason::RESTORE_FAILED, &e.to_string());
            e
        };
        if !image.rootfs.is_empty() {
            // The old vmm is gone; a rename replaces whatever name is there.
            std::fs::rename(&staged, run_host.join(VM_DISK)).map_err(|e| {
                fail(Error::io(
                    format!("putting the snapshot's disk in {}", run_host.display()),
                    e,
                ))
            })?;
        }
        if self.cfg.vsock_device && image.guest_init {
            // The old vmm's socket: the new vmm binds its own at the same path.
            let _ = std::fs::remove_file(self.cfg.vsock_path(&run_host));
        }
        // The same uid as before: the run directory and its files are its.
        let (args, jail) = restore_launch(
            &self.cfg,
            &image,
            &dir,
            false,
            Source::Own(&name),
            old.jail_uid,
        );
        let vmm =
            Arc::new(supervisor::spawn(&self.vmm_path, &dir, &args, jail.as_ref()).map_err(fail)?);
        let recorded = {
            let mut i = sess.lock();
            i.vmm = Some(vmm.clone());
            i.row.vmm_pid = vmm.pid;
            i.row.vmm_start_ticks = vmm.start_ticks;
            self.store.put_session(&i.row)
        };
        self.watch_exit(sess.clone(), vmm.clone());
        let started = match recorded {
            Ok(()) => supervisor::wait_for_state(&vmm, "running", Duration::from_secs(60)).await,
            Err(e) => Err(e),
        };
        if let Err(e) = started {
            vmm.kill();
            return Err(fail(e));
        }
        self.transition(&sess, S::Ready, "restore", "")?;
        self.transition(&sess, S::Running, "restore", "")?;
        self.touch(&sess);
        if image.guest_init {
            if let Err(e) = self.guest_channel(&sess).await {
                tracing::warn!(session = %id, error = %e, "guest channel after the restore (retried on the next exec)");
            }
        }
        Ok(sess.row())
    }

    /// Stops a session with `why` and waits until it is STOPPED (or FAILED).
    pub async fn stop(&self, id: &str, why: &str) -> Result<SessionRow> {
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let state = sess.row().state;
        if is_terminal(state) {
            return Ok(sess.row());
        }
        // A stop for what the guest sent says what that was.
        let detail = sess
            .guest()
            .and_then(|g| g.violation())
            .filter(|v| v.reason == why)
            .map(|v| v.detail)
            .unwrap_or_default();
        // A channel lost to a host-agent restart is opened again, so the branch comes back.
        let conn = match self.guest_channel(&sess).await {
            Ok(c) => Some(c),
            Err(e) => {
                if sess.guest_init() {
                    tracing::warn!(session = %id, error = %e, "no guest channel to fetch the branch through");
                }
                None
            }
        };
        sess.lock().pending_stop = Some(why.to_string());
        self.transition(&sess, S::Stopping, why, &detail)?;
        if let Some(conn) = conn {
            match self.finish_guest(&sess, &conn).await {
                Ok((branch, head)) => {
                    let mut i = sess.lock();
                    i.row.branch = branch;
                    i.row.head_commit = head;
                    self.store.put_session(&i.row)?;
                }
                Err(e) => {
                    tracing::warn!(session = %id, error = %e, "fetching the session branch failed");
                    sess.lock().fetch_error = Some(e.to_string());
                }
            }
            sess.lock().guest = None;
        }
        let Some(vmm) = sess.vmm() else {
            self.transition(&sess, S::Stopped, why, "no vmm process")?;
            return Ok(sess.row());
        };
        if let Err(e) = vmm.control(json!({"op":"stop"})).await {
            tracing::warn!(session = %id, error = %e, "control stop failed; killing the vmm");
            vmm.kill();
        }
        if !sess.wait_until(is_terminal, Duration::from_secs(10)).await {
            tracing::warn!(session = %id, "vmm did not exit after stop; killing it");
            vmm.kill();
            if !sess.wait_until(is_terminal, Duration::from_secs(10)).await {
                return Err(Error::Timeout(format!(
                    "session {id}: vmm pid {} did not exit after SIGKILL",
                    vmm.pid
                )));
            }
        }
        Ok(sess.row())
    }

    /// Deletes a STOPPED/FAILED session's files and record.
    pub async fn delete(&self, id: &str) -> Result<()> {
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let row = sess.row();
        if !is_terminal(row.state) {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is {}; stop it before deleting it",
                state_name(row.state)
            )));
        }
        if !row.dir.is_empty() {
            let _ = std::fs::remove_dir_all(&row.dir);
        }
        self.store.delete_session(id)?;
        self.map().remove(id);
        Ok(())
    }

    /// Writes one usage record for every metered, unfinished session.
    pub fn sample_usage(&self) {
        let now = now_ms();
        for sess in self.all() {
            let mut i = sess.lock();
            let pid = i.vmm.as_ref().and_then(|v| v.sample_pid());
            let Some(m) = i.meter.as_mut() else { continue };
            if m.is_finished() {
                continue;
            }
            let row = m.record(now, pid.and_then(read_sample));
            if let Err(e) = self.store.insert_usage(&row) {
                tracing::error!(session = %sess.id, error = %e, "writing usage record");
            }
        }
    }

    /// Checks TTL, max lifetime and idle timeout; stops or pauses sessions.
    pub fn enforce_limits(self: &Arc<Self>) {
        let now = now_ms();
        for sess in self.all() {
            let action = {
                let mut i = sess.lock();
                let r = &i.row;
                let live = r.state == S::Running as i32 || r.state == S::Paused as i32;
                if !live || i.enforcing {
                    continue;
                }
                let ttl_due = r.ttl_s > 0 && now >= r.created_at + (r.ttl_s as i64) * 1000;
                let life = self.cfg.max_lifetime_seconds;
                let life_due = life > 0 && now >= r.created_at + (life as i64) * 1000;
                let idle_due = r.state == S::Running as i32
                    && r.idle_s > 0
                    && now >= r.last_activity + (r.idle_s as i64) * 1000;
                let violation = i.guest.as_ref().and_then(|g| g.violation());
                let action = if let Some(v) = &violation {
                    tracing::warn!(session = %sess.id, reason = v.reason, detail = %v.detail, "stopping the session for what its guest sent");
                    Some(v.reason)
                } else if ttl_due {
                    Some(reason::TTL_EXPIRED)
                } else if life_due {
                    Some(reason::MAX_LIFETIME)
                } else if idle_due {
                    Some(reason::IDLE)
                } else {
                    None
                };
                if action.is_some() {
                    i.enforcing = true;
                }
                action
            };
            let Some(why) = action else { continue };
            let mgr = self.clone();
            tokio::spawn(async move {
                let r = if why == reason::IDLE {
                    mgr.pause(&sess.id, why).await.map(|_| ())
                } else {
                    mgr.stop(&sess.id, why).await.map(|_| ())
                };
                if let Err(e) = r {
                    tracing::warn!(session = %sess.id, reason = why, error = %e, "limit action failed");
                }
                sess.lock().enforcing = false;
            });
        }
    }

    /// Loads sessions from the database and re-attaches to their vmm
    /// processes; sessions whose vmm is gone become FAILED (vmm_crash).
    pub async fn recover(self: &Arc<Self>) -> Result<()> {
        Pool::clean_leftovers(&self.pool_dir());
        let rows = self.store.sessions()?;
        // Every uid a session that is not over holds stays its own, before
        // anything (the warm pool included) is handed one.
        for row in rows.iter().filter(|r| !is_terminal(r.state)) {
            self.jail_uids.mark_used(row.jail_uid);
        }
        for row in rows {
            let image = match self.store.image(&row.image_id)? {
                Some(i) => i,
                None => ImageRow {
                    id: row.image_id.clone(),
                    ..Default::default()
                },
            };
            let state = row.state;
            let sess = self.insert_session(row.clone(), image.clone());
            if is_terminal(state) {
                continue;
            }
            if let Err(e) = self.recover_one(&sess, row, &image).await {
                tracing::error!(session = %sess.id, error = %e, "re-attaching session");
            }
        }
        // A create interrupted by a crash may have started a vmm it never recorded.
        let live: std::collections::HashSet<u32> = self
            .store
            .sessions()?
            .iter()
            .filter(|r| !is_terminal(r.state))
            .map(|r| r.vmm_pid)
            .collect();
        supervisor::kill_orphans(&self.cfg.state_dir.join("sessions"), &live);
        Ok(())
    }

    async fn recover_one(
        self: &Arc<Self>,
        sess: &Arc<Session>,
        row: SessionRow,
        image: &ImageRow,
    ) -> Result<()> {
        let sess = sess.clone();
        let state = row.state;
        if let Some(last) = self.store.last_usage(&row.id)? {
            if !last.is_final {
                sess.lock().meter = Some(Meter::resume_from(&last, image.mem_mib, billable(state)));
            }
        } else if row.ready_at > 0 {
            let mut m = Meter::start(&row.id, &row.execution_id, image.mem_mib, row.ready_at);
            m.set_billable(row.ready_at, billable(state));
            sess.lock().meter = Some(m);
        }
        let vmm = supervisor::attach(row.vmm_pid, row.vmm_start_ticks, &PathBuf::from(&row.dir));
        let Some(vmm) = vmm else {
            let detail = "vmm process gone while host-agent was not running";
            if state == S::Stopping as i32 {
                self.transition(&sess, S::Stopped, &row.reason, detail)?;
            } else {
                self.transition(&sess, S::Failed, reason::VMM_CRASH, detail)?;
            }
            return Ok(());
        };
        let vmm = Arc::new(vmm);
        sess.lock().vmm = Some(vmm.clone());
        self.watch_exit(sess.clone(), vmm.clone());
        let status = vmm.control(json!({"op":"status"})).await;
        let vm_state = status
            .as_ref()
            .ok()
            .and_then(|v| v.get("state").and_then(|s| s.as_str()).map(str::to_string));
        tracing::info!(session = %row.id, pid = vmm.pid, state = state_name(state), vm = ?vm_state, "re-attached");
        match (
            S::try_from(state).unwrap_or(S::Unspecified),
            vm_state.as_deref(),
        ) {
            (S::Running, Some("running")) if image.guest_init => {
                // The old channel died with the old process; take the guest's session back
                // now rather than on the first exec (a failure is retried then).
                let mgr = self.clone();
                let sess = sess.clone();
                tokio::spawn(async move {
                    if let Err(e) = mgr.guest_channel(&sess).await {
                        tracing::warn!(session = %sess.id, error = %e, "re-opening the guest channel after a restart");
                    }
                });
            }
            (S::Running, Some("running")) | (S::Paused, Some("paused")) => {}
            (S::Ready, Some("running")) => {
                self.transition(&sess, S::Running, "reconciled", "")?;
            }
            (S::Running | S::Ready, Some("paused")) => {
                self.transition(&sess, S::Paused, "reconciled", "vmm was paused")?;
            }
            (S::Paused, Some("running")) => {
                // The pause was not recorded as done; make it so.
                vmm.control(json!({"op":"pause"})).await?;
            }
            (S::Stopping, _) => {
                let why = row.reason.clone();
                sess.lock().pending_stop = Some(why);
                if vmm.control(json!({"op":"stop"})).await.is_err() {
                    vmm.kill();
                }
            }
            _ if vmm.exit_status().is_some() => {
                // It exited meanwhile; the exit watcher records it.
            }
            _ => {
                // PENDING/RESTORING (the Create call died with the old
                // process) or an unreachable vmm: fail the session.
                let detail = match &status {
                    Err(e) => format!("after restart: {e}"),
                    Ok(_) => "host-agent restarted during restore".to_string(),
                };
                vmm.kill();
                self.transition(&sess, S::Failed, reason::HOST_AGENT_RESTART, &detail)?;
            }
        }
        Ok(())
    }

    /// Stops every live session with reason `host_agent_shutdown`.
    pub async fn stop_all(&self) {
        for sess in self.all() {
            if !is_terminal(sess.row().state) {
                if let Err(e) = self.stop(&sess.id, reason::HOST_AGENT_SHUTDOWN).await {
                    tracing::warn!(session = %sess.id, error = %e, "stop on shutdown");
                }
            }
        }
    }
}

/// `requested`, checked to name a snapshot directory directly under `snaps`
/// (where SnapshotSession writes this session's snapshots). The check is on
/// the name: the directory may belong to a jailed vmm, so nothing in it is
/// followed here (the vmm validates the snapshot itself when it restores).
fn own_snapshot(snaps: &std::path::Path, requested: &str) -> Result<PathBuf> {
    let not_ours = || {
        Error::invalid(format!(
            "snapshot_dir {requested:?} is not a snapshot of this session (use a snapshot_dir that \
             SnapshotSession returned for it)"
        ))
    };
    let path = std::path::Path::new(requested);
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let valid_name = !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !valid_name || path.parent() != Some(snaps) {
        return Err(not_ours());
    }
    let manifest = std::fs::symlink_metadata(path.join("manifest")).map_err(|_| not_ours())?;
    if !manifest.is_file() {
        return Err(not_ours());
    }
    Ok(path.to_path_buf())
}

/// Where the copy of a session's disk taken with snapshot `name` is kept:
/// in the session's directory, out of reach of a jailed vmm.
fn snapshot_disk(dir: &std::path::Path, name: &str) -> PathBuf {
    dir.join("snapshot-disks").join(format!("{name}.ext4"))
}

/// This host's wall clock, Unix nanoseconds, for the guest to set its own.
fn unix_now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

/// Sends the file at `path` to the guest as RepoChunks, the last one marked.
async fn send_file_chunks(conn: &GuestConn, path: &std::path::Path) -> Result<()> {
    use tokio::io::AsyncReadExt;
    let mut file = tokio::fs::File::open(path)
        .await
        .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    let size = file
        .metadata()
        .await
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?
        .len();
    let mut left = size;
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        let want = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
        file.read_exact(&mut buf[..want])
            .await
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        left -= want as u64;
        conn.send(In::RepoChunk(RepoChunk {
            data: buf[..want].to_vec(),
            last: left == 0,
        }))
        .await?;
        if left == 0 {
            return Ok(());
        }
    }
}
