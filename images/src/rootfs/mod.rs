//! The root filesystem recipe: the cached Debian base ([`base`]),
//! guest-init and the agent user on top ([`customize`]), an ext4 image
//! ([`mkfs`]).
//!
//! Output: `rootfs.ext4`. Cached by input hash: the base's input hash,
//! guest-init's SHA-256, the size and the recipe version. The manifest lists
//! every installed Debian package and its version.

pub mod base;
pub mod customize;
pub mod guest_init;
pub mod mkfs;

use std::path::PathBuf;
use std::process::Command;

use crate::cache::{self, Built, Entry, Outcome};
use crate::error::{Error, IoContext, Result};
use crate::hash;
use crate::manifest::Inputs;
use crate::progress::{self, Echo};
use crate::tools::{self, Need};
use crate::RECIPE_VERSION;

/// Version of [`customize`]'s changes; part of the rootfs input hash.
const CUSTOMIZE_VERSION: &str = "2";
/// Default image size.
pub const DEFAULT_SIZE_MIB: u64 = 1024;
/// Timestamps inside the image (2024-01-01), for reproducibility.
const EPOCH: u64 = 1_704_067_200;

/// What to build.
#[derive(Debug, Clone)]
pub struct RootfsOptions {
    /// Cache root.
    pub cache_dir: PathBuf,
    /// Image size in MiB.
    pub size_mib: u64,
    /// A static guest-init; `None` builds one with cargo.
    pub guest_init: Option<PathBuf>,
    /// The cargo profile when building guest-init.
    pub guest_init_profile: guest_init::Profile,
    /// Debian suite and mirror.
    pub base: base::BaseOptions,
}

/// Builds (or finds in the cache) the root filesystem image.
pub fn build(opts: &RootfsOptions) -> Result<Outcome> {
    let step = "rootfs";
    tools::require(
        step,
        &[
            Need::Program("debootstrap"),
            Need::Program("mkfs.ext4"),
            Need::Program("tar"),
        ],
    )?;
    if let Some(p) = &opts.guest_init {
        guest_init::check_static(p)?;
    }
    if !tools::is_root() {
        return Err(Error::NotRoot {
            step: "images rootfs".into(),
            why: "runs debootstrap and gives files to root and the agent user".into(),
        });
    }
    let guest_init = match &opts.guest_init {
        Some(p) => {
            guest_init::check_static(p)?;
            p.clone()
        }
        None => guest_init::build_static(opts.guest_init_profile)?,
    };
    let cache_dir = crate::cache::absolute(&opts.cache_dir)?;
    let base = base::build(&cache_dir, &opts.base)?;
    let mut inputs = Inputs::default();
    inputs
        .set("recipe", RECIPE_VERSION)
        // Version of the customize step alone (bumped when it changes what
        // it writes, without invalidating the Debian base).
        .set("customize", CUSTOMIZE_VERSION)
        .set("base_input_hash", base.manifest.input_hash.clone())
        .set("guest_init_sha256", hash::file_sha256(&guest_init)?)
        .set("size_mib", opts.size_mib.to_string())
        .set(
            "agent_user",
            format!("{}:{}", customize::AGENT_USER, customize::AGENT_ID),
        );
    let entry = Entry::in_cache(&cache_dir, "rootfs", inputs);
    let work = cache_dir
        .join("work")
        .join(format!("rootfs-{}", cache::short(&entry.input_hash())));
    let uuid = mkfs::uuid_from_hash(&entry.input_hash());
    entry.get_or_build(step, |out| {
        if work.exists() {
            std::fs::remove_dir_all(&work).at(&work, step)?;
        }
        let tree = work.join("tree");
        std::fs::create_dir_all(&tree).at(&tree, step)?;
        progress::note(step, "unpacking the base tree");
        progress::run(
            step,
            Command::new("tar")
                .args(["--numeric-owner", "--xattrs", "-xpf"])
                .arg(base.path("base.tar"))
                .arg("-C")
                .arg(&tree),
            Echo::Lines,
            &tree,
        )?;
        let init = customize::install_init(&tree, &guest_init)?;
        progress::note(step, &format!("guest-init installed at {}", init.display()));
        customize::add_agent_user(&tree)?;
        customize::write_system_files(&tree)?;
        customize::link_sbin_programs(&tree)?;
        let image = out.join("rootfs.ext4");
        mkfs::make_image(&tree, &image, opts.size_mib, &uuid, EPOCH)?;
        std::fs::remove_dir_all(&work).at(&work, step)?;
        Ok(Built {
            outputs: vec!["rootfs.ext4".into()],
            packages: base.manifest.packages.clone(),
        })
    })
}
