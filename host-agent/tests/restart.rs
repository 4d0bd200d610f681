//! host-agent SIGKILLed while sessions run, then started again on the same
//! state directory: it re-attaches to the vmm processes and loses no
//! session, event or usage record.

mod common;

use std::time::Duration;

use common::*;
use proto::hostagent as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_and_restart_loses_nothing() {
    let mut agent = Agent::start(&["--usage-interval-ms", "200"]);
    agent.counter_image("counter").await;
    let running = agent.create("counter", "run").await;
    let paused = agent.create("counter", "pause").await;
    let mut c = agent.sessions().await;
    c.pause_session(proto::hostagent::PauseSessionRequest::from(
        pb::SessionCall {
            session_id: paused.session_id.clone(),
            idempotency_key: String::new(),
        },
    ))
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let events_before = agent.events_since(0, 9).await;
    let usage_before = agent.usage_of(&running.session_id).await;
    assert!(!usage_before.is_empty());

    agent.kill9();
    // The vmm processes outlive host-agent.
    for pid in [running.vmm_pid, paused.vmm_pid] {
        assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    agent.spawn();

    let r = agent.get(&running.session_id).await;
    assert_eq!(r.state, S::Running as i32, "{r:?}");
    assert_eq!(r.vmm_pid, running.vmm_pid);
    assert_eq!(r.execution_id, running.execution_id);
    let p = agent.get(&paused.session_id).await;
    assert_eq!(p.state, S::Paused as i32, "{p:?}");

    // Every event is still there, with the same seqs, and nothing new was
    // invented by the restart.
    let events_after = agent.events_since(0, 9).await;
    assert_eq!(events_after, events_before);

    // A retried Create with the first key still returns the same session.
    let again = agent.create("counter", "run").await;
    assert_eq!(again.session_id, running.session_id);

    // Usage continues where it left off: same chain, contiguous intervals
    // across the restart (the downtime is covered by the next record).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let usage_after = agent.usage_of(&running.session_id).await;
    assert!(usage_after.len() > usage_before.len());
    assert_eq!(&usage_after[..usage_before.len()], &usage_before[..]);
    check_usage_chain(&usage_after);

    // The re-attached sessions are fully controllable.
    let mut c = agent.sessions().await;
    let call = |id: &str| pb::SessionCall {
        session_id: id.into(),
        idempotency_key: String::new(),
    };
    c.resume_session(call(&paused.session_id)).await.unwrap();
    c.pause_session(proto::hostagent::PauseSessionRequest::from(call(
        &running.session_id,
    )))
    .await
    .unwrap();
    let st = c
        .stop_session(call(&running.session_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.state, S::Stopped as i32);
    assert_eq!(st.reason, "requested");
    let recs = agent.usage_of(&running.session_id).await;
    check_usage_chain(&recs);
    assert!(recs.last().unwrap().r#final);

    // A re-attached vmm that dies is still noticed (through its pidfd).
    sigkill(paused.vmm_pid);
    let f = agent.wait_state(&paused.session_id, S::Failed).await;
    assert_eq!(f.reason, "vmm_crash");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vmm_that_died_while_host_agent_was_down_is_failed_on_restart() {
    let mut agent = Agent::start(&[]);
    agent.counter_image("counter").await;
    let s = agent.create("counter", "").await;
    agent.kill9();
    sigkill(s.vmm_pid);
    tokio::time::sleep(Duration::from_millis(300)).await;
    agent.spawn();
    let f = agent.get(&s.session_id).await;
    assert_eq!(f.state, S::Failed as i32);
    assert_eq!(f.reason, "vmm_crash");
    let recs = agent.usage_of(&s.session_id).await;
    assert!(recs.last().unwrap().r#final);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_stop_on_shutdown_stops_sessions() {
    let mut agent = Agent::start(&["--stop-sessions-on-shutdown", "--warm-pool", "1"]);
    agent.counter_image("counter").await;
    let s = agent.create("counter", "").await;
    let status = agent.terminate();
    assert!(status.success(), "{status:?}");
    // The session's vmm and the warm VMs are gone.
    let gone = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|st| st.contains(") Z"))
            .unwrap_or(true)
    };
    assert!(gone(s.vmm_pid));
    let pool = agent.state_dir().join("pool");
    assert_eq!(std::fs::read_dir(&pool).map(|d| d.count()).unwrap_or(0), 0);
    agent.spawn();
    let st = agent.get(&s.session_id).await;
    assert_eq!(st.state, S::Stopped as i32);
    assert_eq!(st.reason, "host_agent_shutdown");
    let recs = agent.usage_of(&s.session_id).await;
    assert!(recs.last().unwrap().r#final);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_by_default_leaves_sessions_running_for_the_next_start() {
    let mut agent = Agent::start(&[]);
    agent.counter_image("counter").await;
    let s = agent.create("counter", "").await;
    assert!(agent.terminate().success());
    agent.spawn();
    let r = agent.get(&s.session_id).await;
    assert_eq!(r.state, S::Running as i32);
    assert_eq!(r.vmm_pid, s.vmm_pid);
}
