//! RestoreSession: a RUNNING session rolled back to one of its own
//! snapshots. The snapshot carries a copy of the session's disk; the restore
//! puts that disk back, replaces the vmm under a new execution id (the old
//! one is refused), the guest continues from the snapshot's point, usage and
//! events go on without a gap. Snapshots of other sessions, or anything
//! else, are refused.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::counts::{counts, wait_for_counts};
use common::*;
use proto::hostagent as pb;
use tonic::Code;

/// The counter guest prints every this many increments.
const COUNT_INTERVAL: u64 = 20000;

/// The first count in `log` from byte `from` on that does not continue
/// `last` by one `interval` after another (waits up to 60 s for one).
fn first_count_past_continuation(log: &Path, from: usize, last: u64, interval: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let c = counts(log, from);
        let continuing = c
            .iter()
            .zip(1u64..)
            .take_while(|(v, k)| **v == last + k * interval)
            .count();
        if let Some(v) = c.get(continuing) {
            return *v;
        }
        assert!(
            Instant::now() < deadline,
            "no count after {last}'s continuation in {}: {c:?}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_rolls_back_to_its_own_snapshot() {
    let t = tempfile::tempdir().unwrap();
    let rootfs = t.path().join("rootfs.img");
    let mut original = vec![0u8; 1 << 20];
    original[..5].copy_from_slice(b"first");
    std::fs::write(&rootfs, &original).unwrap();
    let agent = Agent::start(&["--usage-interval-ms", "200"]);
    test_guest_image(
        &agent,
        "count",
        "counter",
        &format!("interval={COUNT_INTERVAL}"),
        32,
        Some(&rootfs),
    )
    .await;
    let mut im = agent.images().await;
    let s = agent.create("count", "").await;
    let dir = agent.state_dir().join("sessions").join(&s.session_id);
    // The vmm is jailed (host-agent's default): its files are in its run directory.
    let run = dir.join("jail/run");
    let log = run.join("serial.log");
    wait_for_counts(&log, 0, 2);

    let mut c = agent.sessions().await;
    let call = pb::SessionCall {
        session_id: s.session_id.clone(),
        idempotency_key: String::new(),
    };
    // The snapshot is taken at or after this count (the guest runs on after it).
    let at_snapshot = *counts(&log, 0).last().unwrap();
    let snap = c.snapshot_session(call.clone()).await.unwrap().into_inner();
    let snap_dir = PathBuf::from(&snap.snapshot_dir);
    let kept = dir.join("snapshot-disks").join(format!(
        "{}.ext4",
        snap_dir.file_name().unwrap().to_str().unwrap()
    ));
    assert_eq!(
        std::fs::read(&kept).unwrap(),
        original,
        "the snapshot's copy of the disk is kept out of the VM's reach"
    );
    // After the snapshot the "guest" writes its disk and counts on.
    std::fs::write(run.join("disk.ext4"), b"later").unwrap();
    let before = wait_for_counts(&log, 0, counts(&log, 0).len() + 6);
    let last_before = *before.last().unwrap();
    let log_len = std::fs::metadata(&log).unwrap().len() as usize;

    // Not this session's snapshot, or not a snapshot at all: refused.
    let golden = im
        .get_image(pb::GetImageRequest {
            image_id: "count".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .golden_snapshot_dir;
    for bad in [golden.as_str(), "/etc", "", "relative/dir"] {
        let err = c
            .restore_session(pb::RestoreSessionRequest {
                session_id: s.session_id.clone(),
                snapshot_dir: bad.into(),
                idempotency_key: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{bad:?}: {err:?}");
    }

    let restored = c
        .restore_session(pb::RestoreSessionRequest {
            session_id: s.session_id.clone(),
            snapshot_dir: snap.snapshot_dir.clone(),
            idempotency_key: String::new(),
        })
        .await
        .expect("restore from the session's snapshot")
        .into_inner();
    assert_eq!(restored.state, S::Running as i32);
    assert_ne!(restored.execution_id, s.execution_id);
    assert_ne!(restored.vmm_pid, s.vmm_pid);
    assert!(
        !Path::new(&format!("/proc/{}", s.vmm_pid)).exists()
            || std::fs::read_to_string(format!("/proc/{}/stat", s.vmm_pid))
                .unwrap_or_default()
                .contains(") Z "),
        "the replaced vmm still runs"
    );
    assert_eq!(std::fs::read(run.join("disk.ext4")).unwrap(), original);
    // The guest counts on from the snapshot's point, not from where it was.
    // The replaced vmm may have printed a few more counts after `log_len`
    // was read and before it was stopped: they continue `last_before` one
    // interval at a time. The first count past them is the restored guest's.
    let first_restored = first_count_past_continuation(&log, log_len, last_before, COUNT_INTERVAL);
    assert!(
        first_restored > at_snapshot && first_restored < last_before,
        "count after the restore {first_restored} is not between the snapshot's {at_snapshot} and the last before {last_before}"
    );

    // The old execution id is refused.
    let mut ex = pb::exec_client::ExecClient::new(agent.channel().await);
    let stale = ex
        .exec(tokio_stream::iter(vec![pb::ExecRequest {
            kind: Some(pb::exec_request::Kind::Start(pb::ExecStart {
                session_id: s.session_id.clone(),
                execution_id: s.execution_id.clone(),
                argv: vec!["true".into()],
                ..Default::default()
            })),
        }]))
        .await
        .unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition, "{stale:?}");

    // Events: RUNNING -> RESTORING -> READY -> RUNNING, all "restore", after
    // the create's four and the snapshot's two.
    let events = agent.events_since(0, 9).await;
    let restore: Vec<(i32, i32)> = events[6..]
        .iter()
        .filter(|e| e.reason == "restore")
        .map(|e| (e.from, e.to))
        .collect();
    assert_eq!(
        restore,
        vec![
            (S::Running as i32, S::Restoring as i32),
            (S::Restoring as i32, S::Ready as i32),
            (S::Ready as i32, S::Running as i32)
        ]
    );
    // Usage goes on in one chain, later records under the new execution id.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let usage = agent.usage_of(&s.session_id).await;
    check_usage_chain(&usage);
    assert_eq!(usage.last().unwrap().execution_id, restored.execution_id);

    // A stopped session cannot be rolled back.
    c.stop_session(call).await.unwrap();
    let err = c
        .restore_session(pb::RestoreSessionRequest {
            session_id: s.session_id.clone(),
            snapshot_dir: snap.snapshot_dir.clone(),
            idempotency_key: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
}
