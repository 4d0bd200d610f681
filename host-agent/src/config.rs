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

/// Sessions' vmm processes run through `vmm jail`: own mount, PID, IPC and
/// UTS namespaces, the session's `jail/` directory as root, a cgroup
/// `agentvm/<vm>` with a memory limit, and this unprivileged uid/gid.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JailSettings {
    /// uid the vmm runs as (not 0).
    pub uid: u32,
    /// gid the vmm runs as (not 0).
    pub gid: u32,
    /// Memory limit of a VM's cgroup beyond the image's guest memory, MiB
    /// (0: no memory limit).
    #[serde(default = "default_jail_overhead_mib")]
    pub memory_overhead_mib: u64,
}

fn default_jail_overhead_mib() -> u64 {
    256
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
    /// Database, images, sessions and snapshots live here.
    pub state_dir: PathBuf,
    /// The vmm binary; `None` looks next to this executable, then in PATH.
    pub vmm: Option<PathBuf>,
    /// Most live (not STOPPED/FAILED) sessions on this node.
    pub max_sessions: u32,
    /// Default session TTL in seconds (0 = none).
    pub default_ttl_seconds: u64,
    /// Default idle timeout in seconds before auto-pause (0 = none).
    pub default_idle_timeout_seconds: u64,
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
    /// Run sessions' (and warm VMs') vmm processes jailed. Golden snapshot
    /// builds run unjailed: they boot the operator's own image once.
    pub jail: Option<JailSettings>,
    /// How long READY may take for guest-init images (seconds).
    pub guest_ready_timeout_seconds: u64,
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
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            tls: None,
            listen_unix: None,
            metrics_listen: None,
            state_dir: PathBuf::from("host-agent-state"),
            vmm: None,
            max_sessions: 256,
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
            jail: None,
            guest_ready_timeout_seconds: 120,
            allowed_image_roots: None,
            allowed_repository_roots: None,
            clients_file: None,
            unauthenticated_local: None,
            max_audit_bytes_per_session: 64 << 20,
            max_branch_bundle_bytes: 1 << 30,
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
        if let Some(j) = &self.jail {
            if j.uid == 0 || j.gid == 0 {
                return Err(Error::invalid(
                    "jail.uid and jail.gid must not be 0: jailed vmm processes run unprivileged",
                ));
            }
            if !self.guest_vsock_uds.starts_with("{dir}/") {
                return Err(Error::invalid(format!(
                    "guest_vsock_uds {:?} must lie in the VM's directory (\"{{dir}}/...\") when \
                     vmm processes are jailed: a jailed vmm sees only its own directory",
                    self.guest_vsock_uds
                )));
            }
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

    /// The vsock Unix socket of the VM whose directory is `dir`.
    pub fn vsock_path(&self, dir: &Path) -> PathBuf {
        PathBuf::from(
            self.guest_vsock_uds
                .replace("{dir}", &dir.display().to_string()),
        )
    }

    /// The vmm's `--vsock CID:UDS` value for a VM in `dir`, for images that
    /// run guest-init (None: no vsock device).
    pub fn vsock_device_arg(&self, guest_init: bool, dir: &Path) -> Option<String> {
        (guest_init && self.vsock_device)
            .then(|| format!("{GUEST_CID}:{}", self.vsock_path(dir).display()))
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
