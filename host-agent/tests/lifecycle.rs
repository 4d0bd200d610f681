//! VM lifecycle over real gRPC with real vmm processes and the counter test
//! guest: create (idempotent), pause, snapshot, resume, stop, delete, usage;
//! a vmm killed from outside; event resume from a seq.

mod common;

use std::time::Duration;

use common::*;
use proto::hostagent as pb;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_pause_snapshot_resume_stop_delete() {
    let agent = Agent::start(&["--usage-interval-ms", "200"]);
    let img = agent.counter_image("counter").await;
    assert!(!img.golden_snapshot_dir.is_empty());

    let s = agent.create("counter", "create-1").await;
    assert_eq!(s.state, S::Running as i32);
    assert!(s.vmm_pid > 0);
    assert!(!s.execution_id.is_empty());
    // A retried Create with the same key returns the same session.
    let again = agent.create("counter", "create-1").await;
    assert_eq!(again.session_id, s.session_id);
    assert_eq!(again.execution_id, s.execution_id);
    // The same key with a different request is refused.
    let err = agent
        .sessions()
        .await
        .create_session(pb::CreateSessionRequest {
            image_id: "counter".into(),
            idempotency_key: "create-1".into(),
            limits: Some(pb::Limits {
                ttl_seconds: 99,
                idle_timeout_seconds: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    let mut c = agent.sessions().await;
    let call = |key: &str| pb::SessionCall {
        session_id: s.session_id.clone(),
        idempotency_key: key.into(),
    };
    let p = c
        .pause_session(proto::hostagent::PauseSessionRequest::from(call("pause-1")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.state, S::Paused as i32);
    assert_eq!(p.reason, "requested");
    tokio::time::sleep(Duration::from_millis(600)).await;

    let snap = c
        .snapshot_session(call("snap-1"))
        .await
        .unwrap()
        .into_inner();
    let dir = std::path::Path::new(&snap.snapshot_dir);
    assert!(
        dir.join("state").is_file() && dir.join("memory").is_file(),
        "{snap:?}"
    );
    // Retrying the snapshot with its key returns the same snapshot.
    let snap2 = c
        .snapshot_session(call("snap-1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(snap2.snapshot_dir, snap.snapshot_dir);

    let r = c
        .resume_session(call("resume-1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.state, S::Running as i32);
    // Snapshot while running: paused around the snapshot, running after.
    let snap3 = c.snapshot_session(call("")).await.unwrap().into_inner();
    assert_eq!(snap3.session.unwrap().state, S::Running as i32);
    assert_ne!(snap3.snapshot_dir, snap.snapshot_dir);

    // Deleting a live session is refused.
    let err = c.delete_session(call("")).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);

    let st = c.stop_session(call("stop-1")).await.unwrap().into_inner();
    assert_eq!(st.state, S::Stopped as i32);
    assert_eq!(st.reason, "requested");
    assert!(st.ended_at >= st.ready_at && st.ready_at > 0);

    // The vmm process is gone.
    assert!(
        !std::path::Path::new(&format!("/proc/{}", s.vmm_pid)).exists() || {
            let stat =
                std::fs::read_to_string(format!("/proc/{}/stat", s.vmm_pid)).unwrap_or_default();
            stat.contains(") Z")
        }
    );

    // Usage: contiguous, cumulative, ends with one final record, billed at
    // least one second; the paused time is not billed.
    let recs = agent.usage_of(&s.session_id).await;
    assert!(!recs.is_empty());
    check_usage_chain(&recs);
    let last = recs.last().unwrap();
    assert!(last.r#final);
    assert!(last.billed_seconds >= 1.0);
    let wall = (st.ended_at - st.ready_at) as f64 / 1000.0;
    assert!(
        last.billed_seconds <= wall - 0.5 || last.billed_seconds == 1.0,
        "billed {} of {wall} s wall, with >= 0.6 s paused",
        last.billed_seconds
    );
    assert!(last.memory_allocated_gib_seconds > 0.0);

    // Events of the session, in order.
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
    let mut path = Vec::new();
    while let Ok(Ok(Some(e))) = tokio::time::timeout(Duration::from_millis(500), w.message()).await
    {
        path.push(S::try_from(e.to).unwrap());
    }
    use S::*;
    assert_eq!(
        path,
        vec![
            Pending, Restoring, Ready, Running, Paused, Running, Paused, Running, Stopping, Stopped
        ]
    );

    c.delete_session(call("del-1")).await.unwrap();
    let err = c
        .get_session(pb::SessionRef {
            session_id: s.session_id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    // Events and usage stay after delete.
    assert_eq!(agent.usage_of(&s.session_id).await.len(), recs.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vmm_killed_from_outside_fails_the_session() {
    let agent = Agent::start(&[]);
    agent.counter_image("counter").await;
    let s = agent.create("counter", "").await;
    sigkill(s.vmm_pid);
    let f = agent.wait_state(&s.session_id, S::Failed).await;
    assert_eq!(f.reason, "vmm_crash");
    assert!(f.detail.contains("signal 9"), "{f:?}");
    let recs = agent.usage_of(&s.session_id).await;
    assert!(recs.last().unwrap().r#final);
    assert!(recs.last().unwrap().billed_seconds >= 1.0);
    // Stopping a failed session is a no-op that returns it.
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
    assert_eq!(st.state, S::Failed as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_resumes_from_a_seq_without_gaps_or_duplicates() {
    let agent = Agent::start(&[]);
    agent.counter_image("counter").await;
    let a = agent.create("counter", "").await;
    // 4 events so far: PENDING, RESTORING, READY, RUNNING.
    let first = agent.events_since(0, 4).await;
    let seqs: Vec<u64> = first.iter().map(|e| e.seq).collect();
    assert!(seqs.windows(2).all(|w| w[1] > w[0]));

    // A watcher that saw up to the 2nd event reconnects from there, and
    // follows live events while more sessions change state.
    let since = first[1].seq;
    let mut w = agent
        .events()
        .await
        .watch(pb::WatchRequest {
            since_seq: since,
            session_id: String::new(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let agent2 = &agent;
    let mutate = async {
        let b = agent2.create("counter", "").await;
        let mut c = agent2.sessions().await;
        for id in [&a.session_id, &b.session_id] {
            c.stop_session(pb::SessionCall {
                session_id: id.clone(),
                idempotency_key: String::new(),
            })
            .await
            .unwrap();
        }
    };
    mutate.await;
    // 2 remaining of a's start + 4 of b's start + 2 stops x 2 events.
    let mut got = Vec::new();
    while got.len() < 2 + 4 + 4 {
        let e = tokio::time::timeout(Duration::from_secs(60), w.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        got.push(e);
    }
    assert_eq!(got[0].seq, first[2].seq);
    assert_eq!(got[1].seq, first[3].seq);
    for win in got.windows(2) {
        assert!(
            win[1].seq > win[0].seq,
            "strictly increasing, no duplicates"
        );
    }
    // Nothing more arrives.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), w.message())
            .await
            .is_err()
    );
    // The full history equals what a fresh watcher from 0 sees.
    let all = agent.events_since(0, 12).await;
    let all_seqs: Vec<u64> = all.iter().map(|e| e.seq).collect();
    let mut joined: Vec<u64> = first[..2].iter().map(|e| e.seq).collect();
    joined.extend(got.iter().map(|e| e.seq));
    assert_eq!(all_seqs, joined);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vmm_exit_zero_not_requested_is_a_guest_exit() {
    let agent = Agent::start(&[]);
    agent.counter_image("counter").await;
    let s = agent.create("counter", "").await;
    // Stop the VM behind host-agent's back, as a guest reset would: the vmm
    // exits with code 0 without host-agent having asked. (Jailed, host-agent's
    // default, its control socket is in the jail's run directory.)
    let sock = agent
        .state_dir()
        .join("sessions")
        .join(&s.session_id)
        .join("jail/run/control.sock");
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let mut c = tokio::net::UnixStream::connect(&sock).await.unwrap();
    c.write_all(b"{\"op\":\"stop\"}\n").await.unwrap();
    let mut line = String::new();
    tokio::io::BufReader::new(c)
        .read_line(&mut line)
        .await
        .unwrap();
    assert!(line.contains("\"ok\":true"), "{line}");
    let st = agent.wait_state(&s.session_id, S::Stopped).await;
    assert_eq!(st.reason, "guest_exit");
    assert!(st.detail.contains("code 0"), "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_validates_its_session_filter() {
    let agent = Agent::start(&[]);
    let err = agent
        .events()
        .await
        .watch(pb::WatchRequest {
            since_seq: 0,
            session_id: "x".repeat(65),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    // A watch from a seq beyond the end waits for new events, no error.
    let mut w = agent
        .events()
        .await
        .watch(pb::WatchRequest {
            since_seq: 1_000_000,
            session_id: String::new(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        tokio::time::timeout(Duration::from_millis(200), w.message())
            .await
            .is_err()
    );
}
