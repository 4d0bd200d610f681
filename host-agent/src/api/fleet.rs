//! `hostagent.v1.Fleet`: the registry's nodes, images pushed to and
//! pulled from the fleet's object store, and sessions moved to another
//! node through it.

use std::sync::Arc;

use proto::hostagent as pb;
use proto::hostagent::fleet_server::Fleet as FleetService;
use tonic::{Request, Response, Status};

use crate::auth::layer::caller_of;
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

    async fn move_session(
        &self,
        req: Request<pb::MoveSessionRequest>,
    ) -> Result<Response<pb::Session>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        crate::api::check_session_id(&r.session_id)?;
        let fleet = self.fleet()?;
        crate::fleet::bundle::check_to_node(&r.to_node, &fleet.node)?;
        if !fleet.has_image_store() {
            return Err(Error::FailedPrecondition(
                "moving a session needs the fleet's image store: start host-agent (here and \
                 on the node the session moves to) with the same --image-store URL, or --nats \
                 URL"
                .into(),
            )
            .into());
        }
        // Another client's session is NOT_FOUND, as a session that does not exist.
        crate::api::owned_session(&self.0, &caller, &r.session_id)?;
        let row = self.0.move_out(fleet, &r.session_id, &r.to_node).await?;
        Ok(Response::new(self.0.session_out(&row)))
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
