//! Policy enforcement end to end: allow, deny and ask (once, always,
//! reject, timeout), patterns with last-match-wins, wrapper unwrapping,
//! rules edited on the session branch, secrets scoping and redaction.

mod common;

use common::*;
use proto::guest::{answer::Reply, error::Code, guest_message::Kind as Out};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_and_deny_with_last_match_wins() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.session(&repo, "coder", "main").await;
    // "git *" allow comes after "*": ask, so it wins.
    let r = c.run("a", &["git", "status", "--short"]).await;
    assert_eq!(r.code(), Some(0), "{r:?}");
    assert!(r.asks.is_empty());
    // "git push *" deny comes last and wins over "git *".
    let r = c.run("d", &["git", "push", "origin", "main"]).await;
    let (reason, rule) = r.rejected.expect("denied");
    assert_eq!(reason, "denied by policy");
    assert_eq!(rule, "bash: \"git push *\" = deny");
    assert!(r.pid.is_none(), "a denied command must not start");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrappers_and_shell_scripts_are_unwrapped() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.session(&repo, "coder", "main").await;
    for (i, argv) in [
        &["sudo", "-u", "root", "git", "push", "origin", "main"][..],
        &[
            "env", "A=1", "timeout", "5", "nice", "-n", "3", "git", "push", "x",
        ],
        &["/usr/bin/env", "xargs", "-n", "1", "git", "push", "y"],
        &["bash", "-lc", "echo ok && git push origin main"],
    ]
    .iter()
    .enumerate()
    {
        let r = c.run(&format!("w{i}"), argv).await;
        let (_, rule) = r
            .rejected
            .unwrap_or_else(|| panic!("{argv:?} was not denied"));
        assert!(rule.contains("git push *"), "{argv:?}: {rule}");
    }
    // Unwrapped to an allowed command, it runs.
    let r = c
        .run("ok", &["env", "FOO=bar", "timeout", "5", "echo", "fine"])
        .await;
    assert_eq!(r.stdout(), "fine\n");
    // A shell script whose parts are all allowed runs.
    let r = c.run("sh", &["sh", "-c", "echo one; echo two"]).await;
    assert_eq!(r.stdout(), "one\ntwo\n", "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ask_once_always_and_reject() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.session(&repo, "coder", "main").await;

    // `ls` matches only "*": ask.
    c.exec(exec_msg("once", "t", &["ls", "README.md"])).await;
    let r = c.finish("once", Some(Reply::Once)).await;
    assert_eq!(r.asks.len(), 1);
    assert_eq!(r.asks[0].subject, "ls README.md");
    assert_eq!(r.asks[0].rule, "bash: \"*\" = ask");
    assert_eq!(r.stdout(), "README.md\n");

    // Once means once: asked again.
    c.exec(exec_msg("always", "t", &["ls", "README.md"])).await;
    let r = c.finish("always", Some(Reply::Always)).await;
    assert_eq!(r.asks.len(), 1);
    assert_eq!(r.code(), Some(0));

    // Always: not asked for the rest of the session.
    c.exec(exec_msg("again", "t", &["ls", "README.md"])).await;
    let r = c.finish("again", None).await;
    assert!(r.asks.is_empty());
    assert_eq!(r.code(), Some(0));

    // Reject.
    c.exec(exec_msg("rej", "t", &["uname"])).await;
    let r = c.finish("rej", Some(Reply::Reject)).await;
    assert_eq!(r.asks.len(), 1);
    assert_eq!(
        r.rejected.expect("rejected").0,
        "rejected by the control plane"
    );
    assert!(r.pid.is_none());

    // Answering an unknown ask is an error, and the session goes on.
    c.send(proto::guest::host_message::Kind::Answer(
        proto::guest::Answer {
            ask_id: "ask-nope".into(),
            reply: Reply::Once as i32,
        },
    ))
    .await;
    let (code, msg) = c.expect_error().await;
    assert_eq!(code, Code::InvalidArgument as i32);
    assert!(msg.contains("no pending ask"), "{msg}");

    let decisions: Vec<&String> = c
        .audit
        .iter()
        .filter(|l| l.contains("\"ask.answered\""))
        .collect();
    assert_eq!(decisions.len(), 3);
    assert!(decisions[1].contains("\"decision\":\"always\""));
    assert!(decisions[2].contains("\"decision\":\"reject\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ask_times_out_as_reject() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.connect().await;
    c.hello().await;
    let mut spec = SessionSpec::new("s1", "coder", "main");
    spec.ask_timeout_ms = 300;
    let ready = c.start_session(&spec, &repo.bundle()).await;
    assert!(matches!(ready, Out::Ready(_)), "{ready:?}");
    let started = std::time::Instant::now();
    c.exec(exec_msg("slow", "t", &["uname"])).await;
    let r = c.finish("slow", None).await;
    assert_eq!(r.asks.len(), 1);
    assert_eq!(r.asks[0].timeout_ms, 300);
    let (reason, _) = r.rejected.expect("timed out");
    assert!(reason.contains("timed out after 300 ms"), "{reason}");
    assert!(started.elapsed() >= std::time::Duration::from_millis(300));
    assert!(c
        .audit
        .iter()
        .any(|l| l.contains("\"ask.answered\"") && l.contains("\"decision\":\"timeout\"")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ending_the_turn_cancels_its_pending_asks() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.session(&repo, "coder", "main").await;
    c.exec(exec_msg("held", "t1", &["uname"])).await;
    let ask = c
        .expect(|m| match m {
            Out::AskRequest(a) => Some(a.clone()),
            _ => None,
        })
        .await;
    c.end_turn("t1").await;
    let r = c.finish("held", None).await;
    let (reason, _) = r.rejected.expect("rejected");
    assert!(reason.contains("turn or session ended"), "{reason}");
    // A late answer finds nothing to approve.
    c.send(proto::guest::host_message::Kind::Answer(
        proto::guest::Answer {
            ask_id: ask.ask_id,
            reply: Reply::Once as i32,
        },
    ))
    .await;
    assert!(c.expect_error().await.1.contains("no pending ask"));
    assert!(r.pid.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_edited_on_the_session_branch_change_nothing() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.session(&repo, "coder", "main").await;
    // The agent rewrites its own rules to allow everything and commits.
    let mut e = exec_msg("edit", "t", &["tee", "agents/coder.md"]);
    e.stdin = b"---\npermission:\n  bash: allow\n---\n".to_vec();
    c.exec(e).await;
    assert_eq!(c.finish("edit", None).await.code(), Some(0));
    let r = c
        .run("commit", &["git", "commit", "-q", "-am", "loosen my rules"])
        .await;
    assert_eq!(r.code(), Some(0), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(std::fs::read_to_string(h.workspace.join("agents/coder.md"))
        .unwrap()
        .contains("bash: allow"));
    // Decisions still come from the base commit.
    let r = c.run("push", &["git", "push", "origin", "main"]).await;
    assert!(r.rejected.is_some(), "{r:?}");
    c.exec(exec_msg("ls", "t", &["ls"])).await;
    let r = c.finish("ls", Some(Reply::Reject)).await;
    assert_eq!(r.asks.len(), 1, "ls must still be asked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_that_does_not_parse_stops_the_session() {
    let repo = Repo::with_files(&[(
        "agents/coder.md",
        "---\npermission:\n  bash: sometimes\n---\n",
    )]);
    let h = Harness::start().await;
    let mut c = h.connect().await;
    c.hello().await;
    let r = c
        .start_session(&SessionSpec::new("s1", "coder", "main"), &repo.bundle())
        .await;
    let Out::Error(e) = r else { panic!("{r:?}") };
    assert_eq!(e.code, Code::Policy as i32);
    assert!(
        e.message.contains("agents/coder.md")
            && e.message
                .contains("\"sometimes\" is not one of allow, ask, deny"),
        "{}",
        e.message
    );
    assert!(e.message.contains("session not started"));
    // Nothing runs: there is no session.
    let r = c.run("x", &["echo", "hi"]).await;
    let (code, msg) = r.error.expect("refused");
    assert_eq!(code, Code::Protocol as i32);
    assert!(msg.contains("no session"), "{msg}");

    // A missing agent file and a broken manifest are refused the same way.
    for (files, needle) in [
        (vec![("README.md", "x")], "agents/coder.md does not exist"),
        (
            vec![
                ("agents/coder.md", FREE_RULES),
                (
                    "agent-manifest.yaml",
                    "version: 1\nagents:\n  coder:\n    secretz: []\n",
                ),
            ],
            "agent-manifest.yaml",
        ),
    ] {
        let repo = Repo::with_files(&files);
        let h = Harness::start().await;
        let mut c = h.connect().await;
        c.hello().await;
        let r = c
            .start_session(&SessionSpec::new("s1", "coder", "main"), &repo.bundle())
            .await;
        let Out::Error(e) = r else { panic!("{r:?}") };
        assert!(e.message.contains(needle), "{}", e.message);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_scoped_and_never_echoed() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.connect().await;
    c.hello().await;
    let mut spec = SessionSpec::new("s1", "coder", "main");
    // Granted to coder: TOKEN, OTHER. Allowed by the session: TOKEN, UNGRANTED.
    spec.allowlist = vec!["TOKEN".into(), "UNGRANTED".into()];
    spec.secrets = [
        ("TOKEN", "tok-5f2a9c1d"),
        ("OTHER", "oth-77e1b3"),
        ("UNGRANTED", "ung-31c0aa"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    let ready = c.start_session(&spec, &repo.bundle()).await;
    assert!(matches!(ready, Out::Ready(_)), "{ready:?}");

    let r = c.run("env", &["env"]).await;
    let env = r.stdout();
    assert!(env.contains("TOKEN=[REDACTED:TOKEN]"), "{env}");
    assert!(
        !env.contains("OTHER="),
        "OTHER is granted but not allowed by the session"
    );
    assert!(
        !env.contains("UNGRANTED="),
        "UNGRANTED is allowed but not granted"
    );
    // The value in an argument is redacted from events too.
    let r = c.run("echo", &["echo", "tok-5f2a9c1d"]).await;
    assert_eq!(r.stdout(), "[REDACTED:TOKEN]\n");
    assert!(c
        .audit
        .iter()
        .any(|l| l.contains("\"secret.delivered\"") && l.contains("\"resource\":\"TOKEN\"")));
    assert!(!c
        .audit
        .iter()
        .any(|l| l.contains("\"secret.delivered\"") && l.contains("OTHER")));
    // An error quoting the value (a cwd named after it) is redacted too.
    let mut e = exec_msg("cwd", "t", &["pwd"]);
    e.cwd = b"oth-77e1b3".to_vec();
    c.exec(e).await;
    let (_, msg) = c.finish("cwd", None).await.error.expect("bad cwd");
    assert!(msg.contains("[REDACTED:OTHER]"), "{msg}");
    // Nothing the agent sent, and nothing in the audit log, holds a value.
    let log = std::fs::read(h.audit_log("s1")).unwrap();
    for v in ["tok-5f2a9c1d", "oth-77e1b3", "ung-31c0aa"] {
        assert!(!contains(&c.transcript(), v), "{v} leaked on the channel");
        assert!(!contains(&log, v), "{v} leaked into the audit log");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_env_reaches_commands_and_risky_names_are_refused() {
    let repo = Repo::new();
    let h = Harness::start().await;
    // The session's variables reach every command undecided, so a name that
    // changes what runs (or guest-init's own) is refused at StartSession, as
    // host-agent refuses it at CreateSession.
    for (field, name) in [
        ("env", "PATH"),
        ("env", "GUEST_INIT_TURN"),
        ("secrets", "LD_PRELOAD"),
        ("secrets", "GIT_SSH_COMMAND"),
    ] {
        let mut c = h.connect().await;
        c.hello().await;
        let mut spec = SessionSpec::new("s1", "coder", "main");
        let pair = (name.to_string(), "/tmp/x".to_string());
        if field == "env" {
            spec.env.extend([pair]);
        } else {
            spec.allowlist = vec![name.into()];
            spec.secrets.extend([pair]);
        }
        let r = c.start_session(&spec, &repo.bundle()).await;
        let Out::Error(e) = r else {
            panic!("{name}: {r:?}")
        };
        assert!(
            e.message.contains(&format!("{field}: the name {name:?}")),
            "{}",
            e.message
        );
    }
    let mut c = h.connect().await;
    c.hello().await;
    let mut spec = SessionSpec::new("s1", "coder", "main");
    spec.env
        .extend([("GREETING".to_string(), "hello-env".to_string())]);
    let ready = c.start_session(&spec, &repo.bundle()).await;
    assert!(matches!(ready, Out::Ready(_)), "{ready:?}");
    let env = c.run("env", &["env"]).await.stdout();
    assert!(env.contains("GREETING=hello-env"), "{env}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_env_and_paths_are_decided() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.session(&repo, "coder", "main").await;
    // `git *` allows `git status`, but not with a PATH of the agent's choosing.
    let mut e = exec_msg("env", "t", &["git", "status"]);
    e.env.insert("PATH".into(), "/tmp/evil".into());
    c.exec(e).await;
    let r = c.finish("env", Some(Reply::Reject)).await;
    assert_eq!(r.asks.len(), 1, "{r:?}");
    assert_eq!(
        r.asks[0].subject,
        "git status [the Exec's environment sets PATH]"
    );
    assert!(r.pid.is_none());
    // A program given by a path in the workspace is decided by that path.
    c.exec(exec_msg("path", "t", &["./git", "status"])).await;
    let r = c.finish("path", Some(Reply::Reject)).await;
    assert_eq!(r.asks.len(), 1, "{r:?}");
    assert!(
        r.asks[0].subject.ends_with("/workspace/git status"),
        "{r:?}"
    );
    // `always` for the escalated command does not allow it with another variable.
    let mut e = exec_msg("ld1", "t", &["git", "status"]);
    e.env.insert("LD_PRELOAD".into(), "/x.so".into());
    c.exec(e).await;
    let r = c.finish("ld1", Some(Reply::Always)).await;
    assert_eq!(r.asks.len(), 1);
    let mut e = exec_msg("ld2", "t", &["git", "status"]);
    e.env.insert("LD_PRELOAD".into(), "/x.so".into());
    c.exec(e).await;
    let r = c.finish("ld2", None).await;
    assert!(r.asks.is_empty(), "answered always: {r:?}");
    let mut e = exec_msg("ld3", "t", &["git", "status"]);
    e.env.insert("BASH_ENV".into(), "/x.sh".into());
    c.exec(e).await;
    let r = c.finish("ld3", Some(Reply::Reject)).await;
    assert_eq!(r.asks.len(), 1, "{r:?}");
}
