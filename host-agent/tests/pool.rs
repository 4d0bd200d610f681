//! Warm pool, restore retries and concurrent creates.

mod common;

use std::time::{Duration, Instant};

use common::*;
use proto::hostagent::node_client::NodeClient;

/// Waits (up to 120 s) until the node has at least `n` warm VMs ready.
async fn wait_warm(node: &mut NodeClient<tonic::transport::Channel>, n: u32) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while node
        .get_capacity(proto::hostagent::GetCapacityRequest {})
        .await
        .unwrap()
        .into_inner()
        .warm_pool_ready
        < n
    {
        assert!(
            Instant::now() < deadline,
            "the pool never reached {n} warm VMs"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_takes_a_warm_vm_and_the_pool_refills() {
    let agent = Agent::start(&["--warm-pool", "2"]);
    agent.counter_image("counter").await;
    let mut node = agent.node().await;
    wait_warm(&mut node, 2).await;
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
    wait_warm(&mut node, 2).await;
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
            c.pause_session(proto::hostagent::PauseSessionRequest::from(
                proto::hostagent::SessionCall {
                    session_id: s.session_id.clone(),
                    idempotency_key: String::new(),
                },
            ))
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

/// The detail of the session's RUNNING event.
async fn running_detail(agent: &Agent, session_id: &str) -> String {
    let mut stream = agent
        .events()
        .await
        .watch(proto::hostagent::WatchRequest {
            since_seq: 0,
            session_id: session_id.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    loop {
        let e = tokio::time::timeout(Duration::from_secs(60), stream.message())
            .await
            .expect("an event in time")
            .unwrap()
            .expect("the stream stays open");
        if e.to == S::Running as i32 {
            return e.detail;
        }
    }
}

fn find_named(dir: &std::path::Path, name: &str) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.file_name().is_some_and(|n| n == name) {
            found.push(p.clone());
        }
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            found.extend(find_named(&p, name));
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_vm_that_fails_when_taken_costs_a_cold_restore_not_the_session() {
    let agent = Agent::start(&["--warm-pool", "1"]);
    agent.counter_image("counter").await;
    let mut node = agent.node().await;
    wait_warm(&mut node, 1).await;
    let pool = agent.state_dir().join("pool");
    let warm_pid: u32 = find_named(&pool, "pid")
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .find_map(|t| t.split_whitespace().next().and_then(|p| p.parse().ok()))
        .expect("the warm VM's pid file");
    // The warm VM is alive but cannot be resumed: its control socket is gone.
    let sockets = find_named(&pool, "control.sock");
    assert_eq!(sockets.len(), 1, "{sockets:?}");
    std::fs::remove_file(&sockets[0]).unwrap();

    let s = agent.create("counter", "").await;
    assert_eq!(s.state, S::Running as i32, "{s:?}");
    assert_ne!(s.vmm_pid, warm_pid, "the session runs on a new vmm");
    let detail = running_detail(&agent, &s.session_id).await;
    assert!(
        detail.contains("from the golden snapshot (the warm VM failed:"),
        "the RUNNING event says where the VM came from and why: {detail:?}"
    );
    // The failed warm VM was killed and reaped.
    let gone = Instant::now() + Duration::from_secs(20);
    while std::path::Path::new(&format!("/proc/{warm_pid}")).exists() {
        assert!(Instant::now() < gone, "warm vmm {warm_pid} still runs");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The session works, and the next create takes a warm VM again.
    let st = agent.stop(&s.session_id).await;
    assert_eq!(st.state, S::Stopped as i32);
    wait_warm(&mut node, 1).await;
    let again = agent.create("counter", "").await;
    assert_eq!(
        running_detail(&agent, &again.session_id).await,
        "from a warm VM"
    );
}

/// A `--vmm` that exits 1 (as a vmm whose guest triple-faulted does) the
/// first `times` times it is asked to restore, then is the real vmm. It
/// leaves a file `failed-N` per failure. Only shell builtins run before the
/// exec: a child of its own would pass for the jailed vmm.
fn failing_restores(dir: &std::path::Path, times: u32) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let script = dir.join("vmm-failing");
    let marks: Vec<String> = (1..=times)
        .map(|n| format!("'{}'", dir.join(format!("failed-{n}")).display()))
        .collect();
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\ncase \"$*\" in *restore*)\n  for m in {marks}; do\n    \
             if [ ! -e \"$m\" ]; then : > \"$m\"; echo 'VM failed: vCPU 0 triple-faulted' >&2; exit 1; fi\n  \
             done\nesac\nexec '{vmm}' \"$@\"\n",
            marks = marks.join(" "),
            vmm = vmm_path().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

/// How many restores `failing_restores` failed.
fn failures(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("failed-"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_whose_vmm_exits_before_the_guest_is_ready_is_tried_once_more() {
    let t = tempfile::tempdir().unwrap();
    let once = failing_restores(t.path(), 1);
    let agent = Agent::start(&["--vmm", once.to_str().unwrap()]);
    agent.counter_image("counter").await;
    let s = agent.create("counter", "").await;
    assert_eq!(s.state, S::Running as i32, "{s:?}");
    assert_eq!(failures(t.path()), 1);
    let detail = running_detail(&agent, &s.session_id).await;
    assert!(
        detail.starts_with("from the golden snapshot (a restore failed: ")
            && detail.contains("triple-faulted"),
        "the RUNNING event says the first restore failed and why: {detail:?}"
    );

    // Only once: a vmm that keeps failing fails the session.
    let t2 = tempfile::tempdir().unwrap();
    let always = failing_restores(t2.path(), 5);
    let agent = Agent::start(&["--vmm", always.to_str().unwrap()]);
    agent.counter_image("counter").await;
    let err = agent
        .sessions()
        .await
        .create_session(proto::hostagent::CreateSessionRequest {
            image_id: "counter".into(),
            ..Default::default()
        })
        .await
        .expect_err("a restore that always fails fails the create");
    assert!(err.message().contains("triple-faulted"), "{err:?}");
    assert_eq!(failures(t2.path()), 2, "tried twice, not more");
}
