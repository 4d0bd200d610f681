//! host-agent running sessions' vmm processes through `vmm jail`, its
//! default as root: the vmm of a session (and of a warm VM) runs as a uid of
//! its own from the jail range, in its own namespaces (network included)
//! with the session's jail directory as root; uids are never shared by two
//! live sessions, also across a restart; pause, resume, snapshot, usage and stop work through
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

/// The default uid range of jailed VMs (host-agent's README).
const DEFAULT_UIDS: std::ops::RangeInclusive<u32> = 2_000_000_000..=2_000_065_535;

/// Checks `vmm` is jailed as its session in `dir` should be; returns its uid.
fn assert_confined(vmm: u32, dir: &Path, uids: std::ops::RangeInclusive<u32>) -> u32 {
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
    let ids = |key: &str| -> Vec<u32> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap()
            .split_whitespace()
            .map(|v| v.parse().unwrap())
            .collect()
    };
    let uid = ids("Uid:")[0];
    assert!(uids.contains(&uid), "uid {uid} outside {uids:?}: {status}");
    assert_eq!(ids("Uid:"), vec![uid; 4], "{status}");
    assert_eq!(ids("Gid:"), vec![uid; 4], "gid = uid: {status}");
    for ns in ["mnt", "pid", "net"] {
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
    // Its files are its own.
    let disk_dir = std::fs::metadata(dir.join("jail/run")).unwrap();
    assert_eq!((disk_dir.uid(), disk_dir.gid()), (uid, uid));
    uid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_run_jailed_through_their_whole_life() {
    if !jail_supported() {
        return;
    }
    // No jail option: jailing is the default.
    let mut agent = Agent::start(&["--usage-interval-ms", "200"]);
    agent.counter_image("counter").await;
    let s = agent.create("counter", "jailed").await;
    assert_eq!(s.state, S::Running as i32);
    let dir = session_dir(&agent, &s.session_id);
    let vmm = jailed_vmm(s.vmm_pid);
    let uid = assert_confined(vmm, &dir, DEFAULT_UIDS);

    let mut c = agent.sessions().await;
    let call = || pb::SessionCall {
        session_id: s.session_id.clone(),
        idempotency_key: String::new(),
    };
    c.pause_session(proto::hostagent::PauseSessionRequest::from(call()))
        .await
        .expect("pause a jailed vmm");
    c.resume_session(call()).await.expect("resume a jailed vmm");
    let snap = c
        .snapshot_session(call())
        .await
        .expect("snapshot a jailed vmm")
        .into_inner();
    let snap_dir = PathBuf::from(&snap.snapshot_dir);
    // Taken out of the jail into the node's layer store.
    assert!(
        snap_dir.starts_with(agent.state_dir().join("layers")),
        "{snap_dir:?}"
    );
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
    assert_eq!(
        assert_confined(vmm, &dir, DEFAULT_UIDS),
        uid,
        "the rolled-back vmm keeps the session's uid"
    );

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
    c.pause_session(proto::hostagent::PauseSessionRequest::from(call()))
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
    let agent = Agent::start(&["--warm-pool", "1"]);
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
    assert_confined(vmm, &dir, DEFAULT_UIDS);
    // Its control socket followed the warm VM's directory into the session's.
    agent
        .sessions()
        .await
        .pause_session(proto::hostagent::PauseSessionRequest::from(
            pb::SessionCall {
                session_id: s.session_id.clone(),
                idempotency_key: String::new(),
            },
        ))
        .await
        .expect("pause a warm VM taken from the pool");

    sigkill(s.vmm_pid);
    let f = agent.wait_state(&s.session_id, S::Failed).await;
    assert_eq!(f.reason, "vmm_crash", "{f:?}");
    wait_gone(vmm, "the jailed vmm outlived its jailer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_session_has_its_own_uid_and_a_restart_reuses_none_in_use() {
    if !jail_supported() {
        return;
    }
    // Two uids: enough for two live sessions, not three.
    let range = "3000000-3000001";
    let uids = 3_000_000..=3_000_001;
    let mut agent = Agent::start(&["--jail-uid-range", range]);
    agent.counter_image("counter").await;
    let a = agent.create("counter", "uid-a").await;
    let uid_a = assert_confined(
        jailed_vmm(a.vmm_pid),
        &session_dir(&agent, &a.session_id),
        uids.clone(),
    );

    // A restarted host-agent knows uid_a is taken.
    agent.kill9();
    agent.spawn();
    let b = agent.create("counter", "uid-b").await;
    let uid_b = assert_confined(
        jailed_vmm(b.vmm_pid),
        &session_dir(&agent, &b.session_id),
        uids.clone(),
    );
    assert_ne!(uid_a, uid_b, "two live sessions share a uid");

    // The range is used up: a third session is refused, with the fix named.
    let err = agent
        .sessions()
        .await
        .create_session(pb::CreateSessionRequest {
            image_id: "counter".into(),
            idempotency_key: "uid-c".into(),
            ..Default::default()
        })
        .await
        .expect_err("a third session with two uids");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
    assert!(err.message().contains("--jail-uid-range"), "{err}");

    // A session that ends gives its uid back.
    let st = agent
        .sessions()
        .await
        .stop_session(pb::SessionCall {
            session_id: a.session_id.clone(),
            idempotency_key: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.state, S::Stopped as i32);
    let c = agent.create("counter", "uid-c2").await;
    let uid_c = assert_confined(
        jailed_vmm(c.vmm_pid),
        &session_dir(&agent, &c.session_id),
        uids,
    );
    assert_eq!(uid_c, uid_a);
}

#[test]
fn without_root_host_agent_refuses_to_start_unless_told_no_jail() {
    if !is_root() {
        println!("skipped: needs root to start host-agent as another user");
        return;
    }
    use std::os::unix::process::CommandExt;
    let t = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
        .arg(t.path().join("state"))
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "started unjailed without root: {err}"
    );
    assert!(
        err.contains("needs root") && err.contains("--no-jail"),
        "{err}"
    );
    assert!(!t.path().join("state").exists(), "it created state first");
}
