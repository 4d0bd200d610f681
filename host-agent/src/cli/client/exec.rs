//! `host-agent exec`: one command in a guest-init session, its stdin
//! forwarded, its output printed, its exit status this process's.

use proto::hostagent as pb;
use proto::hostagent::exec_client::ExecClient;
use tonic::transport::Channel;

use super::{status as st, Bearer};

/// Runs `exec SESSION [--execution-id ID] [--turn T] [--stdin] -- ARGV`.
pub async fn run(
    ch: Channel,
    bearer: Bearer,
    session: String,
    execution_id: Option<String>,
    turn: String,
    stdin: bool,
    argv: Vec<String>,
) -> Result<(), String> {
    let execution_id = super::execution_id_or_current(&ch, &bearer, &session, execution_id).await?;
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
            Some(R::Ask(a)) => {
                eprintln!(
                    "host-agent: waiting for approval: ask {} for {:?} (rule {:?}); \
                     answer with `host-agent approvals answer {} {} once|always|reject`",
                    a.ask_id, a.subject, a.rule, a.session_id, a.ask_id
                );
            }
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
    Ok(())
}
