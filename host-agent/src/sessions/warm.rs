//! Filling the warm pool ([`crate::pool`]): per image with a golden snapshot,
//! restore VMs paused until the pool holds the configured number.

use super::*;

impl Manager {
    /// Restores one paused warm VM of `image` in a new pool directory.
    async fn spawn_warm(&self, image: &ImageRow) -> Result<VmmProcess> {
        let dir = self.pool_dir().join(uuid::Uuid::new_v4().to_string());
        let uid = self.allocate_jail_uid()?;
        let started = async {
            prepare_disk(image, &dir, uid).await?;
            let (args, jail) =
                restore_launch(&self.cfg, image, &dir, true, Source::Golden, uid, None);
            supervisor::spawn(&self.vmm_path, &dir, args.into(), jail.as_ref(), None)
        }
        .await;
        let vm = match started {
            Ok(vm) => vm,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                if let Some(uid) = uid {
                    self.jail_uids.release(uid);
                }
                return Err(e);
            }
        };
        let ready = match std::fs::write(dir.join("pid"), format!("{} {}", vm.pid, vm.start_ticks))
        {
            Ok(()) => {
                supervisor::wait_for_state(&vm, VmState::Paused, Duration::from_secs(30)).await
            }
            Err(e) => Err(Error::io(format!("writing {}/pid", dir.display()), e)),
        };
        if let Err(e) = ready {
            self.pool.discard(&vm);
            return Err(e);
        }
        Ok(vm)
    }

    /// Tops up every image with a golden snapshot to `size` warm VMs.
    pub async fn fill_pool(&self, size: usize) {
        let Ok(images) = self.store.images() else {
            return;
        };
        for image in images.into_iter().filter(|i| !i.golden_dir.is_empty()) {
            while self.pool.count(&image.id) < size {
                match self.spawn_warm(&image).await {
                    Ok(vm) => {
                        // The image may have been deleted meanwhile.
                        if matches!(self.store.image(&image.id), Ok(Some(_))) {
                            self.pool.push(&image.id, vm);
                        } else {
                            self.pool.discard(&vm);
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
