//! A session outlives its connection: when the channel closes (host-agent
//! restarted), guest-init kills the session's turns but keeps its workspace,
//! policy and audit chain, and a new connection resumes it with
//! ResumeSession. A StartSession on a new connection replaces a kept session.

mod common;

use common::*;
use proto::guest::{guest_message::Kind as Out, host_message::Kind as In, ResumeSession};

fn resume(id: &str, audit_seq_seen: u64) -> In {
    resume_at(id, audit_seq_seen, "")
}

/// ResumeSession naming the host's last event by seq and hash.
fn resume_at(id: &str, audit_seq_seen: u64, hash: &str) -> In {
    In::ResumeSession(ResumeSession {
        session_id: id.into(),
        audit_seq_seen,
        host_time_unix_ns: 0,
        audit_hash_seen: hash.into(),
        // Not PID 1: a guest-init serving on a test machine mixes nothing.
        entropy: vec![7; 64],
    })
}

/// The `hash` of the guest's own audit event `seq`.
fn hash_of(h: &Harness, session: &str, seq: u64) -> String {
    std::fs::read_to_string(h.audit_log(session))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["seq"] == seq)
        .map(|v| v["hash"].as_str().unwrap().to_string())
        .unwrap()
}

/// (seq, action, result) of every line of an audit log.
fn audit_actions(h: &Harness, session: &str) -> Vec<(u64, String, String)> {
    std::fs::read_to_string(h.audit_log(session))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["seq"].as_u64().unwrap(),
                v["action"].as_str().unwrap().to_string(),
                v["result"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

async fn wait_until_gone(cmd: &str) {
    wait_for(|| processes_matching(cmd).is_empty()).await;
    assert!(processes_matching(cmd).is_empty(), "{cmd} still runs");
}

/// Session s1 on a new connection, with note.txt written in its workspace
/// and a long command (`sleep <prefix><n>`, returned) running in turn-1.
async fn session_with_a_long_turn(h: &Harness, repo: &Repo, prefix: &str) -> (Client, String) {
    let mut c = h.session(repo, "free", "main").await;
    let wrote = c.run("w", &["sh", "-c", "echo kept > note.txt"]).await;
    assert_eq!(wrote.code(), Some(0), "{wrote:?}");
    let long = format!("sleep {prefix}{}", std::process::id() % 1000);
    c.exec(exec_msg("long", "turn-1", &["sh", "-c", &long]))
        .await;
    c.expect(|m| matches!(m, Out::ExecStarted(s) if s.exec_id == "long").then_some(()))
        .await;
    wait_for(|| !processes_matching(&long).is_empty()).await;
    (c, long)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_survives_its_connection_and_is_resumed() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let (c, long) = session_with_a_long_turn(&h, &repo, "37").await;
    assert_eq!(
        processes_matching(&long).len(),
        1,
        "the turn's command runs"
    );

    // The channel breaks: nobody can read the turn's output any more, so it is killed.
    drop(c);
    wait_until_gone(&long).await;

    // A resume of another session is refused and does not discard the kept one.
    let mut c2 = h.connect().await;
    c2.hello().await;
    c2.send(resume("other", 0)).await;
    let (code, msg) = c2.expect_error().await;
    assert_eq!(code, proto::guest::error::Code::Protocol as i32);
    assert!(msg.contains("\"s1\""), "{msg}");

    // The host says it holds the audit events up to seq 2 (the same event as
    // the guest's): the rest come again first.
    c2.send(resume_at("s1", 2, &hash_of(&h, "s1", 2))).await;
    let ready = c2
        .expect(|m| match m {
            Out::Ready(r) => Some(r.clone()),
            _ => None,
        })
        .await;
    assert_eq!(ready.session_id, "s1");
    assert_eq!(ready.branch, "session/s1");
    assert_eq!(ready.base_commit, repo.head());
    let replayed: Vec<serde_json::Value> = c2
        .audit
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(replayed[0]["seq"], 3, "{replayed:?}");
    assert!(
        replayed.iter().any(|e| e["action"] == "session.detached"),
        "the event audited while no channel was open is sent: {replayed:?}"
    );
    assert_eq!(replayed.last().unwrap()["action"], "session.resumed");
    // The workspace and the session's policy are still there.
    assert_eq!(c2.run("r", &["cat", "note.txt"]).await.stdout(), "kept\n");

    let log = audit_actions(&h, "s1");
    let seqs: Vec<u64> = log.iter().map(|(s, ..)| *s).collect();
    let expected: Vec<u64> = (seqs[0]..seqs[0] + seqs.len() as u64).collect();
    assert_eq!(seqs, expected, "one audit chain across both connections");
    let actions: Vec<&str> = log.iter().map(|(_, a, _)| a.as_str()).collect();
    let detached = actions.iter().position(|a| *a == "session.detached");
    let resumed = actions.iter().position(|a| *a == "session.resumed");
    assert!(
        detached.is_some() && resumed > detached,
        "detach then resume audited: {actions:?}"
    );
    assert!(!actions.contains(&"session.end"), "{actions:?}");

    // A resumed session cannot be resumed again on the same connection.
    c2.send(resume("s1", 0)).await;
    assert_eq!(
        c2.expect_error().await.0,
        proto::guest::error::Code::Protocol as i32
    );

    // A new session on the next connection replaces the kept one.
    drop(c2);
    let mut c3 = h.connect().await;
    c3.hello().await;
    let started = c3
        .start_session(&SessionSpec::new("s2", "free", "main"), &repo.bundle())
        .await;
    assert!(matches!(started, Out::Ready(_)), "{started:?}");
    let (_, last, why) = audit_actions(&h, "s1").pop().unwrap();
    assert_eq!(
        (last.as_str(), why.as_str()),
        (
            "session.end",
            "replaced by a new session; workspace cleared"
        )
    );
}

/// A connection the guest was never told is dead (a vsock connection reset
/// by a restored VM's transport-reset event wakes no reader) must not keep
/// guest-init from the host's next one: a new connection supersedes the one
/// being served, which ends as if it had closed (its turns killed, its
/// session detached), and the new one resumes the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_connection_supersedes_one_still_open_and_resumes_its_session() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let (mut old, long) = session_with_a_long_turn(&h, &repo, "38").await;

    // The old connection stays open on this side; the host connects again.
    let mut new = h.connect().await;
    new.hello().await;
    new.send(resume("s1", 0)).await;
    let ready = new
        .expect(|m| match m {
            Out::Ready(r) => Some(r.clone()),
            _ => None,
        })
        .await;
    assert_eq!(ready.session_id, "s1");
    wait_until_gone(&long).await;
    assert_eq!(new.run("r", &["cat", "note.txt"]).await.stdout(), "kept\n");

    // guest-init closed the superseded connection: it reads to its end.
    let mut rest = Vec::new();
    while let Some(m) = old.recv().await {
        rest.push(m);
    }
    assert!(
        !rest.iter().any(|m| matches!(m, Out::Ready(_))),
        "the old connection got nothing of the new one's: {rest:?}"
    );
    let actions: Vec<String> = audit_actions(&h, "s1")
        .into_iter()
        .map(|(_, a, _)| a)
        .collect();
    let detached = actions.iter().position(|a| a == "session.detached");
    let resumed = actions.iter().position(|a| a == "session.resumed");
    assert!(
        detached.is_some() && resumed > detached,
        "detached, then resumed on the new connection: {actions:?}"
    );
}

/// Starts session s1, closes its connection, and resumes it on a new one
/// with the message `resume` builds; returns the connection (after Ready)
/// and the audit events it received before Ready.
async fn rolled_back(
    h: &Harness,
    resume: impl FnOnce(&Harness) -> In,
) -> (Client, Vec<serde_json::Value>) {
    let repo = Repo::new();
    drop(h.session(&repo, "free", "main").await);
    let mut c = h.connect().await;
    c.hello().await;
    c.send(resume(h)).await;
    c.expect(|m| matches!(m, Out::Ready(_)).then_some(())).await;
    let sent = c
        .audit
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (c, sent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_behind_the_host_numbers_its_audit_after_the_hosts() {
    // As after a restore from an older snapshot: the host holds events up to
    // seq 1000, the guest's own log is far shorter.
    let h = Harness::start().await;
    let (mut c, sent) = rolled_back(&h, |_| resume("s1", 1000)).await;
    assert_eq!(sent[0]["action"], "session.rolled_back", "{sent:?}");
    assert_eq!(
        sent[0]["seq"], 1001,
        "nothing the host holds is numbered again"
    );
    assert_eq!(sent[1]["action"], "session.resumed");
    assert_eq!(c.run("e", &["echo", "on"]).await.stdout(), "on\n");
    let (last_seq, ..) = audit_actions(&h, "s1").pop().unwrap();
    assert!(last_seq > 1002, "{last_seq}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_whose_event_differs_from_the_hosts_at_that_seq_was_rolled_back() {
    // The host's event at the seq it names is not the guest's: the guest runs
    // on from an older snapshot and wrote other events since.
    let h = Harness::start().await;
    let own = std::cell::Cell::new(0);
    let (_c, sent) = rolled_back(&h, |h| {
        own.set(audit_actions(h, "s1").last().unwrap().0);
        resume_at("s1", own.get(), "not-the-guests-hash")
    })
    .await;
    assert_eq!(
        sent[0]["action"], "session.rolled_back",
        "nothing resent: {sent:?}"
    );
    assert_eq!(sent[0]["seq"], own.get() + 1);
    assert_eq!(sent[1]["action"], "session.resumed");
}
