//! PauseSession persist: a session paused to disk writes a diff snapshot
//! over the layer its memory descends from (its size follows the pages the
//! guest dirtied, not the guest's memory), its vmm goes, and ResumeSession
//! restores it where it was, under a new execution id, also after a
//! host-agent restart. Snapshot storage is billed and bounded by the node's
//! quota; a damaged or missing layer fails the resume with restore_failed.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::counts::{counts, wait_for_counts};
use common::*;
use proto::hostagent as pb;
use tonic::Code;

/// The serial log of session `id`'s (jailed) vmm.
fn serial_log(agent: &Agent, id: &str) -> PathBuf {
    agent
        .state_dir()
        .join("sessions")
        .join(id)
        .join("jail/run/serial.log")
}

fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| s.contains(") Z "))
}

/// The layer directories in the store (not the golden snapshots' links).
fn layer_dirs(agent: &Agent) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(agent.state_dir().join("layers"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.is_symlink())
        .collect();
    dirs.sort();
    dirs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_paused_to_disk_lets_its_vmm_go_and_resumes_where_it_was() {
    let mut agent = Agent::start(&["--usage-interval-ms", "200"]);
    test_guest_image(&agent, "count", "counter", "interval=20000", 32, None).await;
    let s = agent.create("count", "").await;
    let log = serial_log(&agent, &s.session_id);
    wait_for_counts(&log, 0, 2);
    let mut c = agent.sessions().await;

    let p = c
        .pause_session(persist_req(&s.session_id))
        .await
        .expect("pause to disk")
        .into_inner();
    assert_eq!(p.state, S::Paused as i32, "{p:?}");
    assert!(p.persisted && p.vmm_pid == 0, "{p:?}");
    assert!(
        p.snapshot_bytes > 0 && p.snapshot_bytes < 4 << 20,
        "a counting guest dirties a few pages, not its 32 MiB: {} bytes",
        p.snapshot_bytes
    );
    assert!(gone(s.vmm_pid), "the vmm is gone");
    // The layer is a diff over the golden snapshot's layer.
    let layers = layer_dirs(&agent);
    assert_eq!(layers.len(), 1, "{layers:?}");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(layers[0].join("manifest")).unwrap()).unwrap();
    assert_eq!(manifest["kind"], "diff");
    let parent = manifest["parent"].as_str().unwrap().to_string();
    let golden = agent.state_dir().join("layers").join(&parent);
    assert!(
        golden.is_symlink(),
        "its parent {parent} is the golden snapshot's layer"
    );

    // A rollback needs it resumed first, and says so.
    let rollback = c
        .restore_session(pb::RestoreSessionRequest {
            session_id: s.session_id.clone(),
            snapshot_dir: "/nowhere".into(),
            idempotency_key: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        rollback.code(),
        tonic::Code::FailedPrecondition,
        "{rollback:?}"
    );
    assert!(
        rollback.message().contains("paused to disk"),
        "{rollback:?}"
    );

    // Nothing runs while it is on disk.
    let last = *counts(&log, 0).last().unwrap();
    let log_len = std::fs::metadata(&log).unwrap().len() as usize;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(*counts(&log, 0).last().unwrap(), last);
    // Pausing it to disk again changes nothing.
    let again = c
        .pause_session(persist_req(&s.session_id))
        .await
        .unwrap()
        .into_inner();
    assert!(again.persisted);
    assert_eq!(layer_dirs(&agent), layers);

    // Survives a host-agent restart.
    agent.kill9();
    agent.spawn();
    let mut c = agent.sessions().await;
    let back = agent.get(&s.session_id).await;
    assert!(back.state == S::Paused as i32 && back.persisted, "{back:?}");

    let r = c
        .resume_session(call(&s.session_id))
        .await
        .expect("resume from disk")
        .into_inner();
    assert_eq!(r.state, S::Running as i32, "{r:?}");
    assert!(!r.persisted);
    assert_ne!(r.execution_id, s.execution_id);
    assert_ne!(r.vmm_pid, 0);
    // The guest counts on from where it was (its memory came back): the
    // next count printed, or the one after (it prints every 20000).
    let after = wait_for_counts(&log, log_len, 2);
    assert!(
        after[0] > last && after[0] <= last + 2 * 20000,
        "first count after the resume {} does not follow the last before {last}",
        after[0]
    );
    // The persisted layer is now the session's base; it stays with it.
    assert_eq!(layer_dirs(&agent), layers);

    let events = agent.session_events(&s.session_id).await;
    let persisted = events
        .iter()
        .find(|e| e.to == S::Paused as i32)
        .expect("a PAUSED event");
    assert_eq!(persisted.reason, "requested");
    assert!(
        persisted.detail.starts_with("persisted: layer"),
        "{persisted:?}"
    );
    let resumed: Vec<(i32, i32)> = events
        .iter()
        .filter(|e| e.reason == "resumed")
        .map(|e| (e.from, e.to))
        .collect();
    assert_eq!(
        resumed,
        [
            (S::Paused as i32, S::Restoring as i32),
            (S::Restoring as i32, S::Ready as i32),
            (S::Ready as i32, S::Running as i32)
        ]
    );

    // Storage was billed while it was kept, in its own counter.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let usage = agent.usage_of(&s.session_id).await;
    check_usage_chain(&usage);
    let last_usage = usage.last().unwrap();
    assert!(last_usage.snapshot_gib_seconds > 0.0, "{last_usage:?}");
    for w in usage.windows(2) {
        assert!(w[1].snapshot_gib_seconds >= w[0].snapshot_gib_seconds);
    }

    // Deleted, its layers go; the golden snapshot stays with its image.
    agent.stop(&s.session_id).await;
    c.delete_session(call(&s.session_id)).await.unwrap();
    assert!(layer_dirs(&agent).is_empty());
    assert!(golden.join("manifest").is_file());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_snapshot_follows_the_dirtied_pages_and_the_quota_bounds_them() {
    let agent = Agent::start(&["--snapshot-quota-mib", "8"]);
    // 10 % of 128 MiB dirtied over and over.
    test_guest_image(&agent, "dirty", "dirtier", "permille=100", 128, None).await;
    test_guest_image(&agent, "count", "counter", "interval=20000", 32, None).await;
    let d = agent.create("dirty", "").await;
    let other = agent.create("count", "").await;
    // How many pages it dirties, it said at boot (the golden build's console).
    let golden = agent
        .images()
        .await
        .get_image(pb::GetImageRequest {
            image_id: "dirty".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .golden_snapshot_dir;
    let console = std::fs::read_to_string(Path::new(&golden).join("console.log")).unwrap();
    let want_pages: u64 = console
        .lines()
        .find_map(|l| l.strip_prefix("dirtier: start pages="))
        .expect("the guest said how many pages it dirties")
        .trim()
        .parse()
        .unwrap();
    assert!(want_pages > 1000, "{want_pages}");
    // Two passes since the restore: every one of them dirtied again.
    let log = serial_log(&agent, &d.session_id);
    for _ in 0..600 {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.matches("pass=").count() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut c = agent.sessions().await;
    let p = c
        .pause_session(persist_req(&d.session_id))
        .await
        .unwrap()
        .into_inner();
    let dirtied = want_pages * 4096;
    assert!(
        p.snapshot_bytes >= dirtied * 9 / 10 && p.snapshot_bytes <= dirtied + (4 << 20),
        "{} bytes written for {dirtied} bytes dirtied (of 128 MiB)",
        p.snapshot_bytes
    );
    let cap = agent
        .node()
        .await
        .get_capacity(pb::GetCapacityRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cap.snapshot_bytes_quota, 8 << 20);
    assert_eq!(cap.snapshot_bytes_used, p.snapshot_bytes);

    // The quota is used up: the next pause to disk is refused, and the
    // session runs on.
    let err = c
        .pause_session(persist_req(&other.session_id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("snapshot_quota_mib"), "{err:?}");
    let o = agent.get(&other.session_id).await;
    assert!(o.state == S::Running as i32 && !o.persisted, "{o:?}");
    // So is a SnapshotSession, whose snapshot the session keeps.
    let err = c
        .snapshot_session(call(&other.session_id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("snapshot_quota_mib"), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_or_missing_layer_fails_the_resume_with_restore_failed() {
    let agent = Agent::start(&[]);
    test_guest_image(&agent, "count", "counter", "interval=20000", 32, None).await;
    let mut c = agent.sessions().await;

    // A state file with a flipped byte: its checksum (CRC-64) does not match.
    let a = agent.create("count", "").await;
    c.pause_session(persist_req(&a.session_id)).await.unwrap();
    let layer = layer_dirs(&agent).pop().unwrap();
    let state = layer.join("state");
    let mut bytes = std::fs::read(&state).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&state, bytes).unwrap();
    let err = c.resume_session(call(&a.session_id)).await.unwrap_err();
    let failed = agent.get(&a.session_id).await;
    assert_eq!(failed.state, S::Failed as i32, "{failed:?} after {err:?}");
    assert_eq!(failed.reason, "restore_failed");
    assert!(
        failed.detail.contains("checksum mismatch") && failed.detail.contains("state"),
        "the detail says what is wrong: {}",
        failed.detail
    );

    // A layer whose files are gone: named.
    let b = agent.create("count", "").await;
    c.pause_session(persist_req(&b.session_id)).await.unwrap();
    let mut before = layer_dirs(&agent);
    before.retain(|d| d != &layer);
    let lost = before.pop().unwrap();
    std::fs::remove_dir_all(&lost).unwrap();
    c.resume_session(call(&b.session_id)).await.unwrap_err();
    let failed = agent.get(&b.session_id).await;
    assert_eq!(failed.state, S::Failed as i32, "{failed:?}");
    assert_eq!(failed.reason, "restore_failed");
    let name = lost.file_name().unwrap().to_str().unwrap();
    assert!(
        failed.detail.contains(name) && failed.detail.contains("missing"),
        "{}",
        failed.detail
    );
    assert!(Path::new(&agent.state_dir()).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_idle_pause_goes_to_disk_on_a_node_that_says_so() {
    let agent = Agent::start(&["--idle-pause", "disk"]);
    test_guest_image(&agent, "count", "counter", "interval=20000", 32, None).await;
    let s = agent
        .sessions()
        .await
        .create_session(pb::CreateSessionRequest {
            image_id: "count".into(),
            limits: Some(pb::Limits {
                ttl_seconds: 0,
                idle_timeout_seconds: 1,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let p = agent.wait_state(&s.session_id, S::Paused).await;
    assert_eq!(p.reason, "idle");
    assert!(p.persisted, "paused to disk: {p:?}");
    assert!(gone(s.vmm_pid), "its vmm is gone");
    // Stopped while on disk (no guest-init: no branch to fetch), its
    // layer goes with it.
    let stopped = agent.stop(&s.session_id).await;
    assert_eq!(stopped.state, S::Stopped as i32, "{stopped:?}");
    assert!(layer_dirs(&agent).is_empty());
}
