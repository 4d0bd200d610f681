//! `hostagent.v1.Snapshots`: the node's snapshot layers (golden snapshots
//! and the diffs written over them), listed and collected. Admin scope
//! (`auth::methods`): the listing shows every session's layers.

use std::sync::Arc;

use proto::hostagent as pb;
use proto::hostagent::snapshots_server::Snapshots;
use tonic::{Request, Response, Status};

use crate::error::{Error, Result};
use crate::layers::{LayerInfo, LayerRow, Layers};
use crate::sessions::Manager;

/// The Snapshots service.
pub struct SnapshotsApi(pub Arc<Manager>);

/// A listed layer (with its holders and children) as the API reports it.
pub fn layer_pb(l: &LayerInfo) -> pb::Layer {
    pb::Layer {
        holders: l.holders.clone(),
        children: l.children,
        ..row_pb(&l.row)
    }
}

/// A layer record as the API reports it, without holders or children (a
/// deleted layer has neither).
pub fn row_pb(r: &LayerRow) -> pb::Layer {
    pb::Layer {
        layer_id: r.id.clone(),
        parent_id: r.parent.clone(),
        kind: r.kind.clone(),
        bytes: r.bytes,
        created_at: r.created_at,
        holders: Vec::new(),
        children: 0,
        dir: r.dir.clone(),
    }
}

/// CollectGarbage's answer for the layers `gone`: each of them, and the
/// bytes they took.
pub fn collected_pb(gone: &[LayerRow]) -> pb::CollectGarbageResponse {
    pb::CollectGarbageResponse {
        deleted: gone.iter().map(row_pb).collect(),
        bytes_freed: gone.iter().map(|l| l.bytes).sum(),
    }
}

/// Runs `f` on the layer store off the async threads (it reads the
/// database and, collecting, removes directories).
async fn on_layers<T, F>(layers: &Arc<Layers>, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce(&Layers) -> Result<T> + Send + 'static,
{
    let layers = layers.clone();
    tokio::task::spawn_blocking(move || f(&layers))
        .await
        .map_err(|e| Error::Snapshot(format!("the snapshot layer task failed: {e}")))?
}

#[tonic::async_trait]
impl Snapshots for SnapshotsApi {
    async fn list_layers(
        &self,
        _req: Request<pb::ListLayersRequest>,
    ) -> Result<Response<pb::ListLayersResponse>, Status> {
        let listed = on_layers(&self.0.layers, Layers::list).await?;
        Ok(Response::new(pb::ListLayersResponse {
            layers: listed.iter().map(layer_pb).collect(),
        }))
    }

    async fn collect_garbage(
        &self,
        req: Request<pb::CollectGarbageRequest>,
    ) -> Result<Response<pb::CollectGarbageResponse>, Status> {
        let dry_run = req.into_inner().dry_run;
        let gone = on_layers(&self.0.layers, move |l| l.collect(dry_run)).await?;
        if !dry_run && !gone.is_empty() {
            tracing::info!(
                layers = gone.len(),
                "CollectGarbage deleted snapshot layers nothing held"
            );
        }
        Ok(Response::new(collected_pb(&gone)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, parent: &str, bytes: u64) -> LayerRow {
        LayerRow {
            id: id.into(),
            parent: parent.into(),
            kind: "pause".into(),
            dir: format!("/state/layers/{id}"),
            bytes,
            created_at: 1_700_000_000_000,
            owner_session: "s1".into(),
        }
    }

    #[test]
    fn a_listed_layer_carries_its_holders_and_children() {
        let l = layer_pb(&LayerInfo {
            row: row("a", "g", 4096),
            holders: vec!["session:s1".into()],
            children: 2,
        });
        assert_eq!(l.layer_id, "a");
        assert_eq!(l.parent_id, "g");
        assert_eq!(l.kind, "pause");
        assert_eq!(l.bytes, 4096);
        assert_eq!(l.created_at, 1_700_000_000_000);
        assert_eq!(l.holders, ["session:s1"]);
        assert_eq!(l.children, 2);
        assert_eq!(l.dir, "/state/layers/a");
    }

    #[test]
    fn bytes_freed_sums_the_deleted_layers() {
        let r = collected_pb(&[row("c", "b", 10), row("b", "", 32)]);
        let ids: Vec<&str> = r.deleted.iter().map(|l| l.layer_id.as_str()).collect();
        assert_eq!(ids, ["c", "b"]);
        assert_eq!(r.bytes_freed, 42);
        assert_eq!(collected_pb(&[]), pb::CollectGarbageResponse::default());
    }
}
