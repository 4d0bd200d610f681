//! The operator's repository on this node, as sessions use it: the bundle
//! a session starts from, and the session branch fetched back at Stop.
//!
//! git runs as the repository's owner when that is not root (host-agent
//! running as root would otherwise run the owner's hooks and config as root,
//! and write root-owned objects into the owner's repository), trusts only
//! that one path (`safe.directory`), and checks every object it receives
//! from a guest (`transfer.fsckObjects`, `fetch.fsckObjects`).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::io::AsyncWriteExt;

use crate::error::{Error, Result};

/// Name of the one ref in a bundle made for a base ref that is a commit,
/// not a branch or tag.
const COMMIT_BASE_REF: &str = "refs/heads/base";

/// A repository path and who git runs as in it.
#[derive(Debug, Clone)]
pub struct Repo {
    path: PathBuf,
    /// (uid, gid) to run git as; None: as host-agent itself.
    owner: Option<(u32, u32)>,
}

/// What [`Repo::write_base_bundle`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseBundle {
    /// Bundle size in bytes.
    pub size: u64,
    /// The base ref to name in StartSession: the operator's branch or tag
    /// name, or the commit it resolved to.
    pub base_ref: String,
}

impl Repo {
    /// The repository at `path` (resolved); git will run as its owner when
    /// host-agent is root and the owner is not.
    pub fn open(path: &str) -> Result<Repo> {
        let path = std::fs::canonicalize(path)
            .map_err(|e| Error::io(format!("resolving repository {path}"), e))?;
        let meta = std::fs::metadata(&path)
            .map_err(|e| Error::io(format!("reading repository {}", path.display()), e))?;
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        let owner = (euid == 0 && meta.uid() != 0).then_some((meta.uid(), meta.gid()));
        Ok(Repo { path, owner })
    }

    /// The repository's resolved path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The (uid, gid) git runs as, when not host-agent's own.
    pub fn owner(&self) -> Option<(u32, u32)> {
        self.owner
    }

    /// `git` with this repository as its directory and only it trusted, as
    /// the owner.
    fn git(&self) -> tokio::process::Command {
        let mut c = tokio::process::Command::new("git");
        c.arg("-c")
            .arg(format!("safe.directory={}", self.path.display()))
            .arg("-C")
            .arg(&self.path)
            .current_dir("/")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        if let Some((uid, gid)) = self.owner {
            // std drops supplementary groups too when it changes the uid.
            c.uid(uid).gid(gid);
        }
        c
    }

    /// Runs git with `args` and returns its stdout.
    pub async fn run(&self, args: &[&str]) -> Result<Vec<u8>> {
        let out = self
            .git()
            .args(args)
            .output()
            .await
            .map_err(|e| Error::io("running git", e))?;
        if !out.status.success() {
            return Err(Error::FailedPrecondition(format!(
                "git {} in {}: {}",
                args.join(" "),
                self.path.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(out.stdout)
    }

    async fn has_ref(&self, name: &str) -> bool {
        self.run(&["show-ref", "--verify", "--quiet", name])
            .await
            .is_ok()
    }

    /// Writes to `dest` a bundle holding `base_ref` and what it needs, and no
    /// other ref: a branch or tag as itself, a commit as [`COMMIT_BASE_REF`].
    pub async fn write_base_bundle(&self, base_ref: &str, dest: &Path) -> Result<BaseBundle> {
        check_base_ref(base_ref)?;
        let mut file = create_new(dest).await?;
        let sent_ref = if let Some(name) = self.named_ref(base_ref).await {
            self.pipe_into(
                &["bundle", "create", "--quiet", "-", &name],
                None,
                &mut file,
            )
            .await?;
            base_ref.to_string()
        } else {
            let commit = self.commit_of(base_ref, base_ref).await?;
            // A bundle's refs must be names; git bundle refuses a bare commit,
            // so the (v2) header is written here and git writes the pack.
            let header = format!("# v2 git bundle\n{commit} {COMMIT_BASE_REF}\n\n");
            file.write_all(header.as_bytes())
                .await
                .map_err(|e| Error::io(format!("writing {}", dest.display()), e))?;
            let revs = format!("{commit}\n");
            self.pipe_into(
                &["pack-objects", "--stdout", "--revs", "-q"],
                Some(revs.into_bytes()),
                &mut file,
            )
            .await?;
            commit
        };
        file.flush()
            .await
            .map_err(|e| Error::io(format!("writing {}", dest.display()), e))?;
        let size = file
            .metadata()
            .await
            .map_err(|e| Error::io(format!("reading {}", dest.display()), e))?
            .len();
        Ok(BaseBundle {
            size,
            base_ref: sent_ref,
        })
    }

    /// The commit `base_ref` names, read as [`Repo::write_base_bundle`] reads
    /// it: a branch first, then a tag, then any commit name.
    pub async fn resolve_commit(&self, base_ref: &str) -> Result<String> {
        check_base_ref(base_ref)?;
        let name = self.named_ref(base_ref).await;
        self.commit_of(name.as_deref().unwrap_or(base_ref), base_ref)
            .await
    }

    /// The full name of the branch, or else the tag, `base_ref` names.
    async fn named_ref(&self, base_ref: &str) -> Option<String> {
        for name in [
            format!("refs/heads/{base_ref}"),
            format!("refs/tags/{base_ref}"),
        ] {
            if self.has_ref(&name).await {
                return Some(name);
            }
        }
        None
    }

    /// The commit `name` resolves to; the error names `base_ref`, what the
    /// caller asked for.
    async fn commit_of(&self, name: &str, base_ref: &str) -> Result<String> {
        let spec = format!("{name}^{{commit}}");
        let commit = self
            .run(&[
                "rev-parse",
                "--verify",
                "--quiet",
                "--end-of-options",
                &spec,
            ])
            .await
            .map_err(|_| {
                Error::FailedPrecondition(format!(
                    "base_ref {base_ref:?} is not a branch, tag or commit of repository {}",
                    self.path.display()
                ))
            })?;
        Ok(String::from_utf8_lossy(&commit).trim().to_string())
    }

    /// The contents of `path` in `commit`, or `None` when the commit has no
    /// such file; a file over `limit` bytes (or not a file) is an error.
    pub async fn file_at(&self, commit: &str, path: &str, limit: u64) -> Result<Option<Vec<u8>>> {
        let object = format!("{commit}:{path}");
        let Ok(kind) = self.run(&["cat-file", "-t", &object]).await else {
            return Ok(None);
        };
        if String::from_utf8_lossy(&kind).trim() != "blob" {
            return Err(Error::FailedPrecondition(format!(
                "{path} at {commit} in {} is not a file",
                self.path.display()
            )));
        }
        let size = self.run(&["cat-file", "-s", &object]).await?;
        let size: u64 = String::from_utf8_lossy(&size)
            .trim()
            .parse()
            .map_err(|_| Error::FailedPrecondition(format!("git gave no size for {object}")))?;
        if size > limit {
            return Err(Error::FailedPrecondition(format!(
                "{path} at {commit} is {size} bytes; at most {limit} are read"
            )));
        }
        Ok(Some(self.run(&["cat-file", "blob", &object]).await?))
    }

    /// Runs git with `args` (and `input` on stdin), its stdout streamed into `out`.
    async fn pipe_into(
        &self,
        args: &[&str],
        input: Option<Vec<u8>>,
        out: &mut tokio::fs::File,
    ) -> Result<()> {
        let mut cmd = self.git();
        cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        if input.is_some() {
            cmd.stdin(Stdio::piped());
        }
        let mut child = cmd.spawn().map_err(|e| Error::io("running git", e))?;
        if let (Some(mut stdin), Some(input)) = (child.stdin.take(), input) {
            tokio::spawn(async move {
                let _ = stdin.write_all(&input).await;
            });
        }
        let mut stdout = child
            .stdout
            .take()
            .ok_or_else(|| Error::Guest("git stdout was not captured".into()))?;
        let copied = tokio::io::copy(&mut stdout, out).await;
        // A failed copy must not leave git blocked on a full pipe.
        drop(stdout);
        let done = child
            .wait_with_output()
            .await
            .map_err(|e| Error::io("running git", e))?;
        if !done.status.success() {
            return Err(Error::FailedPrecondition(format!(
                "git {} in {}: {}",
                args.join(" "),
                self.path.display(),
                String::from_utf8_lossy(&done.stderr).trim()
            )));
        }
        copied.map_err(|e| Error::io("writing the repository bundle", e))?;
        Ok(())
    }

    /// Fetches `src` from the bundle file `bundle` into `dst` (forced),
    /// checking every object; a bundle with a corrupt or malformed object is
    /// refused and the repository keeps its refs.
    pub async fn fetch_bundle(&self, bundle: &Path, src: &str, dst: &str) -> Result<()> {
        let file = std::fs::File::open(bundle)
            .map_err(|e| Error::io(format!("opening {}", bundle.display()), e))?;
        if let Some((uid, gid)) = self.owner {
            // git, as the owner, reopens it through its standard input: the
            // file must be theirs; the directories above it need not be
            // reachable.
            std::os::unix::fs::fchown(&file, Some(uid), Some(gid))
                .map_err(|e| Error::io(format!("handing {} to uid {uid}", bundle.display()), e))?;
        }
        let refspec = format!("+{src}:{dst}");
        let args = [
            "-c",
            "transfer.fsckObjects=true",
            "-c",
            "fetch.fsckObjects=true",
            "-c",
            "receive.fsckObjects=true",
            "fetch",
            "--quiet",
            "--no-write-fetch-head",
            "--no-tags",
            // Not /dev/stdin: that link is made by udev or systemd, and a
            // host without them (a minimal init, a container) has none;
            // git failed with "'/dev/stdin' does not appear to be a git
            // repository" there. /proc, which host-agent needs anyway,
            // always has this one.
            "/proc/self/fd/0",
            &refspec,
        ];
        let out = self
            .git()
            .args(args)
            .stdin(file)
            .output()
            .await
            .map_err(|e| Error::io("running git fetch", e))?;
        if !out.status.success() {
            return Err(Error::FailedPrecondition(format!(
                "git fetch of the session branch into {} was refused: {}",
                self.path.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(())
    }
}

/// Refuses a base ref that is empty or could be read as an option.
fn check_base_ref(base_ref: &str) -> Result<()> {
    if base_ref.is_empty() || base_ref.starts_with('-') {
        return Err(Error::invalid(format!(
            "base_ref {base_ref:?} is not a branch, tag or commit name"
        )));
    }
    Ok(())
}

/// Creates `path` (replacing an old one), private to host-agent.
pub async fn create_new(path: &Path) -> Result<tokio::fs::File> {
    let _ = tokio::fs::remove_file(path).await;
    tokio::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .await
        .map_err(|e| Error::io(format!("creating {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn git(dir: &Path, args: &[&str]) -> String {
        let out = std::process::Command::new("git")
            .args(["-c", "user.name=t", "-c", "user.email=t@t", "-C"])
            .arg(dir)
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "git {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    #[tokio::test]
    async fn a_file_is_read_at_the_commit_the_base_ref_names() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        git(d, &["init", "-q", "-b", "main"]);
        std::fs::write(d.join("m.yaml"), "one").unwrap();
        git(d, &["add", "m.yaml"]);
        git(d, &["commit", "-qm", "one"]);
        let first = git(d, &["rev-parse", "HEAD"]);
        git(d, &["tag", "v1"]);
        std::fs::write(d.join("m.yaml"), "two").unwrap();
        std::fs::create_dir(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/x"), "x").unwrap();
        git(d, &["add", "."]);
        git(d, &["commit", "-qm", "two"]);
        let second = git(d, &["rev-parse", "HEAD"]);
        // A branch named like the tag: the branch wins, as in the bundle.
        git(d, &["branch", "v1"]);

        let repo = Repo::open(d.to_str().unwrap()).unwrap();
        assert_eq!(repo.resolve_commit("main").await.unwrap(), second);
        assert_eq!(repo.resolve_commit("v1").await.unwrap(), second);
        assert_eq!(repo.resolve_commit(&first).await.unwrap(), first);
        assert_eq!(repo.resolve_commit("HEAD~1").await.unwrap(), first);
        for bad in ["nope", "-x", ""] {
            assert!(repo.resolve_commit(bad).await.is_err(), "{bad}");
        }

        let read = |c: String, p: &'static str, limit: u64| {
            let repo = repo.clone();
            async move { repo.file_at(&c, p, limit).await }
        };
        assert_eq!(
            read(first.clone(), "m.yaml", 100).await.unwrap().unwrap(),
            b"one"
        );
        assert_eq!(
            read(second.clone(), "m.yaml", 100).await.unwrap().unwrap(),
            b"two"
        );
        assert_eq!(read(first.clone(), "sub/x", 100).await.unwrap(), None);
        let err = read(second.clone(), "sub", 100).await.unwrap_err();
        assert!(err.to_string().contains("not a file"), "{err}");
        let err = read(second, "m.yaml", 2).await.unwrap_err();
        assert!(err.to_string().contains("at most 2"), "{err}");
    }
}
