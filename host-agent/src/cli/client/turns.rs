//! `host-agent turns end SESSION TURN`: ends a turn, printing what it killed.

use clap::Subcommand;
use proto::hostagent as pb;
use proto::hostagent::exec_client::ExecClient;
use tonic::transport::Channel;

use super::{status as st, Bearer};
use crate::cli::output::{print_all, Output};

/// The `turns` subcommands.
#[derive(Subcommand)]
pub enum TurnsCmd {
    /// End a turn: kill every process its commands started.
    End {
        /// Session id.
        session: String,
        /// The turn id its commands were started with (`exec --turn`).
        turn: String,
    },
}

/// Runs a `turns` subcommand.
pub async fn run(ch: Channel, bearer: Bearer, out: Output, cmd: TurnsCmd) -> Result<(), String> {
    let TurnsCmd::End { session, turn } = cmd;
    let mut cl = ExecClient::with_interceptor(ch, bearer);
    let ended = cl
        .end_turn(pb::EndTurnRequest {
            session_id: session,
            turn_id: turn,
        })
        .await
        .map_err(st)?
        .into_inner();
    print_all(&ended.killed, out);
    Ok(())
}
