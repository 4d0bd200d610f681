//! Filling the warm pool ([`crate::pool`]): per image with a golden snapshot,
//! restore VMs paused until the pool holds the configured number.
//!
//! A VM of an image whose golden snapshot has a network device is restored
//! in a network made ahead for it: its namespace (named after its pool
//! directory), veth pair, tap owned by its jail's uid, and rules with an
//! empty allowlist, so its guest reaches nothing until a session takes it
//! and loads its own policy (`create.rs`).

use super::*;
use crate::pool::{WarmNetwork, WarmVm, NETNS_FILE};

impl Manager {
    /// Restores one paused warm VM of `image` in a new pool directory.
    async fn spawn_warm(&self, image: &ImageRow) -> Result<WarmVm> {
        let dir = self.pool_dir().join(uuid::Uuid::new_v4().to_string());
        let uid = self.allocate_jail_uid()?;
        let mut network = None;
        let started = async {
            // Warm VMs are of the image's own size.
            prepare_disk(image, &dir, uid, 0).await?;
            network = self.warm_network(image, &dir, uid).await?;
            let netns = network.as_ref().map(|n| n.vm().netns.clone());
            let (args, jail) = restore_launch(
                &self.cfg,
                image,
                &dir,
                true,
                Source::Golden,
                uid,
                netns.as_deref(),
            );
            // The image's shares: a session takes a warm VM only when its
            // shares are exactly these.
            let mut command = args.into();
            let fs = self
                .launch_shares(&dir, uid, &self.image_shares(image), &mut command)
                .await?;
            supervisor::spawn(
                &self.vmm_path,
                &dir,
                command,
                jail.as_ref(),
                netns.as_deref(),
                fs,
            )
        }
        .await;
        let vmm = match started {
            Ok(vmm) => vmm,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                if let Some(uid) = uid {
                    self.jail_uids.release(uid);
                }
                if let Some(n) = network {
                    let _ = tokio::task::spawn_blocking(move || n.release()).await;
                }
                return Err(e);
            }
        };
        let ready =
            match std::fs::write(dir.join("pid"), format!("{} {}", vmm.pid, vmm.start_ticks)) {
                Ok(()) => {
                    supervisor::wait_for_state(&vmm, VmState::Paused, Duration::from_secs(30)).await
                }
                Err(e) => Err(Error::io(format!("writing {}/pid", dir.display()), e)),
            };
        let warm = WarmVm { vmm, network };
        if let Err(e) = ready {
            self.pool.discard(warm);
            return Err(e);
        }
        Ok(warm)
    }

    /// Makes the network of a warm VM of `image` in `dir` when the image's
    /// golden snapshot has a network device: its tap owned by the jail's
    /// `uid`, an empty allowlist (the node's fixed denials only). The
    /// namespace's name is recorded in the directory ([`NETNS_FILE`]) first,
    /// so whoever finds the directory knows which namespace is its.
    async fn warm_network(
        &self,
        image: &ImageRow,
        dir: &Path,
        uid: Option<u32>,
    ) -> Result<Option<WarmNetwork>> {
        let Some(node) = self.network_for(image)? else {
            return Ok(None);
        };
        let id = vmm_api::command::jail_id(dir);
        let dir = dir.to_path_buf();
        tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&dir)
                .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
            let vm = node.make(&id, uid.map(|u| (u, u)), &[])?;
            let record = dir.join(NETNS_FILE);
            if let Err(e) = std::fs::write(&record, &vm.netns) {
                node.release(&vm);
                return Err(Error::io(
                    format!("recording the warm VM's namespace in {}", record.display()),
                    e,
                ));
            }
            Ok(Some(WarmNetwork::new(node, vm)))
        })
        .await
        .map_err(|e| Error::Network(format!("the warm VM's network task failed: {e}")))?
    }

    /// Tops up every image with a golden snapshot to `size` warm VMs.
    pub async fn fill_pool(&self, size: usize) {
        let Ok(images) = self.store.images() else {
            return;
        };
        // An image made from a session restores a chain of layers and
        // becomes each session on ForkSession: it has no warm VMs.
        for image in images
            .into_iter()
            .filter(|i| !i.golden_dir.is_empty() && i.source_session.is_empty())
        {
            if self.network.is_none() && has_network(&image) {
                // Its VMs cannot be restored here; CreateSession says why.
                continue;
            }
            while self.pool.count(&image.id) < size {
                match self.spawn_warm(&image).await {
                    Ok(vm) => {
                        // The image may have been deleted meanwhile.
                        if matches!(self.store.image(&image.id), Ok(Some(_))) {
                            self.pool.push(&image.id, vm);
                        } else {
                            self.pool.discard(vm);
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(image = %image.id, error = %e, "warm pool: restore failed");
                        break;
                    }
                }
            }
        }
    }

    /// Runs [`Manager::fill_pool`] forever.
    pub async fn run_pool(self: Arc<Self>, size: usize) {
        loop {
            self.fill_pool(size).await;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}
