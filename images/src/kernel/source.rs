//! Debian's linux-source package: download the pinned version and unpack
//! its tarball once into the cache.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::debian;
use crate::disk;
use crate::error::{Error, IoContext, Result};
use crate::progress::{self, Echo};

/// Marker written once a tree is completely unpacked.
const UNPACKED: &str = ".images-unpacked";
/// Room an unpacked 6.12 tree takes, with margin.
const TREE_MIB: u64 = 2000;

/// Returns the unpacked kernel tree of `package=version`, fetching and
/// unpacking it into `cache` if needed.
pub fn unpacked_tree(cache: &Path, package: &str, version: &str) -> Result<PathBuf> {
    let step = "kernel source";
    // Kbuild refuses source paths with colons (an epoch in the version).
    let name = format!("{package}_{}", version.replace(':', "_"));
    let dest = cache.join("src").join(&name);
    let tree = dest.join(package);
    let lock = cache.join("src").join(format!("{name}.lock"));
    let _lock = crate::cache::Lock::acquire(&lock, step)?;
    if dest.join(UNPACKED).exists() && tree.join("Makefile").exists() {
        progress::note(step, &format!("cached: {}", tree.display()));
        return Ok(tree);
    }
    let deb = debian::download(package, version, "all", &cache.join("downloads"))?;
    disk::ensure_free(cache, TREE_MIB, "unpack the kernel source")?;
    if dest.exists() {
        std::fs::remove_dir_all(&dest).at(&dest, "remove a partly unpacked tree")?;
    }
    std::fs::create_dir_all(&dest).at(&dest, step)?;
    let tarball = format!("./usr/src/{package}.tar.xz");
    progress::note(
        step,
        &format!("extracting {tarball} from {}", deb.display()),
    );
    progress::run(
        step,
        Command::new("sh")
            .arg("-c")
            .arg("dpkg-deb --fsys-tarfile \"$1\" | tar -x -C \"$2\" \"$3\"")
            .args(["sh"])
            .arg(&deb)
            .arg(&dest)
            .arg(&tarball),
        Echo::Lines,
        &dest,
    )?;
    let xz = dest.join(&tarball);
    if !xz.exists() {
        return Err(Error::Package {
            package: package.to_string(),
            message: format!("the package holds no {tarball}"),
        });
    }
    progress::note(
        step,
        "unpacking the kernel tree (about 1.5 GB, a minute or two)",
    );
    progress::run(
        step,
        Command::new("tar")
            .arg("-xJf")
            .arg(&xz)
            .arg("-C")
            .arg(&dest),
        Echo::Quiet,
        &dest,
    )?;
    let usr = dest.join("usr");
    std::fs::remove_dir_all(&usr).at(&usr, step)?;
    if !tree.join("Makefile").exists() {
        return Err(Error::Package {
            package: package.to_string(),
            message: format!("the tarball did not unpack to {}", tree.display()),
        });
    }
    let marker = dest.join(UNPACKED);
    std::fs::write(&marker, version).at(&marker, step)?;
    Ok(tree)
}
