//! `host-agent events watch`: lifecycle events, followed live.

use clap::Subcommand;
use proto::hostagent as pb;
use proto::hostagent::events_client::EventsClient;
use tonic::transport::Channel;

use super::{status as st, Bearer};
use crate::cli::output::{print_streamed, Output};

/// The `events` subcommands.
#[derive(Subcommand)]
pub enum EventsCmd {
    /// Stream events after a seq.
    Watch {
        #[arg(long, default_value_t = 0)]
        since: u64,
    },
}

/// Runs `events watch --since SEQ`.
pub async fn watch(ch: Channel, bearer: Bearer, out: Output, since: u64) -> Result<(), String> {
    let mut cl = EventsClient::with_interceptor(ch, bearer);
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
    Ok(())
}
