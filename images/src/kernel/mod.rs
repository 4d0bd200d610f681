//! The guest kernel recipe: Debian's linux-source, the checked-in
//! microVM config fragment, `allnoconfig` + fragment, `olddefconfig`, a check
//! that every required option survived, then (unless only the config is
//! wanted) `make vmlinux`.
//!
//! Outputs: `config` (the final `.config`) and, for a full build, `vmlinux`
//! (ELF with the PVH entry note). Cached by input hash: source package and
//! version, the fragment's hash, the compiler version and the recipe version.

pub mod config;
pub mod source;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cache::{Built, Entry, Outcome};
use crate::disk;
use crate::elf;
use crate::error::{Error, IoContext, Result};
use crate::hash;
use crate::manifest::Inputs;
use crate::progress::{self, Echo};
use crate::tools::{self, Need};
use crate::{debian, RECIPE_VERSION};

/// The source package the issue asks for (the 6.12 series).
pub const DEFAULT_SOURCE_PACKAGE: &str = "linux-source-6.12";
/// Room a minimal kernel build takes, with margin.
const BUILD_MIB: u64 = 3000;

/// What to build.
#[derive(Debug, Clone)]
pub struct KernelOptions {
    /// Cache root.
    pub cache_dir: PathBuf,
    /// Debian source package.
    pub source_package: String,
    /// Its version; `None` resolves apt's candidate (recorded in the manifest).
    pub source_version: Option<String>,
    /// The config fragment.
    pub fragment: PathBuf,
    /// Stop after the config check (seconds instead of a long build).
    pub check_config_only: bool,
    /// Parallel make jobs.
    pub jobs: usize,
}

/// The fragment checked in beside this crate.
pub fn default_fragment() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kernel/microvm.config")
}

fn needs(check_only: bool) -> Vec<Need> {
    let mut n = vec![
        Need::Program("apt-get"),
        Need::Program("apt-cache"),
        Need::Program("dpkg-deb"),
        Need::Program("tar"),
        Need::Program("xz"),
        Need::Program("make"),
        Need::Program("gcc"),
        Need::Program("flex"),
        Need::Program("bison"),
    ];
    if !check_only {
        n.extend([
            Need::Program("bc"),
            Need::Program("perl"),
            Need::Header("gelf.h"),
            Need::Header("openssl/ssl.h"),
        ]);
    }
    n
}

/// Builds (or finds in the cache) the kernel config or the kernel.
pub fn build(opts: &KernelOptions) -> Result<Outcome> {
    let step = if opts.check_config_only {
        "kernel config"
    } else {
        "kernel"
    };
    // A malformed fragment is reported before anything is downloaded.
    let required = config::load_fragment(&opts.fragment)?;
    tools::require(step, &needs(opts.check_config_only))?;
    let version = match &opts.source_version {
        Some(v) => v.clone(),
        None => debian::candidate_version(&opts.source_package)?,
    };
    let mut inputs = Inputs::default();
    inputs
        .set("recipe", RECIPE_VERSION)
        .set("arch", "x86_64")
        .set("source_package", opts.source_package.clone())
        .set("source_version", version.clone())
        .set("config_fragment_sha256", hash::file_sha256(&opts.fragment)?);
    if !opts.check_config_only {
        inputs.set("gcc", compiler_version()?);
    }
    let cache_dir = crate::cache::absolute(&opts.cache_dir)?;
    let kind = if opts.check_config_only {
        "kernel-config"
    } else {
        "kernel"
    };
    let entry = Entry::in_cache(&cache_dir, kind, inputs);
    let objdir = cache_dir.join("work").join(format!(
        "{kind}-{}",
        crate::cache::short(&entry.input_hash())
    ));
    entry.get_or_build(step, |out| {
        let tree = source::unpacked_tree(&cache_dir, &opts.source_package, &version)?;
        configure(step, &tree, &objdir, &opts.fragment)?;
        config::verify(&opts.fragment, &objdir.join(".config"))?;
        progress::note(
            step,
            &format!(
                "all {} required options survived olddefconfig",
                required.len()
            ),
        );
        let cfg = out.join("config");
        std::fs::copy(objdir.join(".config"), &cfg).at(&cfg, "keep the config")?;
        let mut outputs = vec!["config".to_string()];
        if !opts.check_config_only {
            compile(step, &tree, &objdir, opts.jobs)?;
            let vmlinux = out.join("vmlinux");
            std::fs::copy(objdir.join("vmlinux"), &vmlinux).at(&vmlinux, "keep vmlinux")?;
            if !elf::has_pvh_note(&vmlinux)? {
                return Err(Error::BadArtifact {
                    path: vmlinux,
                    message: "the kernel has no PVH entry note (CONFIG_PVH)".into(),
                });
            }
            outputs.push("vmlinux".into());
        }
        std::fs::remove_dir_all(&objdir).at(&objdir, "clean the build directory")?;
        Ok(Built {
            outputs,
            packages: BTreeMap::from([(opts.source_package.clone(), version.clone())]),
        })
    })
}

fn make(tree: &Path, objdir: &Path) -> Command {
    let mut c = Command::new("make");
    c.arg("-C")
        .arg(tree)
        .arg(format!("O={}", objdir.display()))
        .arg("ARCH=x86_64")
        // Reproducible builds: fixed build identity in the version banner.
        .env("KBUILD_BUILD_USER", "agentvm")
        .env("KBUILD_BUILD_HOST", "images")
        .env("KBUILD_BUILD_TIMESTAMP", "1970-01-01");
    c
}

/// `allnoconfig` with the fragment as `KCONFIG_ALLCONFIG`, then
/// `olddefconfig`, in a fresh `objdir`.
fn configure(step: &str, tree: &Path, objdir: &Path, fragment: &Path) -> Result<()> {
    if objdir.exists() {
        std::fs::remove_dir_all(objdir).at(objdir, "clean the build directory")?;
    }
    std::fs::create_dir_all(objdir).at(objdir, step)?;
    let fragment = std::fs::canonicalize(fragment).at(fragment, step)?;
    progress::note(step, "make allnoconfig with the microVM fragment");
    progress::run(
        step,
        make(tree, objdir)
            .arg(format!("KCONFIG_ALLCONFIG={}", fragment.display()))
            .arg("allnoconfig"),
        Echo::Lines,
        objdir,
    )?;
    progress::note(step, "make olddefconfig");
    progress::run(
        step,
        make(tree, objdir).arg("olddefconfig"),
        Echo::Lines,
        objdir,
    )?;
    Ok(())
}

fn compile(step: &str, tree: &Path, objdir: &Path, jobs: usize) -> Result<()> {
    disk::ensure_free(objdir, BUILD_MIB, "build the kernel")?;
    progress::note(
        step,
        &format!("make -j{jobs} vmlinux (tens of minutes on a few cores; every 100th line shown)"),
    );
    progress::run(
        step,
        make(tree, objdir).arg(format!("-j{jobs}")).arg("vmlinux"),
        Echo::Every(100),
        objdir,
    )?;
    Ok(())
}

fn compiler_version() -> Result<String> {
    let out = progress::run(
        "kernel",
        Command::new("gcc").arg("-dumpfullversion"),
        Echo::Quiet,
        Path::new("/tmp"),
    )?;
    Ok(format!("gcc {}", out.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_build_needs_more_than_the_config_check() {
        let check = needs(true);
        let full = needs(false);
        assert!(check.contains(&Need::Program("flex")));
        assert!(!check.contains(&Need::Header("gelf.h")));
        assert!(full.contains(&Need::Header("gelf.h")));
        assert!(full.contains(&Need::Header("openssl/ssl.h")));
        assert!(full.contains(&Need::Program("bc")));
    }
}
