//! The audit log of a real session: streamed events equal the file, the
//! chain verifies with `guest-init audit verify`, and edits, removals and
//! reorderings are reported at the right line.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use proto::guest::{answer::Reply, guest_message::Kind as Out, host_message::Kind as In, Shutdown};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_log_verifies_and_tampering_is_found() {
    let repo = Repo::new();
    let mut h = Harness::start().await;
    let mut c = h.session(&repo, "coder", "main").await;
    assert_eq!(c.run("e1", &["echo", "hi"]).await.code(), Some(0));
    assert!(c
        .run("e2", &["git", "push", "origin", "main"])
        .await
        .rejected
        .is_some());
    c.exec(exec_msg("e3", "t", &["ls"])).await;
    c.finish("e3", Some(Reply::Once)).await;
    c.end_turn("t").await;
    c.send(In::Shutdown(Shutdown {})).await;
    c.expect(|m| matches!(m, Out::ShutdownStarted(_)).then_some(()))
        .await;
    // Collect the session.end event that follows.
    while c.recv().await.is_some() {}
    (&mut h.task).await.unwrap().unwrap();

    let path = h.audit_log("s1");
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<String> = text.lines().map(str::to_string).collect();
    // The host's streamed copy is the same chain.
    assert_eq!(lines, c.audit);
    let actions: Vec<String> = lines
        .iter()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["action"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    for a in [
        "session.start",
        "exec.decided",
        "exec.started",
        "exec.exited",
        "exec.rejected",
        "ask.requested",
        "ask.answered",
        "turn.killed",
        "session.end",
    ] {
        assert!(actions.iter().any(|x| x == a), "missing {a} in {actions:?}");
    }
    let first: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    for key in [
        "v",
        "seq",
        "at",
        "session_id",
        "turn_id",
        "actor",
        "action",
        "resource",
        "decision",
        "result",
        "prev_hash",
        "hash",
    ] {
        assert!(first.get(key).is_some(), "missing field {key}");
    }
    // Only root may write the log.
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );

    let (code, out) = verify(&path);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!("chain holds: {} lines", lines.len())),
        "{out}"
    );

    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, ls: &[String]| {
        let p = dir.path().join(name);
        std::fs::write(&p, ls.join("\n") + "\n").unwrap();
        p
    };
    // Edited: a denial turned into an allow.
    let mut edited = lines.clone();
    let i = edited
        .iter()
        .position(|l| l.contains("\"decision\":\"deny\""))
        .unwrap();
    edited[i] = edited[i].replace("\"decision\":\"deny\"", "\"decision\":\"allow\"");
    let (code, out) = verify(&write("edited", &edited));
    assert_eq!(code, 1);
    assert!(
        out.contains(&format!("broken at line {}", i + 1)) && out.contains("edited"),
        "{out}"
    );
    // Removed.
    let mut removed = lines.clone();
    removed.remove(2);
    let (code, out) = verify(&write("removed", &removed));
    assert_eq!(code, 1);
    assert!(out.contains("broken at line 3"), "{out}");
    // Reordered.
    let mut reordered = lines.clone();
    reordered.swap(3, 4);
    let (code, out) = verify(&write("reordered", &reordered));
    assert_eq!(code, 1);
    assert!(out.contains("broken at line 4"), "{out}");
    // Missing file: a clear error, exit 2.
    let (code, _) = verify(&dir.path().join("absent"));
    assert_eq!(code, 2);
}
