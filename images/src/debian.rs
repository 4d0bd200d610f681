//! Debian packages through the system's apt: resolve a version, download the
//! `.deb` (cached by name and version), read the installed set of a tree.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Error, IoContext, Result};
use crate::progress::{self, Echo};
use crate::tools::{self, Need};

/// The version apt would install of `package` (its candidate).
pub fn candidate_version(package: &str) -> Result<String> {
    tools::require("resolve a package version", &[Need::Program("apt-cache")])?;
    let out = Command::new("apt-cache")
        .args(["policy", package])
        .output()
        .map_err(|source| Error::Spawn {
            step: "resolve a package version".into(),
            program: "apt-cache".into(),
            source,
        })?;
    parse_candidate(&String::from_utf8_lossy(&out.stdout)).ok_or_else(|| Error::Package {
        package: package.to_string(),
        message: "apt knows no installable version; run `apt-get update`, and on Debian 12 \
                  make sure bookworm-security (or bookworm-backports) is in the sources"
            .to_string(),
    })
}

/// The `Candidate:` of `apt-cache policy` output, unless `(none)`.
pub fn parse_candidate(policy: &str) -> Option<String> {
    policy
        .lines()
        .find_map(|l| l.trim().strip_prefix("Candidate:"))
        .map(str::trim)
        .filter(|v| !v.is_empty() && *v != "(none)")
        .map(str::to_string)
}

/// The file name apt gives `package`'s `.deb` for `version`.
pub fn deb_file_name(package: &str, version: &str, arch: &str) -> String {
    format!("{package}_{}_{arch}.deb", version.replace(':', "%3a"))
}

/// Downloads `package=version` into `dir` (unless already there) and
/// returns the `.deb` path.
pub fn download(package: &str, version: &str, arch: &str, dir: &Path) -> Result<PathBuf> {
    let step = "download a package";
    let deb = dir.join(deb_file_name(package, version, arch));
    if deb.exists() {
        progress::note(step, &format!("cached: {}", deb.display()));
        return Ok(deb);
    }
    tools::require(step, &[Need::Program("apt-get")])?;
    std::fs::create_dir_all(dir).at(dir, step)?;
    progress::note(step, &format!("downloading {package}={version}"));
    progress::run(
        step,
        Command::new("apt-get")
            .args(["download", "-q", &format!("{package}={version}")])
            .current_dir(dir),
        Echo::Lines,
        dir,
    )
    .map_err(|e| match e {
        Error::CommandFailed { tail, .. } => Error::Package {
            package: package.to_string(),
            message: format!("apt-get download failed (run `apt-get update`?): {tail}"),
        },
        other => other,
    })?;
    if !deb.exists() {
        return Err(Error::Package {
            package: package.to_string(),
            message: format!("apt-get download did not leave {}", deb.display()),
        });
    }
    Ok(deb)
}

/// Installed packages and versions of a Debian tree, from its dpkg status.
pub fn installed_packages(root: &Path) -> Result<BTreeMap<String, String>> {
    let p = root.join("var/lib/dpkg/status");
    let text = std::fs::read_to_string(&p).at(&p, "read the installed package list")?;
    Ok(parse_dpkg_status(&text))
}

/// Parses a dpkg status file: `Package` → `Version` for installed packages.
pub fn parse_dpkg_status(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for para in text.split("\n\n") {
        let mut name = None;
        let mut version = None;
        let mut installed = false;
        for line in para.lines() {
            if let Some(v) = line.strip_prefix("Package: ") {
                name = Some(v.trim());
            } else if let Some(v) = line.strip_prefix("Version: ") {
                version = Some(v.trim());
            } else if let Some(v) = line.strip_prefix("Status: ") {
                installed = v.trim().ends_with(" installed");
            }
        }
        if let (Some(n), Some(v), true) = (name, version, installed) {
            out.insert(n.to_string(), v.to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_apt_cache_policy() {
        let p = "linux-source-6.12:\n  Installed: (none)\n  Candidate: 6.12.117-1~deb12u1\n  Version table:\n";
        assert_eq!(parse_candidate(p).as_deref(), Some("6.12.117-1~deb12u1"));
        assert_eq!(
            parse_candidate("x:\n  Installed: (none)\n  Candidate: (none)\n"),
            None
        );
        assert_eq!(parse_candidate(""), None);
    }

    #[test]
    fn deb_names_escape_epochs() {
        assert_eq!(
            deb_file_name("git", "1:2.39.5-0+deb12u2", "amd64"),
            "git_1%3a2.39.5-0+deb12u2_amd64.deb"
        );
    }

    #[test]
    fn parses_dpkg_status_keeping_only_installed() {
        let s = "Package: git\nStatus: install ok installed\nVersion: 1:2.39.5\n\nPackage: gone\nStatus: deinstall ok config-files\nVersion: 1\n\nPackage: bash\nVersion: 5.2.15-2+b7\nStatus: install ok installed\n";
        let m = parse_dpkg_status(s);
        assert_eq!(m.len(), 2);
        assert_eq!(m["git"], "1:2.39.5");
        assert_eq!(m["bash"], "5.2.15-2+b7");
    }
}
