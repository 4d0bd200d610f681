//! Images made from a session (RegisterImage from_session_id): the
//! session's snapshot layer, with the disk that goes with it, becomes the
//! image's golden snapshot; every session of the image starts from it as a
//! fork does.

use super::*;
use crate::launch::GOLDEN_DISK;
use crate::layers::{image_holder, LayerRow};

/// What RegisterImage from a session asks.
#[derive(Debug, Clone)]
pub struct FromSession {
    /// The new image's id (checked by the caller).
    pub image_id: String,
    /// The session.
    pub session_id: String,
    /// One of its SnapshotSession snapshots (empty: take one now).
    pub snapshot_dir: String,
    /// The image's rate limits, encoded (empty: the session's image's).
    pub io_limits: Option<String>,
}

impl Manager {
    /// Registers image `req.image_id` whose golden snapshot is a snapshot of
    /// session `req.session_id` (see RegisterImage).
    pub async fn image_from_session(self: &Arc<Self>, req: FromSession) -> Result<ImageRow> {
        let sess = self.session(&req.session_id)?;
        if self.store.image(&req.image_id)?.is_some() {
            return Err(Error::AlreadyExists(format!(
                "image {:?} is already registered; delete it first or pick another id",
                req.image_id
            )));
        }
        let _op = sess.op.lock().await;
        let row = sess.row();
        let source_image = sess.lock().image.clone();
        let state = row.state;
        if state != S::Running as i32 && state != S::Ready as i32 && state != S::Paused as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {} is {}; an image is made from a RUNNING or PAUSED session",
                row.id,
                state_name(state)
            )));
        }
        let layer = match req.snapshot_dir.as_str() {
            "" => self.fork_layer(&sess, &row, &source_image).await?,
            dir => self.snapshot_with_disk(&row, &source_image, dir).await?,
        };
        // Its VMs are restored with the source's devices: a network device
        // needs a network (the marker a golden snapshot build writes).
        let marker = Path::new(&layer.dir).join(crate::launch::NETWORK_MARKER);
        if crate::launch::has_network(&source_image) && !marker.exists() {
            std::fs::write(&marker, "virtio-net on tap0 (from the source session)\n")
                .map_err(|e| Error::io(format!("writing {}", marker.display()), e))?;
        }
        let image = ImageRow {
            id: req.image_id.clone(),
            kernel: source_image.kernel.clone(),
            rootfs: source_image.rootfs.clone(),
            initrd: source_image.initrd.clone(),
            cmdline: source_image.cmdline.clone(),
            mem_mib: source_image.mem_mib,
            vcpus: source_image.vcpus,
            guest_init: source_image.guest_init,
            golden_dir: layer.dir.clone(),
            created_at: now_ms(),
            golden_built_at: now_ms(),
            io_limits: req
                .io_limits
                .clone()
                .unwrap_or_else(|| source_image.io_limits.clone()),
            source_session: row.id.clone(),
            // Its snapshot has the session's virtio-fs devices.
            shares: row.shares.clone(),
        };
        self.layers.hold(&layer.id, &image_holder(&image.id))?;
        if let Err(e) = self.store.insert_image(&image) {
            let _ = self
                .layers
                .release(Some(&layer.id), &image_holder(&image.id));
            return Err(e);
        }
        tracing::info!(image = %image.id, session = %row.id, layer = %layer.id, "image made from a session's snapshot");
        Ok(image)
    }

    /// Session `row`'s SnapshotSession snapshot `dir`, with the copy of the
    /// disk taken with it put in the layer (where images keep their disk).
    async fn snapshot_with_disk(
        &self,
        row: &SessionRow,
        image: &ImageRow,
        dir: &str,
    ) -> Result<LayerRow> {
        let layer = self.own_snapshot(&row.id, dir)?;
        let kept = Path::new(&layer.dir).join(GOLDEN_DISK);
        if !image.rootfs.is_empty() && !kept.exists() {
            let copy = super::ops::snapshot_disk(Path::new(&row.dir), &layer.id);
            copy_disk(&copy, &kept, None).await?;
            self.layers.grew(&layer.id)?;
        }
        Ok(layer)
    }
}
