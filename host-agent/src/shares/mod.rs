//! virtio-fs shares: host directories a VM gets as virtio-fs devices, each
//! served by a virtiofsd of its own beside the VM's vmm ([`virtiofsd`]) and
//! mounted by guest-init before the repository is cloned.
//!
//! An image declares shares at RegisterImage (its golden snapshot is built
//! with their devices); a session's own (CreateSession `shares`) replace the
//! image's share of the same tag and come after the others. What the VM's
//! devices are follows from the tags alone: a session whose tags are the
//! image's, in order, is restored from the golden snapshot (the fresh
//! virtiofsd may serve other directories); any other set needs a VM booted
//! with its devices. This module is the model: checks, the merge, the
//! stored form and what guest-init is sent; starting and ending the daemons
//! is [`virtiofsd`].

mod daemons;
pub mod virtiofsd;

use std::path::{Component, Path, PathBuf};

use proto::hostagent as pb;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::path_roots::{Kind, PathRoots};

pub use daemons::{Daemons, Started};
pub use virtiofsd::{FsLaunch, VirtiofsCache};

/// Most shares a VM may have (the vmm has 18 virtio devices in all; a disk,
/// the network, vsock and rng take four).
pub const MAX_SHARES: usize = 8;

/// Longest mount path accepted.
const MAX_MOUNT_PATH: usize = 4096;

/// Trees a share may not be mounted on or in (the guest's kernel
/// interfaces).
const RESERVED_MOUNTS: [&str; 3] = ["/proc", "/sys", "/dev"];

/// The config setting (and flag) that allows host directories to be shared.
pub const ROOTS_SETTING: &str = "allowed_share_roots";
/// The flag for [`ROOTS_SETTING`].
pub const ROOTS_FLAG: &str = "allowed-share-root";

/// One share, as stored with an image or a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Share {
    /// The virtio-fs tag the guest mounts it by.
    pub tag: String,
    /// The host directory (resolved once checked against the roots).
    pub host_path: String,
    /// The guest cannot change it.
    pub read_only: bool,
    /// Where guest-init mounts it (empty in a request: the image's, else
    /// `/mnt/<tag>`; always filled once merged).
    pub mount_path: String,
}

impl Share {
    /// The share as the API reports it.
    pub fn to_pb(&self) -> pb::Share {
        pb::Share {
            tag: self.tag.clone(),
            host_path: self.host_path.clone(),
            read_only: self.read_only,
            mount_path: self.mount_path.clone(),
        }
    }

    /// The mount guest-init is asked for.
    pub fn to_mount(&self) -> proto::guest::Mount {
        proto::guest::Mount {
            tag: self.tag.clone(),
            path: self.mount_path.clone(),
            read_only: self.read_only,
        }
    }
}

/// The mount path of a share that names none: `/mnt/<tag>`.
pub fn default_mount_path(tag: &str) -> String {
    format!("/mnt/{tag}")
}

/// Checks the form of a request's shares (`field`: `shares`): tags,
/// duplicates, absolute host paths and mount paths. Host paths are not
/// looked at yet ([`resolve`] does); empty mount paths stay empty for
/// [`merge`] to fill.
pub fn check_request(field: &str, shares: &[pb::Share]) -> Result<Vec<Share>> {
    if shares.len() > MAX_SHARES {
        return Err(Error::invalid(format!(
            "{field}: {} shares given; at most {MAX_SHARES}",
            shares.len()
        )));
    }
    let mut out: Vec<Share> = Vec::with_capacity(shares.len());
    for (i, s) in shares.iter().enumerate() {
        let at = format!("{field}[{i}]");
        vmm_api::command::check_tag(&s.tag).map_err(|_| {
            Error::invalid(format!(
                "{at}.tag {:?} must be 1 to {} bytes of letters, digits, '_', '.' or '-'",
                s.tag,
                vmm_api::command::MAX_TAG_LEN
            ))
        })?;
        if let Some(j) = out.iter().position(|o| o.tag == s.tag) {
            return Err(Error::invalid(format!(
                "{at}.tag {:?} is also {field}[{j}]'s: each tag names one share",
                s.tag
            )));
        }
        if s.host_path.is_empty() {
            return Err(Error::invalid(format!(
                "{at}.host_path is required: the directory on this node to share"
            )));
        }
        if !s.mount_path.is_empty() {
            check_mount_path(&format!("{at}.mount_path"), &s.mount_path)?;
        }
        out.push(Share {
            tag: s.tag.clone(),
            host_path: s.host_path.clone(),
            read_only: s.read_only,
            mount_path: s.mount_path.clone(),
        });
    }
    Ok(out)
}

/// Checks a mount path (request field `field`): absolute, without `.` or
/// `..` parts, not `/` and not in /proc, /sys or /dev.
pub fn check_mount_path(field: &str, path: &str) -> Result<()> {
    let p = Path::new(path);
    // Textually too: components() quietly drops a "." in the middle.
    let plain = path.len() <= MAX_MOUNT_PATH
        && !path.contains('\0')
        && !path.split('/').any(|c| c == "." || c == "..")
        && p.is_absolute()
        && p.components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    if !plain {
        return Err(Error::invalid(format!(
            "{field} {path:?} must be an absolute path of at most {MAX_MOUNT_PATH} bytes \
             without '.' or '..' parts"
        )));
    }
    let p: PathBuf = p.components().collect();
    if p == Path::new("/") {
        return Err(Error::invalid(format!(
            "{field} {path:?} would hide the guest's root file system; mount it under \
             a directory such as /mnt"
        )));
    }
    if let Some(r) = RESERVED_MOUNTS.iter().find(|r| p.starts_with(r)) {
        return Err(Error::invalid(format!(
            "{field} {path:?} lies in {r}, which the guest's kernel provides; mount it \
             elsewhere (such as /mnt/<tag>)"
        )));
    }
    Ok(())
}

/// The roots shares must lie under, or why shares cannot be given at all
/// (`allowed_share_roots` is empty).
pub fn roots_or_refuse<'a>(roots: Option<&'a PathRoots>, field: &str) -> Result<&'a PathRoots> {
    roots.ok_or_else(|| {
        Error::FailedPrecondition(format!(
            "{field}: this node shares no host directories: {ROOTS_SETTING} is empty; an \
             operator allows directories with {ROOTS_SETTING} in the config file (or \
             --{ROOTS_FLAG} DIR)"
        ))
    })
}

/// Resolves each share's host path (links followed) and checks that it is
/// an existing directory under `roots` (request field `field`); the shares
/// then hold the resolved paths.
pub fn resolve(roots: Option<&PathRoots>, field: &str, shares: &mut [Share]) -> Result<()> {
    if shares.is_empty() {
        return Ok(());
    }
    let roots = roots_or_refuse(roots, field)?;
    for (i, s) in shares.iter_mut().enumerate() {
        let resolved = roots.check(&format!("{field}[{i}].host_path"), &s.host_path, Kind::Dir)?;
        s.host_path = resolved.display().to_string();
    }
    Ok(())
}

/// A session's shares: `image`'s, each replaced by the session's share of
/// the same tag (its host path and read-only flag; its mount path when it
/// gives one), then the session's other shares, in the order given; every
/// mount path filled. Refuses more than [`MAX_SHARES`] in all and two
/// shares on one mount path.
pub fn merge(image: &[Share], session: &[Share]) -> Result<Vec<Share>> {
    let mut out: Vec<Share> = image.to_vec();
    for s in session {
        match out.iter_mut().find(|o| o.tag == s.tag) {
            Some(o) => {
                o.host_path = s.host_path.clone();
                o.read_only = s.read_only;
                if !s.mount_path.is_empty() {
                    o.mount_path = s.mount_path.clone();
                }
            }
            None => out.push(s.clone()),
        }
    }
    fill_mount_paths(&mut out);
    if out.len() > MAX_SHARES {
        return Err(Error::invalid(format!(
            "shares: the image's and the session's make {} shares; at most {MAX_SHARES}",
            out.len()
        )));
    }
    check_distinct_mounts(&out)?;
    Ok(out)
}

/// Fills the mount paths left empty with `/mnt/<tag>`.
pub fn fill_mount_paths(shares: &mut [Share]) {
    for s in shares.iter_mut().filter(|s| s.mount_path.is_empty()) {
        s.mount_path = default_mount_path(&s.tag);
    }
}

/// Refuses two shares mounted on the same path.
pub fn check_distinct_mounts(shares: &[Share]) -> Result<()> {
    for (i, s) in shares.iter().enumerate() {
        let here: PathBuf = Path::new(&s.mount_path).components().collect();
        if let Some(o) = shares[..i]
            .iter()
            .find(|o| Path::new(&o.mount_path).components().collect::<PathBuf>() == here)
        {
            return Err(Error::invalid(format!(
                "shares: {:?} and {:?} are both mounted on {}; give one another mount_path",
                o.tag, s.tag, s.mount_path
            )));
        }
    }
    Ok(())
}

/// The tags of `shares`, in device order.
pub fn tags(shares: &[Share]) -> Vec<&str> {
    shares.iter().map(|s| s.tag.as_str()).collect()
}

/// Whether a VM with `shares` has the devices of a snapshot made with
/// `snapshot` (the same tags in the same order): it can be restored from it.
pub fn same_devices(shares: &[Share], snapshot: &[Share]) -> bool {
    tags(shares) == tags(snapshot)
}

/// The stored form: JSON, empty for none (rows from before shares).
pub fn encode(shares: &[Share]) -> String {
    if shares.is_empty() {
        return String::new();
    }
    // A Vec of plain strings and bools always serializes.
    serde_json::to_string(shares).unwrap_or_default()
}

/// Reads [`encode`]'s form back.
pub fn decode(stored: &str) -> Result<Vec<Share>> {
    if stored.is_empty() {
        return Ok(Vec::new());
    }
    serde_json::from_str(stored)
        .map_err(|e| Error::Corrupt(format!("stored shares {stored:?} do not read back: {e}")))
}

/// [`decode`] where a damaged row must not stop the caller: none, logged.
pub fn decode_or_none(stored: &str, whose: &str) -> Vec<Share> {
    decode(stored).unwrap_or_else(|e| {
        tracing::error!(of = whose, error = %e, "stored shares do not read back; none used");
        Vec::new()
    })
}

/// The API's form of stored shares.
pub fn to_pb(stored: &str, whose: &str) -> Vec<pb::Share> {
    decode_or_none(stored, whose)
        .iter()
        .map(Share::to_pb)
        .collect()
}

#[cfg(test)]
mod tests;
