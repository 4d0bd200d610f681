//! `host-agent`: `serve` runs the daemon; the other subcommands are a small
//! operator client over the gRPC API.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cli;

use cli::client::{
    run_client, ApprovalsCmd, ClientTls, EventsCmd, ExecArgs, FilesCmd, FleetCmd, ImagesCmd,
    SchedulesCmd, SessionsCmd, SnapshotsCmd, TriggersCmd, TurnsCmd,
};
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
    /// Client output: aligned tables, or one JSON object per line.
    #[arg(long, global = true, value_enum, default_value = "table")]
    output: cli::output::Output,
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
    /// printed, and the command's exit code becomes this one's. `exec
    /// attach` reattaches to a command, `exec list` lists them.
    Exec(ExecArgs),
    /// Turns of guest-init sessions.
    #[command(subcommand)]
    Turns(TurnsCmd),
    /// Asks waiting for an answer, and answering them.
    #[command(subcommand)]
    Approvals(ApprovalsCmd),
    /// Files in a session's workspace: stat, ls, get, put, mkdir, rm, mv, watch.
    #[command(subcommand)]
    Files(FilesCmd),
    /// A session's audit records as host-agent holds them.
    Audit {
        /// Session id.
        session: String,
        /// Check the host's hash chain and the guest's sequence; fails when
        /// either breaks.
        #[arg(long)]
        verify: bool,
    },
    /// The node's snapshot layers: list them, collect those nothing holds.
    #[command(subcommand)]
    Snapshots(SnapshotsCmd),
    /// Schedules: sessions started by a clock (cron in a time zone).
    #[command(subcommand)]
    Schedules(SchedulesCmd),
    /// Webhook triggers: runs started by a signed HTTP request.
    #[command(subcommand)]
    Triggers(TriggersCmd),
    /// The fleet: the nodes of the registry (NATS KV agentvm_nodes).
    #[command(subcommand)]
    Fleet(FleetCmd),
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
                run_client(cli.addr, tls, cli.token_file, cli.output, other).await
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
