//! virtiofsd, the vhost-user backend of the share scenarios' virtio-fs
//! devices: `$AGENTVM_VIRTIOFSD` when set, else the copy the project's tests
//! use, `$HOME/.cache/agentvm/virtiofsd-<VERSION>/bin/virtiofsd`, installed
//! there with `cargo install --locked` when it is missing (building it needs
//! libseccomp-dev and libcap-ng-dev, which `run` installs). The outer VM
//! runs the host's binary (it sees the host's tree read-only).

use std::path::{Path, PathBuf};
use std::process::Command;

use images::error::IoContext;

use super::{note, run, PrepareError, Result};

/// The virtiofsd release the harness installs (the same as vmm/tests').
pub const VERSION: &str = "1.14.0";

/// The variable that names a virtiofsd to use instead (as host-agent and
/// the vmm's tests read it).
const ENV: &str = "AGENTVM_VIRTIOFSD";

/// The virtiofsd to run, installed first if need be; checked to start.
pub fn ensure() -> Result<PathBuf> {
    // Empty counts as unset, as host-agent reads it.
    if let Some(path) = std::env::var_os(ENV).filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            return Err(PrepareError::Missing(format!(
                "${ENV} is {}, which is not a file",
                path.display()
            )));
        }
        check(&path)?;
        return Ok(path);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    let root = PathBuf::from(home).join(format!(".cache/agentvm/virtiofsd-{VERSION}"));
    let bin = root.join("bin/virtiofsd");
    if !bin.is_file() {
        install(&root)?;
    }
    check(&bin)?;
    Ok(bin)
}

/// `cargo install`s virtiofsd into `root` (through a scratch root renamed
/// into place, so a half-built install is never taken for one).
fn install(root: &Path) -> Result<()> {
    let parent = root.parent().unwrap_or(root);
    std::fs::create_dir_all(parent).at(parent, "create the virtiofsd cache directory")?;
    let partial = parent.join(format!(
        "virtiofsd-{VERSION}.partial-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&partial);
    note(&format!(
        "installing virtiofsd {VERSION} into {} (cargo install; a few minutes)",
        root.display()
    ));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    run(
        "virtiofsd",
        Command::new(cargo)
            .args([
                "install",
                "--locked",
                "virtiofsd",
                "--version",
                VERSION,
                "--root",
            ])
            .arg(&partial),
        parent,
    )?;
    // A directory without the binary is a broken install: replaced.
    if root.exists() {
        std::fs::remove_dir_all(root).at(root, "remove a broken virtiofsd install")?;
    }
    std::fs::rename(&partial, root).at(root, "move the installed virtiofsd into place")?;
    Ok(())
}

/// Fails unless `bin --version` runs and names [`VERSION`] (a binary from
/// `$AGENTVM_VIRTIOFSD` may be another release: that is only noted).
fn check(bin: &Path) -> Result<()> {
    let out = run(
        "virtiofsd",
        Command::new(bin).arg("--version"),
        Path::new("/tmp"),
    )?;
    if !out.contains(VERSION) {
        note(&format!(
            "{} says {:?}; the harness was written against virtiofsd {VERSION}",
            bin.display(),
            out.trim()
        ));
    }
    Ok(())
}
