//! Limits: per-session TTL, idle timeout (auto-pause), node max lifetime and
//! max sessions, each with its own reason.

mod common;

use common::*;
use proto::hostagent as pb;
use tonic::Code;

async fn create_with(agent: &Agent, ttl: u64, idle: u64) -> pb::Session {
    agent
        .sessions()
        .await
        .create_session(pb::CreateSessionRequest {
            image_id: "counter".into(),
            limits: Some(pb::Limits {
                ttl_seconds: ttl,
                idle_timeout_seconds: idle,
            }),
            ..Default::default()
        })
        .await
        .expect("create")
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_stops_and_idle_pauses() {
    let agent = Agent::start(&["--limits-interval-ms", "100"]);
    agent.counter_image("counter").await;
    let ttl = create_with(&agent, 1, 0).await;
    let idle = create_with(&agent, 0, 1).await;

    let s = agent.wait_state(&ttl.session_id, S::Stopped).await;
    assert_eq!(s.reason, "ttl_expired");
    assert!(s.ended_at - s.created_at >= 1000);

    let p = agent.wait_state(&idle.session_id, S::Paused).await;
    assert_eq!(p.reason, "idle");
    // Resuming counts as activity; the session runs again.
    let r = agent
        .sessions()
        .await
        .resume_session(pb::SessionCall {
            session_id: idle.session_id.clone(),
            idempotency_key: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.state, S::Running as i32);
    // ... and, idle again, pauses again.
    let p = agent.wait_state(&idle.session_id, S::Paused).await;
    assert_eq!(p.reason, "idle");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_lifetime_and_max_sessions() {
    let agent = Agent::start(&[
        "--limits-interval-ms",
        "100",
        "--max-lifetime",
        "2",
        "--max-sessions",
        "2",
    ]);
    agent.counter_image("counter").await;
    let a = agent.create("counter", "").await;
    let _b = agent.create("counter", "").await;
    let err = agent
        .sessions()
        .await
        .create_session(pb::CreateSessionRequest {
            image_id: "counter".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("limit of 2"), "{err:?}");

    let s = agent.wait_state(&a.session_id, S::Stopped).await;
    assert_eq!(s.reason, "max_lifetime");
    // With a slot free again, Create succeeds.
    agent.wait_state(&_b.session_id, S::Stopped).await;
    let c = agent.create("counter", "").await;
    assert_eq!(c.state, S::Running as i32);
}
