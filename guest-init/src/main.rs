//! guest-init: PID 1 of every guest and the session agent.
//!
//! * no arguments: PID 1 (mounts, network, reaping, session agent on vsock
//!   port 700, power off at the end);
//! * `serve --listen unix:PATH|vsock:PORT [--workspace DIR]`: the session
//!   agent alone, outside PID 1 (tests, debugging);
//! * `audit verify FILE`: checks an audit log's hash chain;
//! * `policy check --rules agents/NAME.md [--manifest FILE] -- ARGV...`:
//!   decides a command with those rules, as a session would.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use guest_init::agent::{self, Config};
use guest_init::channel::ListenAddr;
use guest_init::pid1;
use guest_init::policy::check::{self, CheckRequest};
use guest_init::reaper;
use guest_init::{audit, privilege, turn};

#[derive(Parser)]
#[command(
    name = "guest-init",
    version,
    about = "PID 1 and session agent for agent-session microVMs"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the session agent outside PID 1.
    Serve(ServeArgs),
    /// Audit log tools.
    Audit {
        #[command(subcommand)]
        command: AuditCommand,
    },
    /// Command policy tools.
    Policy {
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// PID 1 mode with overrides, for tests inside a PID namespace.
    #[command(hide = true)]
    Init(InitArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// unix:PATH or vsock:PORT.
    #[arg(long)]
    listen: ListenAddr,
    /// Directory the repository is cloned into.
    #[arg(long, default_value = "/workspace")]
    workspace: PathBuf,
    /// Private directory for the audit log and bundles (default: a
    /// `.guest-init-state` directory beside the workspace).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// uid/gid for agent commands when running as root.
    #[arg(long, default_value_t = privilege::DEFAULT_AGENT_ID)]
    agent_uid: u32,
    /// How turns are tracked.
    #[arg(long, value_enum, default_value_t = Turns::Auto)]
    turns: Turns,
    /// Install nftables egress rules and /etc/hosts (changes this machine!).
    #[arg(long)]
    apply_egress: bool,
    /// Maximum frame size in bytes.
    #[arg(long, default_value_t = proto::framing::DEFAULT_MAX_FRAME)]
    max_frame: usize,
}

#[derive(Clone, Copy, ValueEnum)]
enum Turns {
    /// cgroup2 where writable, else process-tree.
    Auto,
    /// Process-tree tracking only.
    ProcessTree,
}

#[derive(Subcommand)]
enum AuditCommand {
    /// Verify the hash chain; exit 0 if it holds, 1 at the first broken link.
    Verify {
        /// The JSON-lines audit log.
        file: PathBuf,
    },
}

#[derive(Subcommand)]
enum PolicyCommand {
    /// Decide one command line: prints allow|ask|deny, the deciding rule and
    /// the commands found; exit 0 whatever the decision, 2 on bad input.
    Check(CheckArgs),
}

#[derive(clap::Args)]
struct CheckArgs {
    /// The rules file, `agents/NAME.md` (NAME is the agent).
    #[arg(long)]
    rules: PathBuf,
    /// The repository's `agent-manifest.yaml`, to check it and show the grant.
    #[arg(long)]
    manifest: Option<PathBuf>,
    /// Workspace root the command runs under.
    #[arg(long, default_value = "/workspace")]
    workspace: PathBuf,
    /// Working directory (default: the workspace; relative to it if relative).
    #[arg(long)]
    cwd: Option<PathBuf>,
    /// A variable of the Exec's env (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE")]
    env: Vec<String>,
    /// The command, after `--`.
    #[arg(last = true, required = true, value_name = "ARGV")]
    argv: Vec<String>,
}

#[derive(clap::Args)]
struct InitArgs {
    /// Mount the pseudo file systems under this directory instead of /.
    #[arg(long)]
    root: Option<PathBuf>,
    /// Where to serve instead of vsock.
    #[arg(long)]
    listen: Option<ListenAddr>,
    #[arg(long)]
    workspace: Option<PathBuf>,
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Skip configuring lo and eth0.
    #[arg(long)]
    no_network: bool,
    /// Exit instead of powering off.
    #[arg(long)]
    no_poweroff: bool,
    /// Set the clock from the host's time (off by default in this test mode,
    /// where the "guest" shares the host's clock).
    #[arg(long)]
    set_clock: bool,
    /// Hostname to set instead of the kernel command line's.
    #[arg(long)]
    hostname: Option<String>,
    /// Install egress rules (off by default in this test mode).
    #[arg(long)]
    apply_egress: bool,
    /// Hosts file to write allowed names to.
    #[arg(long)]
    hosts_file: Option<PathBuf>,
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GUEST_INIT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::env::var("GUEST_INIT_LOG_FORMAT").is_ok_and(|v| v == "json") {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let result = match cli.command {
        None => {
            if reaper::self_pid() != 1 {
                eprintln!("guest-init: without arguments guest-init runs as PID 1 (it mounts file systems and powers off); use `guest-init serve --listen unix:PATH` elsewhere");
                return ExitCode::from(2);
            }
            pid1::set_default_path();
            pid1::run(pid1::Options::guest()).map(|_| ExitCode::SUCCESS)
        }
        Some(Command::Init(a)) => {
            pid1::set_default_path();
            let mut o = pid1::Options::guest();
            o.hostname = a.hostname;
            if let Some(r) = a.root {
                o.root = r;
            }
            if let Some(l) = a.listen {
                o.listen = Some(l);
            }
            if let Some(w) = a.workspace {
                o.workspace = w;
            }
            if let Some(s) = a.state_dir {
                o.state_dir = s;
            }
            o.network = !a.no_network;
            o.poweroff = !a.no_poweroff;
            o.set_clock = a.set_clock;
            // A test's PID namespace on the test machine: not its CPUs or disks.
            o.own_machine = false;
            o.apply_egress = a.apply_egress;
            if let Some(h) = a.hosts_file {
                o.hosts_file = h;
            }
            pid1::run(o).map(|_| ExitCode::SUCCESS)
        }
        Some(Command::Serve(a)) => serve(a),
        Some(Command::Audit {
            command: AuditCommand::Verify { file },
        }) => verify(&file),
        Some(Command::Policy {
            command: PolicyCommand::Check(a),
        }) => policy_check(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("guest-init: {e}");
            ExitCode::from(2)
        }
    }
}

fn serve(a: ServeArgs) -> std::io::Result<ExitCode> {
    let state_dir = a.state_dir.unwrap_or_else(|| {
        let name = a
            .workspace
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        a.workspace
            .with_file_name(format!(".guest-init-state-{name}"))
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        if let Err(e) = reaper::become_subreaper() {
            tracing::warn!(error = %e, "cannot become a child subreaper: daemonised processes escape process-tree tracking");
        }
        tokio::spawn(reaper::run());
        let cfg = Config {
            workspace: a.workspace,
            state_dir,
            identity: privilege::agent_identity(Some(privilege::Identity {
                uid: a.agent_uid,
                gid: a.agent_uid,
            })),
            turn_backend: match a.turns {
                Turns::Auto => turn::detect(),
                Turns::ProcessTree => turn::Backend::ProcessTree,
            },
            apply_egress: a.apply_egress,
            hosts_file: PathBuf::from("/etc/hosts"),
            max_frame: a.max_frame,
            // `serve` runs on some machine's own clock, never a guest's.
            set_clock: false,
            own_machine: false,
        };
        let mut transport = a.listen.bind()?;
        agent::serve(transport.as_mut(), cfg).await?;
        Ok(ExitCode::SUCCESS)
    })
}

fn policy_check(a: CheckArgs) -> std::io::Result<ExitCode> {
    let req = CheckRequest {
        rules: a.rules,
        manifest: a.manifest,
        workspace: a.workspace,
        cwd: a.cwd,
        env: a.env,
        argv: a.argv,
    };
    match check::check(&req) {
        Ok(report) => {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            match write!(out, "{report}").and_then(|()| out.flush()) {
                // `policy check ... | head -1` closes the pipe early; that is fine.
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e),
                _ => Ok(ExitCode::SUCCESS),
            }
        }
        Err(e) => Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)),
    }
}

fn verify(file: &std::path::Path) -> std::io::Result<ExitCode> {
    let f = std::fs::File::open(file)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", file.display())))?;
    let outcome = audit::verify(std::io::BufReader::new(f))?;
    println!("{}: {outcome}", file.display());
    Ok(match outcome {
        audit::VerifyOutcome::Holds { .. } => ExitCode::SUCCESS,
        audit::VerifyOutcome::Broken { .. } => ExitCode::from(1),
    })
}
