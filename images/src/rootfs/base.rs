//! The Debian base tree: `debootstrap --variant=minbase` with the packages
//! the guest needs, packed as `base.tar` and cached, so that a new guest-init
//! or image size does not download Debian again.

use std::path::Path;
use std::process::Command;

use crate::cache::{self, Built, Entry, Outcome};
use crate::debian;
use crate::disk;
use crate::error::{IoContext, Result};
use crate::manifest::Inputs;
use crate::progress::{self, Echo};
use crate::RECIPE_VERSION;

/// Packages installed on top of minbase (which brings bash, coreutils).
pub const PACKAGES: &[&str] = &["bash", "coreutils", "git", "ca-certificates", "nftables"];
/// Room debootstrap needs for the tree and its tarball, with margin.
const BASE_MIB: u64 = 1500;

/// Where the base comes from.
#[derive(Debug, Clone)]
pub struct BaseOptions {
    /// Debian suite, e.g. `bookworm`.
    pub suite: String,
    /// Mirror URL (a snapshot.debian.org URL pins every version by date).
    pub mirror: String,
}

/// Builds (or finds) the base tarball.
pub fn build(cache_dir: &Path, opts: &BaseOptions) -> Result<Outcome> {
    let step = "rootfs base";
    let mut inputs = Inputs::default();
    inputs
        .set("recipe", RECIPE_VERSION)
        .set("arch", "amd64")
        .set("suite", opts.suite.clone())
        .set("mirror", opts.mirror.clone())
        .set("variant", "minbase")
        .set("include", PACKAGES.join(","));
    let entry = Entry::in_cache(cache_dir, "rootfs-base", inputs);
    let work = cache_dir
        .join("work")
        .join(format!("rootfs-base-{}", cache::short(&entry.input_hash())));
    entry.get_or_build(step, |out| {
        disk::ensure_free(cache_dir, BASE_MIB, "debootstrap the root filesystem")?;
        if work.exists() {
            std::fs::remove_dir_all(&work).at(&work, step)?;
        }
        let tree = work.join("tree");
        std::fs::create_dir_all(&tree).at(&tree, step)?;
        progress::note(
            step,
            &format!(
                "debootstrap {} from {} (a few minutes)",
                opts.suite, opts.mirror
            ),
        );
        progress::run(
            step,
            Command::new(crate::tools::program(step, "debootstrap")?)
                .arg("--variant=minbase")
                .arg(format!("--include={}", PACKAGES.join(",")))
                .arg("--arch=amd64")
                .arg(&opts.suite)
                .arg(&tree)
                .arg(&opts.mirror),
            Echo::Lines,
            &tree,
        )?;
        // Package lists and downloaded .debs are not needed in the guest.
        for dir in ["var/cache/apt/archives", "var/lib/apt/lists"] {
            clear_files(&tree.join(dir))?;
        }
        let packages = debian::installed_packages(&tree)?;
        progress::note(
            step,
            &format!("{} packages installed; packing base.tar", packages.len()),
        );
        let tar = out.join("base.tar");
        progress::run(
            step,
            Command::new("tar")
                .args(["--numeric-owner", "--xattrs", "-cf"])
                .arg(&tar)
                .arg("-C")
                .arg(&tree)
                .arg("."),
            Echo::Lines,
            out,
        )?;
        std::fs::remove_dir_all(&work).at(&work, step)?;
        Ok(Built {
            outputs: vec!["base.tar".into()],
            packages,
        })
    })
}

/// Removes the plain files directly in `dir` (keeps subdirectories such as
/// `partial/`, which apt expects).
fn clear_files(dir: &Path) -> Result<()> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for e in rd {
        let e = e.at(dir, "clean apt caches")?;
        if e.file_type().at(e.path(), "clean apt caches")?.is_file() {
            std::fs::remove_file(e.path()).at(e.path(), "clean apt caches")?;
        }
    }
    Ok(())
}
