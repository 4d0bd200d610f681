//! Checks, before a step starts, that the programs and headers it needs are
//! installed, and names the Debian package for each one that is not.

use std::path::{Path, PathBuf};

use crate::error::{Error, MissingTool, Result};

/// A program or header a step needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// An executable looked up in `PATH` (and `/usr/sbin`, `/sbin`).
    Program(&'static str),
    /// A header under `/usr/include`, standing for a `-dev` package.
    Header(&'static str),
}

/// Debian packages for the programs and headers the recipes use.
const PACKAGES: &[(&str, &str)] = &[
    ("apt-get", "apt"),
    ("apt-cache", "apt"),
    ("dpkg-deb", "dpkg"),
    ("tar", "tar"),
    ("xz", "xz-utils"),
    ("make", "make"),
    ("gcc", "gcc"),
    ("flex", "flex"),
    ("bison", "bison"),
    ("bc", "bc"),
    ("perl", "perl"),
    ("gelf.h", "libelf-dev"),
    ("openssl/ssl.h", "libssl-dev"),
    ("debootstrap", "debootstrap"),
    ("mkfs.ext4", "e2fsprogs"),
    ("debugfs", "e2fsprogs"),
    ("cargo", "cargo (or rustup)"),
    ("git", "git"),
];

/// The [`MissingTool`] for a program or header name.
pub fn missing_program(name: &str) -> MissingTool {
    let package = PACKAGES
        .iter()
        .find(|(t, _)| *t == name)
        .map(|(_, p)| p.to_string())
        .unwrap_or_else(|| format!("the package providing {name}"));
    MissingTool {
        tool: name.to_string(),
        package,
    }
}

/// Full path of `program`, searching `PATH` and then the sbin directories
/// (which a non-login root shell may lack).
pub fn find_program(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(program))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Checks every need of `step`; all missing ones are reported together.
pub fn require(step: &str, needs: &[Need]) -> Result<()> {
    let missing: Vec<MissingTool> = needs
        .iter()
        .filter(|n| match n {
            Need::Program(p) => find_program(p).is_none(),
            Need::Header(h) => !Path::new("/usr/include").join(h).exists(),
        })
        .map(|n| match n {
            Need::Program(p) | Need::Header(p) => missing_program(p),
        })
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::MissingTools {
            step: step.to_string(),
            missing,
        })
    }
}

/// A program's path for a `Command`, or the missing-tool error.
pub fn program(step: &str, name: &'static str) -> Result<PathBuf> {
    find_program(name).ok_or_else(|| Error::MissingTools {
        step: step.to_string(),
        missing: vec![missing_program(name)],
    })
}

/// True when running as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_sh_and_reports_what_is_missing() {
        assert!(find_program("sh").is_some());
        require("t", &[Need::Program("sh")]).unwrap();
        let e = require(
            "build the kernel",
            &[
                Need::Program("sh"),
                Need::Program("no-such-tool-abc"),
                Need::Header("no/such/header.h"),
            ],
        )
        .unwrap_err();
        match e {
            Error::MissingTools { missing, .. } => {
                let names: Vec<&str> = missing.iter().map(|m| m.tool.as_str()).collect();
                assert_eq!(names, ["no-such-tool-abc", "no/such/header.h"]);
            }
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn known_tools_map_to_their_packages() {
        assert_eq!(missing_program("gelf.h").package, "libelf-dev");
        assert_eq!(missing_program("mkfs.ext4").package, "e2fsprogs");
        assert_eq!(missing_program("debootstrap").package, "debootstrap");
    }
}
