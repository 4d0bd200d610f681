//! Sessions: the `Manager` that holds every session of the node, each with
//! its row, its supervised vmm and its guest channel.
//!
//! `PENDING → RESTORING → READY → RUNNING ⇄ PAUSED → STOPPING → STOPPED`,
//! and `FAILED` from any live state. Every transition is written with its
//! event in one SQLite transaction, then signalled to watchers.
//!
//! By responsibility: `lifecycle` (states, transitions, reasons), `create`
//! (CreateSession and getting a VM), `channel` (the guest channel),
//! `exits` (a vmm ending), `ops` (pause, resume, snapshot, rollback, stop,
//! delete), `limits` (usage samples and the time limits), `recover`
//! (re-attach after a restart), `moves` (a session paused to disk moving
//! to another node, and taken in there). This file keeps the types and the
//! lookups.

mod asks;
mod boot;
mod channel;
mod commands;
mod create;
mod exits;
mod fork;
mod golden;
mod lifecycle;
mod limits;
mod moves;
mod net_usage;
mod network;
mod ops;
mod persist;
mod ports;
mod recover;
mod resolver;
pub mod resources;
mod shares;
mod template;
mod turns;
mod warm;

pub use commands::CommandSpec;
use lifecycle::billable;
pub use lifecycle::{is_terminal, now_ms, reason, state_name};
pub use network::NetworkState;
pub use ports::{Exposed, MAX_EXPOSED_PORTS};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
pub use template::FromSession;
pub use turns::{check_turn_id, Killed, MAX_TURN_ID_BYTES};

use proto::guest::{
    guest_message::Kind as Out, host_message::Kind as In, RepoChunk, ResumeSession, Shutdown,
    StartSession,
};
use proto::hostagent::SessionState as S;
use tokio::sync::watch;

use crate::accounting::{read_sample, Meter};
use crate::config::{Config, DEFAULT_IMAGE_ROOT, DEFAULT_REPOSITORY_ROOT};
use crate::error::{Error, Result};
use crate::events::EventBus;
use crate::guest::{self, GuestConn};
use crate::jail_uids::JailUids;
use crate::launch::{copy_disk, has_network, prepare_disk, restore_launch, Source, VM_DISK};
use crate::metrics;
use crate::network::namespace::VmNetwork;
use crate::network::node::NodeNetwork;
use crate::path_roots::PathRoots;
use crate::pool::Pool;
use crate::repo::Repo;
use crate::session_env::SessionEnv;
use crate::store::{EventRow, ImageRow, SessionRow, Store};
use crate::supervisor::{self, ExitStatus, VmmProcess};
use vmm_api::{SnapshotKind, VmState};

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
    /// Overrides of the image's device rate limits.
    pub io_limits: crate::io_limits::IoLimits,
    /// Whether the client may loosen the image's limits (the admin scope).
    pub may_loosen_limits: bool,
    /// The session's environment and secrets, for its StartSession only.
    pub session_env: Arc<SessionEnv>,
    /// Their keyed digest for the idempotency fingerprint (empty: none).
    pub session_env_digest: String,
    /// The session's size as asked (checked against the image at create).
    pub resources: Option<proto::hostagent::SessionResources>,
    /// The session's own shares (checked, host paths resolved), merged
    /// with the image's at create.
    pub shares: Vec<crate::shares::Share>,
    /// Exec and Files calls resume it when it is paused to disk.
    pub auto_resume: bool,
}

impl CreateParams {
    fn fingerprint(&self) -> String {
        let mut f = format!(
            "{:?}",
            (
                &self.image_id,
                self.ttl_s,
                self.idle_s,
                &self.labels,
                &self.repository,
                &self.agent,
                &self.base_ref,
                self.io_limits.encode()
            )
        );
        // Only when asked for, so keys stored before sizes still match.
        if let Some(r) = &self.resources {
            f.push_str(&format!(
                " size:{}/{}/{}/{}",
                r.vcpus, r.mem_mib, r.cpu_millis, r.disk_mib
            ));
        }
        if self.auto_resume {
            f.push_str(" auto_resume");
        }
        // Only when given, so keys stored before shares still match.
        if !self.shares.is_empty() {
            f.push_str(" shares:");
            f.push_str(&crate::shares::encode(&self.shares));
        }
        // Only a keyed digest of the environment and secrets, and only when
        // there are some (so keys stored before them still match).
        if !self.session_env_digest.is_empty() {
            f.push_str(" env:");
            f.push_str(&self.session_env_digest);
        }
        f
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
    /// The VM's network, for images whose golden snapshot has one.
    network: Option<VmNetwork>,
    /// The session's allowlist in force (with a network).
    net_allow: Vec<crate::network::rules::Allow>,
    /// Blocks denied to the session on top of the node's.
    net_deny: Vec<crate::network::addressing::Cidr>,
    /// Host names its manifest grants (answered by its DNS resolver).
    net_hosts: Vec<crate::network::grants::HostGrant>,
    /// Its exposed guest ports, by guest port.
    exposed: BTreeMap<u16, crate::network::expose::ExposedPort>,
    /// Its network's DNS resolver.
    dns: Option<Arc<crate::network::dns::DnsHandle>>,
    /// The latest raw network counters, not yet in a usage record.
    net_reading: Option<crate::accounting::NetIo>,
    /// The environment and secrets its StartSession carries: held from
    /// CreateSession until the session is started (or failed), then
    /// dropped, since guest-init keeps them from there.
    session_env: Option<Arc<SessionEnv>>,
    /// Where its VM is restored from when not from the image's golden
    /// snapshot: a chain of layers (a fork, an image made from a session),
    /// its base first; the top layer holds the disk that goes with it.
    restore_from: Option<Vec<crate::layers::LayerRow>>,
    /// The session its guest becomes this one from (ForkSession instead of
    /// StartSession on the guest channel).
    fork_of: Option<fork::ForkOrigin>,
    /// The next snapshot layer its vmm writes must be full: a write that
    /// failed once it was asked for may have moved the vmm's own dirty
    /// tracking on, so a diff over the session's base would miss pages.
    full_layer_next: bool,
    /// Its VM boots the image's kernel rather than restoring the golden
    /// snapshot: its shares' tags are not the snapshot's (CreateSession
    /// only; its later VMs restore its own layers).
    boot: bool,
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
    /// Its commands (Exec), running and ended.
    pub execs: Arc<crate::execs::ExecTable>,
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

    /// Holds the environment and secrets for the session's StartSession.
    fn hold_session_env(&self, env: Arc<SessionEnv>) {
        self.lock().session_env = Some(env);
    }

    /// Drops them: the session is started (guest-init has them) or failed.
    fn forget_session_env(&self) {
        self.lock().session_env = None;
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
    /// This manager, for the tasks it starts from `&self` methods.
    me: std::sync::Weak<Manager>,
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
    /// Where shares' host directories may lie (`None`: no shares; see
    /// [`crate::shares`]).
    pub share_roots: Option<PathRoots>,
    /// The virtiofsd binary serving shares.
    pub virtiofsd_path: PathBuf,
    /// uids of jailed VMs.
    pub jail_uids: Arc<JailUids>,
    /// The node's network for sessions (`network` in the configuration).
    pub network: Option<Arc<NodeNetwork>>,
    /// Keys the digest of CreateSession's env and secrets in idempotency
    /// fingerprints.
    pub fingerprint_key: crate::session_env::fingerprint::Key,
    /// The node's snapshot layers.
    pub layers: Arc<crate::layers::Layers>,
    /// This node in its fleet (set once at start by `serve`).
    pub fleet: std::sync::OnceLock<Arc<crate::fleet::Fleet>>,
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
        let share_roots = match cfg.allowed_share_roots.as_slice() {
            [] => None,
            roots => Some(PathRoots::new(
                crate::shares::ROOTS_SETTING,
                crate::shares::ROOTS_FLAG,
                roots,
            )?),
        };
        let virtiofsd_path = cfg.virtiofsd();
        let store = Arc::new(Store::open(&cfg.state_dir.join("host-agent.db"))?);
        let fingerprint_key = crate::session_env::fingerprint::Key::load_or_create(&cfg.state_dir)?;
        let layers = Arc::new(crate::layers::Layers::open(&cfg.state_dir, store.clone())?);
        let events = EventBus::new(&store)?;
        let vmm_path = cfg.vmm_path();
        let jail_uids = Arc::new(JailUids::new(cfg.jail.uid_range));
        let network = cfg
            .network
            .as_ref()
            .map(|n| NodeNetwork::start(&n.node_settings()?).map(Arc::new))
            .transpose()?;
        Ok(Arc::new_cyclic(|me| Manager {
            me: me.clone(),
            cfg,
            store,
            events,
            vmm_path,
            pool: Pool::new(jail_uids.clone()),
            jail_uids,
            network,
            sessions: Mutex::new(HashMap::new()),
            create_lock: tokio::sync::Mutex::new(()),
            golden_lock: tokio::sync::Mutex::new(()),
            image_roots,
            repository_roots,
            share_roots,
            virtiofsd_path,
            fingerprint_key,
            layers,
            fleet: std::sync::OnceLock::new(),
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

    /// Where session `id`'s files live.
    fn session_dir(&self, id: &str) -> String {
        self.cfg
            .state_dir
            .join("sessions")
            .join(id)
            .display()
            .to_string()
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

    /// Live sessions' (vCPUs, memory MiB) as committed: each session's
    /// size (its image's, for a row from before sizes were recorded).
    pub fn used_resources(&self) -> (u32, u64) {
        self.all()
            .iter()
            .map(|s| s.lock())
            // A session paused to disk has no VM.
            .filter(|i| !is_terminal(i.row.state) && !i.row.persisted)
            .fold((0, 0), |(c, m), i| {
                let (vcpus, mem) = match resources::Resources::decode(&i.row.resources) {
                    Some(r) => (r.vcpus, r.mem_mib),
                    None => (i.image.vcpus, i.image.mem_mib),
                };
                (c + vcpus, m + u64::from(mem))
            })
    }

    /// Memory live sessions may commit on this node, MiB (0: the node's
    /// memory is unknown, and nothing is refused for it).
    pub fn memory_limit_mib(&self) -> u64 {
        let total = crate::accounting::host_memory_mib();
        (total as f64 * self.cfg.memory_overcommit_ratio) as u64
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

    /// Whether a live session uses `image`.
    pub fn image_in_use(&self, image: &str) -> bool {
        self.all().iter().any(|s| {
            let i = s.lock();
            i.row.image_id == image && !is_terminal(i.row.state)
        })
    }

    /// Session `row` as the API reports it, with what the layer records
    /// say of it (its snapshot storage).
    pub fn session_out(&self, row: &SessionRow) -> proto::hostagent::Session {
        let mut out = crate::api::session_pb(row);
        out.snapshot_bytes = self.layers.bytes_of_session(&row.id).unwrap_or_else(|e| {
            tracing::warn!(session = %row.id, error = %e, "reading its snapshot storage");
            0
        });
        out
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

    fn insert_session(&self, row: SessionRow, image: ImageRow) -> Arc<Session> {
        let (state, _) = watch::channel(row.state);
        let sess = Arc::new(Session {
            id: row.id.clone(),
            op: tokio::sync::Mutex::new(()),
            guest_open: tokio::sync::Mutex::new(()),
            execs: Arc::default(),
            inner: Mutex::new(Inner {
                row,
                image,
                vmm: None,
                meter: None,
                pending_stop: None,
                enforcing: false,
                guest: None,
                fetch_error: None,
                network: None,
                net_allow: vec![],
                net_hosts: vec![],
                exposed: BTreeMap::new(),
                dns: None,
                net_reading: None,
                net_deny: vec![],
                session_env: None,
                restore_from: None,
                fork_of: None,
                full_layer_next: false,
                boot: false,
            }),
            state,
        });
        self.map().insert(sess.id.clone(), sess.clone());
        sess
    }
}

impl metrics::GaugeSource for Manager {
    fn gauges(&self) -> metrics::Gauges {
        metrics::Gauges {
            sessions_by_state: self.count_by_state(),
            usage_totals: self.usage_totals(),
            guest_backpressured: self.guest_backpressured(),
            denied_totals: self.denied_totals(),
            fleet: self.fleet_gauges(),
        }
    }
}

impl Manager {
    /// The fleet export's outbox and counters, in a fleet.
    fn fleet_gauges(&self) -> Option<metrics::FleetGauges> {
        let fleet = self.fleet.get().filter(|f| f.js.is_some())?;
        let (outbox_rows, oldest) = self.store.outbox_backlog().unwrap_or_default();
        let s = &fleet.export_stats;
        use std::sync::atomic::Ordering::Relaxed;
        Some(metrics::FleetGauges {
            outbox_rows,
            outbox_oldest_seconds: match oldest {
                0 => 0.0,
                at => ((now_ms() - at).max(0) as f64) / 1000.0,
            },
            published: s.published.load(Relaxed),
            duplicates: s.duplicates.load(Relaxed),
            failures: s.failures.load(Relaxed),
        })
    }
}
