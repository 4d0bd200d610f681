//! git for tests: a fixed identity, no system or user configuration, and
//! throwaway repositories.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `git -C dir <args>` with a fixed identity, every directory safe, and no
/// system or user config; not yet run (a caller with its own way to run
/// children, like guest-init's reaper, runs it).
pub fn command(dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new("git");
    cmd.arg("-C")
        .arg(dir)
        .args(["-c", "user.name=Test", "-c", "user.email=test@example.com"])
        .args(["-c", "safe.directory=*"])
        .args(args)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null");
    cmd
}

/// The trimmed stdout of a finished `git <args>`; panics with git's stderr
/// if it failed.
pub fn check(args: &[&str], out: &Output) -> String {
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Runs [`command`]; panics with git's stderr on failure, returns its
/// trimmed stdout.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = command(dir, args).output().expect("git runs");
    check(args, &out)
}

/// `dir/repo`: a repository with `files` (path, text) in one commit on
/// `main`, in a directory everyone may enter (a jailed or dropped-privilege
/// reader gets to it).
pub fn repo_with_files(dir: &Path, files: &[(&str, &str)]) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let repo = dir.join("repo");
    std::fs::create_dir_all(&repo).unwrap();
    git(&repo, &["init", "-q", "-b", "main"]);
    for (path, text) in files {
        let full = repo.join(path);
        std::fs::create_dir_all(full.parent().expect("a file has a directory")).unwrap();
        std::fs::write(full, text).unwrap();
    }
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-q", "-m", "initial"]);
    repo
}

/// `dir/repo`: [`repo_with_files`] with a README.md only.
pub fn repo_with_main(dir: &Path) -> PathBuf {
    repo_with_files(dir, &[("README.md", "hello\n")])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repository_with_files_on_main() {
        let dir = tempfile::tempdir().unwrap();
        let repo = repo_with_files(dir.path(), &[("a/b.txt", "x\n"), ("README.md", "hi\n")]);
        assert_eq!(git(&repo, &["rev-parse", "--abbrev-ref", "HEAD"]), "main");
        assert_eq!(git(&repo, &["show", "main:a/b.txt"]), "x");
        assert_eq!(
            git(&repo, &["log", "--format=%an <%ae>"]),
            "Test <test@example.com>"
        );
        let e = std::panic::catch_unwind(|| git(&repo, &["rev-parse", "no-such-ref"])).unwrap_err();
        assert!(e.downcast_ref::<String>().unwrap().contains("no-such-ref"));
    }
}
