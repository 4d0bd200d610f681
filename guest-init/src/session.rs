//! The session's repository: received as a git bundle over the channel,
//! cloned into the workspace at the base ref, and checked out on the new
//! branch `session/<session_id>`.
//!
//! Mechanism: the guest has no route to the customer's git server, so the
//! host sends `git bundle create - <refs>` (any bundle holding the base ref)
//! in RepoChunk messages after StartSession. The guest stores it in its
//! state directory, runs `git clone --no-checkout` from it, resolves the base
//! ref (a branch, tag or commit of the bundle) to a commit, checks out
//! `session/<id>` there, and removes the `origin` remote, so there is nothing
//! to push to. FetchBranch streams `git bundle create - session/<id>` back;
//! the host fetches from that bundle. Nothing ever pushes.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::process::Command;

use crate::privilege::Identity;

/// Largest bundle accepted: 8 GiB.
pub const MAX_BUNDLE_BYTES: u64 = 8 << 30;

/// What went wrong with the repository.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// A session id that cannot be part of a branch name.
    #[error("session id {0:?} must be 1-128 characters of letters, digits, '.', '_' or '-', not starting with '.' or '-'")]
    BadSessionId(String),
    /// A base ref that is empty or could be taken for an option.
    #[error("base ref {0:?} must be a branch, tag or commit name (letters, digits, '.', '_', '-', '/'), not starting with '-'")]
    BadRef(String),
    /// The workspace already holds files.
    #[error("workspace {0} is not empty; a session needs an empty workspace")]
    WorkspaceNotEmpty(String),
    /// A git command failed.
    #[error("git {args} failed: {stderr}")]
    Git {
        /// The arguments.
        args: String,
        /// Its error output.
        stderr: String,
    },
    /// The base ref is not in the bundle.
    #[error("base ref {0:?} is not a branch, tag or commit in the repository bundle")]
    UnknownRef(String),
    /// File system trouble.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SessionError {
    let what = what.into();
    move |source| SessionError::Io { what, source }
}

/// Checks a session id and returns the branch name for it.
pub fn branch_for(session_id: &str) -> Result<String, SessionError> {
    let ok = (1..=128).contains(&session_id.len())
        && !session_id.starts_with(['.', '-'])
        && !session_id.ends_with(".lock")
        && !session_id.contains("..")
        && session_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if !ok {
        return Err(SessionError::BadSessionId(session_id.to_string()));
    }
    Ok(format!("session/{session_id}"))
}

/// Checks a base ref.
pub fn check_ref(r: &str) -> Result<(), SessionError> {
    let ok = (1..=256).contains(&r.len())
        && !r.starts_with('-')
        && !r.contains("..")
        && r.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'));
    if ok {
        Ok(())
    } else {
        Err(SessionError::BadRef(r.to_string()))
    }
}

/// Runs git in a repository with settings that no repository config can
/// override into running programs (hooks, fsmonitor), as `identity` if given.
pub fn git_command(dir: &Path, identity: Option<Identity>) -> Command {
    let mut cmd = Command::new("git");
    cmd.arg("-C")
        .arg(dir)
        .args([
            "-c",
            "safe.directory=*",
            "-c",
            "core.hooksPath=/dev/null",
            "-c",
            "core.fsmonitor=false",
        ])
        .env_clear()
        .env("PATH", crate::exec::BASE_PATH)
        .env("HOME", "/nonexistent")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_TERMINAL_PROMPT", "0")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    if let Some(id) = identity {
        cmd.uid(id.uid).gid(id.gid);
    }
    cmd
}

async fn git(dir: &Path, args: &[&str]) -> Result<Vec<u8>, SessionError> {
    git_as(dir, None, args).await
}

/// Runs git in `dir` as `identity` (None: as guest-init); its stdout.
async fn git_as(
    dir: &Path,
    identity: Option<Identity>,
    args: &[&str],
) -> Result<Vec<u8>, SessionError> {
    let out = crate::reaper::output(git_command(dir, identity).args(args))
        .await
        .map_err(io("cannot run git (is it installed?)"))?;
    if !out.status.success() {
        return Err(SessionError::Git {
            args: args.join(" "),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(out.stdout)
}

/// Clones `bundle` into `workspace` and checks out `branch` at `base_ref`;
/// returns the base commit. On failure the workspace is left empty.
pub async fn clone_and_branch(
    bundle: &Path,
    workspace: &Path,
    base_ref: &str,
    branch: &str,
) -> Result<String, SessionError> {
    check_ref(base_ref)?;
    if workspace.exists() {
        let mut entries =
            std::fs::read_dir(workspace).map_err(io(format!("reading {}", workspace.display())))?;
        if entries.next().is_some() {
            return Err(SessionError::WorkspaceNotEmpty(
                workspace.display().to_string(),
            ));
        }
    }
    let result = clone_inner(bundle, workspace, base_ref, branch).await;
    if result.is_err() {
        clear_dir(workspace);
    }
    result
}

async fn clone_inner(
    bundle: &Path,
    workspace: &Path,
    base_ref: &str,
    branch: &str,
) -> Result<String, SessionError> {
    let parent = workspace.parent().unwrap_or(Path::new("/"));
    let bundle_s = bundle.to_string_lossy();
    let ws_s = workspace.to_string_lossy();
    git(
        parent,
        &["clone", "--no-checkout", "--quiet", "--", &bundle_s, &ws_s],
    )
    .await?;
    let mut commit = None;
    for candidate in [
        format!("refs/remotes/origin/{base_ref}^{{commit}}"),
        format!("refs/tags/{base_ref}^{{commit}}"),
        format!("{base_ref}^{{commit}}"),
    ] {
        if let Ok(out) = git(
            workspace,
            &[
                "rev-parse",
                "--verify",
                "--quiet",
                "--end-of-options",
                &candidate,
            ],
        )
        .await
        {
            commit = Some(String::from_utf8_lossy(&out).trim().to_string());
            break;
        }
    }
    let commit = commit.ok_or_else(|| SessionError::UnknownRef(base_ref.to_string()))?;
    git(workspace, &["checkout", "--quiet", "-b", branch, &commit]).await?;
    git(workspace, &["remote", "remove", "origin"]).await?;
    Ok(commit)
}

/// Puts the repository in `workspace` on the new branch of session
/// `session_id` (`session/<id>`) at its HEAD commit, for a fork: the
/// parent's branch (or whatever HEAD was on) stays where it is, and
/// neither the working tree nor the index is touched, so uncommitted
/// changes stay as they are. Returns that commit. Runs as `identity`, so
/// the refs it writes are the agent's like the rest of the repository.
/// Fails when HEAD has no commit or the branch already exists.
pub async fn fork_branch(
    workspace: &Path,
    session_id: &str,
    identity: Option<Identity>,
) -> Result<String, SessionError> {
    let branch = branch_for(session_id)?;
    let out = git_as(
        workspace,
        identity,
        &["rev-parse", "--verify", "--end-of-options", "HEAD^{commit}"],
    )
    .await?;
    let commit = String::from_utf8_lossy(&out).trim().to_string();
    git_as(
        workspace,
        identity,
        &["branch", "--no-track", &branch, &commit],
    )
    .await?;
    let full = format!("refs/heads/{branch}");
    git_as(
        workspace,
        identity,
        &["symbolic-ref", "-m", "guest-init: fork", "HEAD", &full],
    )
    .await?;
    Ok(commit)
}

/// Removes everything inside `dir`, keeping `dir`.
pub fn clear_dir(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            let _ = if p.is_dir() && !p.is_symlink() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
        }
    }
}

/// The text of `path` at `commit`, or None when it does not exist there.
/// Reads the object database, never the working tree.
pub async fn read_at(
    workspace: &Path,
    commit: &str,
    path: &str,
) -> Result<Option<String>, SessionError> {
    let spec = format!("{commit}:{path}");
    if git(workspace, &["cat-file", "-e", &spec]).await.is_err() {
        return Ok(None);
    }
    let bytes = git(workspace, &["cat-file", "blob", &spec]).await?;
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|_| SessionError::Git {
            args: format!("cat-file blob {spec}"),
            stderr: "file is not valid UTF-8".into(),
        })
}

/// Starts `git bundle create - <branch>` (as `identity`), stdout piped;
/// registered with the reaper, so release it after waiting.
pub fn bundle_branch(
    workspace: &Path,
    branch: &str,
    identity: Option<Identity>,
) -> std::io::Result<tokio::process::Child> {
    crate::reaper::spawn(
        git_command(workspace, identity)
            .args(["bundle", "create", "--quiet", "-", branch])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
}

/// Where an incoming bundle is stored.
pub fn bundle_path(state_dir: &Path, session_id: &str) -> PathBuf {
    state_dir.join(format!("incoming-{session_id}.bundle"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(branch_for("abc-1.2_x").unwrap(), "session/abc-1.2_x");
        for bad in [
            "",
            "-x",
            ".x",
            "a..b",
            "a b",
            "a/b",
            "x.lock",
            &"a".repeat(129),
        ] {
            assert!(branch_for(bad).is_err(), "{bad}");
        }
        assert!(check_ref("main").is_ok());
        assert!(check_ref("release/1.0").is_ok());
        assert!(check_ref("--upload-pack=x").is_err());
        assert!(check_ref("a..b").is_err());
        assert!(check_ref("a b").is_err());
    }
}
