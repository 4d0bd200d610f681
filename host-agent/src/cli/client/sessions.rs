//! `host-agent sessions`: create, list, get, pause, resume, stop, delete,
//! snapshot, restore, move, network, expose, unexpose.

use clap::Subcommand;
use proto::hostagent as pb;
use proto::hostagent::fleet_client::FleetClient;
use proto::hostagent::sessions_client::SessionsClient;
use tonic::transport::Channel;

use super::labels::{LabelArgs, StateArg};
use super::{status as st, Bearer};
use crate::cli::output::{print_all, Output, Record};

/// The `sessions` subcommands.
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
        /// Override one of the image's device rate limits, `FIELD=RATE`
        /// (repeatable; tighter only, unless the client is an admin).
        #[arg(long = "io-limit")]
        io_limit: Vec<String>,
        /// A host directory shared into the VM on top of the image's,
        /// `TAG=HOST_PATH[,ro][,mount=GUEST_PATH]` (repeatable; an image
        /// share's tag replaces that share).
        #[arg(long = "share")]
        share: Vec<String>,
        #[command(flatten)]
        size: SizeArgs,
        #[command(flatten)]
        labels: LabelArgs,
        #[command(flatten)]
        session_env: Box<super::session_env::SessionEnvArgs>,
        /// Resume the session from disk on any exec or files call while it
        /// is paused to disk.
        #[arg(long)]
        auto_resume: bool,
    },
    /// List sessions (filtered, a page at a time).
    List(ListArgs),
    /// Show a session.
    Get { id: String },
    /// Pause a session (in memory, or to disk with --persist).
    Pause {
        id: String,
        /// Write its memory to disk (a diff snapshot) and stop its vmm.
        #[arg(long)]
        persist: bool,
    },
    /// Resume a session.
    Resume { id: String },
    /// Stop a session.
    Stop { id: String },
    /// Delete a stopped session.
    Delete { id: String },
    /// Write a snapshot of a session; prints its directory.
    Snapshot { id: String },
    /// Make new sessions from a running or paused session; prints them.
    Fork {
        id: String,
        /// How many (1..=64).
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[arg(long, default_value = "")]
        idempotency_key: String,
    },
    /// Roll a session back to one of its snapshots.
    Restore { id: String, snapshot_dir: String },
    /// Move a session paused to disk to another node of the fleet (through
    /// the image store); it is STOPPED (moved) here, and the other node's
    /// `sessions resume SESSION` takes it in and resumes it.
    Move {
        id: String,
        /// The node it moves to (its --node-name).
        #[arg(long = "to", value_name = "NODE")]
        to: String,
    },
    /// Replace a live session's egress allowlist and add denied blocks
    /// (narrowing only, unless the client is an admin); prints the network.
    Network {
        id: String,
        /// An allowed destination: `CIDR`, `CIDR tcp|udp`, `"CIDR tcp|udp
        /// PORT"` (repeatable; the whole new allowlist).
        #[arg(long = "allow")]
        allow: Vec<String>,
        /// A block denied whatever any allowlist says (repeatable).
        #[arg(long = "deny")]
        deny: Vec<String>,
    },
    /// Make a live session's guest TCP port reachable at a node address;
    /// prints the address.
    Expose { id: String, guest_port: u32 },
    /// Close a session's exposed port; prints the network.
    Unexpose { id: String, guest_port: u32 },
}

/// `sessions create`'s size within the image (0 or left out: the image's).
#[derive(clap::Args)]
pub struct SizeArgs {
    /// vCPUs the session's commands see (at most the image's).
    #[arg(long, default_value_t = 0)]
    vcpus: u32,
    /// Memory of the session's commands, MiB (at most the image's).
    #[arg(long, default_value_t = 0)]
    mem_mib: u32,
    /// CPU time cap of the VM, thousandths of a CPU (1500: one and a half).
    #[arg(long, default_value_t = 0)]
    cpu_millis: u32,
    /// Root disk size, MiB (at least the image's).
    #[arg(long, default_value_t = 0)]
    disk_mib: u64,
}

impl SizeArgs {
    /// The request's `resources` (none when nothing is asked for).
    fn resources(&self) -> Option<pb::SessionResources> {
        let r = pb::SessionResources {
            vcpus: self.vcpus,
            mem_mib: self.mem_mib,
            cpu_millis: self.cpu_millis,
            disk_mib: self.disk_mib,
        };
        (r != pb::SessionResources::default()).then_some(r)
    }
}

/// Runs `sessions <cmd>`.
pub async fn run(ch: Channel, bearer: Bearer, out: Output, c: SessionsCmd) -> Result<(), String> {
    let mut cl = SessionsClient::with_interceptor(ch.clone(), bearer.clone());
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
            io_limit,
            share,
            size,
            labels,
            session_env,
            auto_resume,
        } => {
            let (env, secrets, secret_refs) = session_env.fields(std::io::stdin())?;
            cl.create_session(pb::CreateSessionRequest {
                image_id: image,
                repository_path: repository,
                agent,
                base_ref,
                idempotency_key,
                limits: Some(pb::Limits {
                    ttl_seconds: ttl,
                    idle_timeout_seconds: idle_timeout,
                }),
                io_limits: super::io_limits::parse(&io_limit)?,
                labels: labels.map()?,
                env,
                secrets,
                secret_refs,
                resources: size.resources(),
                auto_resume,
                shares: super::shares::parse(&share)?,
            })
            .await
            .map_err(st)?
            .into_inner()
        }
        SessionsCmd::List(args) => return list(&mut cl, out, args).await,
        SessionsCmd::Get { id } => cl
            .get_session(pb::SessionRef { session_id: id })
            .await
            .map_err(st)?
            .into_inner(),
        SessionsCmd::Pause { id, persist } => cl
            .pause_session(pb::PauseSessionRequest {
                session_id: id,
                idempotency_key: String::new(),
                persist,
            })
            .await
            .map_err(st)?
            .into_inner(),
        SessionsCmd::Resume { id } => cl.resume_session(call(id)).await.map_err(st)?.into_inner(),
        SessionsCmd::Stop { id } => cl.stop_session(call(id)).await.map_err(st)?.into_inner(),
        SessionsCmd::Delete { id } => {
            cl.delete_session(call(id)).await.map_err(st)?;
            return Ok(());
        }
        SessionsCmd::Fork {
            id,
            count,
            idempotency_key,
        } => {
            let r = cl
                .fork_session(pb::ForkSessionRequest {
                    session_id: id,
                    count,
                    idempotency_key,
                    labels: Default::default(),
                })
                .await
                .map_err(st)?
                .into_inner();
            print_all(&r.sessions, out);
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
        SessionsCmd::Network { id, allow, deny } => {
            let n = cl
                .update_session_network(pb::UpdateSessionNetworkRequest {
                    session_id: id,
                    allow,
                    deny,
                })
                .await
                .map_err(st)?
                .into_inner();
            print_all(&[n], out);
            return Ok(());
        }
        SessionsCmd::Expose { id, guest_port } => {
            let e = cl
                .expose_port(port_request(id, guest_port))
                .await
                .map_err(st)?
                .into_inner();
            print_all(&[e], out);
            return Ok(());
        }
        SessionsCmd::Unexpose { id, guest_port } => {
            let n = cl
                .unexpose_port(port_request(id, guest_port))
                .await
                .map_err(st)?
                .into_inner();
            print_all(&[n], out);
            return Ok(());
        }
        SessionsCmd::Move { id, to } => FleetClient::with_interceptor(ch, bearer)
            .move_session(pb::MoveSessionRequest {
                session_id: id,
                to_node: to,
            })
            .await
            .map_err(st)?
            .into_inner(),
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
    Ok(())
}

/// `sessions list`'s filters and paging.
#[derive(clap::Args, Debug)]
pub struct ListArgs {
    #[command(flatten)]
    labels: LabelArgs,
    /// Only sessions in this state (repeatable: any of them).
    #[arg(long = "state", value_enum, ignore_case = true)]
    state: Vec<StateArg>,
    /// Only sessions of this image.
    #[arg(long = "image", value_name = "ID", default_value = "")]
    image: String,
    /// Sessions per page (0: host-agent's default, 100; at most 1000).
    #[arg(long, default_value_t = 0)]
    page_size: u32,
    /// Follow every page to the end.
    #[arg(long, conflicts_with = "page_token")]
    all: bool,
    /// The page after an earlier list's next page token.
    #[arg(long, value_name = "TOKEN")]
    page_token: Option<String>,
}

impl ListArgs {
    /// The first request.
    fn request(self) -> Result<(pb::ListSessionsRequest, bool), String> {
        let req = pb::ListSessionsRequest {
            states: self.state.iter().map(|s| s.to_pb()).collect(),
            image_id: self.image,
            labels: self.labels.map()?,
            page_size: self.page_size,
            page_token: self.page_token.unwrap_or_default(),
        };
        Ok((req, self.all))
    }
}

/// `sessions list`: one page (its next page token on stderr), or every
/// page with `--all`.
async fn list(
    cl: &mut SessionsClient<tonic::service::interceptor::InterceptedService<Channel, Bearer>>,
    out: Output,
    args: ListArgs,
) -> Result<(), String> {
    let (mut req, all) = args.request()?;
    let mut sessions = Vec::new();
    loop {
        let page = cl
            .list_sessions(req.clone())
            .await
            .map_err(st)?
            .into_inner();
        sessions.extend(page.sessions);
        if page.next_page_token.is_empty() {
            break;
        }
        if !all {
            eprintln!("next_page_token: {}", page.next_page_token);
            break;
        }
        if page.next_page_token == req.page_token {
            return Err("host-agent returned the same page token again".into());
        }
        req.page_token = page.next_page_token;
    }
    print_all(&sessions, out);
    Ok(())
}

/// The request naming TCP port `guest_port` of session `id`.
fn port_request(id: String, guest_port: u32) -> pb::ExposePortRequest {
    pb::ExposePortRequest {
        session_id: id,
        guest_port,
        protocol: "tcp".into(),
    }
}
