//! A session whose VM cannot be a restore of its image's golden snapshot,
//! because its shares' tags (its virtio-fs devices) are not the snapshot's:
//! its VM boots the image's kernel instead, with the same devices as a
//! restore plus its shares, on a fresh copy of the image's root disk.
//! Slower than a restore (a whole boot, then guest-init's answer), and its
//! memory descends from no layer: its first pause to disk is a full
//! snapshot, and its own layers serve its later restores.

use super::*;
use crate::images::resolve_files;
use crate::launch::{boot_launch, grow_disk};

impl Manager {
    /// A new vmm booting `image` for session `sess` in `dir` (with its
    /// network when `grant` is given), its shares' virtiofsd started first;
    /// not yet adopted.
    pub(super) async fn spawn_boot(
        self: &Arc<Self>,
        sess: &Arc<Session>,
        image: &ImageRow,
        dir: &Path,
        grant: Option<&create::Grant>,
    ) -> Result<VmmProcess> {
        // The image's files are read now: check them again, as a golden
        // build does (a pulled image's files are its own).
        let mut files = image.clone();
        if !crate::fleet::images::is_pulled_file(self, &image.id, &image.kernel) {
            resolve_files(&mut files, &self.image_roots)?;
        }
        let uid = self.allocate_jail_uid()?;
        // Recorded at once: a failure before the vmm is adopted fails the
        // session, which gives the uid back.
        {
            let mut i = sess.lock();
            i.row.jail_uid = uid.unwrap_or(0);
            self.store.put_session(&i.row)?;
        }
        let size = resources::Resources::decode(&sess.row().resources);
        if !files.rootfs.is_empty() {
            // The registered root disk as it was before any boot (the golden
            // one was left mounted by its guest).
            let (run, _) = supervisor::run_dirs(dir, uid.is_some());
            std::fs::create_dir_all(&run)
                .map_err(|e| Error::io(format!("creating {}", run.display()), e))?;
            let disk = run.join(VM_DISK);
            copy_disk(Path::new(&files.rootfs), &disk, uid.map(|u| (u, u))).await?;
            grow_disk(&disk, size.map_or(0, |s| s.disk_mib << 20))?;
        }
        let netns = match grant {
            Some(grant) => Some(self.session_network(sess, dir, uid, grant).await?),
            None => None,
        };
        let (spec, mut jail) = boot_launch(&self.cfg, &files, dir, uid, netns.as_deref());
        if let (Some(jail), Some(size)) = (jail.as_mut(), size) {
            jail.cpu_max = size.cpu_max();
        }
        let mut command = spec.into();
        let fs = self
            .launch_shares(dir, uid, &self.shares_of(sess), &mut command)
            .await?;
        tracing::info!(
            session = %sess.id,
            image = %image.id,
            "booting the image: the session's shares are not its golden snapshot's devices"
        );
        supervisor::spawn(
            &self.vmm_path,
            dir,
            command,
            jail.as_ref(),
            netns.as_deref(),
            fs,
        )
    }
}
