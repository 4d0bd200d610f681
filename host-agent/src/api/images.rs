//! `hostagent.v1.Images`.

use std::sync::Arc;

use proto::hostagent as pb;
use proto::hostagent::images_server::Images;
use tonic::{Request, Response, Status};

use super::{idempotent, image_pb};
use crate::auth::layer::caller_of;
use crate::error::Error;
use crate::images::{valid_id, validate};
use crate::sessions::{now_ms, FromSession, Manager};
use crate::store::ImageRow;

/// The Images service.
pub struct ImagesApi(pub Arc<Manager>);

/// RegisterImage's `shares` checked, their directories resolved under the
/// share roots and their mount paths filled in, in the stored form.
fn image_shares(mgr: &Manager, shares: &[pb::Share]) -> Result<String, Error> {
    let mut shares = crate::shares::check_request("shares", shares)?;
    crate::shares::resolve(mgr.share_roots.as_ref(), "shares", &mut shares)?;
    crate::shares::fill_mount_paths(&mut shares);
    crate::shares::check_distinct_mounts(&shares)?;
    Ok(crate::shares::encode(&shares))
}

impl ImagesApi {
    /// RegisterImage from a session's snapshot (`from_session_id`).
    async fn register_from_session(
        &self,
        caller: &crate::auth::Caller,
        r: pb::RegisterImageRequest,
    ) -> Result<Response<pb::Image>, Status> {
        valid_id(&r.image_id)?;
        let set: Vec<&str> = [
            ("kernel_path", !r.kernel_path.is_empty()),
            ("rootfs_path", !r.rootfs_path.is_empty()),
            ("initrd_path", !r.initrd_path.is_empty()),
            ("cmdline", !r.cmdline.is_empty()),
            ("mem_mib", r.mem_mib != 0),
            ("vcpus", r.vcpus != 0),
            ("guest_init", r.guest_init),
            ("shares", !r.shares.is_empty()),
        ]
        .into_iter()
        .filter(|(_, given)| *given)
        .map(|(name, _)| name)
        .collect();
        if !set.is_empty() {
            return Err(Error::invalid(format!(
                "{} must be left empty with from_session_id: an image made from a session \
                 takes them from the session's image",
                set.join(", ")
            ))
            .into());
        }
        let io_limits = match &r.io_limits {
            Some(l) => Some(crate::io_limits::IoLimits::from_pb(Some(l))?.encode()),
            None => None,
        };
        let fp = format!(
            "{:?}",
            (
                &r.image_id,
                &r.from_session_id,
                &r.from_snapshot_dir,
                &r.io_limits
            )
        );
        let mgr = &self.0;
        let img = idempotent(
            mgr,
            caller,
            &r.idempotency_key,
            "RegisterImage",
            &fp,
            async {
                let row = mgr
                    .image_from_session(FromSession {
                        image_id: r.image_id.clone(),
                        session_id: r.from_session_id.clone(),
                        snapshot_dir: r.from_snapshot_dir.clone(),
                        io_limits,
                    })
                    .await?;
                Ok(image_pb(&row))
            },
        )
        .await?;
        Ok(Response::new(img))
    }
}

#[tonic::async_trait]
impl Images for ImagesApi {
    async fn register_image(
        &self,
        req: Request<pb::RegisterImageRequest>,
    ) -> Result<Response<pb::Image>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        if !r.from_session_id.is_empty() {
            return self.register_from_session(&caller, r).await;
        }
        if !r.from_snapshot_dir.is_empty() {
            return Err(Error::invalid(
                "from_snapshot_dir needs from_session_id (the session it is a snapshot of)",
            )
            .into());
        }
        let fp = format!(
            "{:?}",
            (
                &r.image_id,
                &r.kernel_path,
                &r.rootfs_path,
                &r.initrd_path,
                &r.cmdline,
                r.mem_mib,
                r.vcpus,
                r.guest_init,
                &r.io_limits
            )
        );
        // Only when given, so keys stored before shares still match.
        let fp = match r.shares.is_empty() {
            true => fp,
            false => format!("{fp} shares:{:?}", r.shares),
        };
        let mgr = &self.0;
        let img = idempotent(
            mgr,
            &caller,
            &r.idempotency_key,
            "RegisterImage",
            &fp,
            async {
                let mut row = ImageRow {
                    id: r.image_id.clone(),
                    kernel: r.kernel_path.clone(),
                    rootfs: r.rootfs_path.clone(),
                    initrd: r.initrd_path.clone(),
                    cmdline: r.cmdline.clone(),
                    mem_mib: r.mem_mib,
                    vcpus: r.vcpus,
                    guest_init: r.guest_init,
                    golden_dir: String::new(),
                    created_at: now_ms(),
                    golden_built_at: 0,
                    io_limits: crate::io_limits::IoLimits::from_pb(r.io_limits.as_ref())?.encode(),
                    source_session: String::new(),
                    shares: String::new(),
                };
                validate(&mut row, &mgr.image_roots)?;
                row.shares = image_shares(mgr, &r.shares)?;
                mgr.store.insert_image(&row)?;
                Ok(image_pb(&row))
            },
        )
        .await?;
        Ok(Response::new(img))
    }

    async fn build_golden_snapshot(
        &self,
        req: Request<pb::BuildGoldenSnapshotRequest>,
    ) -> Result<Response<pb::Image>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        valid_id(&r.image_id)?;
        if r.settle_ms > 60_000 {
            return Err(Error::invalid(format!(
                "settle_ms {} is out of range 0..=60000",
                r.settle_ms
            ))
            .into());
        }
        let fp = format!("{:?}", (&r.image_id, r.settle_ms));
        let mgr = &self.0;
        let img = idempotent(
            mgr,
            &caller,
            &r.idempotency_key,
            "BuildGoldenSnapshot",
            &fp,
            async { Ok(image_pb(&mgr.build_golden(&r.image_id, r.settle_ms).await?)) },
        )
        .await?;
        Ok(Response::new(img))
    }

    async fn get_image(
        &self,
        req: Request<pb::GetImageRequest>,
    ) -> Result<Response<pb::Image>, Status> {
        let id = req.into_inner().image_id;
        valid_id(&id)?;
        let img = self
            .0
            .store
            .image(&id)?
            .ok_or_else(|| Error::not_found("image", &id))?;
        Ok(Response::new(image_pb(&img)))
    }

    async fn list_images(
        &self,
        _req: Request<pb::ListImagesRequest>,
    ) -> Result<Response<pb::ListImagesResponse>, Status> {
        let images = self.0.store.images()?.iter().map(image_pb).collect();
        Ok(Response::new(pb::ListImagesResponse { images }))
    }

    async fn delete_image(
        &self,
        req: Request<pb::DeleteImageRequest>,
    ) -> Result<Response<pb::DeleteImageResponse>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        valid_id(&r.image_id)?;
        let mgr = &self.0;
        let resp = idempotent(
            mgr,
            &caller,
            &r.idempotency_key,
            "DeleteImage",
            &r.image_id,
            async {
                let _g = mgr.golden_lock.lock().await;
                if mgr.store.image(&r.image_id)?.is_none() {
                    return Err(Error::not_found("image", &r.image_id));
                }
                if mgr.image_in_use(&r.image_id) {
                    return Err(Error::FailedPrecondition(format!(
                        "image {:?} has live sessions; stop them first",
                        r.image_id
                    )));
                }
                mgr.pool.drain(&r.image_id);
                mgr.store.delete_image(&r.image_id)?;
                // Its golden snapshots go unless sessions (forks, sessions
                // paused to disk) or images still descend from them; the
                // rest of its directory goes now.
                mgr.layers
                    .release(None, &crate::layers::image_holder(&r.image_id))?;
                let dir = mgr.image_dir(&r.image_id);
                if let Ok(entries) = std::fs::read_dir(&dir) {
                    for e in entries.flatten() {
                        let path = e.path();
                        if mgr
                            .store
                            .layer_by_dir(&path.display().to_string())?
                            .is_none()
                        {
                            let _ = std::fs::remove_dir_all(&path);
                        }
                    }
                }
                let _ = std::fs::remove_dir(&dir);
                Ok(pb::DeleteImageResponse {})
            },
        )
        .await?;
        Ok(Response::new(resp))
    }
}
