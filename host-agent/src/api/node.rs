//! `hostagent.v1.Node`: capacity and version (health is the standard
//! `grpc.health.v1.Health` service).

use std::sync::Arc;

use proto::hostagent as pb;
use proto::hostagent::node_server::Node;
use tonic::{Request, Response, Status};

use crate::sessions::Manager;

/// The node's capacity now (GetCapacity, and the fleet registry's entry).
pub fn capacity(mgr: &Manager) -> crate::error::Result<pb::Capacity> {
    let (vcpus_used, mem_used) = mgr.used_resources();
    let vcpus_total = std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1);
    Ok(pb::Capacity {
        vcpus_total,
        vcpus_used,
        memory_mib_total: crate::accounting::host_memory_mib(),
        memory_mib_used: mem_used,
        sessions_max: mgr.cfg.max_sessions,
        sessions_live: mgr.live_count() as u32,
        warm_pool_ready: mgr.pool.ready() as u32,
        memory_mib_limit: mgr.memory_limit_mib(),
        memory_overcommit_ratio: mgr.cfg.memory_overcommit_ratio,
        snapshot_bytes_used: mgr.layers.session_bytes()?,
        snapshot_bytes_quota: mgr.cfg.snapshot_quota_mib << 20,
    })
}

/// The Node service.
pub struct NodeApi(pub Arc<Manager>);

#[tonic::async_trait]
impl Node for NodeApi {
    async fn get_capacity(
        &self,
        _req: Request<pb::GetCapacityRequest>,
    ) -> Result<Response<pb::Capacity>, Status> {
        Ok(Response::new(capacity(&self.0)?))
    }

    async fn get_version(
        &self,
        _req: Request<pb::GetVersionRequest>,
    ) -> Result<Response<pb::Version>, Status> {
        Ok(Response::new(pb::Version {
            version: env!("CARGO_PKG_VERSION").to_string(),
            vmm_path: self.0.vmm_path.display().to_string(),
        }))
    }
}
