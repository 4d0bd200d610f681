//! `host-agent events watch`: lifecycle and schedule events, followed live,
//! of every session the client may see, one session, sessions with labels,
//! or one kind.

use clap::Subcommand;
use proto::hostagent as pb;
use proto::hostagent::events_client::EventsClient;
use tonic::transport::Channel;

use super::labels::LabelArgs;
use super::{status as st, Bearer};
use crate::cli::output::{print_streamed, Output};

/// The `events` subcommands.
#[derive(Subcommand)]
pub enum EventsCmd {
    /// Stream events after a seq, then follow live.
    Watch {
        #[arg(long, default_value_t = 0)]
        since: u64,
        /// Only this session's events.
        #[arg(long, value_name = "ID", default_value = "")]
        session: String,
        #[command(flatten)]
        labels: LabelArgs,
        /// Only events of this kind (session, schedule); repeatable.
        #[arg(long = "kind", value_name = "KIND")]
        kinds: Vec<String>,
    },
}

/// Runs `events watch [--since SEQ] [--session ID] [--label KEY=VALUE]...`.
pub async fn run(ch: Channel, bearer: Bearer, out: Output, c: EventsCmd) -> Result<(), String> {
    let EventsCmd::Watch {
        since,
        session,
        labels,
        kinds,
    } = c;
    let mut cl = EventsClient::with_interceptor(ch, bearer);
    let mut stream = cl
        .watch(pb::WatchRequest {
            since_seq: since,
            session_id: session,
            labels: labels.map()?,
            kinds,
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
