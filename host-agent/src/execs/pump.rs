//! The pump of one command: takes what the guest sends about it from the
//! guest channel's route and writes it into the command's record.

use std::sync::Arc;

use proto::guest::{exec_exited, guest_message::Kind as Out, output, GuestMessage};
use proto::hostagent as pb;
use tokio::sync::{mpsc, watch};

use super::record::{End, ExecRecord};
use super::ring::{Stream, MAX_CHUNK};
use super::ExecTable;

/// Moves messages about `rec` from `rx` (its route on the guest channel)
/// into it until it ends; `drop_behind` turning true (the session
/// stopping) makes output stop waiting for slow streams. When the route
/// closes first, the command is LOST.
pub async fn pump(
    rec: Arc<ExecRecord>,
    table: Arc<ExecTable>,
    mut rx: mpsc::Receiver<GuestMessage>,
    mut drop_behind: watch::Receiver<bool>,
) {
    while let Some(m) = rx.recv().await {
        let end = match m.kind {
            Some(Out::ExecStarted(e)) => {
                rec.started(e.pid, e.argv);
                None
            }
            Some(Out::Output(o)) => {
                let stream = if o.stream == output::Stream::Stderr as i32 {
                    Stream::Stderr
                } else {
                    Stream::Stdout
                };
                for piece in o.data.chunks(MAX_CHUNK) {
                    rec.append(stream, piece, &mut drop_behind).await;
                }
                None
            }
            Some(Out::ExecExited(e)) => Some(End::Exited(pb::ExecExit {
                status: e.status.map(|s| match s {
                    exec_exited::Status::Code(c) => pb::exec_exit::Status::Code(c),
                    exec_exited::Status::Signal(n) => pb::exec_exit::Status::Signal(n),
                }),
                reason: e.reason,
            })),
            Some(Out::ExecRejected(r)) => Some(End::Rejected(if r.rule.is_empty() {
                r.reason
            } else {
                format!("{} ({})", r.reason, r.rule)
            })),
            Some(Out::AskRequest(a)) => {
                rec.ask(pb::Ask {
                    ask_id: a.ask_id,
                    session_id: rec.meta.session_id.clone(),
                    exec_id: a.exec_id,
                    turn_id: a.turn_id,
                    tool: a.tool,
                    subject: a.subject,
                    rule: a.rule,
                    asked_at: crate::clock::now_ms(),
                });
                None
            }
            Some(Out::Error(e)) => Some(End::Failed(format!("guest-init: {}", e.message))),
            _ => None,
        };
        if let Some(end) = end {
            rec.finish(end);
            table.trim();
            return;
        }
    }
    rec.finish(End::Lost(
        "its guest channel closed before it ended (the session stopped, or host-agent lost \
         the guest)"
            .into(),
    ));
    table.trim();
}
