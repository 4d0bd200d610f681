//! host-agent SIGKILLed while creates are in flight under load, then started
//! again: every idempotency key maps to one session, each live session's vmm
//! runs, no vmm process is left running without a live session, and retried
//! creates converge.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use proto::hostagent as pb;

const CREATES: usize = 12;

/// vmm processes whose command line mentions the agent's state directory.
fn vmm_pids_under(dir: &std::path::Path) -> HashSet<u32> {
    let needle = dir.display().to_string();
    let mut out = HashSet::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd);
            if cmd.contains(&needle) && cmd.contains("vmm") && !cmd.contains("host-agent") {
                out.insert(pid);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_create_under_load_leaves_consistent_state() {
    let mut agent = Agent::start(&[]);
    agent.counter_image("counter").await;

    let mut tasks = Vec::new();
    for i in 0..CREATES {
        let mut c = agent.sessions().await;
        tasks.push(tokio::spawn(async move {
            c.create_session(pb::CreateSessionRequest {
                image_id: "counter".into(),
                idempotency_key: format!("load-{i}"),
                ..Default::default()
            })
            .await
        }));
    }
    // Kill while the creates are still being served.
    tokio::time::sleep(Duration::from_millis(30)).await;
    agent.kill9();
    for t in tasks {
        // Each in-flight create either finished or saw the connection drop.
        let _ = t.await;
    }
    agent.spawn();

    // Retried creates return one session per key, in a settled state.
    let mut ids = HashSet::new();
    for i in 0..CREATES {
        let s = agent.create("counter", &format!("load-{i}")).await;
        assert!(
            ids.insert(s.session_id.clone()),
            "two keys share {}",
            s.session_id
        );
        let again = agent.create("counter", &format!("load-{i}")).await;
        assert_eq!(
            again.session_id, s.session_id,
            "retry of load-{i} made a new session"
        );
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let sessions = loop {
        let list = agent
            .sessions()
            .await
            .list_sessions(pb::ListSessionsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .sessions;
        let settled = list
            .iter()
            .all(|s| s.state == S::Running as i32 || s.state == S::Failed as i32);
        if settled || std::time::Instant::now() > deadline {
            break list;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(sessions.len(), CREATES, "one session per key: {sessions:?}");
    let mut live_pids = HashSet::new();
    for s in &sessions {
        if s.state == S::Running as i32 {
            assert!(
                std::path::Path::new(&format!("/proc/{}", s.vmm_pid)).exists(),
                "running session {} has no vmm",
                s.session_id
            );
            live_pids.insert(s.vmm_pid);
        } else {
            assert_eq!(s.state, S::Failed as i32, "{s:?}");
            assert!(!s.reason.is_empty(), "failed without a reason: {s:?}");
        }
    }
    assert!(!live_pids.is_empty(), "no session survived: {sessions:?}");
    let running = vmm_pids_under(agent.dir.path());
    let orphans: Vec<_> = running.difference(&live_pids).collect();
    assert!(
        orphans.is_empty(),
        "vmm processes without a live session: {orphans:?}"
    );
}
