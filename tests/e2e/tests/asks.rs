//! Asks as events, against guest-init run as a host process (see
//! `guest_init.rs`): a command the rules ask about shows its ask in its own
//! Exec stream and as an `ask` event (command and rule) in `Events.Watch`;
//! each answer is an `ask_answered` event; an ask whose command ends
//! unanswered (here its turn ended) is an `ask_unanswered` event.

use std::time::Duration;

use proto::hostagent as pb;
use proto::hostagent::exec_request::Kind as Req;
use proto::hostagent::exec_response::Kind as Resp;
use test_harness::agent::Agent;
use test_harness::bin::host_agent_path;

mod common;

use common::*;

/// An Exec stream of `argv` in `turn`, its stdin held open, returning the
/// stream once the command's first message (started, ask, rejected) came.
async fn start_exec(
    agent: &Agent,
    s: &pb::Session,
    turn: &str,
    argv: &[&str],
) -> (tonic::Streaming<pb::ExecResponse>, pb::ExecResponse) {
    let start = pb::ExecRequest {
        kind: Some(Req::Start(pb::ExecStart {
            session_id: s.session_id.clone(),
            execution_id: s.execution_id.clone(),
            turn_id: turn.into(),
            argv: argv.iter().map(|a| a.to_string()).collect(),
            ..Default::default()
        })),
    };
    let mut ex = pb::exec_client::ExecClient::new(agent.channel().await);
    let mut stream = ex
        .exec(tokio_stream::iter(vec![start]))
        .await
        .expect("exec")
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(30), stream.message())
        .await
        .expect("a first message in time")
        .expect("no error")
        .expect("not the end");
    (stream, first)
}

/// The rest of an Exec stream.
async fn rest(mut stream: tonic::Streaming<pb::ExecResponse>) -> Vec<Resp> {
    let mut out = Vec::new();
    while let Some(m) = tokio::time::timeout(Duration::from_secs(30), stream.message())
        .await
        .expect("the stream ends in time")
        .expect("no stream error")
    {
        out.extend(m.kind);
    }
    out
}

/// The next event of `reason` from a watch stream.
/// Every event of session `s`, from its first, then live.
async fn watch_session(agent: &Agent, s: &pb::Session) -> tonic::Streaming<pb::Event> {
    agent
        .events()
        .await
        .watch(pb::WatchRequest {
            since_seq: 0,
            session_id: s.session_id.clone(),
            ..Default::default()
        })
        .await
        .expect("watch")
        .into_inner()
}

async fn next_event(w: &mut tonic::Streaming<pb::Event>, reason: &str) -> pb::Event {
    loop {
        let e = tokio::time::timeout(Duration::from_secs(30), w.message())
            .await
            .unwrap_or_else(|_| panic!("no {reason} event in time"))
            .expect("watch error")
            .expect("watch ended");
        if e.reason == reason {
            return e;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asks_show_in_the_exec_stream_and_as_events_with_their_answers() {
    let guest = start_guest().await;
    let vsock = guest.vsock().display().to_string();
    let agent = Agent::start(&["--guest-vsock-uds", &vsock, "--no-vsock-device"]);
    agent.guest_init_image().await;
    let s = guest_init_session(&agent, &guest).await;
    let mut watch = watch_session(&agent, &s).await;
    let mut approvals = pb::approvals_client::ApprovalsClient::new(agent.channel().await);

    // `ls` falls to the rules' `"*": ask`: the ask comes in the Exec stream
    // and as an event naming the command and the rule.
    let (stream, first) = start_exec(&agent, &s, "t1", &["ls", "-a"]).await;
    let Some(Resp::Ask(ask)) = first.kind else {
        panic!("expected the ask first, got {first:?}");
    };
    assert_eq!(ask.subject, "ls -a");
    assert_eq!(ask.rule, "bash: \"*\" = ask");
    assert_eq!(ask.session_id, s.session_id);
    assert_eq!(ask.turn_id, "t1");
    let asked = next_event(&mut watch, "ask").await;
    assert!(
        asked.detail.contains(&ask.ask_id)
            && asked.detail.contains("\"ls -a\"")
            && asked.detail.contains(&format!("by rule {:?}", ask.rule)),
        "{asked:?}"
    );
    // Answered once: an event, and the command runs.
    approvals
        .answer(pb::AnswerRequest {
            session_id: s.session_id.clone(),
            execution_id: s.execution_id.clone(),
            ask_id: ask.ask_id.clone(),
            reply: pb::Reply::Once as i32,
        })
        .await
        .expect("answer");
    let answered = next_event(&mut watch, "ask_answered").await;
    assert_eq!(answered.detail, format!("ask {}: once", ask.ask_id));
    let out = rest(stream).await;
    assert!(
        out.iter().any(|k| matches!(
            k,
            Resp::Exit(pb::ExecExit {
                status: Some(pb::exec_exit::Status::Code(0)),
                ..
            })
        )),
        "{out:?}"
    );

    // Rejected through the operator's CLI: listed, answered, an event, and
    // the command's stream says so.
    let (stream, first) = start_exec(&agent, &s, "t2", &["ls", "/"]).await;
    let Some(Resp::Ask(ask)) = first.kind else {
        panic!("expected an ask, got {first:?}");
    };
    let listed = cli(
        &agent,
        &["--output", "json", "approvals", "list", &s.session_id],
    );
    let listed: serde_json::Value = serde_json::from_str(listed.trim()).expect("one JSON line");
    assert_eq!(listed["ask_id"], ask.ask_id.as_str(), "{listed}");
    assert_eq!(listed["subject"], "ls /", "{listed}");
    cli(
        &agent,
        &["approvals", "answer", &s.session_id, &ask.ask_id, "reject"],
    );
    let answered = next_event(&mut watch, "ask_answered").await;
    assert_eq!(answered.detail, format!("ask {}: reject", ask.ask_id));
    let out = rest(stream).await;
    assert!(
        out.iter().any(|k| matches!(k, Resp::Rejected(_))),
        "{out:?}"
    );

    // Unanswered: its turn ends while it waits.
    let (stream, first) = start_exec(&agent, &s, "t3", &["ls", "/tmp"]).await;
    let Some(Resp::Ask(ask)) = first.kind else {
        panic!("expected an ask, got {first:?}");
    };
    pb::exec_client::ExecClient::new(agent.channel().await)
        .end_turn(pb::EndTurnRequest {
            session_id: s.session_id.clone(),
            turn_id: "t3".into(),
        })
        .await
        .expect("end the turn");
    let unanswered = next_event(&mut watch, "ask_unanswered").await;
    assert!(
        unanswered
            .detail
            .starts_with(&format!("ask {}: ", ask.ask_id))
            && unanswered
                .detail
                .contains("ended before the command was approved"),
        "{unanswered:?}"
    );
    let out = rest(stream).await;
    assert!(
        out.iter().any(|k| matches!(k, Resp::Rejected(_))),
        "{out:?}"
    );
    // It is no longer pending.
    let pending = approvals
        .list_asks(pb::ListAsksRequest {
            session_id: s.session_id.clone(),
        })
        .await
        .expect("list asks")
        .into_inner()
        .asks;
    assert!(pending.is_empty(), "{pending:?}");

    // The audit, checked by the CLI.
    let out = std::process::Command::new(host_agent_path())
        .args(["--addr", &agent.addr, "audit", &s.session_id, "--verify"])
        .output()
        .expect("host-agent audit runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("holds"), "{stderr}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ask.answered"),
        "the audit has the answers"
    );
}

/// Runs the operator CLI against `agent`; its stdout (it must succeed).
fn cli(agent: &Agent, args: &[&str]) -> String {
    let out = std::process::Command::new(host_agent_path())
        .args(["--addr", &agent.addr])
        .args(args)
        .output()
        .expect("host-agent runs");
    assert!(
        out.status.success(),
        "host-agent {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ask_nobody_answers_times_out_after_the_nodes_ask_timeout() {
    let guest = start_guest().await;
    let vsock = guest.vsock().display().to_string();
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(config.path(), r#"{"ask_timeout_seconds": 1}"#).unwrap();
    let config = config.path().display().to_string();
    let agent = Agent::start(&[
        "--config",
        &config,
        "--guest-vsock-uds",
        &vsock,
        "--no-vsock-device",
    ]);
    agent.guest_init_image().await;
    let s = guest_init_session(&agent, &guest).await;
    let mut watch = watch_session(&agent, &s).await;
    let (stream, first) = start_exec(&agent, &s, "t1", &["ls", "-a"]).await;
    let Some(Resp::Ask(ask)) = first.kind else {
        panic!("expected an ask, got {first:?}");
    };
    // Nobody answers: the guest gives up after the node's 1 s, not its
    // default 300 s (the 30 s bound of next_event would fail first).
    let unanswered = next_event(&mut watch, "ask_unanswered").await;
    assert!(
        unanswered
            .detail
            .starts_with(&format!("ask {}: ", ask.ask_id))
            && unanswered.detail.contains("timed out after 1000 ms"),
        "{unanswered:?}"
    );
    let out = rest(stream).await;
    assert!(
        out.iter().any(|k| matches!(k, Resp::Rejected(_))),
        "{out:?}"
    );
}
