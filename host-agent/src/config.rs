//! Node configuration: built-in defaults, an optional JSON file, then flags.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::auth::Scope;
use crate::error::{Error, Result};

/// The guest's vsock context id. Every VM has its own host socket, so all
/// can use the same one; it is fixed because a restored VM keeps the CID of
/// its golden snapshot.
pub const GUEST_CID: u32 = 3;

/// The default image root, in the state directory.
pub const DEFAULT_IMAGE_ROOT: &str = "image-files";
/// The default repository root, in the state directory.
pub const DEFAULT_REPOSITORY_ROOT: &str = "repositories";

/// Mutual TLS material (PEM files).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// CA that signs client certificates (clients without one are refused).
    pub ca: PathBuf,
    /// This server's certificate chain.
    pub cert: PathBuf,
    /// This server's private key.
    pub key: PathBuf,
}

/// Sessions' vmm processes run through `vmm jail` (unless `no_jail`): own
/// mount, PID, IPC, UTS and network namespaces, the session's `jail/`
/// directory as root, a cgroup `agentvm/<vm>` with a memory limit, and a uid
/// and gid of their own from `uid_range` (uid = gid, one per VM).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct JailSettings {
    /// uids (and the same gids) handed to jailed VMs, one each, as
    /// `FIRST-LAST` (inclusive). Must not overlap real users or /etc/subuid.
    pub uid_range: UidRange,
    /// Memory limit of a VM's cgroup beyond the image's guest memory, MiB
    /// (0: no memory limit).
    pub memory_overhead_mib: u64,
}

impl Default for JailSettings {
    fn default() -> Self {
        JailSettings {
            uid_range: UidRange::DEFAULT,
            memory_overhead_mib: 256,
        }
    }
}

/// Sessions' networks: the node's pool of VM addresses and its egress policy.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct NetworkConfig {
    /// The blocks VMs' host-side addresses come from: one IPv4 block (a /30
    /// per VM) and, optionally, one IPv6 block (a /126 per VM); a string or
    /// a list of one or two.
    #[serde(deserialize_with = "one_or_more")]
    pub pool: Vec<String>,
    /// The node-wide allowlist: `CIDR`, `CIDR tcp|udp` or `CIDR tcp|udp PORT`.
    pub allow: Vec<String>,
    /// Private ranges an allowlist may name (otherwise always denied).
    pub private_allowed: Vec<String>,
    /// Turn on IPv4 forwarding and load the node's rules (masquerading the
    /// pool, no VM-to-VM traffic) at start; off where the operator manages
    /// the node's firewall.
    pub manage_node: bool,
    /// Prefix of the VMs' network namespaces; at start, namespaces under it
    /// that no live session owns are removed.
    pub netns_prefix: String,
    /// The namespace that stands for the node (tests); unset: host-agent's own.
    pub node_netns: Option<String>,
    /// The node address exposed guest ports listen on (ExposePort).
    pub expose_address: String,
    /// Resolvers the sessions' DNS resolvers ask (`ADDRESS` or
    /// `ADDRESS:PORT`); empty: the `nameserver`s of /etc/resolv.conf.
    pub dns_upstreams: Vec<String>,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        NetworkConfig {
            pool: vec!["10.200.0.0/16".into()],
            allow: vec![],
            private_allowed: vec![],
            manage_node: true,
            netns_prefix: crate::network::namespace::NETNS_PREFIX.into(),
            node_netns: None,
            expose_address: "127.0.0.1".into(),
            dns_upstreams: vec![],
        }
    }
}

impl NetworkConfig {
    /// The settings of [`crate::network::node::NodeNetwork::start`]; the
    /// pool must be one IPv4 block and at most one IPv6 block.
    pub fn node_settings(&self) -> crate::error::Result<crate::network::node::NodeSettings> {
        let (v6, v4): (Vec<&String>, Vec<&String>) =
            self.pool.iter().partition(|p| p.contains(':'));
        let [pool] = v4.as_slice() else {
            return Err(crate::error::Error::invalid(format!(
                "network.pool {:?} must hold exactly one IPv4 block",
                self.pool
            )));
        };
        if v6.len() > 1 {
            return Err(crate::error::Error::invalid(format!(
                "network.pool {:?} may hold at most one IPv6 block",
                self.pool
            )));
        }
        Ok(crate::network::node::NodeSettings {
            pool: pool.to_string(),
            pool6: v6.first().map(|p| p.to_string()),
            allow: self.allow.clone(),
            private_allowed: self.private_allowed.clone(),
            node_netns: self.node_netns.clone(),
            manage_node: self.manage_node,
            netns_prefix: self.netns_prefix.clone(),
            expose_address: self.expose_address.clone(),
            dns_upstreams: self.dns_upstreams.clone(),
        })
    }
}

/// A string, or a list of strings.
fn one_or_more<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMore {
        One(String),
        More(Vec<String>),
    }
    Ok(match OneOrMore::deserialize(d)? {
        OneOrMore::One(s) => vec![s],
        OneOrMore::More(v) => v,
    })
}

/// An inclusive range of uids, written `FIRST-LAST`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    /// First uid (at least 1).
    pub first: u32,
    /// Last uid (at least `first`).
    pub last: u32,
}

impl UidRange {
    /// The default range: 65536 ids far above regular users (1000+), systemd's
    /// dynamic users (61184-65519), the /etc/subuid blocks useradd hands out
    /// (100000 up, 65536 each) and systemd-nspawn's container ids (up to
    /// 1879048191).
    pub const DEFAULT: UidRange = UidRange {
        first: 2_000_000_000,
        last: 2_000_065_535,
    };

    /// How many ids the range holds.
    pub fn len(&self) -> u64 {
        u64::from(self.last) - u64::from(self.first) + 1
    }

    /// Always false: a range holds at least one id.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether `uid` lies in the range.
    pub fn contains(&self, uid: u32) -> bool {
        (self.first..=self.last).contains(&uid)
    }
}

impl std::str::FromStr for UidRange {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || {
            format!(
                "invalid uid range {s:?}: expected FIRST-LAST, e.g. {}-{}, with 0 < FIRST <= LAST < 4294967295",
                UidRange::DEFAULT.first,
                UidRange::DEFAULT.last
            )
        };
        let (a, b) = s.trim().split_once('-').ok_or_else(bad)?;
        let first: u32 = a.trim().parse().map_err(|_| bad())?;
        let last: u32 = b.trim().parse().map_err(|_| bad())?;
        // u32::MAX is (uid_t)-1, "no change" to setresuid.
        if first == 0 || first > last || last == u32::MAX {
            return Err(bad());
        }
        Ok(UidRange { first, last })
    }
}

impl std::fmt::Display for UidRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

impl<'de> Deserialize<'de> for UidRange {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Bounds on the files vmm processes write in the state directory.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LogLimits {
    /// Largest serial console log and vmm log of a VM, bytes: past it the
    /// file is rotated (one previous file kept as `NAME.1`).
    pub max_file_bytes: u64,
}

impl Default for LogLimits {
    fn default() -> Self {
        LogLimits {
            max_file_bytes: 16 << 20,
        }
    }
}

/// Where the idle auto-pause puts a session (`idle_pause`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IdlePause {
    /// The vmm is paused and keeps its memory.
    #[default]
    Memory,
    /// The session is paused to disk.
    Disk,
}

/// Everything `host-agent serve` needs. Every field has a default, so an
/// empty directory is enough to start.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// gRPC listen address. A non-loopback address requires `tls`.
    pub listen: SocketAddr,
    /// Serve on this Unix socket instead of `listen` (created with mode
    /// 0600; access is by file permissions).
    pub listen_unix: Option<PathBuf>,
    /// Mutual TLS: with it, every client must present a certificate signed
    /// by `tls.ca`.
    pub tls: Option<TlsConfig>,
    /// Prometheus metrics listen address; `None` disables the endpoint.
    pub metrics_listen: Option<SocketAddr>,
    /// Webhook listener for triggers (`POST /triggers/<id>`, plain HTTP;
    /// each request is authenticated by its HMAC signature); `None`: no
    /// webhooks.
    pub webhook_listen: Option<SocketAddr>,
    /// How long a schedule run refused for capacity is retried (with
    /// backoff) from its fire, seconds; then it is recorded failed.
    pub schedule_retry_window_seconds: u64,
    /// Database, images, sessions and snapshots live here.
    pub state_dir: PathBuf,
    /// The vmm binary; `None` looks next to this executable, then in PATH.
    pub vmm: Option<PathBuf>,
    /// Most live (not STOPPED/FAILED) sessions on this node.
    pub max_sessions: u32,
    /// Memory that live sessions may have committed, as a multiple of the
    /// node's memory (0.1..=100; 1 by default: no overcommit). A session
    /// commits its `mem_mib`; guests restored from snapshots fault their
    /// memory in lazily, so a ratio above 1 bets that they do not all use
    /// all of it.
    pub memory_overcommit_ratio: f64,
    /// Default session TTL in seconds (0 = none).
    pub default_ttl_seconds: u64,
    /// Default idle timeout in seconds before auto-pause (0 = none).
    pub default_idle_timeout_seconds: u64,
    /// Where the idle auto-pause puts a session: `memory` (the default: its
    /// vmm stays, paused) or `disk` (PauseSession persist: a diff snapshot,
    /// the vmm stopped, its memory freed).
    pub idle_pause: IdlePause,
    /// Bytes of snapshot layers sessions may keep on this node (persisted
    /// pauses, fork points, SnapshotSession snapshots), MiB; 0 = no quota.
    /// A pause to disk is refused once they take this much.
    pub snapshot_quota_mib: u64,
    /// Hard cap on a session's lifetime in seconds (0 = none).
    pub max_lifetime_seconds: u64,
    /// Warm VMs kept restored and paused per image with a golden snapshot.
    pub warm_pool_size: u32,
    /// Usage sampling period in milliseconds (1000 in production).
    pub usage_interval_ms: u64,
    /// How often limits (TTL, idle, lifetime) are checked, in milliseconds.
    pub limits_interval_ms: u64,
    /// Stop every session with reason `host_agent_shutdown` on SIGTERM/SIGINT
    /// (default: leave them running, to be re-attached on restart).
    pub stop_sessions_on_shutdown: bool,
    /// Log as JSON lines.
    pub log_json: bool,
    /// Host side of a VM's vsock (a Unix socket, Firecracker's CONNECT
    /// convention); `{dir}` is replaced by the VM's directory.
    pub guest_vsock_uds: String,
    /// The vsock port guest-init listens on.
    pub guest_port: u32,
    /// Give guest-init VMs a virtio-vsock device (guest CID
    /// [`GUEST_CID`]) whose host socket is `guest_vsock_uds`. Off only where
    /// something else serves that socket (the tests' stand-in for a guest).
    pub vsock_device: bool,
    /// Run sessions' (and warm VMs') vmm processes unjailed: for development
    /// only. By default they are jailed, which needs root; host-agent refuses
    /// to start without root unless this is set. Golden snapshot builds always
    /// run unjailed: they boot the operator's own image once.
    pub no_jail: bool,
    /// How jailed vmm processes are confined.
    pub jail: JailSettings,
    /// Sessions' networks (`None`, the default: VMs get no network device).
    /// With it, golden snapshots are built with a virtio-net device and
    /// every session of such an image gets a network namespace of its own
    /// with host-side egress rules (see the README).
    pub network: Option<NetworkConfig>,
    /// Size bounds of VMs' serial and vmm logs.
    pub logs: LogLimits,
    /// How long READY may take for guest-init images (seconds).
    pub guest_ready_timeout_seconds: u64,
    /// How long a guest-init command waiting for an approval (an `ask`)
    /// waits for Answer before it counts as rejected, seconds (1..=86400).
    pub ask_timeout_seconds: u64,
    /// Directories that RegisterImage's kernel_path, rootfs_path and
    /// initrd_path must lie in (after resolving links). `None`:
    /// `<state_dir>/image-files` only; `[]`: none.
    pub allowed_image_roots: Option<Vec<PathBuf>>,
    /// Directories that CreateSession's repository_path must lie in (after
    /// resolving links). `None`: `<state_dir>/repositories` only; `[]`: none.
    pub allowed_repository_roots: Option<Vec<PathBuf>>,
    /// The clients file: bearer-token and certificate clients with their
    /// scopes (see `auth::clients`). `None`: no token or certificate client.
    pub clients_file: Option<PathBuf>,
    /// The scope of a caller without credentials on the Unix socket or from
    /// a loopback address without TLS. `None` (the default): such calls are
    /// refused with UNAUTHENTICATED.
    pub unauthenticated_local: Option<Scope>,
    /// Most bytes of audit JSON stored per session; the guest event that
    /// would pass it stops the session (reason `audit_limit`).
    pub max_audit_bytes_per_session: u64,
    /// Largest session branch bundle taken from a guest at Stop (bytes);
    /// a larger one is not fetched.
    pub max_branch_bundle_bytes: u64,
    /// The node's secrets: one file per secret, named after it
    /// (systemd-credentials style), which CreateSession's `secret_refs`
    /// name; read at each create. `None`: `secret_refs` are refused.
    pub secrets_dir: Option<PathBuf>,
    /// This node in a fleet: NATS JetStream export, registry, image store
    /// (see [`crate::fleet::FleetConfig`]; without `fleet.nats`, none).
    pub fleet: crate::fleet::FleetConfig,
    /// Directories that shares' host paths (RegisterImage and CreateSession
    /// `shares`) must lie in, after resolving links. Empty (the default):
    /// shares are refused with FAILED_PRECONDITION.
    pub allowed_share_roots: Vec<PathBuf>,
    /// The virtiofsd binary that serves shares; `None`: `virtiofsd` from
    /// PATH. `$AGENTVM_VIRTIOFSD` wins over both.
    pub virtiofsd_path: Option<PathBuf>,
    /// virtiofsd's `--cache` for every share (see
    /// [`crate::shares::VirtiofsCache`]; `auto` by default).
    pub virtiofs_cache: crate::shares::VirtiofsCache,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            tls: None,
            listen_unix: None,
            metrics_listen: None,
            webhook_listen: None,
            schedule_retry_window_seconds: 600,
            state_dir: PathBuf::from("host-agent-state"),
            vmm: None,
            max_sessions: 256,
            memory_overcommit_ratio: 1.0,
            idle_pause: IdlePause::Memory,
            snapshot_quota_mib: 0,
            default_ttl_seconds: 0,
            default_idle_timeout_seconds: 0,
            max_lifetime_seconds: 0,
            warm_pool_size: 0,
            usage_interval_ms: 1000,
            limits_interval_ms: 1000,
            stop_sessions_on_shutdown: false,
            log_json: false,
            guest_vsock_uds: "{dir}/vsock.sock".to_string(),
            guest_port: proto::guest::DEFAULT_VSOCK_PORT,
            vsock_device: true,
            no_jail: false,
            jail: JailSettings::default(),
            network: None,
            logs: LogLimits::default(),
            guest_ready_timeout_seconds: 120,
            ask_timeout_seconds: 300,
            allowed_image_roots: None,
            allowed_repository_roots: None,
            clients_file: None,
            unauthenticated_local: None,
            max_audit_bytes_per_session: 64 << 20,
            max_branch_bundle_bytes: 1 << 30,
            secrets_dir: None,
            fleet: crate::fleet::FleetConfig::default(),
            allowed_share_roots: vec![],
            virtiofsd_path: None,
            virtiofs_cache: crate::shares::VirtiofsCache::Auto,
        }
    }
}

impl Config {
    /// Reads a JSON config file (fields as in [`Config`]).
    pub fn from_file(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading config {}", path.display()), e))?;
        serde_json::from_str(&text)
            .map_err(|e| Error::invalid(format!("config {}: {e}", path.display())))
    }

    /// Checks the values; call after flags are applied.
    pub fn validate(&self) -> Result<()> {
        self.fleet.validate()?;
        if !self.listen.ip().is_loopback() && self.tls.is_none() {
            return Err(Error::invalid(format!(
                "listen address {} is not loopback; listening on other addresses requires \
                 mutual TLS: give tls.ca, tls.cert and tls.key (--tls-ca, --tls-cert, --tls-key)",
                self.listen
            )));
        }
        if let Some(t) = &self.tls {
            for (name, p) in [
                ("tls.ca", &t.ca),
                ("tls.cert", &t.cert),
                ("tls.key", &t.key),
            ] {
                if !p.is_file() {
                    return Err(Error::invalid(format!(
                        "{name} {} is not a readable file",
                        p.display()
                    )));
                }
            }
        }
        if let Some(m) = self.metrics_listen {
            if !m.ip().is_loopback() {
                return Err(Error::invalid(format!(
                    "metrics address {m} is not loopback"
                )));
            }
        }
        if self.usage_interval_ms == 0 || self.limits_interval_ms == 0 {
            return Err(Error::invalid(
                "usage_interval_ms and limits_interval_ms must be at least 1",
            ));
        }
        // Only the vmm's own vsock device needs the socket inside its jail
        // (without one, something else serves it, as in the tests).
        if self.jailed() && self.vsock_device && !self.guest_vsock_uds.starts_with("{dir}/") {
            return Err(Error::invalid(format!(
                "guest_vsock_uds {:?} must lie in the VM's directory (\"{{dir}}/...\") when \
                 vmm processes are jailed: a jailed vmm sees only its own directory \
                 (or pass --no-jail for development)",
                self.guest_vsock_uds
            )));
        }
        if self.unauthenticated_local.is_some() && self.tls.is_some() {
            return Err(Error::invalid(
                "unauthenticated_local has no effect with mutual TLS (every client presents a \
                 certificate): list the certificates' CNs with `mtls` in clients_file instead",
            ));
        }
        if self.max_audit_bytes_per_session == 0 || self.max_branch_bundle_bytes == 0 {
            return Err(Error::invalid(
                "max_audit_bytes_per_session and max_branch_bundle_bytes must be at least 1 \
                 (they bound what one guest can make host-agent store)",
            ));
        }
        if self.max_sessions == 0 {
            return Err(Error::invalid("max_sessions must be at least 1"));
        }
        if !(1..=86_400).contains(&self.ask_timeout_seconds) {
            return Err(Error::invalid(format!(
                "ask_timeout_seconds {} is out of range 1..=86400",
                self.ask_timeout_seconds
            )));
        }
        if !(0.1..=100.0).contains(&self.memory_overcommit_ratio) {
            return Err(Error::invalid(format!(
                "memory_overcommit_ratio {} is out of range 0.1..=100",
                self.memory_overcommit_ratio
            )));
        }
        if let Some(d) = &self.secrets_dir {
            if !d.is_dir() {
                return Err(Error::invalid(format!(
                    "secrets_dir {} is not a directory (--secrets-dir)",
                    d.display()
                )));
            }
        }
        if self.jailed() && self.jail.uid_range.len() < u64::from(self.max_sessions) {
            tracing::warn!(
                range = %self.jail.uid_range,
                max_sessions = self.max_sessions,
                "jail.uid_range holds fewer uids than max_sessions: creates fail once it is used up"
            );
        }
        for r in &self.allowed_share_roots {
            if !r.is_absolute() {
                return Err(Error::invalid(format!(
                    "allowed_share_roots: {} is not an absolute path (--allowed-share-root)",
                    r.display()
                )));
            }
        }
        if self.logs.max_file_bytes < 4096 {
            return Err(Error::invalid(
                "logs.max_file_bytes must be at least 4096 (--max-log-bytes)",
            ));
        }
        Ok(())
    }

    /// Whether vmm processes of sessions and warm VMs run jailed.
    pub fn jailed(&self) -> bool {
        !self.no_jail
    }

    /// Refuses a jailed configuration where host-agent cannot jail (not
    /// root): the operator must either run as root or say `--no-jail`.
    pub fn check_privileges(&self, euid: u32) -> Result<()> {
        if self.jailed() && euid != 0 {
            return Err(Error::invalid(format!(
                "host-agent jails every vmm by default (own namespaces, cgroup and uid from \
                 {}), which needs root, but it runs as uid {euid}: run it as root, or pass \
                 --no-jail (config: \"no_jail\": true) to run vmm processes unjailed, for \
                 development only",
                self.jail.uid_range
            )));
        }
        Ok(())
    }

    /// The image roots in effect (the default when none are configured).
    pub fn image_roots(&self) -> Vec<PathBuf> {
        self.allowed_image_roots
            .clone()
            .unwrap_or_else(|| vec![self.state_dir.join(DEFAULT_IMAGE_ROOT)])
    }

    /// The repository roots in effect (the default when none are configured).
    pub fn repository_roots(&self) -> Vec<PathBuf> {
        self.allowed_repository_roots
            .clone()
            .unwrap_or_else(|| vec![self.state_dir.join(DEFAULT_REPOSITORY_ROOT)])
    }

    /// The virtiofsd binary to run (see [`crate::shares::virtiofsd::binary`]).
    pub fn virtiofsd(&self) -> PathBuf {
        crate::shares::virtiofsd::binary(self.virtiofsd_path.as_deref())
    }

    /// The vsock Unix socket of the VM whose directory is `dir`.
    pub fn vsock_path(&self, dir: &Path) -> PathBuf {
        PathBuf::from(
            self.guest_vsock_uds
                .replace("{dir}", &dir.display().to_string()),
        )
    }

    /// The vmm's vsock device for a VM in `dir`, for images that run
    /// guest-init (None: no vsock device).
    pub fn vsock_device(&self, guest_init: bool, dir: &Path) -> Option<vmm_api::VsockSpec> {
        (guest_init && self.vsock_device).then(|| vmm_api::VsockSpec {
            cid: GUEST_CID,
            uds: self.vsock_path(dir),
        })
    }

    /// The vmm binary to run: the configured one, else `vmm` next to the
    /// current executable (or one level up, for `target/<profile>/deps`),
    /// else `vmm` from PATH.
    pub fn vmm_path(&self) -> PathBuf {
        if let Some(p) = &self.vmm {
            return p.clone();
        }
        if let Ok(exe) = std::env::current_exe() {
            for dir in exe.ancestors().skip(1).take(2) {
                let candidate = dir.join("vmm");
                if candidate.is_file() {
                    return candidate;
                }
            }
        }
        PathBuf::from("vmm")
    }
}

#[cfg(test)]
mod tests;
