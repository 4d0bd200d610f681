//! host-agent SIGKILLed while creates are in flight, then started again:
//! every idempotency key maps to one session, the sessions that were running
//! are re-attached with their vmm, the creates that were interrupted fail
//! with a reason, no vmm process is left running without a live session, and
//! retried creates converge.
//!
//! The interrupted state is forced, not timed: the vmm is reached through a
//! gate script that holds every vmm it starts while a gate file exists. A
//! first wave of creates runs with the gate open and finishes; the gate is
//! closed, a second wave is sent, and host-agent is killed only once every
//! second-wave session is known (from the API) to be RESTORING with its vmm
//! process started and held.

mod common;

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use proto::hostagent as pb;

const FIRST_WAVE: usize = 4;
const SECOND_WAVE: usize = 8;

/// vmm processes whose command line mentions the agent's state directory.
fn vmm_pids_under(dir: &Path) -> HashSet<u32> {
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

/// Writes the gate script: it waits while `gate` exists, then becomes the vmm.
fn gate_script(dir: &Path, gate: &Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let script = dir.join("vmm-gate");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nwhile [ -e '{}' ]; do sleep 0.02; done\nexec '{}' \"$@\"\n",
            gate.display(),
            vmm_path().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

async fn list(agent: &Agent) -> Vec<pb::Session> {
    agent
        .sessions()
        .await
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sessions
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_create_leaves_consistent_state() {
    let gates = tempfile::tempdir().unwrap();
    let gate = gates.path().join("closed");
    let script = gate_script(gates.path(), &gate);
    let mut agent = Agent::start(&["--vmm", script.to_str().unwrap()]);
    agent.counter_image("counter").await;

    // First wave: created and running before anything is killed.
    let mut first = HashSet::new();
    for i in 0..FIRST_WAVE {
        let s = agent.create("counter", &format!("load-{i}")).await;
        assert_eq!(s.state, S::Running as i32, "{s:?}");
        first.insert(s.session_id);
    }

    // Second wave: every vmm is held at the gate, so each create is in RESTORING.
    std::fs::write(&gate, b"").unwrap();
    let mut tasks = Vec::new();
    for i in FIRST_WAVE..FIRST_WAVE + SECOND_WAVE {
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
    let deadline = Instant::now() + Duration::from_secs(120);
    let held: Vec<pb::Session> = loop {
        let held: Vec<_> = list(&agent)
            .await
            .into_iter()
            .filter(|s| s.state == S::Restoring as i32 && s.vmm_pid != 0)
            .collect();
        if held.len() == SECOND_WAVE {
            break held;
        }
        assert!(
            Instant::now() < deadline,
            "the second wave did not reach RESTORING with a started vmm within 120 s: \
             {} of {SECOND_WAVE}",
            held.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    agent.kill9();
    for t in tasks {
        let r = t.await.unwrap();
        assert!(r.is_err(), "a held create finished: {r:?}");
    }

    // Open the gate: the held processes become vmm restores that belong to
    // no live host-agent, the leftovers the restart must find and kill.
    std::fs::remove_file(&gate).unwrap();
    let vmm = std::fs::canonicalize(vmm_path()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    for s in &held {
        loop {
            let exe = std::fs::read_link(format!("/proc/{}/exe", s.vmm_pid));
            // Gone, or the gate script has become the vmm.
            if exe.as_ref().map_or(true, |e| *e == vmm) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "process {} never left the gate: {exe:?}",
                s.vmm_pid
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    agent.spawn();

    // Retried creates return one session per key, in a settled state.
    let mut ids = HashSet::new();
    for i in 0..FIRST_WAVE + SECOND_WAVE {
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
        assert!(
            s.state == S::Running as i32 || s.state == S::Failed as i32,
            "retry of load-{i} returned an unsettled session: {s:?}"
        );
    }
    let sessions = list(&agent).await;
    assert_eq!(
        sessions.len(),
        FIRST_WAVE + SECOND_WAVE,
        "one session per key: {sessions:?}"
    );
    let mut live_pids = HashSet::new();
    for s in &sessions {
        if first.contains(&s.session_id) {
            assert_eq!(s.state, S::Running as i32, "first wave re-attached: {s:?}");
            assert!(
                Path::new(&format!("/proc/{}", s.vmm_pid)).exists(),
                "running session {} has no vmm",
                s.session_id
            );
            live_pids.insert(s.vmm_pid);
        } else {
            assert_eq!(s.state, S::Failed as i32, "interrupted create: {s:?}");
            assert!(!s.reason.is_empty(), "failed without a reason: {s:?}");
        }
    }
    // The leftovers are killed asynchronously; wait for them to go.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let running = vmm_pids_under(agent.dir.path());
        let orphans: Vec<_> = running.difference(&live_pids).copied().collect();
        if orphans.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "vmm processes without a live session after 30 s: {orphans:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
