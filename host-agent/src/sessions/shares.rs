//! A session's shares at each of its VMs' starts: the virtiofsd processes
//! started first (see [`crate::shares::virtiofsd`]), their devices on the
//! vmm's command line.

use vmm_api::command::VmmCommand;

use super::*;
use crate::shares::{virtiofsd, Share, Started};

impl Manager {
    /// How this node runs virtiofsd.
    pub fn fs_settings(&self) -> virtiofsd::Settings<'_> {
        virtiofsd::Settings {
            binary: &self.virtiofsd_path,
            cache: self.cfg.virtiofs_cache,
            roots: self.share_roots.as_ref(),
        }
    }

    /// Starts a virtiofsd for each of `shares` for the VM in `dir` (jailed
    /// as `uid`), waits until each listens, and gives `command` their
    /// devices; returns the daemons for the vmm to take
    /// ([`supervisor::spawn`]).
    pub(super) async fn launch_shares(
        &self,
        dir: &Path,
        uid: Option<u32>,
        shares: &[Share],
        command: &mut VmmCommand,
    ) -> Result<Started> {
        let launched = virtiofsd::launch(self.fs_settings(), dir, uid, shares).await?;
        command.devices_mut().fs = launched.specs;
        Ok(launched.daemons)
    }

    /// Session `sess`'s shares in force.
    pub(super) fn shares_of(&self, sess: &Session) -> Vec<Share> {
        crate::shares::decode_or_none(&sess.row().shares, &sess.id)
    }

    /// Image `image`'s shares (its golden snapshot's devices).
    pub(super) fn image_shares(&self, image: &ImageRow) -> Vec<Share> {
        crate::shares::decode_or_none(&image.shares, &image.id)
    }
}
