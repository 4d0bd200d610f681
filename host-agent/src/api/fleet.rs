//! `hostagent.v1.Fleet`: the registry's nodes, and images pushed to and
//! pulled from the fleet's object store.

use std::sync::Arc;

use proto::hostagent as pb;
use proto::hostagent::fleet_server::Fleet as FleetService;
use tonic::{Request, Response, Status};

use crate::error::Error;
use crate::fleet::Fleet;
use crate::sessions::Manager;

/// The Fleet service.
pub struct FleetApi(pub Arc<Manager>);

impl FleetApi {
    fn fleet(&self) -> Result<&Arc<Fleet>, Status> {
        self.0.fleet.get().ok_or_else(|| {
            Error::FailedPrecondition(
                "this node is not in a fleet: start host-agent with --nats URL".into(),
            )
            .into()
        })
    }
}

#[tonic::async_trait]
impl FleetService for FleetApi {
    async fn list_nodes(
        &self,
        _req: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        let nodes = self.fleet()?.nodes().await?;
        Ok(Response::new(pb::ListNodesResponse {
            nodes: nodes.iter().map(|n| n.to_pb()).collect(),
        }))
    }

    async fn push_image(
        &self,
        req: Request<pb::PushImageRequest>,
    ) -> Result<Response<pb::PushImageResponse>, Status> {
        let id = req.into_inner().image_id;
        let m = self.fleet()?.push_image(&self.0, &id).await?;
        Ok(Response::new(pb::PushImageResponse {
            image_id: id,
            store: m.store,
            files: m.files,
            bytes: m.bytes,
            chunks: m.chunks,
            chunks_uploaded: m.chunks_moved,
            bytes_uploaded: m.bytes_moved,
        }))
    }

    async fn pull_image(
        &self,
        req: Request<pb::PullImageRequest>,
    ) -> Result<Response<pb::PullImageResponse>, Status> {
        let id = req.into_inner().image_id;
        let (image, m) = self.fleet()?.pull_image(&self.0, &id).await?;
        Ok(Response::new(pb::PullImageResponse {
            image: Some(crate::api::image_pb(&image)),
            store: m.store,
            files: m.files,
            bytes: m.bytes,
            chunks: m.chunks,
            bytes_fetched: m.bytes_moved,
        }))
    }
}
