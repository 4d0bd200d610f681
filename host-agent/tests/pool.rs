//! Warm pool and concurrent creates.

mod common;

use std::time::{Duration, Instant};

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_takes_a_warm_vm_and_the_pool_refills() {
    let agent = Agent::start(&["--warm-pool", "2"]);
    agent.counter_image("counter").await;
    let mut node = agent.node().await;
    let wait_ready = |n: u32| {
        let mut node = node.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                let cap = node
                    .get_capacity(proto::hostagent::GetCapacityRequest {})
                    .await
                    .unwrap()
                    .into_inner();
                if cap.warm_pool_ready >= n {
                    return;
                }
                assert!(Instant::now() < deadline, "pool never reached {n}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    wait_ready(2).await;
    let warm_pids: Vec<u32> = std::fs::read_dir(agent.state_dir().join("pool"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("pid")).ok())
        .filter_map(|t| t.split_whitespace().next().and_then(|p| p.parse().ok()))
        .collect();
    assert_eq!(warm_pids.len(), 2);
    let s = agent.create("counter", "").await;
    assert_eq!(s.state, S::Running as i32);
    assert!(warm_pids.contains(&s.vmm_pid), "session got a warm VM");
    wait_ready(2).await;
    // The session behaves like any other.
    let st = agent
        .sessions()
        .await
        .stop_session(proto::hostagent::SessionCall {
            session_id: s.session_id.clone(),
            idempotency_key: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.state, S::Stopped as i32);
    let _ = node
        .get_version(proto::hostagent::GetVersionRequest {})
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_creates_all_succeed() {
    let agent = Agent::start(&[]);
    agent.counter_image("counter").await;
    let mut tasks = Vec::new();
    for i in 0..60 {
        let addr = agent.addr.clone();
        tasks.push(tokio::spawn(async move {
            let ch = tonic::transport::Channel::from_shared(addr)
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut c = proto::hostagent::sessions_client::SessionsClient::new(ch);
            // 50 distinct sessions; ten of them are also retried with their key
            // at the same time.
            let req = proto::hostagent::CreateSessionRequest {
                image_id: "counter".into(),
                idempotency_key: format!("k{}", i % 50),
                ..Default::default()
            };
            let s = c.create_session(req).await.map(|r| r.into_inner())?;
            // Pause it, so 50 spinning guests do not starve the machine
            // (pausing an already paused session is a no-op).
            c.pause_session(proto::hostagent::SessionCall {
                session_id: s.session_id.clone(),
                idempotency_key: String::new(),
            })
            .await?;
            Ok::<_, tonic::Status>(s)
        }));
    }
    let mut ids = std::collections::HashMap::new();
    for (i, t) in tasks.into_iter().enumerate() {
        let s = t.await.unwrap().expect("create succeeds");
        // A retry may see its session already paused by the first caller.
        assert!(
            s.state == S::Running as i32 || s.state == S::Paused as i32,
            "{s:?}"
        );
        let prev = ids.insert(i % 50, s.session_id.clone());
        if let Some(p) = prev {
            assert_eq!(p, s.session_id, "same key, same session");
        }
    }
    let distinct: std::collections::HashSet<_> = ids.values().collect();
    assert_eq!(distinct.len(), 50);
    let list = agent
        .sessions()
        .await
        .list_sessions(proto::hostagent::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sessions;
    assert_eq!(list.len(), 50);
}
