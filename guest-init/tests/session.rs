//! Clone and branch, exec with streamed output, exit codes, signals, stdin,
//! and fetching the session branch back.

mod common;

use common::*;
use proto::guest::{
    exec_exited::Status, guest_message::Kind as Out, host_message::Kind as In, FetchBranch, Signal,
    StdinData,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_the_base_ref_onto_the_session_branch() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.connect().await;
    c.hello().await;
    let ready = c
        .start_session(&SessionSpec::new("abc-1", "coder", "main"), &repo.bundle())
        .await;
    let Out::Ready(r) = ready else {
        panic!("{ready:?}")
    };
    assert_eq!(r.branch, "session/abc-1");
    assert_eq!(r.base_commit, repo.head());
    assert_eq!(
        git(&h.workspace, &["rev-parse", "--abbrev-ref", "HEAD"]),
        "session/abc-1"
    );
    assert_eq!(git(&h.workspace, &["rev-parse", "HEAD"]), repo.head());
    // No remote: nothing to push to.
    assert_eq!(git(&h.workspace, &["remote"]), "");
    assert_eq!(
        std::fs::read_to_string(h.workspace.join("README.md")).unwrap(),
        "hello\n"
    );
    // The agent sees the same from inside.
    let out = c
        .run("e1", &["git", "rev-parse", "--abbrev-ref", "HEAD"])
        .await;
    assert_eq!(out.stdout(), "session/abc-1\n", "{out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn base_ref_can_be_a_tag_or_a_commit() {
    let repo = Repo::new();
    git(
        repo.path(),
        &["commit", "-q", "--allow-empty", "-m", "second"],
    );
    let first = git(repo.path(), &["rev-parse", "v1"]);
    for base in ["v1", first.as_str()] {
        let h = Harness::start().await;
        let mut c = h.connect().await;
        c.hello().await;
        let ready = c
            .start_session(&SessionSpec::new("s", "coder", base), &repo.bundle())
            .await;
        let Out::Ready(r) = ready else {
            panic!("{base}: {ready:?}")
        };
        assert_eq!(r.base_commit, first);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_base_ref_is_a_clear_error() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.connect().await;
    c.hello().await;
    let r = c
        .start_session(&SessionSpec::new("s", "coder", "nope"), &repo.bundle())
        .await;
    let Out::Error(e) = r else { panic!("{r:?}") };
    assert!(
        e.message
            .contains("base ref \"nope\" is not a branch, tag or commit"),
        "{}",
        e.message
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_streams_output_and_reports_exit_codes() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.session(&repo, "free", "main").await;
    let r = c
        .run("e1", &["sh", "-c", "echo out; echo err >&2; exit 3"])
        .await;
    assert_eq!(r.stdout(), "out\n");
    assert_eq!(String::from_utf8_lossy(&r.stderr), "err\n");
    assert_eq!(r.status, Some(Status::Code(3)));
    assert!(r.pid.is_some());
    // Output arrives while the command runs, in order, in several chunks.
    let r = c
        .run(
            "e2",
            &["sh", "-c", "echo a; sleep 0.3; echo b; sleep 0.3; echo c"],
        )
        .await;
    assert_eq!(r.stdout(), "a\nb\nc\n");
    assert!(r.output_chunks >= 3, "{} chunks", r.output_chunks);
    assert_eq!(r.code(), Some(0));
    // cwd inside the workspace.
    std::fs::create_dir(h.workspace.join("sub")).unwrap();
    let mut e = exec_msg("e3", "t", &["pwd"]);
    e.cwd = b"sub".to_vec();
    c.exec(e).await;
    let r = c.finish("e3", None).await;
    assert!(r.stdout().trim_end().ends_with("/workspace/sub"), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_reports_signals_and_takes_stdin() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.session(&repo, "free", "main").await;
    c.exec(exec_msg("sleeper", "t", &["sleep", "60"])).await;
    c.expect(|m| matches!(m, Out::ExecStarted(s) if s.exec_id == "sleeper").then_some(()))
        .await;
    c.send(In::Signal(Signal {
        exec_id: "sleeper".into(),
        signal: libc::SIGTERM,
    }))
    .await;
    let r = c.finish("sleeper", None).await;
    assert_eq!(r.status, Some(Status::Signal(libc::SIGTERM)));

    // Initial stdin, closed after.
    let mut e = exec_msg("cat1", "t", &["cat"]);
    e.stdin = b"from start\n".to_vec();
    c.exec(e).await;
    assert_eq!(c.finish("cat1", None).await.stdout(), "from start\n");

    // Stdin kept open and streamed.
    let mut e = exec_msg("cat2", "t", &["cat"]);
    e.keep_stdin_open = true;
    c.exec(e).await;
    c.expect(|m| matches!(m, Out::ExecStarted(s) if s.exec_id == "cat2").then_some(()))
        .await;
    for (data, eof) in [(&b"one "[..], false), (b"two\n", true)] {
        c.send(In::Stdin(StdinData {
            exec_id: "cat2".into(),
            data: data.to_vec(),
            eof,
        }))
        .await;
    }
    let r = c.finish("cat2", None).await;
    assert_eq!(r.stdout(), "one two\n");
    assert_eq!(r.code(), Some(0));

    // A program that does not exist is a rejection, not a crash.
    let r = c.run("missing", &["definitely-not-a-program"]).await;
    let (reason, _) = r.rejected.expect("rejected");
    assert!(reason.contains("cannot start"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_branch_comes_back_as_a_bundle() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.session(&repo, "free", "main").await;
    let r = c
        .run(
            "w",
            &[
                "sh",
                "-c",
                "echo change > new.txt && git add new.txt && git commit -q -m 'agent work'",
            ],
        )
        .await;
    assert_eq!(
        r.code(),
        Some(0),
        "{r:?} {}",
        String::from_utf8_lossy(&r.stderr)
    );
    c.send(In::FetchBranch(FetchBranch {})).await;
    let mut bundle = Vec::new();
    loop {
        let chunk = c
            .expect(|m| match m {
                Out::BundleChunk(b) => Some(b.clone()),
                _ => None,
            })
            .await;
        bundle.extend(chunk.data);
        if chunk.last {
            break;
        }
    }
    let file = repo.path().join("../session.bundle");
    std::fs::write(&file, &bundle).unwrap();
    let main_before = repo.head();
    git(
        repo.path(),
        &[
            "fetch",
            "-q",
            file.to_str().unwrap(),
            "session/s1:refs/heads/session/s1",
        ],
    );
    assert_eq!(
        git(repo.path(), &["log", "-1", "--format=%s", "session/s1"]),
        "agent work"
    );
    assert_eq!(
        git(repo.path(), &["rev-parse", "session/s1~1"]),
        main_before
    );
    // main is untouched.
    assert_eq!(repo.head(), main_before);
    std::fs::remove_file(file).unwrap();
}
