//! Images: registration checks and golden snapshot builds.
//!
//! A golden snapshot is built by booting the image in a fresh vmm, waiting
//! until it is ready (for images without guest-init: running, plus a settle
//! time), pausing it and writing a full snapshot to
//! `<state>/images/<id>/golden-<time>`. Every session of the image restores
//! that directory; nothing session-specific is in it.

use crate::error::{Error, Result};
use crate::path_roots::{Kind, PathRoots};
use crate::store::ImageRow;

/// Longest accepted kernel command line.
pub const MAX_CMDLINE: usize = 2048;

/// Checks an image id: 1..=64 of `[A-Za-z0-9._-]`, not starting with '.'.
pub fn valid_id(id: &str) -> Result<()> {
    check_name("image_id", id, 64)
}

/// Checks `id`, the value of request field `field`: 1..=`max` of
/// `[A-Za-z0-9._-]`, not starting with '.' (so it names a file safely).
pub fn check_name(field: &str, id: &str, max: usize) -> Result<()> {
    if id.is_empty() || id.len() > max {
        return Err(Error::invalid(format!(
            "{field} must be 1 to {max} characters, got {}",
            id.len()
        )));
    }
    if id.starts_with('.')
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(Error::invalid(format!(
            "{field} {id:?} may only hold letters, digits, '.', '_' and '-' and must not start with '.'"
        )));
    }
    Ok(())
}

/// Checks the image's files against `roots` and replaces each path by what
/// it resolves to (so a link changed later does not change the image).
pub fn resolve_files(img: &mut ImageRow, roots: &PathRoots) -> Result<()> {
    for (field, path) in [
        ("kernel_path", &mut img.kernel),
        ("rootfs_path", &mut img.rootfs),
        ("initrd_path", &mut img.initrd),
    ] {
        if !path.is_empty() {
            *path = roots.check(field, path, Kind::File)?.display().to_string();
        }
    }
    Ok(())
}

/// Validates and fills defaults of a registration; its files must lie
/// under `roots`.
pub fn validate(img: &mut ImageRow, roots: &PathRoots) -> Result<()> {
    valid_id(&img.id)?;
    if img.kernel.is_empty() {
        return Err(Error::invalid("kernel_path is required"));
    }
    resolve_files(img, roots)?;
    if img.cmdline.len() > MAX_CMDLINE {
        return Err(Error::invalid(format!(
            "cmdline is {} bytes; at most {MAX_CMDLINE}",
            img.cmdline.len()
        )));
    }
    if img.cmdline.bytes().any(|b| b == 0 || b == b'\n') {
        return Err(Error::invalid("cmdline must not contain NUL or newline"));
    }
    if img.mem_mib == 0 {
        img.mem_mib = 128;
    }
    if img.mem_mib > 65536 {
        return Err(Error::invalid(format!(
            "mem_mib {} is out of range 1..=65536",
            img.mem_mib
        )));
    }
    if img.vcpus == 0 {
        img.vcpus = 1;
    }
    if img.vcpus > 32 {
        return Err(Error::invalid(format!(
            "vcpus {} is out of range 1..=32",
            img.vcpus
        )));
    }
    Ok(())
}
