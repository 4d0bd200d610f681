//! `hostagent.v1.Node`: capacity and version (health is the standard
//! `grpc.health.v1.Health` service).

use std::sync::Arc;

use proto::hostagent as pb;
use proto::hostagent::node_server::Node;
use tonic::{Request, Response, Status};

use crate::sessions::Manager;

/// The Node service.
pub struct NodeApi(pub Arc<Manager>);

#[tonic::async_trait]
impl Node for NodeApi {
    async fn get_capacity(
        &self,
        _req: Request<pb::GetCapacityRequest>,
    ) -> Result<Response<pb::Capacity>, Status> {
        let (vcpus_used, mem_used) = self.0.used_resources();
        let vcpus_total = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        Ok(Response::new(pb::Capacity {
            vcpus_total,
            vcpus_used,
            memory_mib_total: crate::accounting::host_memory_mib(),
            memory_mib_used: mem_used,
            sessions_max: self.0.cfg.max_sessions,
            sessions_live: self.0.live_count() as u32,
            warm_pool_ready: self.0.pool.ready() as u32,
            memory_mib_limit: self.0.memory_limit_mib(),
            memory_overcommit_ratio: self.0.cfg.memory_overcommit_ratio,
            snapshot_bytes_used: self.0.layers.session_bytes()?,
            snapshot_bytes_quota: self.0.cfg.snapshot_quota_mib << 20,
        }))
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
