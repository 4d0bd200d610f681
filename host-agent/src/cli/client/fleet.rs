//! `host-agent fleet nodes`: the nodes of the fleet's registry, as this
//! node reads them.

use clap::Subcommand;
use proto::hostagent as pb;
use proto::hostagent::fleet_client::FleetClient;
use serde_json::{json, Value};
use tonic::transport::Channel;

use super::{status as st, Bearer};
use crate::cli::output::{print_all, Output, Record};

/// The `fleet` subcommands.
#[derive(Subcommand)]
pub enum FleetCmd {
    /// The registry's nodes: address, sessions, vCPUs, memory, warm VMs,
    /// images, and how long ago each put its entry.
    Nodes,
}

/// Runs `fleet <cmd>`.
pub async fn run(ch: Channel, bearer: Bearer, out: Output, c: FleetCmd) -> Result<(), String> {
    let mut cl = FleetClient::with_interceptor(ch, bearer);
    match c {
        FleetCmd::Nodes => {
            let nodes = cl
                .list_nodes(pb::ListNodesRequest {})
                .await
                .map_err(st)?
                .into_inner()
                .nodes;
            print_all(&nodes, out);
        }
    }
    Ok(())
}

impl Record for pb::FleetNode {
    fn headers() -> &'static [&'static str] {
        &[
            "NODE",
            "ADDRESS",
            "SESSIONS",
            "VCPUS",
            "MEMORY_MIB",
            "WARM",
            "IMAGES",
            "VERSION",
        ]
    }
    fn cells(&self) -> Vec<String> {
        let c = self.capacity.unwrap_or_default();
        vec![
            self.node.clone(),
            self.address.clone(),
            format!("{}/{}", c.sessions_live, c.sessions_max),
            format!("{}/{}", c.vcpus_used, c.vcpus_total),
            format!("{}/{}", c.memory_mib_used, c.memory_mib_limit),
            c.warm_pool_ready.to_string(),
            if self.images.is_empty() {
                "-".into()
            } else {
                self.images.join(",")
            },
            self.version.clone(),
        ]
    }
    fn json(&self) -> Value {
        let c = self.capacity.unwrap_or_default();
        json!({
            "node": self.node,
            "address": self.address,
            "version": self.version,
            "updated_at": self.updated_at,
            "vcpus_total": c.vcpus_total,
            "vcpus_used": c.vcpus_used,
            "memory_mib_total": c.memory_mib_total,
            "memory_mib_used": c.memory_mib_used,
            "memory_mib_limit": c.memory_mib_limit,
            "sessions_max": c.sessions_max,
            "sessions_live": c.sessions_live,
            "snapshot_bytes_used": c.snapshot_bytes_used,
            "snapshot_bytes_quota": c.snapshot_bytes_quota,
            "warm_vms": self.warm_vms,
            "images": self.images,
        })
    }
}
