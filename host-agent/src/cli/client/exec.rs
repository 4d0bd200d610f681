//! `host-agent exec`: one command in a guest-init session, its stdin
//! forwarded, its output printed, its exit status this process's; with
//! `--tty` on a terminal (the local one in raw mode, its size followed);
//! `exec attach` reattaches to a command, `exec list` lists them.

use clap::{Args, Subcommand};
use proto::hostagent as pb;
use proto::hostagent::exec_client::ExecClient;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use super::{status as st, Bearer};
use crate::cli::output::{print_all, Output};

mod terminal;

/// `exec SESSION [flags] -- ARGV`, or `exec attach` / `exec list`.
#[derive(Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct ExecArgs {
    /// Reattach to a command, or list a session's commands.
    #[command(subcommand)]
    cmd: Option<ExecCmd>,
    /// Session id.
    #[arg(required = true)]
    session: Option<String>,
    /// Execution id (default: the session's current one).
    #[arg(long)]
    execution_id: Option<String>,
    /// Turn id (default: one per command).
    #[arg(long, default_value = "")]
    turn: String,
    /// Forward this process's stdin to the command.
    #[arg(long)]
    stdin: bool,
    /// Run the command on a terminal; when this process's stdin is a
    /// terminal, it is put in raw mode and its size followed (SIGWINCH).
    #[arg(long)]
    tty: bool,
    /// Kill the command after this many milliseconds (0: no limit).
    #[arg(long, default_value_t = 0)]
    timeout_ms: u64,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    argv: Vec<String>,
}

/// `exec` subcommands.
#[derive(Subcommand)]
pub enum ExecCmd {
    /// Reattach to a command (running or ended): its output from --from,
    /// then live; stdin is forwarded with --stdin, the terminal with --tty.
    Attach {
        /// Session id.
        session: String,
        /// The command's exec id (`exec list`).
        exec_id: String,
        /// Output offset to replay from (0: all that is kept).
        #[arg(long, default_value_t = 0)]
        from: u64,
        /// Forward this process's stdin to the command.
        #[arg(long)]
        stdin: bool,
        /// The command runs on a terminal: raw mode and size, as `exec --tty`.
        #[arg(long)]
        tty: bool,
    },
    /// A session's commands, running and the last ended.
    List {
        /// Session id.
        session: String,
    },
}

/// Runs `exec`.
pub async fn run(ch: Channel, bearer: Bearer, out: Output, args: ExecArgs) -> Result<(), String> {
    match args.cmd {
        Some(ExecCmd::List { session }) => {
            let execs = ExecClient::with_interceptor(ch, bearer)
                .list_execs(pb::ListExecsRequest {
                    session_id: session,
                })
                .await
                .map_err(st)?
                .into_inner()
                .execs;
            print_all(&execs, out);
            Ok(())
        }
        Some(ExecCmd::Attach {
            session,
            exec_id,
            from,
            stdin,
            tty,
        }) => {
            let first = pb::exec_request::Kind::Attach(pb::ExecAttach {
                session_id: session,
                exec_id,
                from_offset: from,
            });
            stream(ch, bearer, first, stdin || tty, tty, true).await
        }
        None => {
            let session = args
                .session
                .ok_or("exec needs a SESSION (or `exec attach`, `exec list`)")?;
            let execution_id =
                super::execution_id_or_current(&ch, &bearer, &session, args.execution_id).await?;
            let pty = args.tty.then(terminal::size);
            let first = pb::exec_request::Kind::Start(pb::ExecStart {
                session_id: session,
                execution_id,
                turn_id: args.turn,
                argv: args.argv,
                keep_stdin_open: args.stdin,
                pty,
                timeout_ms: args.timeout_ms,
                ..Default::default()
            });
            stream(ch, bearer, first, args.stdin || args.tty, args.tty, false).await
        }
    }
}

/// Runs an Exec (or, with `attach`, an Attach) stream opened by `first`.
async fn stream(
    ch: Channel,
    bearer: Bearer,
    first: pb::exec_request::Kind,
    stdin: bool,
    tty: bool,
    attach: bool,
) -> Result<(), String> {
    let (tx, rx) = mpsc::channel(16);
    let _ = tx.send(pb::ExecRequest { kind: Some(first) }).await;
    if tty && attach {
        // The command's terminal takes this one's size.
        let resize = pb::exec_request::Kind::Resize(terminal::size());
        let _ = tx.send(pb::ExecRequest { kind: Some(resize) }).await;
    }
    // Raw mode for as long as this lives (restored on drop).
    let _raw = if tty { terminal::raw_mode() } else { None };
    if tty && _raw.is_some() {
        terminal::follow_size(tx.clone());
    }
    if stdin {
        forward_stdin(tx);
    } else {
        drop(tx);
    }
    let mut cl = ExecClient::with_interceptor(ch, bearer.clone());
    let rx = tokio_stream::wrappers::ReceiverStream::new(rx);
    let mut stream = if attach {
        cl.attach(rx).await
    } else {
        cl.exec(rx).await
    }
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
            Some(R::Started(_)) if tty => {
                eprint!("host-agent: exec {} (pid {})\r\n", m.exec_id, m.pid);
            }
            Some(R::Attached(a)) if a.lost_bytes > 0 => {
                eprint!(
                    "host-agent: {} bytes before offset {} are no longer kept\r\n",
                    a.lost_bytes, a.start_offset
                );
            }
            Some(R::Rejected(why)) => return Err(format!("rejected: {why}")),
            Some(R::Ask(a)) => {
                eprint!(
                    "host-agent: waiting for approval: ask {} for {:?} (rule {:?}); \
                     answer with `host-agent approvals answer {} {} once|always|reject`\r\n",
                    a.ask_id, a.subject, a.rule, a.session_id, a.ask_id
                );
            }
            Some(R::Exit(e)) => {
                let why = if e.reason.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", e.reason)
                };
                return match e.status {
                    Some(pb::exec_exit::Status::Code(0)) if why.is_empty() => Ok(()),
                    Some(pb::exec_exit::Status::Code(c)) => {
                        Err(format!("command exited with code {c}{why}"))
                    }
                    Some(pb::exec_exit::Status::Signal(n)) => {
                        Err(format!("command killed by signal {n}{why}"))
                    }
                    None => Err(format!("command ended without a status{why}")),
                };
            }
            _ => {}
        }
    }
    Ok(())
}

/// Forwards this process's stdin, then its end, on a thread of its own.
fn forward_stdin(tx: mpsc::Sender<pb::ExecRequest>) {
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
}

fn exec_state_name(state: i32) -> &'static str {
    match pb::ExecState::try_from(state) {
        Ok(pb::ExecState::Starting) => "STARTING",
        Ok(pb::ExecState::Running) => "RUNNING",
        Ok(pb::ExecState::Exited) => "EXITED",
        Ok(pb::ExecState::Rejected) => "REJECTED",
        Ok(pb::ExecState::Lost) => "LOST",
        _ => "UNSPECIFIED",
    }
}

fn exit_text(e: Option<&pb::ExecExit>) -> String {
    let Some(e) = e else {
        return String::new();
    };
    let status = match e.status {
        Some(pb::exec_exit::Status::Code(c)) => format!("code {c}"),
        Some(pb::exec_exit::Status::Signal(n)) => format!("signal {n}"),
        None => "unknown".into(),
    };
    if e.reason.is_empty() {
        status
    } else {
        format!("{status} ({})", e.reason)
    }
}

impl crate::cli::output::Record for pb::ExecInfo {
    fn headers() -> &'static [&'static str] {
        &["EXEC", "STATE", "EXIT", "PID", "TURN", "OUTPUT", "COMMAND"]
    }

    fn cells(&self) -> Vec<String> {
        let exit = match exit_text(self.exit.as_ref()) {
            e if e.is_empty() => self.detail.clone(),
            e => e,
        };
        vec![
            self.exec_id.clone(),
            exec_state_name(self.state).into(),
            exit,
            self.pid.to_string(),
            self.turn_id.clone(),
            self.output_bytes.to_string(),
            self.argv.join(" "),
        ]
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "exec_id": self.exec_id,
            "session_id": self.session_id,
            "turn_id": self.turn_id,
            "argv": self.argv,
            "state": exec_state_name(self.state),
            "exit": exit_text(self.exit.as_ref()),
            "detail": self.detail,
            "pid": self.pid,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "output_bytes": self.output_bytes,
            "output_start_offset": self.output_start_offset,
            "pty": self.pty,
            "timeout_ms": self.timeout_ms,
            "attached": self.attached,
        })
    }
}
