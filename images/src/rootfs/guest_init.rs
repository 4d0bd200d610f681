//! The guest-init binary that becomes /sbin/init: found or built static,
//! and checked to be static (the root filesystem holds no Rust runtime, and
//! PID 1 must not depend on the dynamic loader).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::elf;
use crate::error::{Error, Result};
use crate::progress::{self, Echo};
use crate::tools::{self, Need};

/// The Rust target guest-init is built for.
pub const TARGET: &str = "x86_64-unknown-linux-gnu";
/// The command that builds a static guest-init, for messages and docs.
pub const BUILD_COMMAND: &str = "RUSTFLAGS='-C target-feature=+crt-static' cargo build --release -p guest-init --target x86_64-unknown-linux-gnu";

/// The workspace this crate lives in.
pub fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_path_buf()
}

/// The cargo profile guest-init is built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Profile {
    /// Optimised: what images ship.
    Release,
    /// Unoptimised, much faster to compile: for tests of the recipe.
    Dev,
}

impl Profile {
    /// The directory cargo builds this profile into.
    fn dir(self) -> &'static str {
        match self {
            Profile::Release => "release",
            Profile::Dev => "debug",
        }
    }
}

/// Where cargo leaves the static build.
pub fn built_path(profile: Profile) -> PathBuf {
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    target_dir
        .join(TARGET)
        .join(profile.dir())
        .join("guest-init")
}

/// Builds guest-init static with cargo (incremental: fast when up to date)
/// and returns its path.
pub fn build_static(profile: Profile) -> Result<PathBuf> {
    let step = "guest-init";
    tools::require(step, &[Need::Program("cargo")])?;
    let mut args = vec!["build", "-p", "guest-init", "--target", TARGET];
    if profile == Profile::Release {
        args.insert(1, "--release");
    }
    progress::note(
        step,
        &format!(
            "building: RUSTFLAGS='-C target-feature=+crt-static' cargo {}",
            args.join(" ")
        ),
    );
    let root = workspace_root();
    progress::run(
        step,
        Command::new("cargo")
            .args(&args)
            .env("RUSTFLAGS", "-C target-feature=+crt-static")
            .current_dir(&root),
        Echo::Lines,
        &root,
    )?;
    let path = built_path(profile);
    check_static(&path)?;
    Ok(path)
}

/// Fails unless `path` is a static ELF program.
pub fn check_static(path: &Path) -> Result<()> {
    if !path.exists() {
        return Err(Error::BadArtifact {
            path: path.to_path_buf(),
            message: format!("guest-init is not there; build it with {BUILD_COMMAND}"),
        });
    }
    if !elf::is_static(path)? {
        return Err(Error::BadArtifact {
            path: path.to_path_buf(),
            message: format!(
                "guest-init is dynamically linked (it has an ELF interpreter); build it with {BUILD_COMMAND}"
            ),
        });
    }
    Ok(())
}
