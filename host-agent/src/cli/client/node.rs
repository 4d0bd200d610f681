//! `host-agent node`: the node's version and capacity.

use proto::hostagent as pb;
use proto::hostagent::node_client::NodeClient;
use tonic::transport::Channel;

use super::{status as st, Bearer};
use crate::cli::output::{print_all, NodeInfo, Output};

/// Runs `node`.
pub async fn run(ch: Channel, bearer: Bearer, out: Output) -> Result<(), String> {
    let mut cl = NodeClient::with_interceptor(ch, bearer);
    let version = cl
        .get_version(pb::GetVersionRequest {})
        .await
        .map_err(st)?
        .into_inner();
    let capacity = cl
        .get_capacity(pb::GetCapacityRequest {})
        .await
        .map_err(st)?
        .into_inner();
    print_all(&[NodeInfo { version, capacity }], out);
    Ok(())
}
