//! `Exec.EndTurn` against guest-init run as a host process (see
//! `guest_init.rs`): a command of a turn still running is killed and
//! reported, its Exec stream ends, the end is recorded as an event and in
//! the guest's audit log; a turn with nothing running ends with nothing
//! killed; bad turn ids and sessions are refused.

use std::time::Duration;

use proto::hostagent as pb;
use proto::hostagent::exec_request::Kind as Req;
use proto::hostagent::exec_response::Kind as Resp;
use test_harness::agent::Agent;
use tonic::Code;

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_turn_kills_the_turns_commands_and_says_what_it_killed() {
    let guest = start_guest().await;
    let vsock = guest.vsock().display().to_string();
    let agent = Agent::start(&["--guest-vsock-uds", &vsock, "--no-vsock-device"]);
    agent.guest_init_image().await;
    let s = guest_init_session(&agent, &guest).await;

    // `cat` with stdin held open runs until something stops it.
    let start = pb::ExecRequest {
        kind: Some(Req::Start(pb::ExecStart {
            session_id: s.session_id.clone(),
            execution_id: s.execution_id.clone(),
            turn_id: "turn-long".into(),
            argv: vec!["cat".into()],
            keep_stdin_open: true,
            ..Default::default()
        })),
    };
    let (keep_tx, keep_rx) = tokio::sync::mpsc::channel::<pb::ExecRequest>(1);
    keep_tx.send(start).await.unwrap();
    let mut ex = pb::exec_client::ExecClient::new(agent.channel().await);
    let mut stream = ex
        .exec(tokio_stream::wrappers::ReceiverStream::new(keep_rx))
        .await
        .expect("exec")
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(30), stream.message())
        .await
        .expect("started in time")
        .expect("a message")
        .expect("not the end");
    let Some(Resp::Started(started)) = first.kind else {
        panic!("expected started, got {first:?}");
    };
    let pid: u32 = started
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("exec id and pid");

    let mut turns = pb::exec_client::ExecClient::new(agent.channel().await);
    let ended = turns
        .end_turn(pb::EndTurnRequest {
            session_id: s.session_id.clone(),
            turn_id: "turn-long".into(),
        })
        .await
        .expect("EndTurn")
        .into_inner();
    assert_eq!(ended.turn_id, "turn-long");
    assert!(
        ended
            .killed
            .iter()
            .any(|k| k.pid == pid && k.command.contains("cat")),
        "the running cat ({pid}) is killed: {:?}",
        ended.killed
    );
    // Its stream ends with the kill.
    let mut exit = None;
    while let Some(m) = tokio::time::timeout(Duration::from_secs(30), stream.message())
        .await
        .expect("the stream ends in time")
        .expect("no stream error")
    {
        if let Some(Resp::Exit(e)) = m.kind {
            exit = e.status;
        }
    }
    assert!(
        matches!(exit, Some(pb::exec_exit::Status::Signal(_))),
        "killed by a signal: {exit:?}"
    );
    drop(keep_tx);

    // A turn with nothing running: nothing killed.
    let empty = turns
        .end_turn(pb::EndTurnRequest {
            session_id: s.session_id.clone(),
            turn_id: "turn-idle".into(),
        })
        .await
        .expect("EndTurn of an idle turn")
        .into_inner();
    assert!(empty.killed.is_empty(), "{:?}", empty.killed);

    // Recorded: an event per turn ended, and the guest's audit.
    let events = agent.session_events(&s.session_id).await;
    let turn_events: Vec<&pb::Event> = events.iter().filter(|e| e.reason == "turn_ended").collect();
    assert_eq!(turn_events.len(), 2, "{events:?}");
    assert!(
        turn_events[0].detail.starts_with(&format!(
            "turn turn-long: {} process(es) killed",
            ended.killed.len()
        )),
        "{:?}",
        turn_events[0]
    );
    assert_eq!(
        turn_events[1].detail, "turn turn-idle: 0 process(es) killed",
        "{:?}",
        turn_events[1]
    );
    assert!(
        turn_events[0].detail.contains(&pid.to_string()),
        "{:?}",
        turn_events[0]
    );
    let audit = host_audit(&agent, &s).await;
    assert!(
        audit
            .iter()
            .any(|a| a.json.contains("turn.killed") && a.json.contains("turn-long")),
        "the guest audited the kill"
    );

    // Bad input.
    for (turn, code) in [("", Code::InvalidArgument), ("a\nb", Code::InvalidArgument)] {
        let e = turns
            .end_turn(pb::EndTurnRequest {
                session_id: s.session_id.clone(),
                turn_id: turn.into(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "{turn:?}: {e:?}");
        assert!(e.message().contains("turn_id"), "{}", e.message());
    }
    let e = turns
        .end_turn(pb::EndTurnRequest {
            session_id: "00000000-0000-0000-0000-000000000000".into(),
            turn_id: "t".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");

    // After Stop, turns no longer end.
    agent.stop(&s.session_id).await;
    let e = turns
        .end_turn(pb::EndTurnRequest {
            session_id: s.session_id.clone(),
            turn_id: "turn-late".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
}
