//! EndTurn kills every process the turn started, including a daemonised
//! grandchild that left the process group and session, with both backends.

mod common;

use common::*;
use guest_init::turn::Backend;
use proto::guest::{exec_exited::Status, guest_message::Kind as Out};

async fn kills_a_tree_with_a_daemonised_grandchild(backend: Option<Backend>, tag: &str) {
    let repo = Repo::new();
    let h = Harness::start_with(Options {
        backend,
        ..Default::default()
    })
    .await;
    let mut c = h.session(&repo, "free", "main").await;
    let daemon = format!("sleep 3{tag}1");
    let child = format!("sleep 3{tag}2");
    let other = format!("sleep 3{tag}3");
    // The daemon double-forks into a new session, closing its stdio.
    let script = format!("setsid sh -c '{daemon} </dev/null >/dev/null 2>&1 &'; {child}");
    c.exec(exec_msg("tree", "turn-1", &["sh", "-c", &script]))
        .await;
    c.expect(|m| matches!(m, Out::ExecStarted(s) if s.exec_id == "tree").then_some(()))
        .await;
    // A command of another turn must survive.
    c.exec(exec_msg("bystander", "turn-2", &["sh", "-c", &other]))
        .await;
    c.expect(|m| matches!(m, Out::ExecStarted(s) if s.exec_id == "bystander").then_some(()))
        .await;
    // Starting three processes can take seconds on a loaded machine: wait
    // for them generously (only a broken start runs into the limit).
    wait_for(|| !processes_matching(&daemon).is_empty() && !processes_matching(&child).is_empty())
        .await;
    let daemon_pid = processes_matching(&daemon);
    assert_eq!(daemon_pid.len(), 1, "the daemon is running");
    // It really left: its parent is no longer the turn's shell.
    let stat = guest_init::reaper::stat(daemon_pid[0]).unwrap();
    assert_ne!(
        stat.pgrp,
        guest_init::reaper::stat(std::process::id()).unwrap().pgrp
    );

    let ended = c.end_turn("turn-1").await;
    let killed: Vec<&str> = ended.killed.iter().map(|k| k.command.as_str()).collect();
    assert!(killed.contains(&daemon.as_str()), "{killed:?}");
    assert!(killed.contains(&child.as_str()), "{killed:?}");
    assert!(!killed.contains(&other.as_str()), "{killed:?}");
    let r = c.finish("tree", None).await;
    assert_eq!(r.status, Some(Status::Signal(libc::SIGKILL)));
    wait_for(|| processes_matching(&daemon).is_empty()).await;
    assert!(
        processes_matching(&daemon).is_empty(),
        "daemon survived EndTurn"
    );
    assert!(processes_matching(&child).is_empty());
    assert_eq!(
        processes_matching(&other).len(),
        1,
        "another turn's process was killed"
    );
    assert!(c
        .audit
        .iter()
        .any(|l| l.contains("\"turn.killed\"") && l.contains("\"turn_id\":\"turn-1\"")));

    c.end_turn("turn-2").await;
    assert!(processes_matching(&other).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_turn_kills_daemonised_grandchildren_process_tree() {
    kills_a_tree_with_a_daemonised_grandchild(Some(Backend::ProcessTree), "11").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_turn_kills_daemonised_grandchildren_detected_backend() {
    let backend = guest_init::turn::detect();
    if backend == Backend::ProcessTree {
        println!("SKIPPED cgroup2 case: no writable cgroup2 hierarchy here (the process-tree case still runs)");
        return;
    }
    println!("turn backend: {backend:?}");
    kills_a_tree_with_a_daemonised_grandchild(Some(backend), "22").await;
}
