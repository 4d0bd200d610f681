//! ForkSession: new sessions from a running (or paused to disk) session.
//! Each restores the fork's snapshot layer with its own copy of the disk,
//! id, execution id and vmm, and goes on from the source's memory; the
//! source resumes. A fork the node's limits would not take is refused
//! before anything is made.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use common::counts::{counts, wait_for_counts};
use common::*;
use proto::hostagent as pb;
use tonic::Code;

fn run_dir(agent: &Agent, id: &str) -> PathBuf {
    agent.state_dir().join("sessions").join(id).join("jail/run")
}

fn fork_req(id: &str, count: u32) -> pb::ForkSessionRequest {
    pb::ForkSessionRequest {
        session_id: id.into(),
        count,
        ..Default::default()
    }
}

fn call(id: &str) -> pb::SessionCall {
    pb::SessionCall {
        session_id: id.into(),
        idempotency_key: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_makes_sessions_that_go_on_from_the_source() {
    let t = tempfile::tempdir().unwrap();
    let agent = Agent::start(&[]);
    let disk = rootfs(t.path());
    test_guest_image(
        &agent,
        "count",
        "counter",
        "interval=20000",
        32,
        Some(&disk),
    )
    .await;
    let s = agent.create("count", "").await;
    let src_log = run_dir(&agent, &s.session_id).join("serial.log");
    wait_for_counts(&src_log, 0, 3);
    // The source writes its disk: the forks get it as it is.
    write_at_start(
        &run_dir(&agent, &s.session_id).join("disk.ext4"),
        b"source state",
    );
    let before = *counts(&src_log, 0).last().unwrap();

    let mut c = agent.sessions().await;
    let r = c
        .fork_session(fork_req(&s.session_id, 3))
        .await
        .expect("fork of 3")
        .into_inner();
    let source = r.source.unwrap();
    assert_eq!(
        source.state,
        S::Running as i32,
        "the source resumes: {source:?}"
    );
    assert_eq!(
        source.execution_id, s.execution_id,
        "the source keeps its execution"
    );
    assert_eq!(source.vmm_pid, s.vmm_pid);
    assert_eq!(r.sessions.len(), 3);
    let mut ids = std::collections::BTreeSet::new();
    let mut inodes = std::collections::BTreeSet::new();
    for f in &r.sessions {
        assert_eq!(f.state, S::Running as i32, "{f:?}");
        assert_eq!(f.parent_session_id, s.session_id);
        assert_ne!(f.execution_id, s.execution_id);
        assert!(f.vmm_pid != 0 && f.vmm_pid != s.vmm_pid);
        ids.insert(f.session_id.clone());
        // Its own copy of the source's disk as it was at the fork.
        let disk = run_dir(&agent, &f.session_id).join("disk.ext4");
        let data = std::fs::read(&disk).unwrap();
        let source = std::fs::read(run_dir(&agent, &s.session_id).join("disk.ext4")).unwrap();
        assert!(
            data.starts_with(b"source state") && data == source,
            "the fork's disk is the source's"
        );
        inodes.insert(std::fs::metadata(&disk).unwrap().ino());
        // It counts on from the source's memory, not from the golden boot.
        let log = run_dir(&agent, &f.session_id).join("serial.log");
        let first = wait_for_counts(&log, 0, 1)[0];
        assert!(
            first > before,
            "fork counts from {first}, the source was at {before}"
        );
    }
    assert_eq!(ids.len(), 3, "three sessions");
    assert_eq!(inodes.len(), 3, "three disks");
    // The source runs on.
    let n = counts(&src_log, 0).len();
    wait_for_counts(&src_log, 0, n + 1);
    // A fork writing its disk leaves the source's alone.
    let first = r.sessions[0].session_id.clone();
    write_at_start(&run_dir(&agent, &first).join("disk.ext4"), b"fork");
    let source_disk = std::fs::read(run_dir(&agent, &s.session_id).join("disk.ext4")).unwrap();
    assert!(
        source_disk.starts_with(b"source state"),
        "the source's disk is its own"
    );

    // The fork's layer is kept while any of them needs it.
    let events = agent.session_events(&first).await;
    assert_eq!(events[0].reason, "forked");
    assert!(events[0].detail.contains(&s.session_id), "{:?}", events[0]);
    for f in &r.sessions {
        agent.stop(&f.session_id).await;
    }
    agent.stop(&s.session_id).await;
    let left: Vec<_> = std::fs::read_dir(agent.state_dir().join("layers"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.is_symlink())
        .collect();
    assert!(left.is_empty(), "every session ended: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_beyond_the_node_limits_is_refused_before_anything_is_made() {
    let agent = Agent::start(&["--max-sessions", "3"]);
    agent.counter_image("count").await;
    let s = agent.create("count", "").await;
    let mut c = agent.sessions().await;
    let err = c
        .fork_session(fork_req(&s.session_id, 3))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    let listed = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sessions;
    assert_eq!(listed.len(), 1, "nothing was made");
    let layers: Vec<_> = std::fs::read_dir(agent.state_dir().join("layers"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.is_symlink())
        .collect();
    assert!(layers.is_empty(), "no snapshot was taken: {layers:?}");
    let src = agent.get(&s.session_id).await;
    assert_eq!(src.state, S::Running as i32);
    for bad in [0, 65] {
        let err = c
            .fork_session(fork_req(&s.session_id, bad))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "count {bad}: {err:?}");
    }
    // Within the limit it works.
    let r = c
        .fork_session(fork_req(&s.session_id, 2))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.sessions.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_paused_to_disk_forks_from_its_layer_and_stays_on_disk() {
    let agent = Agent::start(&[]);
    agent.counter_image("count").await;
    let s = agent.create("count", "").await;
    let mut c = agent.sessions().await;
    c.pause_session(pb::PauseSessionRequest {
        session_id: s.session_id.clone(),
        persist: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let r = c
        .fork_session(fork_req(&s.session_id, 1))
        .await
        .unwrap()
        .into_inner();
    let source = r.source.unwrap();
    assert!(
        source.persisted && source.state == S::Paused as i32,
        "{source:?}"
    );
    assert_eq!(r.sessions[0].state, S::Running as i32);
    // The source's own layer is the fork's: the source can still resume.
    c.stop_session(call(&r.sessions[0].session_id))
        .await
        .unwrap();
    let back = c
        .resume_session(call(&s.session_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(back.state, S::Running as i32);
}
