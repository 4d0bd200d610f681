//! The operator's repository and its sessions: a session is given only its
//! base ref (never other sessions' branches), and the branch a guest hands
//! back at Stop is checked object by object and fetched as the repository's
//! owner. The guest is the stand-in of tests/common/fake_guest.rs.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::fake_guest::FakeGuest;
use common::*;

/// A repository (in a directory everyone may enter) with `main`, a
/// `feature` branch and another session's branch, each with its own commit.
fn repo(dir: &Path) -> PathBuf {
    let repo = repo_with_main(dir);
    for branch in ["feature", "session/other"] {
        git(&repo, &["checkout", "-q", "-b", branch, "main"]);
        git(&repo, &["commit", "-q", "--allow-empty", "-m", branch]);
    }
    git(&repo, &["checkout", "-q", "main"]);
    repo
}

/// A scratch clone of `repo`'s `main`, to make a session's branch in.
fn scratch(repo: &Path, dir: &Path) -> PathBuf {
    let work = dir.join("work");
    git(
        dir,
        &[
            "clone",
            "-q",
            "-b",
            "main",
            repo.to_str().unwrap(),
            work.to_str().unwrap(),
        ],
    );
    work
}

/// A bundle of `refs/heads/session/<id>` at a new commit on `main`, made in
/// the scratch clone `work`; returns it and the commit.
fn branch_bundle(work: &Path, dir: &Path, id: &str) -> (PathBuf, String) {
    let branch = format!("session/{id}");
    git(work, &["checkout", "-q", "-b", &branch]);
    std::fs::write(work.join("agent.txt"), "agent work\n").unwrap();
    git(work, &["add", "-A"]);
    git(work, &["commit", "-q", "-m", "agent work"]);
    let head = git(work, &["rev-parse", "HEAD"]);
    let bundle = dir.join(format!("{id}.branch.bundle"));
    git(
        work,
        &["bundle", "create", "-q", bundle.to_str().unwrap(), &branch],
    );
    (bundle, head)
}

async fn agent_and_guest() -> (Agent, FakeGuest) {
    let guest = FakeGuest::start();
    let agent = Agent::start(&["--guest-vsock-uds", &guest.sock(), "--no-vsock-device"]);
    agent.guest_init_image().await;
    (agent, guest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_gets_only_its_base_ref_never_other_sessions_branches() {
    let (agent, guest) = agent_and_guest().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(dir.path());
    let other = git(&repo, &["rev-parse", "refs/heads/session/other"]);
    let feature = git(&repo, &["rev-parse", "refs/heads/feature"]);
    let main = git(&repo, &["rev-parse", "refs/heads/main"]);

    let s = agent.guest_session(&repo, "good", "main").await.unwrap();
    let bundle = guest.seen.repo_bundles.lock().unwrap()[&s.session_id].clone();
    let heads = git(
        dir.path(),
        &["bundle", "list-heads", bundle.to_str().unwrap()],
    );
    assert_eq!(heads, format!("{main} refs/heads/main"));
    // Nor the other branches' objects.
    let clone = dir.path().join("clone-main");
    git(
        dir.path(),
        &[
            "clone",
            "-q",
            "--no-checkout",
            bundle.to_str().unwrap(),
            clone.to_str().unwrap(),
        ],
    );
    for absent in [&other, &feature] {
        let found = Command::new("git")
            .arg("-C")
            .arg(&clone)
            .args(["cat-file", "-e", absent])
            .status()
            .unwrap();
        assert!(!found.success(), "commit {absent} was sent to the session");
    }

    // A commit as base ref: one ref at that commit, named to the guest by it.
    let c = agent.guest_session(&repo, "good", &feature).await.unwrap();
    let bundle = guest.seen.repo_bundles.lock().unwrap()[&c.session_id].clone();
    let heads = git(
        dir.path(),
        &["bundle", "list-heads", bundle.to_str().unwrap()],
    );
    assert_eq!(heads, format!("{feature} refs/heads/base"));
    git(&repo, &["bundle", "verify", "-q", bundle.to_str().unwrap()]);
    assert_eq!(
        guest.seen.starts.lock().unwrap()[&c.session_id].base_ref,
        feature
    );

    // An unknown base ref is refused, and says so.
    let err = agent
        .guest_session(&repo, "good", "no-such-ref")
        .await
        .unwrap_err();
    assert!(err.message().contains("no-such-ref"), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_branch_bundle_with_a_corrupt_object_is_refused_and_the_repository_unchanged() {
    let (agent, guest) = agent_and_guest().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(dir.path());
    let s = agent.guest_session(&repo, "good", "main").await.unwrap();

    // A commit whose author line has no valid date, on the session branch.
    let bad = dir.path().join("bad");
    git(
        dir.path(),
        &["init", "-q", "-b", "main", bad.to_str().unwrap()],
    );
    let tree = {
        let out = Command::new("git")
            .arg("-C")
            .arg(&bad)
            .args(["mktree"])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let body = format!("tree {tree}\nauthor bad <x> notadate\ncommitter bad <x> 1 +0000\n\nmsg\n");
    let obj = bad.join("commit.txt");
    std::fs::write(&obj, body).unwrap();
    let commit = git(
        &bad,
        &[
            "hash-object",
            "-t",
            "commit",
            "--literally",
            "-w",
            obj.to_str().unwrap(),
        ],
    );
    let branch = format!("session/{}", s.session_id);
    git(
        &bad,
        &["update-ref", &format!("refs/heads/{branch}"), &commit],
    );
    let bundle = dir.path().join("bad.bundle");
    git(
        &bad,
        &["bundle", "create", "-q", bundle.to_str().unwrap(), &branch],
    );
    guest.set_branch_bundle(&s.session_id, bundle);

    let refs_before = git(&repo, &["for-each-ref"]);
    let st = agent.stop(&s.session_id).await;
    assert_eq!(st.state, S::Stopped as i32);
    assert!(st.branch.is_empty(), "{st:?}");
    assert!(
        st.detail.contains("branch not fetched") && st.detail.contains("fsck"),
        "{st:?}"
    );
    assert_eq!(git(&repo, &["for-each-ref"]), refs_before);
    let present = Command::new("git")
        .arg("-C")
        .arg(&repo)
        .args(["cat-file", "-e", &commit])
        .status()
        .unwrap();
    assert!(
        !present.success(),
        "the corrupt commit is in the repository"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_branch_is_fetched_as_the_repository_owner() {
    if !is_root() {
        println!("skipped: changing a repository's owner needs root");
        return;
    }
    let (agent, guest) = agent_and_guest().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(dir.path());
    let work = scratch(&repo, dir.path());
    let chown = Command::new("chown")
        .args(["-R", "65534:65534"])
        .arg(&repo)
        .status()
        .unwrap();
    assert!(chown.success());
    let s = agent
        .guest_session(&repo, "good", "main")
        .await
        .expect("a session on a repository owned by another user");
    let (bundle, head) = branch_bundle(&work, dir.path(), &s.session_id);
    guest.set_branch_bundle(&s.session_id, bundle);

    let st = agent.stop(&s.session_id).await;
    assert_eq!(st.state, S::Stopped as i32);
    assert_eq!(st.head_commit, head, "{st:?}");
    // The fetched objects (a new pack: the repository had loose objects only)
    // and the ref are the owner's.
    git(&repo, &["cat-file", "-e", &head]);
    let packs: Vec<_> = std::fs::read_dir(repo.join(".git/objects/pack"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".pack"))
        .collect();
    assert!(!packs.is_empty(), "no pack was fetched");
    for p in &packs {
        let m = p.metadata().unwrap();
        assert_eq!((m.uid(), m.gid()), (65534, 65534), "{:?}", p.path());
    }
    let r = std::fs::metadata(repo.join(".git/refs/heads/session").join(&s.session_id)).unwrap();
    assert_eq!((r.uid(), r.gid()), (65534, 65534));
    // Nothing in the repository belongs to root.
    let out = Command::new("find")
        .arg(repo.join(".git"))
        .args(["-uid", "0"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "");
}
