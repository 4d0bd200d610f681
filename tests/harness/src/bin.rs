//! The workspace root and its binaries, as a test finds them.
//!
//! A binary is taken from the target directory the running test was built
//! into (`target/<profile>/`, found from the test executable's path); if it
//! is missing there, `cargo build -p <name>` builds it once, in the same
//! profile, target and target directory. It is not rebuilt when merely out
//! of date: a whole-workspace build or test run builds every binary. An
//! environment variable per binary overrides the lookup.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The workspace root (the directory of the root `Cargo.toml`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("tests/harness is two levels below the workspace root")
        .to_path_buf()
}

/// The directory the running test executable was built into,
/// `<target dir>/[<triple>/]<profile>` (a test runs from its `deps/`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let mut dir = exe.parent().expect("an executable has a directory");
    if dir.file_name() == Some(OsStr::new("deps")) {
        dir = dir.parent().expect("deps/ has a parent");
    }
    dir.to_path_buf()
}

/// `cargo build -p name` into `dir` (a profile directory as
/// [`profile_dir`] returns it): a no-op when the binary is up to date.
pub fn build(name: &str, dir: &Path) {
    let profile = dir.file_name().and_then(|n| n.to_str()).unwrap_or("debug");
    let above = dir.parent().expect("a profile directory has a parent");
    // The target directory holds `.rustc_info.json`; one level lower,
    // `<triple>/<profile>` is a cross (or explicit `--target`) build.
    let (target_dir, triple) = match above.parent() {
        Some(root)
            if !above.join(".rustc_info.json").exists()
                && root.join(".rustc_info.json").exists() =>
        {
            (root, above.file_name().and_then(|n| n.to_str()))
        }
        _ => (above, None),
    };
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.args(["build", "-p", name])
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(workspace_root());
    match profile {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    if let Some(triple) = triple {
        cmd.args(["--target", triple]);
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(status.success(), "{cmd:?} failed");
}

/// The workspace binary `name` (the package and binary share the name) next
/// to the running test's, built if missing; the environment variable `env`
/// overrides the path.
pub fn workspace_binary(name: &str, env: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    let dir = profile_dir();
    let bin = dir.join(name);
    if !bin.is_file() {
        build(name, &dir);
    }
    assert!(bin.is_file(), "no {name} binary at {}", bin.display());
    bin
}

/// The vmm binary (`HOST_AGENT_TEST_VMM` overrides).
pub fn vmm_path() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| workspace_binary("vmm", "HOST_AGENT_TEST_VMM"))
        .clone()
}

/// The guest-init binary (`HOST_AGENT_TEST_GUEST_INIT` overrides).
pub fn guest_init_path() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| workspace_binary("guest-init", "HOST_AGENT_TEST_GUEST_INIT"))
        .clone()
}

/// The host-agent binary (`HOST_AGENT_TEST_BIN` overrides).
pub fn host_agent_path() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| workspace_binary("host-agent", "HOST_AGENT_TEST_BIN"))
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workspace_root_holds_the_workspace_manifest() {
        let manifest = std::fs::read_to_string(workspace_root().join("Cargo.toml")).unwrap();
        assert!(manifest.contains("[workspace]"), "{manifest}");
        assert!(manifest.contains("tests/harness"), "{manifest}");
    }

    #[test]
    fn the_profile_dir_is_above_deps() {
        let dir = profile_dir();
        assert!(dir.join("deps").is_dir(), "{}", dir.display());
    }

    #[test]
    fn an_override_wins_without_a_lookup() {
        // Any variable that is set will do: no build, no file check.
        let path = std::env::var_os("PATH").expect("PATH is set");
        assert_eq!(
            workspace_binary("no-such-package", "PATH"),
            PathBuf::from(path)
        );
    }
}
