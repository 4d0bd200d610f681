//! The ext4 image: a sparse file of the requested size filled from the tree
//! with `mkfs.ext4 -d` (no loop mount), then checked with `e2fsck -fn`.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use crate::error::{Error, IoContext, Result};
use crate::progress::{self, Echo};
use crate::tools;

/// Filesystem label of the root.
pub const LABEL: &str = "agentvm-root";

/// MiB `root` takes on disk, with room for ext4's metadata (inode tables,
/// journal) and some free space: the smallest sensible image size.
pub fn needed_mib(root: &Path) -> Result<u64> {
    let (bytes, inodes) = tree_usage(root)?;
    let data_mib = bytes.div_ceil(1 << 20);
    // 256-byte inodes at one per 16 KiB, the 64 MiB journal of a 1 GiB+ fs,
    // and 10 % slack.
    Ok(data_mib + data_mib / 10 + ((inodes * 256) >> 20) + 80)
}

fn tree_usage(root: &Path) -> Result<(u64, u64)> {
    let mut bytes = 0u64;
    let mut inodes = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).at(&dir, "measure the root filesystem")? {
            let e = e.at(&dir, "measure the root filesystem")?;
            let md =
                std::fs::symlink_metadata(e.path()).at(e.path(), "measure the root filesystem")?;
            inodes += 1;
            bytes += md.blocks() * 512;
            if md.is_dir() {
                stack.push(e.path());
            }
        }
    }
    Ok((bytes, inodes))
}

/// Creates `image` (`size_mib` MiB, sparse) holding `root`. `uuid` fixes
/// the filesystem UUID and directory hash seed, `epoch` its timestamps, so
/// the same tree gives the same image.
pub fn make_image(root: &Path, image: &Path, size_mib: u64, uuid: &str, epoch: u64) -> Result<()> {
    let step = "mkfs.ext4";
    let needed = needed_mib(root)?;
    if needed > size_mib {
        return Err(Error::RootfsTooSmall {
            needed_mib: needed,
            size_mib,
        });
    }
    crate::disk::ensure_free(image, needed, "write the root filesystem image")?;
    let f = std::fs::File::create(image).at(image, step)?;
    f.set_len(size_mib << 20).at(image, step)?;
    drop(f);
    progress::note(
        step,
        &format!(
            "{size_mib} MiB ext4 from {} (about {needed} MiB used)",
            root.display()
        ),
    );
    progress::run(
        step,
        Command::new(tools::program(step, "mkfs.ext4")?)
            .args(["-F", "-q", "-t", "ext4", "-L", LABEL, "-U", uuid])
            .arg("-E")
            .arg(format!("root_owner=0:0,hash_seed={uuid}"))
            .arg("-d")
            .arg(root)
            .arg(image)
            .env("E2FSPROGS_FAKE_TIME", epoch.to_string()),
        Echo::Lines,
        image,
    )?;
    progress::run(
        step,
        Command::new(tools::program(step, "e2fsck")?)
            .arg("-fn")
            .arg(image),
        Echo::Quiet,
        image,
    )?;
    Ok(())
}

/// A UUID (8-4-4-4-12) made from the first 32 hex digits of a hash.
pub fn uuid_from_hash(hex: &str) -> String {
    let h: String = hex.chars().chain(std::iter::repeat('0')).take(32).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_has_the_right_shape() {
        let u = uuid_from_hash("0123456789abcdef0123456789abcdefffff");
        assert_eq!(u, "01234567-89ab-cdef-0123-456789abcdef");
        assert_eq!(uuid_from_hash("ab").len(), 36);
    }

    #[test]
    fn measures_a_tree_and_refuses_an_image_too_small() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/b/f"), vec![1u8; 3 << 20]).unwrap();
        let need = needed_mib(&root).unwrap();
        assert!(need >= 83, "{need}");
        let e = make_image(&root, &d.path().join("img"), 8, &uuid_from_hash("00"), 0).unwrap_err();
        assert!(
            matches!(e, Error::RootfsTooSmall { size_mib: 8, .. }),
            "{e}"
        );
    }
}
