//! ForkSession: a VM restored from a snapshot of session s1 becomes session
//! s2. The kept session is the parent; the fork kills its commands, puts
//! the repository on `session/s2` at s1's HEAD with the working copy as it
//! was, starts a new audit chain with `session.forked`, and answers Ready.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use proto::guest::{
    error::Code, guest_message::Kind as Out, host_message::Kind as In, FetchBranch, ForkSession,
    ResumeSession, Shutdown,
};
use serde_json::Value;

fn fork(id: &str, parent: &str, parent_seq: u64, parent_hash: &str) -> In {
    In::ForkSession(ForkSession {
        session_id: id.into(),
        parent_session_id: parent.into(),
        parent_audit_seq: parent_seq,
        parent_audit_hash: parent_hash.into(),
        // No host time: these guests share this machine's clock.
        host_time_unix_ns: 0,
        // Not PID 1: mixed into nothing.
        entropy: vec![9; 64],
    })
}

fn json(line: &str) -> Value {
    serde_json::from_str(line).unwrap()
}

fn log_lines(h: &Harness, session: &str) -> Vec<Value> {
    std::fs::read_to_string(h.audit_log(session))
        .unwrap()
        .lines()
        .map(json)
        .collect()
}

/// `guest-init audit verify FILE`: exit code and stdout.
fn verify(file: &Path) -> (i32, String) {
    let out = output(
        Command::new(env!("CARGO_BIN_EXE_guest-init"))
            .args(["audit", "verify"])
            .arg(file),
    )
    .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

async fn ready(c: &mut Client) -> proto::guest::Ready {
    c.expect(|m| match m {
        Out::Ready(r) => Some(r.clone()),
        Out::Error(e) => panic!("no Ready: {e:?}"),
        _ => None,
    })
    .await
}

/// Runs argv in the session, expecting exit 0; its stdout.
async fn ok(c: &mut Client, id: &str, argv: &[&str]) -> String {
    let r = c.run(id, argv).await;
    assert_eq!(
        r.code(),
        Some(0),
        "{argv:?}: {r:?} {}",
        String::from_utf8_lossy(&r.stderr)
    );
    r.stdout()
}

async fn fetch_bundle(c: &mut Client) -> Vec<u8> {
    c.send(In::FetchBranch(FetchBranch {})).await;
    let mut bundle = Vec::new();
    loop {
        let chunk = c
            .expect(|m| match m {
                Out::BundleChunk(b) => Some(b.clone()),
                Out::Error(e) => panic!("FetchBranch failed: {e:?}"),
                _ => None,
            })
            .await;
        bundle.extend(chunk.data);
        if chunk.last {
            return bundle;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_becomes_a_new_session_at_the_parents_head() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.session(&repo, "free", "main").await;
    ok(
        &mut c,
        "w",
        &[
            "sh",
            "-c",
            "echo work > work.txt && git add work.txt && git commit -q -m 'parent work' \
             && echo draft > draft.txt && echo edited >> README.md \
             && echo staged > staged.txt && git add staged.txt",
        ],
    )
    .await;
    let head = ok(&mut c, "head", &["git", "rev-parse", "HEAD"]).await;
    let status = ok(&mut c, "status", &["git", "status", "--porcelain"]).await;
    assert_eq!(
        status, " M README.md\nA  staged.txt\n?? draft.txt\n",
        "uncommitted work of each kind"
    );
    let long = format!("sleep 61{}", std::process::id() % 10000);
    let secs = long.trim_start_matches("sleep ").to_string();
    c.exec(exec_msg("long", "turn-1", &["sleep", &secs])).await;
    c.expect(|m| matches!(m, Out::ExecStarted(s) if s.exec_id == "long").then_some(()))
        .await;
    wait_for(|| !processes_matching(&long).is_empty()).await;
    assert_eq!(
        processes_matching(&long).len(),
        1,
        "the parent's command runs"
    );
    // What the host holds of the parent's chain when the snapshot is taken.
    let seen = json(c.audit.last().unwrap());
    let (seen_seq, seen_hash) = (
        seen["seq"].as_u64().unwrap(),
        seen["hash"].as_str().unwrap().to_string(),
    );

    // Restored from the snapshot: the old channel is gone, a new one forks.
    drop(c);
    let mut c2 = h.connect().await;
    c2.hello().await;
    c2.send(fork("s2", "s1", seen_seq, &seen_hash)).await;
    let r = ready(&mut c2).await;
    assert_eq!(
        (
            r.session_id.as_str(),
            r.branch.as_str(),
            r.base_commit.trim()
        ),
        ("s2", "session/s2", head.trim())
    );
    assert!(!r.turn_backend.is_empty(), "{r:?}");

    // The parent's command is killed.
    wait_for(|| processes_matching(&long).is_empty()).await;
    assert!(processes_matching(&long).is_empty(), "{long} still runs");

    // The repository: on session/s2 at the parent's HEAD, working copy as it was.
    let ws = &h.workspace;
    assert_eq!(git(ws, &["rev-parse", "HEAD"]), head.trim());
    assert_eq!(git(ws, &["symbolic-ref", "HEAD"]), "refs/heads/session/s2");
    assert_eq!(git(ws, &["rev-parse", "session/s1"]), head.trim());
    // An exec of the new session works, also with an exec id the parent used.
    assert_eq!(
        ok(&mut c2, "status", &["git", "status", "--porcelain"]).await,
        status
    );
    assert_eq!(ok(&mut c2, "w", &["cat", "draft.txt"]).await, "draft\n");

    // The new chain: session.forked first, naming the parent.
    let first = json(&c2.audit[0]);
    assert_eq!(first["seq"], 1);
    assert_eq!(first["action"], "session.forked");
    assert_eq!(first["session_id"], "s2");
    assert_eq!(first["prev_hash"], "0".repeat(64));
    let result = first["result"].as_str().unwrap();
    for part in [
        "parent_session_id=s1".to_string(),
        format!("parent_audit_seq={seen_seq}"),
        format!("parent_audit_hash={seen_hash}"),
    ] {
        assert!(result.contains(&part), "{part} not in {result}");
    }
    assert!(
        first["resource"]
            .as_str()
            .unwrap()
            .contains(&format!("session/s2 agent=free base={}", head.trim())),
        "{first}"
    );
    // ... and the guest's own last event of the parent's chain, which it
    // holds beyond the host's (the detach and the kill came after).
    let own_seq: u64 = result
        .split_once("guest_audit_seq=")
        .and_then(|(_, r)| r.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no guest_audit_seq in {result}"));
    assert!(own_seq > seen_seq, "{result}");
    let parent_log = log_lines(&h, "s1");
    let own = parent_log
        .iter()
        .find(|l| l["seq"] == own_seq)
        .expect("the named event is in the parent's log");
    assert!(
        result.ends_with(&format!(
            "guest_audit_hash={}",
            own["hash"].as_str().unwrap()
        )),
        "{result}"
    );
    assert!(
        c2.audit.iter().all(|l| json(l)["session_id"] == "s2"),
        "nothing of the parent's reaches the new session's host: {:?}",
        c2.audit
    );
    assert!(
        !c2.all.iter().any(|m| matches!(
            &m.kind,
            Some(Out::ExecExited(x)) if x.exec_id == "long"
        )),
        "the parent's command is reported to the parent's caller only"
    );

    // The branch fetched back is the new session's, with what the parent committed.
    let bundle = fetch_bundle(&mut c2).await;
    let file = h.dir.path().join("s2.bundle");
    std::fs::write(&file, &bundle).unwrap();
    let heads = git(
        repo.path(),
        &["bundle", "list-heads", file.to_str().unwrap()],
    );
    assert_eq!(heads, format!("{} refs/heads/session/s2", head.trim()));
    git(
        repo.path(),
        &[
            "fetch",
            "-q",
            file.to_str().unwrap(),
            "session/s2:refs/heads/session/s2",
        ],
    );
    assert_eq!(
        git(repo.path(), &["log", "-1", "--format=%s", "session/s2"]),
        "parent work"
    );

    // The chain verifies like a started session's, and is what the host got.
    c2.send(In::Shutdown(Shutdown {})).await;
    c2.expect(|m| matches!(m, Out::ShutdownStarted(_)).then_some(()))
        .await;
    while c2.recv().await.is_some() {}
    let path = h.audit_log("s2");
    let (code, said) = verify(&path);
    assert_eq!(code, 0, "{said}");
    let lines: Vec<String> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert!(
        said.contains(&format!("chain holds: {} lines", lines.len())),
        "{said} {}",
        lines.len()
    );
    assert_eq!(lines, c2.audit);
    assert_eq!(verify(&h.audit_log("s1")).0, 0, "the parent's chain holds");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_of_another_session_or_of_none_is_refused() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let protocol = Code::Protocol as i32;
    let invalid = Code::InvalidArgument as i32;

    // No session at all.
    let mut c = h.connect().await;
    c.hello().await;
    c.send(fork("s2", "s1", 0, "")).await;
    let (code, msg) = c.expect_error().await;
    assert_eq!(code, protocol, "{msg}");
    assert!(msg.contains("no session"), "{msg}");
    drop(c);

    // On the connection that runs the session: not the first message.
    let mut c = h.session(&repo, "free", "main").await;
    c.send(fork("s2", "s1", 0, "")).await;
    assert_eq!(c.expect_error().await.0, protocol);
    let head = ok(&mut c, "head", &["git", "rev-parse", "HEAD"]).await;
    drop(c);

    let mut c = h.connect().await;
    c.hello().await;
    // Another parent than the guest's session.
    c.send(fork("s2", "other", 0, "")).await;
    let (code, msg) = c.expect_error().await;
    assert_eq!(code, protocol, "{msg}");
    assert!(msg.contains("\"other\"") && msg.contains("\"s1\""), "{msg}");
    // Bad fields: the parent's own id, an id no branch can carry, a hash
    // that is none.
    for (id, hash) in [("s1", ""), ("a b", ""), ("s2", "not-a-hash")] {
        c.send(fork(id, "s1", 3, hash)).await;
        let (code, msg) = c.expect_error().await;
        assert_eq!(code, invalid, "{id:?} {hash:?}: {msg}");
    }

    // The session is unchanged: it resumes as s1 on its branch, nothing of s2 exists.
    c.send(In::ResumeSession(ResumeSession {
        session_id: "s1".into(),
        audit_seq_seen: 0,
        host_time_unix_ns: 0,
        audit_hash_seen: String::new(),
        entropy: vec![7; 64],
    }))
    .await;
    let r = ready(&mut c).await;
    assert_eq!(
        (r.session_id.as_str(), r.branch.as_str()),
        ("s1", "session/s1")
    );
    assert_eq!(
        git(&h.workspace, &["symbolic-ref", "HEAD"]),
        "refs/heads/session/s1"
    );
    assert_eq!(git(&h.workspace, &["rev-parse", "HEAD"]), head.trim());
    assert_eq!(git(&h.workspace, &["branch", "--list", "session/s2"]), "");
    assert!(!h.audit_log("s2").exists());
    assert!(log_lines(&h, "s1")
        .iter()
        .all(|l| l["action"] != "session.forked"));
    assert_eq!(ok(&mut c, "e", &["echo", "still s1"]).await, "still s1\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_can_be_forked_and_resumed() {
    let repo = Repo::new();
    let h = Harness::start().await;
    drop(h.session(&repo, "free", "main").await);
    let mut c = h.connect().await;
    c.hello().await;
    c.send(fork("s2", "s1", 0, "")).await;
    ready(&mut c).await;
    ok(
        &mut c,
        "w",
        &[
            "sh",
            "-c",
            "echo two > two.txt && git add two.txt && git commit -q -m two",
        ],
    )
    .await;
    drop(c);

    // The fork's own kept session is forked in turn.
    let mut c = h.connect().await;
    c.hello().await;
    c.send(fork("s3", "s1", 0, "")).await;
    let (code, msg) = c.expect_error().await;
    assert_eq!(code, Code::Protocol as i32);
    assert!(msg.contains("\"s2\""), "{msg}");
    c.send(fork("s3", "s2", 0, "")).await;
    let r = ready(&mut c).await;
    assert_eq!(r.branch, "session/s3");
    assert_eq!(
        r.base_commit,
        git(&h.workspace, &["rev-parse", "session/s2"])
    );
    assert_eq!(ok(&mut c, "c", &["cat", "two.txt"]).await, "two\n");
    drop(c);

    // ... and resumed as itself.
    let mut c = h.connect().await;
    c.hello().await;
    c.send(In::ResumeSession(ResumeSession {
        session_id: "s3".into(),
        audit_seq_seen: 0,
        host_time_unix_ns: 0,
        audit_hash_seen: String::new(),
        entropy: vec![7; 64],
    }))
    .await;
    assert_eq!(ready(&mut c).await.session_id, "s3");
    assert_eq!(verify(&h.audit_log("s3")).0, 0);
    let actions: Vec<Value> = log_lines(&h, "s3")
        .iter()
        .map(|l| l["action"].clone())
        .collect();
    assert_eq!(actions[0], "session.forked");
    assert!(
        actions.contains(&Value::from("session.resumed")),
        "{actions:?}"
    );
}
