//! Sessions paused to disk, with guest-init (run as a host process behind
//! the CONNECT shim, as in guest_init.rs): with `auto_resume` an Exec aimed
//! at the persisted session resumes it and runs; without, it is refused
//! until ResumeSession; a persisted session stopped brings its branch back;
//! a guest that does not take the session back after the restore fails the
//! resume and the VM goes back to disk as it was (PAUSED, `resume_failed`)
//! instead of leaving a RUNNING session whose guest never answers.

use proto::hostagent as pb;
use test_harness::agent::{Agent, S};
use tonic::Code;

mod common;

use common::*;

async fn session(agent: &Agent, guest: &Guest, auto_resume: bool) -> pb::Session {
    agent
        .sessions()
        .await
        .create_session(pb::CreateSessionRequest {
            image_id: "gi".into(),
            repository_path: guest.repo().display().to_string(),
            agent: "coder".into(),
            base_ref: "main".into(),
            auto_resume,
            ..Default::default()
        })
        .await
        .expect("create")
        .into_inner()
}

async fn persist(agent: &Agent, s: &pb::Session) -> pb::Session {
    agent
        .sessions()
        .await
        .pause_session(pb::PauseSessionRequest {
            session_id: s.session_id.clone(),
            persist: true,
            ..Default::default()
        })
        .await
        .expect("pause to disk")
        .into_inner()
}

async fn resume(agent: &Agent, s: &pb::Session) -> Result<pb::Session, tonic::Status> {
    agent
        .sessions()
        .await
        .resume_session(pb::SessionCall {
            session_id: s.session_id.clone(),
            idempotency_key: String::new(),
        })
        .await
        .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_resumes_a_session_paused_to_disk_with_auto_resume() {
    let guest = start_guest().await;
    let vsock = guest.vsock().display().to_string();
    let agent = Agent::start(&["--guest-vsock-uds", &vsock, "--no-vsock-device"]);
    agent.guest_init_image().await;
    let s = session(&agent, &guest, true).await;
    assert!(s.auto_resume);
    let (_, out) = exec(&agent, &s, &["echo", "before"], vec![]).await.unwrap();
    assert_eq!(out, "before\n");

    let p = persist(&agent, &s).await;
    assert!(p.persisted && p.state == S::Paused as i32, "{p:?}");
    // Aimed at the session as the caller knew it: resumed, then run.
    let (res, out) = exec(&agent, &s, &["echo", "after"], vec![])
        .await
        .expect("the exec resumes the session");
    assert_eq!(out, "after\n");
    assert_eq!(exit_code(&res), Some(0));
    let now = agent.get(&s.session_id).await;
    assert_eq!(now.state, S::Running as i32);
    assert!(!now.persisted);
    assert_ne!(now.execution_id, s.execution_id, "a new execution");
    let events = agent.session_events(&s.session_id).await;
    assert!(
        events
            .iter()
            .any(|e| e.reason == "auto_resume" && e.to == S::Running as i32),
        "{events:?}"
    );
    // The old execution id is stale now, as after any restore.
    let err = exec(&agent, &s, &["echo", "stale"], vec![])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    // The audit chain went on across the pause to disk.
    let audit = host_audit(&agent, &now).await;
    assert!(audit.len() >= 2, "{audit:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_auto_resume_a_persisted_session_waits_for_resume_and_stops_with_its_branch() {
    let guest = start_guest().await;
    let vsock = guest.vsock().display().to_string();
    let agent = Agent::start(&["--guest-vsock-uds", &vsock, "--no-vsock-device"]);
    agent.guest_init_image().await;
    let s = session(&agent, &guest, false).await;
    persist(&agent, &s).await;
    let err = exec(&agent, &s, &["echo", "no"], vec![]).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("paused to disk"), "{err:?}");

    let r = resume(&agent, &s).await.unwrap();
    let (_, out) = exec(&agent, &r, &["echo", "yes"], vec![]).await.unwrap();
    assert_eq!(out, "yes\n");

    // Paused to disk again, then stopped: resumed to fetch the branch.
    persist(&agent, &r).await;
    let stopped = agent.stop(&s.session_id).await;
    assert_eq!(stopped.state, S::Stopped as i32, "{stopped:?}");
    assert_eq!(stopped.branch, format!("session/{}", s.session_id));
    assert!(!stopped.head_commit.is_empty(), "{stopped:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_whose_guest_does_not_take_the_session_back_puts_it_back_on_disk() {
    let mut guest = start_guest().await;
    let vsock = guest.vsock().display().to_string();
    let agent = Agent::start(&["--guest-vsock-uds", &vsock, "--no-vsock-device"]);
    agent.guest_init_image().await;
    let s = session(&agent, &guest, false).await;
    let first = persist(&agent, &s).await;
    // The guest that answers after the restore has no session to take back.
    guest.restart_guest_init().await;
    let err = resume(&agent, &s).await.unwrap_err();
    assert!(
        err.message().contains("did not take the session back"),
        "{err:?}"
    );
    // Nothing is lost: the VM went back to disk as it was, in a new layer.
    let now = agent.get(&s.session_id).await;
    assert_eq!(now.state, S::Paused as i32, "{now:?}");
    assert!(now.persisted, "{now:?}");
    assert_eq!(now.vmm_pid, 0, "the restored vmm is gone: {now:?}");
    assert_eq!(now.reason, "resume_failed", "{now:?}");
    assert!(now.snapshot_bytes >= first.snapshot_bytes, "{now:?}");
    let events = agent.session_events(&s.session_id).await;
    let last = events.last().unwrap();
    assert_eq!(
        (last.from, last.to, last.reason.as_str()),
        (S::Restoring as i32, S::Paused as i32, "resume_failed"),
        "{events:?}"
    );
    assert!(last.detail.contains("back on disk"), "{last:?}");
    assert!(
        !events
            .iter()
            .any(|e| e.to == S::Ready as i32 && e.reason == "resumed"),
        "never READY: {events:?}"
    );
    // It can be stopped (the resume for its branch fails the same way).
    let stopped = agent.stop(&s.session_id).await;
    assert_eq!(stopped.state, S::Stopped as i32, "{stopped:?}");
}
