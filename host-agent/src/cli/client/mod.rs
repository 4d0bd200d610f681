//! The operator client: the `images`, `sessions`, `events`, `usage`,
//! `node` and `exec` subcommands over the gRPC API.

use std::path::PathBuf;

use clap::Subcommand;
use proto::hostagent as pb;
use proto::hostagent::{
    events_client::EventsClient, exec_client::ExecClient, images_client::ImagesClient,
    node_client::NodeClient, sessions_client::SessionsClient, usage_client::UsageClient,
};
use tonic::transport::Channel;

use super::output::{print_all, print_streamed, NodeInfo, Output, Record};
use crate::Cmd;

#[derive(Subcommand)]
pub enum ImagesCmd {
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
pub enum SessionsCmd {
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
pub enum EventsCmd {
    /// Stream events after a seq.
    Watch {
        #[arg(long, default_value_t = 0)]
        since: u64,
    },
}

/// Client TLS settings from the global flags.
pub struct ClientTls {
    /// CA of the server certificate.
    pub ca: Option<PathBuf>,
    /// This client's certificate.
    pub cert: Option<PathBuf>,
    /// This client's key.
    pub key: Option<PathBuf>,
    /// Server name to verify.
    pub domain: Option<String>,
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

pub async fn run_client(
    addr: String,
    tls: ClientTls,
    token_file: Option<PathBuf>,
    out: Output,
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
                    print_all(&[i.into_inner()], out);
                }
                ImagesCmd::Build { id } => {
                    let i = cl
                        .build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
                            image_id: id,
                            ..Default::default()
                        })
                        .await
                        .map_err(st)?;
                    print_all(&[i.into_inner()], out);
                }
                ImagesCmd::List => {
                    let images = cl
                        .list_images(pb::ListImagesRequest {})
                        .await
                        .map_err(st)?
                        .into_inner()
                        .images;
                    print_all(&images, out);
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
                    let sessions = cl
                        .list_sessions(pb::ListSessionsRequest::default())
                        .await
                        .map_err(st)?
                        .into_inner()
                        .sessions;
                    print_all(&sessions, out);
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
                    match out {
                        Output::Table => println!("{}", r.snapshot_dir),
                        Output::Json => println!(
                            "{}",
                            serde_json::json!({
                                "snapshot_dir": r.snapshot_dir,
                                "pages_written": r.pages_written,
                                "session": r.session.as_ref().map(Record::json),
                            })
                        ),
                    }
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
            print_all(&[s], out);
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
            let mut first = true;
            while let Some(e) = stream.message().await.map_err(st)? {
                print_streamed(&e, first, out);
                first = false;
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
            print_all(&recs, out);
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
            let version = cl
                .get_version(pb::GetVersionRequest {})
                .await
                .map_err(st)?
                .into_inner();
            let capacity = cl
                .get_capacity(pb::GetCapacityRequest {})
                .await
                .map_err(st)?
                .into_inner();
            print_all(&[NodeInfo { version, capacity }], out);
        }
    }
    Ok(())
}
