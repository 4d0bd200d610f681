//! `host-agent serve`: its options and the daemon's start.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;
use host_agent::config::Config;

/// Options of `serve` (flags win over the config file).
#[derive(Args)]
pub struct ServeArgs {
    /// JSON config file (fields of the Config struct; flags win).
    #[arg(long)]
    config: Option<PathBuf>,
    /// gRPC listen address (loopback).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Serve on this Unix socket instead of TCP.
    #[arg(long)]
    listen_unix: Option<PathBuf>,
    /// State directory (database, images, sessions).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// vmm binary.
    #[arg(long)]
    vmm: Option<PathBuf>,
    /// Prometheus metrics listen address (loopback).
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Webhook listener for triggers (POST /triggers/<id>), e.g. 127.0.0.1:7071.
    #[arg(long)]
    webhook_listen: Option<SocketAddr>,
    /// How long a schedule run refused for capacity is retried, seconds.
    #[arg(long)]
    schedule_retry_window: Option<u64>,
    /// Most live sessions.
    #[arg(long)]
    max_sessions: Option<u32>,
    /// Memory live sessions may commit, as a multiple of the node's.
    #[arg(long)]
    memory_overcommit_ratio: Option<f64>,
    /// Warm VMs per image.
    #[arg(long)]
    warm_pool: Option<u32>,
    /// Where the idle auto-pause puts a session: memory or disk.
    #[arg(long, value_enum)]
    idle_pause: Option<host_agent::config::IdlePause>,
    /// Snapshot storage sessions may keep on this node, MiB (0: no quota).
    #[arg(long)]
    snapshot_quota_mib: Option<u64>,
    /// Default session TTL, seconds.
    #[arg(long)]
    default_ttl: Option<u64>,
    /// Default idle timeout before auto-pause, seconds.
    #[arg(long)]
    default_idle_timeout: Option<u64>,
    /// Maximum session lifetime, seconds.
    #[arg(long)]
    max_lifetime: Option<u64>,
    /// Usage sampling period, milliseconds.
    #[arg(long)]
    usage_interval_ms: Option<u64>,
    /// Limits check period, milliseconds.
    #[arg(long)]
    limits_interval_ms: Option<u64>,
    /// Stop all sessions on SIGTERM/SIGINT.
    #[arg(long)]
    stop_sessions_on_shutdown: bool,
    /// Log JSON lines.
    #[arg(long)]
    log_json: bool,
    /// Host side of each VM's vsock (Unix socket, CONNECT convention);
    /// `{dir}` is the VM's directory. Default `{dir}/vsock.sock`.
    #[arg(long)]
    guest_vsock_uds: Option<String>,
    /// Give guest-init VMs no virtio-vsock device: something else serves
    /// --guest-vsock-uds (a stand-in for the guest, as in the tests).
    #[arg(long)]
    no_vsock_device: bool,
    /// Run sessions' vmm processes unjailed (development only). By default
    /// each runs through `vmm jail`, which needs root: without root and
    /// without this flag host-agent refuses to start.
    #[arg(long, conflicts_with_all = ["jail_uid_range", "jail_memory_overhead_mib"])]
    no_jail: bool,
    /// uids (= gids) for jailed VMs, one per VM: FIRST-LAST
    /// [default: 2000000000-2000065535].
    #[arg(long, value_name = "FIRST-LAST")]
    jail_uid_range: Option<host_agent::config::UidRange>,
    /// Memory limit of a jailed VM's cgroup beyond its guest memory, MiB (0: none)
    /// [default: 256].
    #[arg(long)]
    jail_memory_overhead_mib: Option<u64>,
    /// Bound of each VM's serial log (rotated to serial.log.1) and vmm log
    /// (capped), bytes [default: 16777216].
    #[arg(long)]
    max_log_bytes: Option<u64>,
    /// vsock port of guest-init.
    #[arg(long)]
    guest_port: Option<u32>,
    /// Mutual TLS: CA of client certificates (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
    /// Mutual TLS: server certificate (PEM).
    #[arg(long, requires_all = ["tls_ca", "tls_key"])]
    tls_cert: Option<PathBuf>,
    /// Mutual TLS: server private key (PEM).
    #[arg(long, requires_all = ["tls_ca", "tls_cert"])]
    tls_key: Option<PathBuf>,
    /// Clients file: `NAME SCOPES sha256:HEX|mtls` per line (see the README).
    #[arg(long)]
    clients_file: Option<PathBuf>,
    /// Treat calls without credentials on the Unix socket or from loopback
    /// (without TLS) as the admin client `local`.
    #[arg(long)]
    allow_unauthenticated_local: bool,
    /// A directory RegisterImage's files may lie in (repeatable; replaces
    /// allowed_image_roots of the config file).
    #[arg(long)]
    allowed_image_root: Vec<PathBuf>,
    /// A directory CreateSession's repository may lie in (repeatable;
    /// replaces allowed_repository_roots of the config file).
    #[arg(long)]
    allowed_repository_root: Vec<PathBuf>,
    /// Directory of the node's secrets, one file per secret named after it,
    /// which CreateSession's secret_refs name.
    #[arg(long)]
    secrets_dir: Option<PathBuf>,
    /// A directory whose subdirectories images and sessions may share into
    /// their VMs with virtio-fs (repeatable; replaces allowed_share_roots of
    /// the config file; none: shares are refused).
    #[arg(long)]
    allowed_share_root: Vec<PathBuf>,
    /// The virtiofsd binary serving shares [default: virtiofsd from PATH;
    /// $AGENTVM_VIRTIOFSD wins over both].
    #[arg(long)]
    virtiofsd: Option<PathBuf>,
    /// virtiofsd's --cache for every share [default: auto].
    #[arg(long, value_enum)]
    virtiofs_cache: Option<host_agent::shares::VirtiofsCache>,
    /// NATS server URL(s), comma-separated: export events, usage, asks and
    /// audit to JetStream, join the node registry, push and pull images.
    #[arg(long, value_name = "URL")]
    nats: Option<String>,
    /// This node's name in the fleet (subjects, message ids, registry)
    /// [default: the host name].
    #[arg(long)]
    node_name: Option<String>,
    /// The gRPC address the registry shows for this node [default: the
    /// listen address].
    #[arg(long)]
    advertise_address: Option<String>,
    /// NATS credentials file (.creds: JWT and NKey seed).
    #[arg(long)]
    nats_creds: Option<PathBuf>,
    /// File holding a NATS token.
    #[arg(long)]
    nats_token_file: Option<PathBuf>,
    /// CA of the NATS servers' certificates (PEM); TLS is then required.
    #[arg(long)]
    nats_tls_ca: Option<PathBuf>,
    /// Client certificate for NATS (PEM).
    #[arg(long, requires = "nats_tls_key")]
    nats_tls_cert: Option<PathBuf>,
    /// Client key for NATS (PEM).
    #[arg(long, requires = "nats_tls_cert")]
    nats_tls_key: Option<PathBuf>,
    /// How long the JetStream streams host-agent creates keep messages,
    /// seconds [default: 604800].
    #[arg(long)]
    stream_max_age: Option<u64>,
    /// How often this node puts its registry entry, seconds [default: 5].
    #[arg(long)]
    registry_interval: Option<u64>,
    /// How long a registry entry lives without a new put, seconds
    /// [default: 15].
    #[arg(long)]
    registry_ttl: Option<u64>,
    /// Where images are pushed and pulled: `nats` (JetStream's object
    /// store; the default with --nats), `s3://bucket/prefix` (AWS_*
    /// environment) or `file:///dir`.
    #[arg(long, value_name = "nats|URL")]
    image_store: Option<String>,
}

fn init_logs(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if json {
        b.json().init();
    } else {
        b.init();
    }
}

pub async fn run_serve(a: ServeArgs) -> Result<(), String> {
    let mut cfg = match &a.config {
        Some(p) => Config::from_file(p).map_err(|e| e.to_string())?,
        None => Config::default(),
    };
    if let Some(v) = a.listen {
        cfg.listen = v;
    }
    if let Some(v) = a.listen_unix {
        cfg.listen_unix = Some(v);
    }
    if let Some(v) = a.state_dir {
        cfg.state_dir = v;
    }
    if let Some(v) = a.vmm {
        cfg.vmm = Some(v);
    }
    if let Some(v) = a.metrics_listen {
        cfg.metrics_listen = Some(v);
    }
    if let Some(v) = a.webhook_listen {
        cfg.webhook_listen = Some(v);
    }
    if let Some(v) = a.schedule_retry_window {
        cfg.schedule_retry_window_seconds = v;
    }
    if let Some(v) = a.max_sessions {
        cfg.max_sessions = v;
    }
    if let Some(v) = a.memory_overcommit_ratio {
        cfg.memory_overcommit_ratio = v;
    }
    if let Some(v) = a.warm_pool {
        cfg.warm_pool_size = v;
    }
    if let Some(v) = a.idle_pause {
        cfg.idle_pause = v;
    }
    if let Some(v) = a.snapshot_quota_mib {
        cfg.snapshot_quota_mib = v;
    }
    if let Some(v) = a.default_ttl {
        cfg.default_ttl_seconds = v;
    }
    if let Some(v) = a.default_idle_timeout {
        cfg.default_idle_timeout_seconds = v;
    }
    if let Some(v) = a.max_lifetime {
        cfg.max_lifetime_seconds = v;
    }
    if let Some(v) = a.usage_interval_ms {
        cfg.usage_interval_ms = v;
    }
    if let Some(v) = a.limits_interval_ms {
        cfg.limits_interval_ms = v;
    }
    if a.no_vsock_device {
        cfg.vsock_device = false;
    }
    cfg.no_jail |= a.no_jail;
    if let Some(v) = a.jail_uid_range {
        cfg.jail.uid_range = v;
    }
    if let Some(v) = a.jail_memory_overhead_mib {
        cfg.jail.memory_overhead_mib = v;
    }
    if let Some(v) = a.max_log_bytes {
        cfg.logs.max_file_bytes = v;
    }
    if let Some(v) = a.guest_vsock_uds {
        cfg.guest_vsock_uds = v;
    }
    if let Some(v) = a.guest_port {
        cfg.guest_port = v;
    }
    if let (Some(ca), Some(cert), Some(key)) = (a.tls_ca, a.tls_cert, a.tls_key) {
        cfg.tls = Some(host_agent::config::TlsConfig { ca, cert, key });
    }
    if let Some(v) = a.clients_file {
        cfg.clients_file = Some(v);
    }
    if a.allow_unauthenticated_local {
        cfg.unauthenticated_local = Some(host_agent::auth::Scope::Admin);
    }
    if !a.allowed_image_root.is_empty() {
        cfg.allowed_image_roots = Some(a.allowed_image_root);
    }
    if !a.allowed_repository_root.is_empty() {
        cfg.allowed_repository_roots = Some(a.allowed_repository_root);
    }
    if let Some(v) = a.secrets_dir {
        cfg.secrets_dir = Some(v);
    }
    if !a.allowed_share_root.is_empty() {
        cfg.allowed_share_roots = a.allowed_share_root;
    }
    if let Some(v) = a.virtiofsd {
        cfg.virtiofsd_path = Some(v);
    }
    if let Some(v) = a.virtiofs_cache {
        cfg.virtiofs_cache = v;
    }
    let f = &mut cfg.fleet;
    for (field, flag) in [
        (&mut f.nats, a.nats),
        (&mut f.node_name, a.node_name),
        (&mut f.advertise_address, a.advertise_address),
        (&mut f.image_store, a.image_store),
    ] {
        if flag.is_some() {
            *field = flag;
        }
    }
    for (field, flag) in [
        (&mut f.creds_file, a.nats_creds),
        (&mut f.token_file, a.nats_token_file),
        (&mut f.tls_ca, a.nats_tls_ca),
        (&mut f.tls_cert, a.nats_tls_cert),
        (&mut f.tls_key, a.nats_tls_key),
    ] {
        if flag.is_some() {
            *field = flag;
        }
    }
    for (field, flag) in [
        (&mut f.stream_max_age_seconds, a.stream_max_age),
        (&mut f.registry_interval_seconds, a.registry_interval),
        (&mut f.registry_ttl_seconds, a.registry_ttl),
    ] {
        if let Some(v) = flag {
            *field = v;
        }
    }
    cfg.stop_sessions_on_shutdown |= a.stop_sessions_on_shutdown;
    cfg.log_json |= a.log_json;
    init_logs(cfg.log_json);
    cfg.validate().map_err(|e| e.to_string())?;
    // SAFETY: geteuid has no preconditions.
    cfg.check_privileges(unsafe { libc::geteuid() })
        .map_err(|e| e.to_string())?;
    if !cfg.jailed() {
        tracing::warn!(
            "--no-jail: vmm processes run unjailed, as host-agent's own user, with the host's \
             network; for development only, never with untrusted guests"
        );
    }
    let listener = if let Some(path) = &cfg.listen_unix {
        let _ = std::fs::remove_file(path);
        let l = tokio::net::UnixListener::bind(path)
            .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| format!("chmod {}: {e}", path.display()))?;
        println!("host-agent listening on unix:{}", path.display());
        host_agent::Listener::Unix(l)
    } else {
        let l = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?;
        let local = l.local_addr().map_err(|e| e.to_string())?;
        // Tests and scripts read this line to learn the port (--listen :0).
        println!("host-agent listening on {local}");
        host_agent::Listener::Tcp(l)
    };
    host_agent::serve(cfg, listener, host_agent::shutdown_signal())
        .await
        .map_err(|e| e.to_string())
}
