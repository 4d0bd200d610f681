//! `host-agent`: `serve` runs the daemon; the other subcommands are a small
//! operator client over the gRPC API.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use proto::hostagent as pb;
use proto::hostagent::{
    events_client::EventsClient, exec_client::ExecClient, images_client::ImagesClient,
    node_client::NodeClient, sessions_client::SessionsClient, usage_client::UsageClient,
};
use tonic::transport::Channel;

mod cli;

use cli::demo::{run_demo, DemoArgs};
use cli::serve::{run_serve, ServeArgs};

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
    /// The main job on built-in defaults: a host-agent of its own, a test
    /// guest image, a session created, paused, resumed, snapshotted and
    /// stopped, with its events and usage as they arrive.
    Demo(DemoArgs),
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
        // Invariant: main() runs Serve and Demo itself and never passes them here.
        Cmd::Serve(_) | Cmd::Demo(_) => unreachable!("handled in main"),
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
            Cmd::Demo(a) => run_demo(a).await,
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
