//! `host-agent`: `serve` runs the daemon; the other subcommands are a small
//! operator client over the gRPC API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use host_agent::config::Config;
use proto::hostagent as pb;
use proto::hostagent::{
    events_client::EventsClient, exec_client::ExecClient, images_client::ImagesClient,
    node_client::NodeClient, sessions_client::SessionsClient, usage_client::UsageClient,
};
use tonic::transport::Channel;

#[derive(Parser)]
#[command(
    name = "host-agent",
    version,
    about = "Per-node microVM session daemon and its client"
)]
struct Cli {
    /// Address of the host-agent to talk to (client subcommands):
    /// http://HOST:PORT, https://HOST:PORT or unix:PATH.
    #[arg(long, global = true, default_value = "http://127.0.0.1:50051")]
    addr: String,
    /// Client TLS: CA of the server certificate (PEM); use an https:// addr.
    #[arg(long, global = true)]
    client_ca: Option<PathBuf>,
    /// Client TLS: this client's certificate (PEM).
    #[arg(long, global = true)]
    client_cert: Option<PathBuf>,
    /// Client TLS: this client's key (PEM).
    #[arg(long, global = true)]
    client_key: Option<PathBuf>,
    /// Client TLS: server name to verify (default: the addr's host).
    #[arg(long, global = true)]
    client_domain: Option<String>,
    /// Client: a file holding this client's bearer token (sent as
    /// `authorization: Bearer <token>`; surrounding whitespace is ignored).
    #[arg(long, global = true)]
    token_file: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the daemon.
    Serve(Box<ServeArgs>),
    /// Manage images.
    #[command(subcommand)]
    Images(ImagesCmd),
    /// Manage sessions.
    #[command(subcommand)]
    Sessions(SessionsCmd),
    /// Lifecycle events.
    #[command(subcommand)]
    Events(EventsCmd),
    /// Usage records.
    Usage {
        /// Only this session.
        #[arg(long, default_value = "")]
        session: String,
        /// Records after this seq.
        #[arg(long, default_value_t = 0)]
        since: u64,
    },
    /// Node capacity and version.
    Node,
    /// Run a command in a guest-init session; stdin is forwarded, output
    /// printed, and the command's exit code becomes this one's.
    Exec {
        /// Session id.
        session: String,
        /// Execution id (default: the session's current one).
        #[arg(long)]
        execution_id: Option<String>,
        /// Turn id (default: one per command).
        #[arg(long, default_value = "")]
        turn: String,
        /// Forward this process's stdin to the command.
        #[arg(long)]
        stdin: bool,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        argv: Vec<String>,
    },
}

#[derive(Args)]
struct ServeArgs {
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
    /// Most live sessions.
    #[arg(long)]
    max_sessions: Option<u32>,
    /// Warm VMs per image.
    #[arg(long)]
    warm_pool: Option<u32>,
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
}

#[derive(Subcommand)]
enum ImagesCmd {
    /// Register an image.
    Register {
        id: String,
        #[arg(long)]
        kernel: String,
        /// Root disk image (each VM gets its own copy).
        #[arg(long, default_value = "")]
        rootfs: String,
        /// Initial ramdisk (for kernels whose drivers are modules).
        #[arg(long, default_value = "")]
        initrd: String,
        #[arg(long, default_value = "")]
        cmdline: String,
        #[arg(long, default_value_t = 0)]
        mem_mib: u32,
        #[arg(long, default_value_t = 0)]
        vcpus: u32,
        #[arg(long)]
        guest_init: bool,
    },
    /// Build an image's golden snapshot.
    Build { id: String },
    /// List images.
    List,
    /// Delete an image.
    Delete { id: String },
}

#[derive(Subcommand)]
enum SessionsCmd {
    /// Create a session.
    Create {
        image: String,
        /// Host repository the session works on (guest-init images).
        #[arg(long, default_value = "")]
        repository: String,
        /// Agent whose rules (`agents/<agent>.md`) apply (guest-init images).
        #[arg(long, default_value = "")]
        agent: String,
        /// Branch, tag or commit the session branch starts from (guest-init images).
        #[arg(long, default_value = "")]
        base_ref: String,
        #[arg(long, default_value = "")]
        idempotency_key: String,
        #[arg(long, default_value_t = 0)]
        ttl: u64,
        #[arg(long, default_value_t = 0)]
        idle_timeout: u64,
    },
    /// List sessions.
    List,
    /// Show a session.
    Get { id: String },
    /// Pause a session.
    Pause { id: String },
    /// Resume a session.
    Resume { id: String },
    /// Stop a session.
    Stop { id: String },
    /// Delete a stopped session.
    Delete { id: String },
    /// Write a snapshot of a session; prints its directory.
    Snapshot { id: String },
    /// Roll a session back to one of its snapshots.
    Restore { id: String, snapshot_dir: String },
}

#[derive(Subcommand)]
enum EventsCmd {
    /// Stream events after a seq.
    Watch {
        #[arg(long, default_value_t = 0)]
        since: u64,
    },
}

fn init_logs(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        b.json().init();
    } else {
        b.init();
    }
}

async fn run_serve(a: ServeArgs) -> Result<(), String> {
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
    if let Some(v) = a.max_sessions {
        cfg.max_sessions = v;
    }
    if let Some(v) = a.warm_pool {
        cfg.warm_pool_size = v;
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

fn state(s: i32) -> &'static str {
    host_agent::sessions::state_name(s)
}

fn print_session(s: &pb::Session) {
    println!(
        "{} image={} state={} execution={} reason={:?} detail={:?} pid={}",
        s.session_id,
        s.image_id,
        state(s.state),
        s.execution_id,
        s.reason,
        s.detail,
        s.vmm_pid
    );
}

struct ClientTls {
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    domain: Option<String>,
}

/// Adds `authorization: Bearer <token>` to every call when a token is set.
#[derive(Clone)]
struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl Bearer {
    /// Reads the token from `path` (none without a path).
    fn from_file(path: Option<&PathBuf>) -> Result<Bearer, String> {
        let Some(p) = path else {
            return Ok(Bearer(None));
        };
        let text = std::fs::read_to_string(p)
            .map_err(|e| format!("reading token file {}: {e}", p.display()))?;
        let token = text.trim();
        if token.is_empty() {
            return Err(format!("token file {} is empty", p.display()));
        }
        // The token itself never goes into a message.
        let v = format!("Bearer {token}").parse().map_err(|_| {
            format!(
                "token file {} holds characters a header cannot carry",
                p.display()
            )
        })?;
        Ok(Bearer(Some(v)))
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

async fn run_client(
    addr: String,
    tls: ClientTls,
    token_file: Option<PathBuf>,
    cmd: Cmd,
) -> Result<(), String> {
    let bearer = Bearer::from_file(token_file.as_ref())?;
    let mut client_tls = None;
    if tls.ca.is_some() || tls.cert.is_some() {
        let read = |p: &PathBuf| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        let mut t = tonic::transport::ClientTlsConfig::new();
        if let Some(ca) = &tls.ca {
            t = t.ca_certificate(tonic::transport::Certificate::from_pem(read(ca)?));
        }
        if let (Some(c), Some(k)) = (&tls.cert, &tls.key) {
            t = t.identity(tonic::transport::Identity::from_pem(read(c)?, read(k)?));
        }
        if let Some(d) = tls.domain {
            t = t.domain_name(d);
        }
        client_tls = Some(t);
    }
    let ch: Channel = host_agent::connect(&addr, client_tls).await?;
    let st = |e: tonic::Status| format!("{:?}: {}", e.code(), e.message());
    match cmd {
        // Invariant: main() runs Serve itself and never passes it here.
        Cmd::Serve(_) => unreachable!("handled in main"),
        Cmd::Images(c) => {
            let mut cl = ImagesClient::with_interceptor(ch, bearer.clone());
            match c {
                ImagesCmd::Register {
                    id,
                    kernel,
                    rootfs,
                    initrd,
                    cmdline,
                    mem_mib,
                    vcpus,
                    guest_init,
                } => {
                    let i = cl
                        .register_image(pb::RegisterImageRequest {
                            image_id: id,
                            kernel_path: kernel,
                            rootfs_path: rootfs,
                            initrd_path: initrd,
                            cmdline,
                            mem_mib,
                            vcpus,
                            guest_init,
                            ..Default::default()
                        })
                        .await
                        .map_err(st)?;
                    println!("{:?}", i.into_inner());
                }
                ImagesCmd::Build { id } => {
                    let i = cl
                        .build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
                            image_id: id,
                            ..Default::default()
                        })
                        .await
                        .map_err(st)?;
                    println!("{:?}", i.into_inner());
                }
                ImagesCmd::List => {
                    for i in cl
                        .list_images(pb::ListImagesRequest {})
                        .await
                        .map_err(st)?
                        .into_inner()
                        .images
                    {
                        println!("{:?}", i);
                    }
                }
                ImagesCmd::Delete { id } => {
                    cl.delete_image(pb::DeleteImageRequest {
                        image_id: id,
                        idempotency_key: String::new(),
                    })
                    .await
                    .map_err(st)?;
                }
            }
        }
        Cmd::Sessions(c) => {
            let mut cl = SessionsClient::with_interceptor(ch, bearer.clone());
            let call = |id: String| pb::SessionCall {
                session_id: id,
                idempotency_key: String::new(),
            };
            let s = match c {
                SessionsCmd::Create {
                    image,
                    repository,
                    agent,
                    base_ref,
                    idempotency_key,
                    ttl,
                    idle_timeout,
                } => cl
                    .create_session(pb::CreateSessionRequest {
                        image_id: image,
                        repository_path: repository,
                        agent,
                        base_ref,
                        idempotency_key,
                        limits: Some(pb::Limits {
                            ttl_seconds: ttl,
                            idle_timeout_seconds: idle_timeout,
                        }),
                        ..Default::default()
                    })
                    .await
                    .map_err(st)?
                    .into_inner(),
                SessionsCmd::List => {
                    for s in cl
                        .list_sessions(pb::ListSessionsRequest::default())
                        .await
                        .map_err(st)?
                        .into_inner()
                        .sessions
                    {
                        print_session(&s);
                    }
                    return Ok(());
                }
                SessionsCmd::Get { id } => cl
                    .get_session(pb::SessionRef { session_id: id })
                    .await
                    .map_err(st)?
                    .into_inner(),
                SessionsCmd::Pause { id } => {
                    cl.pause_session(call(id)).await.map_err(st)?.into_inner()
                }
                SessionsCmd::Resume { id } => {
                    cl.resume_session(call(id)).await.map_err(st)?.into_inner()
                }
                SessionsCmd::Stop { id } => {
                    cl.stop_session(call(id)).await.map_err(st)?.into_inner()
                }
                SessionsCmd::Delete { id } => {
                    cl.delete_session(call(id)).await.map_err(st)?;
                    return Ok(());
                }
                SessionsCmd::Snapshot { id } => {
                    let r = cl
                        .snapshot_session(call(id))
                        .await
                        .map_err(st)?
                        .into_inner();
                    println!("{}", r.snapshot_dir);
                    return Ok(());
                }
                SessionsCmd::Restore { id, snapshot_dir } => cl
                    .restore_session(pb::RestoreSessionRequest {
                        session_id: id,
                        snapshot_dir,
                        idempotency_key: String::new(),
                    })
                    .await
                    .map_err(st)?
                    .into_inner(),
            };
            print_session(&s);
        }
        Cmd::Events(EventsCmd::Watch { since }) => {
            let mut cl = EventsClient::with_interceptor(ch, bearer.clone());
            let mut stream = cl
                .watch(pb::WatchRequest {
                    since_seq: since,
                    session_id: String::new(),
                })
                .await
                .map_err(st)?
                .into_inner();
            while let Some(e) = stream.message().await.map_err(st)? {
                println!(
                    "{} {} {} -> {} reason={:?} detail={:?} execution={}",
                    e.seq,
                    e.session_id,
                    state(e.from),
                    state(e.to),
                    e.reason,
                    e.detail,
                    e.execution_id
                );
            }
        }
        Cmd::Usage { session, since } => {
            let mut cl = UsageClient::with_interceptor(ch, bearer.clone());
            let recs = cl
                .list_usage(pb::ListUsageRequest {
                    session_id: session,
                    since_seq: since,
                    ..Default::default()
                })
                .await
                .map_err(st)?
                .into_inner()
                .records;
            for u in recs {
                println!(
                    "{} {} [{}..{}] billed={:.3}s vcpu={:.3}s mem_alloc={:.3}GiB·s mem_rss={:.5}GiB·s disk={}B final={}",
                    u.seq, u.session_id, u.interval_start, u.interval_end, u.billed_seconds, u.vcpu_seconds,
                    u.memory_allocated_gib_seconds, u.memory_resident_gib_seconds, u.disk_bytes_written, u.r#final
                );
            }
        }
        Cmd::Exec {
            session,
            execution_id,
            turn,
            stdin,
            argv,
        } => {
            let execution_id = match execution_id {
                Some(e) => e,
                None => {
                    SessionsClient::with_interceptor(ch.clone(), bearer.clone())
                        .get_session(pb::SessionRef {
                            session_id: session.clone(),
                        })
                        .await
                        .map_err(st)?
                        .into_inner()
                        .execution_id
                }
            };
            let (tx, rx) = tokio::sync::mpsc::channel(16);
            let start = pb::ExecRequest {
                kind: Some(pb::exec_request::Kind::Start(pb::ExecStart {
                    session_id: session,
                    execution_id,
                    turn_id: turn,
                    argv,
                    keep_stdin_open: stdin,
                    ..Default::default()
                })),
            };
            let _ = tx.send(start).await;
            if stdin {
                std::thread::spawn(move || {
                    use std::io::Read;
                    let mut input = std::io::stdin();
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let kind = match input.read(&mut buf) {
                            Ok(0) | Err(_) => pb::exec_request::Kind::StdinEof(true),
                            Ok(n) => pb::exec_request::Kind::Stdin(buf[..n].to_vec()),
                        };
                        let eof = matches!(kind, pb::exec_request::Kind::StdinEof(_));
                        if tx
                            .blocking_send(pb::ExecRequest { kind: Some(kind) })
                            .is_err()
                            || eof
                        {
                            return;
                        }
                    }
                });
            } else {
                drop(tx);
            }
            let mut stream = ExecClient::with_interceptor(ch, bearer.clone())
                .exec(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .map_err(st)?
                .into_inner();
            use pb::exec_response::Kind as R;
            use std::io::Write;
            while let Some(m) = stream.message().await.map_err(st)? {
                match m.kind {
                    Some(R::Stdout(d)) => {
                        let _ = std::io::stdout().write_all(&d);
                        let _ = std::io::stdout().flush();
                    }
                    Some(R::Stderr(d)) => {
                        let _ = std::io::stderr().write_all(&d);
                    }
                    Some(R::Rejected(why)) => return Err(format!("rejected: {why}")),
                    Some(R::Exit(e)) => match e.status {
                        Some(pb::exec_exit::Status::Code(0)) => return Ok(()),
                        Some(pb::exec_exit::Status::Code(c)) => {
                            return Err(format!("command exited with code {c}"))
                        }
                        Some(pb::exec_exit::Status::Signal(n)) => {
                            return Err(format!("command killed by signal {n}"))
                        }
                        None => return Err("command ended without a status".into()),
                    },
                    _ => {}
                }
            }
        }
        Cmd::Node => {
            let mut cl = NodeClient::with_interceptor(ch, bearer.clone());
            println!(
                "{:?}",
                cl.get_version(pb::GetVersionRequest {})
                    .await
                    .map_err(st)?
                    .into_inner()
            );
            println!(
                "{:?}",
                cl.get_capacity(pb::GetCapacityRequest {})
                    .await
                    .map_err(st)?
                    .into_inner()
            );
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("host-agent: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        match cli.cmd {
            Cmd::Serve(a) => run_serve(*a).await,
            other => {
                let tls = ClientTls {
                    ca: cli.client_ca,
                    cert: cli.client_cert,
                    key: cli.client_key,
                    domain: cli.client_domain,
                };
                run_client(cli.addr, tls, cli.token_file, other).await
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("host-agent: {e}");
            ExitCode::FAILURE
        }
    }
}
