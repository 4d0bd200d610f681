//! `host-agent usage`: usage records, of one session or all.

use proto::hostagent as pb;
use proto::hostagent::usage_client::UsageClient;
use tonic::transport::Channel;

use super::{status as st, Bearer};
use crate::cli::output::{print_all, Output};

/// Runs `usage [--session ID] [--since SEQ]`.
pub async fn run(
    ch: Channel,
    bearer: Bearer,
    out: Output,
    session: String,
    since: u64,
) -> Result<(), String> {
    let mut cl = UsageClient::with_interceptor(ch, bearer);
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
    Ok(())
}
