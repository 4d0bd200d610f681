//! host-agent running sessions' vmm processes through `vmm jail`
//! (`--jail-uid/--jail-gid`): the vmm of a session (and of a warm VM) runs
//! as the unprivileged uid in its own namespaces with the session's jail
//! directory as root; pause, resume, snapshot, usage and stop work through
//! the jail, and so does rolling back to a snapshot; a restarted host-agent
//! re-attaches to it; SIGKILLing the jailer
//! takes the vmm down and fails the session.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use proto::hostagent as pb;

/// The jailed vmm: the jailer's (session's recorded pid's) only child.
fn jailed_vmm(jailer: u32) -> u32 {
    let start = Instant::now();
    loop {
        let children = std::fs::read_to_string(format!("/proc/{jailer}/task/{jailer}/children"))
            .unwrap_or_default();
        if let Some(pid) = children.split_whitespace().next() {
            return pid.parse().unwrap();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no jailed vmm under {jailer}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until `pid` has exited (gone, or a zombie nobody reaped yet).
fn wait_gone(pid: u32, why: &str) {
    let start = Instant::now();
    while Path::new(&format!("/proc/{pid}/status")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
    {
        assert!(start.elapsed() < Duration::from_secs(10), "{why}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn session_dir(agent: &Agent, id: &str) -> PathBuf {
    agent.state_dir().join("sessions").join(id)
}

fn assert_confined(vmm: u32, dir: &Path) {
    // The vmm's main thread installs its filter just after its control
    // socket appears: wait for it rather than race it.
    let start = Instant::now();
    let status = loop {
        let status = std::fs::read_to_string(format!("/proc/{vmm}/status")).unwrap();
        if status.contains("Seccomp:\t2") {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the vmm's main thread is not filtered after 20 s: {status}"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(
        status.contains("Uid:\t65534\t65534\t65534\t65534"),
        "{status}"
    );
    for ns in ["mnt", "pid"] {
        assert_ne!(
            std::fs::read_link(format!("/proc/{vmm}/ns/{ns}")).unwrap(),
            std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap(),
            "{ns} namespace shared"
        );
    }
    let root = std::fs::metadata(format!("/proc/{vmm}/root/")).unwrap();
    let jail = std::fs::metadata(dir.join("jail")).unwrap();
    assert_eq!(
        (root.dev(), root.ino()),
        (jail.dev(), jail.ino()),
        "root is not the jail"
    );
    let cgroups = std::fs::read_to_string(format!("/proc/{vmm}/cgroup")).unwrap();
    assert!(cgroups.contains("/agentvm/"), "{cgroups}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_run_jailed_through_their_whole_life() {
    if !jail_supported() {
        return;
    }
    let jail = [
        "--jail-uid",
        "65534",
        "--jail-gid",
        "65534",
        "--usage-interval-ms",
        "200",
    ];
    let mut agent = Agent::start(&jail);
    agent.counter_image("counter").await;
    let s = agent.create("counter", "jailed").await;
    assert_eq!(s.state, S::Running as i32);
    let dir = session_dir(&agent, &s.session_id);
    let vmm = jailed_vmm(s.vmm_pid);
    assert_confined(vmm, &dir);

    let mut c = agent.sessions().await;
    let call = || pb::SessionCall {
        session_id: s.session_id.clone(),
        idempotency_key: String::new(),
    };
    c.pause_session(call()).await.expect("pause a jailed vmm");
    c.resume_session(call()).await.expect("resume a jailed vmm");
    let snap = c
        .snapshot_session(call())
        .await
        .expect("snapshot a jailed vmm")
        .into_inner();
    let snap_dir = PathBuf::from(&snap.snapshot_dir);
    assert!(snap_dir.starts_with(dir.join("jail")), "{snap_dir:?}");
    for f in ["state", "memory", "manifest"] {
        assert!(snap_dir.join(f).is_file(), "{f} missing in {snap_dir:?}");
    }
    // Rolled back to it: a new jailed vmm restores the snapshot inside the jail.
    let s = c
        .restore_session(pb::RestoreSessionRequest {
            session_id: s.session_id.clone(),
            snapshot_dir: snap.snapshot_dir.clone(),
            idempotency_key: String::new(),
        })
        .await
        .expect("restore a jailed session from its snapshot")
        .into_inner();
    assert_eq!(s.state, S::Running as i32);
    wait_gone(vmm, "the replaced jailed vmm still runs");
    let vmm = jailed_vmm(s.vmm_pid);
    assert_confined(vmm, &dir);

    // Usage is sampled from the jailed vmm, not its jailer.
    let start = Instant::now();
    loop {
        let usage = agent.usage_of(&s.session_id).await;
        if usage
            .last()
            .is_some_and(|u| u.memory_resident_gib_seconds > 0.0)
        {
            check_usage_chain(&usage);
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no resident memory sampled: {usage:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A restarted host-agent finds the jailed vmm and controls it.
    agent.kill9();
    agent.spawn();
    let mut c = agent.sessions().await;
    c.pause_session(call())
        .await
        .expect("pause after the restart");
    c.resume_session(call())
        .await
        .expect("resume after the restart");
    assert_eq!(jailed_vmm(s.vmm_pid), vmm);

    let st = c.stop_session(call()).await.unwrap().into_inner();
    assert_eq!(st.state, S::Stopped as i32);
    wait_gone(vmm, "the jailed vmm outlived Stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_vms_are_jailed_and_a_killed_jailer_fails_its_session() {
    if !jail_supported() {
        return;
    }
    let agent = Agent::start(&[
        "--jail-uid",
        "65534",
        "--jail-gid",
        "65534",
        "--warm-pool",
        "1",
    ]);
    agent.counter_image("counter").await;
    // Wait until the pool holds a warm VM, so the create takes it.
    let start = Instant::now();
    loop {
        let cap = agent
            .node()
            .await
            .get_capacity(pb::GetCapacityRequest {})
            .await
            .unwrap()
            .into_inner();
        if cap.warm_pool_ready > 0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the warm pool never filled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = agent.create("counter", "warm").await;
    assert_eq!(s.state, S::Running as i32);
    let dir = session_dir(&agent, &s.session_id);
    let vmm = jailed_vmm(s.vmm_pid);
    assert_confined(vmm, &dir);
    // Its control socket followed the warm VM's directory into the session's.
    agent
        .sessions()
        .await
        .pause_session(pb::SessionCall {
            session_id: s.session_id.clone(),
            idempotency_key: String::new(),
        })
        .await
        .expect("pause a warm VM taken from the pool");

    sigkill(s.vmm_pid);
    let f = agent.wait_state(&s.session_id, S::Failed).await;
    assert_eq!(f.reason, "vmm_crash", "{f:?}");
    wait_gone(vmm, "the jailed vmm outlived its jailer");
}
