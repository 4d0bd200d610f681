//! host-agent, guest-init and the vmm together: session calls against
//! guest-init run as a host process (a real Linux guest cannot boot on this
//! machine), reached through the harness's CONNECT shim on a Unix socket —
//! the host side of a vmm's vsock. The vmm itself runs the counter test
//! guest.
//!
//! Covers: golden snapshot waiting for guest-init, Create → READY on
//! guest-init's Ready, exec with streaming stdin/stdout and exit codes,
//! approvals (once / reject), a stale execution id, the audit stream
//! chained on the host, and the session branch fetched back at Stop; after
//! host-agent is SIGKILLed and restarted, the guest's session is resumed over
//! a new channel: exec works again, the audit chain goes on, and the branch
//! still comes back at Stop.

use std::process::{Command, Stdio};
use std::time::Duration;

use proto::hostagent as pb;
use proto::hostagent::exec_request::Kind as Req;
use proto::hostagent::exec_response::Kind as Resp;
use test_harness::agent::{Agent, S};
use test_harness::bin::host_agent_path;
use test_harness::git::git;
use tonic::Code;

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_init_session_exec_approvals_audit_branch() {
    let guest = start_guest().await;
    let vsock = guest.vsock().display().to_string();
    let agent = Agent::start(&["--guest-vsock-uds", &vsock, "--no-vsock-device"]);
    agent.guest_init_image().await;

    let mut se = agent.sessions().await;
    // guest-init images need a repository, agent and base ref.
    let err = se
        .create_session(pb::CreateSessionRequest {
            image_id: "gi".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let s = guest_init_session(&agent, &guest).await;
    assert_eq!(s.state, S::Running as i32);

    // Allowed command, streamed output and exit code.
    let (out, stdout) = exec(&agent, &s, &["echo", "hello", "world"], vec![])
        .await
        .unwrap();
    assert!(matches!(out.first(), Some(Resp::Started(_))), "{out:?}");
    assert_eq!(stdout, "hello world\n");
    assert_eq!(exit_code(&out), Some(0));

    // The operator CLI relays too, stdin included, and exits with the
    // command's status.
    let cli = |args: &[&str], input: &str| {
        let mut child = Command::new(host_agent_path())
            .arg("--addr")
            .arg(&agent.addr)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let sid = s.session_id.clone();
    // (Blocking here is fine: host-agent is another process.)
    let out = cli(
        &["exec", &sid, "--stdin", "--", "cat"],
        "from the terminal\n",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "from the terminal\n");
    let out = cli(&["exec", &sid, "--", "git", "push", "x"], "");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("rejected"));

    // Streaming stdin.
    let (out, stdout) = exec(
        &agent,
        &s,
        &["cat"],
        vec![
            Req::Stdin(b"abc".to_vec()),
            Req::Stdin(b"def".to_vec()),
            Req::StdinEof(true),
        ],
    )
    .await
    .unwrap();
    assert_eq!(stdout, "abcdef");
    assert_eq!(exit_code(&out), Some(0));

    // A denied command is rejected with its rule.
    let (out, _) = exec(&agent, &s, &["git", "push", "origin"], vec![])
        .await
        .unwrap();
    assert!(
        out.iter().any(|k| matches!(k, Resp::Rejected(_))),
        "{out:?}"
    );

    // An ask, answered once, then one rejected.
    let mut ap = pb::approvals_client::ApprovalsClient::new(agent.channel().await);
    for (reply, runs) in [(pb::Reply::Once, true), (pb::Reply::Reject, false)] {
        let exec_fut = exec(&agent, &s, &["ls"], vec![]);
        let answer_fut = async {
            let ask = loop {
                let asks = ap
                    .list_asks(pb::ListAsksRequest {
                        session_id: s.session_id.clone(),
                    })
                    .await
                    .unwrap()
                    .into_inner()
                    .asks;
                if let Some(a) = asks.into_iter().next() {
                    break a;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            assert_eq!(ask.subject, "ls");
            // A stale execution id cannot answer.
            let err = ap
                .answer(pb::AnswerRequest {
                    session_id: s.session_id.clone(),
                    execution_id: "stale".into(),
                    ask_id: ask.ask_id.clone(),
                    reply: reply as i32,
                })
                .await
                .unwrap_err();
            assert_eq!(err.code(), Code::FailedPrecondition);
            ap.answer(pb::AnswerRequest {
                session_id: s.session_id.clone(),
                execution_id: s.execution_id.clone(),
                ask_id: ask.ask_id.clone(),
                reply: reply as i32,
            })
            .await
            .unwrap();
            // Answered asks are gone.
            let err = ap
                .answer(pb::AnswerRequest {
                    session_id: s.session_id.clone(),
                    execution_id: s.execution_id.clone(),
                    ask_id: ask.ask_id,
                    reply: reply as i32,
                })
                .await
                .unwrap_err();
            assert_eq!(err.code(), Code::NotFound);
        };
        let ((out, stdout), ()) = tokio::join!(async { exec_fut.await.unwrap() }, answer_fut);
        if runs {
            assert_eq!(exit_code(&out), Some(0), "{out:?}");
            assert!(stdout.contains("README.md"), "{stdout:?}");
        } else {
            assert!(
                out.iter().any(|k| matches!(k, Resp::Rejected(_))),
                "{out:?}"
            );
        }
    }

    // Work on the session branch.
    let (out, _) = exec(
        &agent,
        &s,
        &[
            "git",
            "-c",
            "user.name=Agent",
            "-c",
            "user.email=agent@example.com",
            "commit",
            "--allow-empty",
            "-q",
            "-m",
            "agent work",
        ],
        vec![],
    )
    .await
    .unwrap();
    assert_eq!(exit_code(&out), Some(0), "{out:?}");

    let main_before = git(&guest.repo(), &["rev-parse", "refs/heads/main"]);
    let st = se
        .stop_session(pb::SessionCall {
            session_id: s.session_id.clone(),
            idempotency_key: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.state, S::Stopped as i32);
    let branch = format!("session/{}", s.session_id);
    assert_eq!(st.branch, branch);
    let head = git(
        &guest.repo(),
        &["rev-parse", &format!("refs/heads/{branch}")],
    );
    assert_eq!(st.head_commit, head);
    assert_ne!(head, main_before, "the agent's commit came back");
    assert_eq!(
        git(&guest.repo(), &["log", "-1", "--format=%s", &head]),
        "agent work"
    );
    assert_eq!(
        git(&guest.repo(), &["rev-parse", "refs/heads/main"]),
        main_before,
        "default branch untouched"
    );
    // The Stop event names the branch and its head.
    let mut w = agent
        .events()
        .await
        .watch(pb::WatchRequest {
            since_seq: 0,
            session_id: s.session_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut stopped = None;
    while let Ok(Ok(Some(e))) = tokio::time::timeout(Duration::from_millis(500), w.message()).await
    {
        if e.to == S::Stopped as i32 {
            stopped = Some(e);
        }
    }
    let stopped = stopped.expect("a STOPPED event");
    assert!(
        stopped.detail.contains(&branch) && stopped.detail.contains(&head),
        "{stopped:?}"
    );

    // The audit stream is stored, chained on the host.
    let audit = host_audit(&agent, &s).await;
    assert!(audit.len() >= 5, "{audit:?}");
    for a in &audit {
        assert!(serde_json::from_str::<serde_json::Value>(&a.json).is_ok());
    }
    assert!(
        audit.iter().any(|a| a.json.contains("git push")),
        "denied command audited"
    );
}

/// The session's audit records as host-agent stored them, after checking
/// that each is chained to the one before (`sha256(prev || json)`).

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guest_session_is_resumed_after_host_agent_restarts() {
    let guest = start_guest().await;
    let vsock = guest.vsock().display().to_string();
    let mut agent = Agent::start(&["--guest-vsock-uds", &vsock, "--no-vsock-device"]);
    agent.guest_init_image().await;
    let s = guest_init_session(&agent, &guest).await;
    let (_, stdout) = exec(&agent, &s, &["echo", "before"], vec![]).await.unwrap();
    assert_eq!(stdout, "before\n");
    let (out, _) = exec(
        &agent,
        &s,
        &[
            "git",
            "-c",
            "user.name=A",
            "-c",
            "user.email=a@example.com",
            "commit",
            "--allow-empty",
            "-q",
            "-m",
            "before the restart",
        ],
        vec![],
    )
    .await
    .unwrap();
    assert_eq!(exit_code(&out), Some(0), "{out:?}");

    agent.kill9();
    agent.spawn();
    assert_eq!(agent.get(&s.session_id).await.state, S::Running as i32);
    // The new host-agent takes the guest's session back: commands run again.
    let (out, stdout) = exec(&agent, &s, &["echo", "after"], vec![])
        .await
        .expect("exec after the restart");
    assert_eq!(stdout, "after\n", "{out:?}");
    assert_eq!(exit_code(&out), Some(0));

    // One audit chain on the host across both processes, with the detach and resume in it.
    let audit = host_audit(&agent, &s).await;
    let actions: Vec<String> = audit
        .iter()
        .map(|a| {
            serde_json::from_str::<serde_json::Value>(&a.json).unwrap()["action"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    let detached = actions.iter().position(|a| a == "session.detached");
    let resumed = actions.iter().position(|a| a == "session.resumed");
    assert!(detached.is_some() && resumed > detached, "{actions:?}");

    // Stop still brings the branch back, with the commit made before the restart.
    let st = agent
        .sessions()
        .await
        .stop_session(pb::SessionCall {
            session_id: s.session_id.clone(),
            idempotency_key: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.state, S::Stopped as i32);
    assert_eq!(
        git(
            &guest.repo(),
            &["log", "-1", "--format=%s", &st.head_commit]
        ),
        "before the restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_guest_init_session_takes_commands_under_its_new_execution() {
    let guest = start_guest().await;
    let vsock = guest.vsock().display().to_string();
    let agent = Agent::start(&["--guest-vsock-uds", &vsock, "--no-vsock-device"]);
    agent.guest_init_image().await;
    // Created through the operator CLI this time, for a script (JSON).
    let out = Command::new(host_agent_path())
        .args([
            "--addr",
            &agent.addr,
            "--output",
            "json",
            "sessions",
            "create",
            "gi",
        ])
        .args(["--repository", guest.repo().to_str().unwrap()])
        .args(["--agent", "coder", "--base-ref", "main"])
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{printed} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let created: serde_json::Value = serde_json::from_str(printed.trim()).expect("one JSON object");
    assert_eq!(created["state"], "RUNNING", "{created}");
    let id = created["session_id"].as_str().unwrap().to_string();
    // For a person: a table whose STATE column says RUNNING.
    let out = Command::new(host_agent_path())
        .args(["--addr", &agent.addr, "sessions", "list"])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&out.stdout).to_string();
    let mut lines = listed.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    let state_col = header
        .iter()
        .position(|h| *h == "STATE")
        .expect("a STATE column");
    let row: Vec<&str> = lines
        .find(|l| l.starts_with(&id))
        .unwrap_or_else(|| panic!("no row for {id}: {listed}"))
        .split_whitespace()
        .collect();
    assert_eq!(row[state_col], "RUNNING", "{listed}");
    let s = agent.get(&id).await;
    let call = pb::SessionCall {
        session_id: s.session_id.clone(),
        idempotency_key: String::new(),
    };
    let mut se = agent.sessions().await;
    let snap = se.snapshot_session(call).await.unwrap().into_inner();
    let restored = se
        .restore_session(pb::RestoreSessionRequest {
            session_id: s.session_id.clone(),
            snapshot_dir: snap.snapshot_dir,
            idempotency_key: String::new(),
        })
        .await
        .expect("restore")
        .into_inner();
    assert_ne!(restored.execution_id, s.execution_id);
    // The guest channel was opened again (ResumeSession) for the new execution.
    let (out, stdout) = exec(&agent, &restored, &["echo", "restored"], vec![])
        .await
        .expect("exec after the restore");
    assert_eq!(stdout, "restored\n", "{out:?}");
    let stale = exec(&agent, &s, &["echo", "stale"], vec![])
        .await
        .unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition);
}
