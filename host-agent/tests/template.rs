//! RegisterImage from a session: the session's snapshot (taken then, or one
//! of its SnapshotSession snapshots) with its disk becomes an image's golden
//! snapshot; every session of the image starts from that memory and disk,
//! also after the source session is gone, until the image is deleted.

mod common;

use std::path::{Path, PathBuf};

use common::counts::{counts, wait_for_counts};
use common::*;
use proto::hostagent as pb;
use tonic::Code;

fn run_dir(agent: &Agent, id: &str) -> PathBuf {
    agent.state_dir().join("sessions").join(id).join("jail/run")
}

fn call(id: &str) -> pb::SessionCall {
    pb::SessionCall {
        session_id: id.into(),
        idempotency_key: String::new(),
    }
}

fn from_session(image: &str, session: &str, snapshot_dir: &str) -> pb::RegisterImageRequest {
    pb::RegisterImageRequest {
        image_id: image.into(),
        from_session_id: session.into(),
        from_snapshot_dir: snapshot_dir.into(),
        ..Default::default()
    }
}

fn layer_dirs(agent: &Agent) -> Vec<PathBuf> {
    std::fs::read_dir(agent.state_dir().join("layers"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.is_symlink())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_made_from_a_session_starts_every_session_from_it() {
    let t = tempfile::tempdir().unwrap();
    let agent = Agent::start(&[]);
    let disk = rootfs(t.path());
    test_guest_image(&agent, "base", "counter", "interval=20000", 32, Some(&disk)).await;
    let mut im = agent.images().await;
    let s = agent.create("base", "").await;
    let log = run_dir(&agent, &s.session_id).join("serial.log");
    wait_for_counts(&log, 0, 3);
    // The environment the operator prepared: its disk.
    write_at_start(
        &run_dir(&agent, &s.session_id).join("disk.ext4"),
        b"prepared",
    );

    // Bad requests first.
    let mut bad = from_session("t0", &s.session_id, "");
    bad.kernel_path = counter_kernel();
    let err = im.register_image(bad).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("kernel_path"), "{err:?}");
    let err = im
        .register_image(from_session("t0", "no-such-session", ""))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    let err = im
        .register_image(pb::RegisterImageRequest {
            image_id: "t0".into(),
            from_snapshot_dir: "/tmp".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    let at = *counts(&log, 0).last().unwrap();
    let image = im
        .register_image(from_session("tmpl", &s.session_id, ""))
        .await
        .expect("an image from the running session")
        .into_inner();
    assert_eq!(image.source_session_id, s.session_id);
    assert_eq!(
        image.kernel_path,
        counter_kernel(),
        "the session's image's kernel"
    );
    assert!(Path::new(&image.golden_snapshot_dir).starts_with(agent.state_dir().join("layers")));
    // The source runs on.
    assert_eq!(agent.get(&s.session_id).await.state, S::Running as i32);
    // Its golden snapshot is the session's: no boot replaces it.
    let err = im
        .build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
            image_id: "tmpl".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");

    // The source goes; the image stays usable.
    agent.stop(&s.session_id).await;
    agent
        .sessions()
        .await
        .delete_session(call(&s.session_id))
        .await
        .unwrap();
    // Its sessions are forks of the source: another repository, agent,
    // environment or size is refused, naming the fields.
    let err = agent
        .sessions()
        .await
        .create_session(pb::CreateSessionRequest {
            image_id: "tmpl".into(),
            agent: "other".into(),
            env: [("K".to_string(), "v".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message()
            .contains("agent, env: image \"tmpl\" was made from session"),
        "{err:?}"
    );
    let mut made = Vec::new();
    for _ in 0..2 {
        let n = agent.create("tmpl", "").await;
        assert_eq!(n.state, S::Running as i32, "{n:?}");
        assert_eq!(n.parent_session_id, s.session_id);
        let disk = std::fs::read(run_dir(&agent, &n.session_id).join("disk.ext4")).unwrap();
        assert!(disk.starts_with(b"prepared"), "the prepared disk");
        let first = wait_for_counts(&run_dir(&agent, &n.session_id).join("serial.log"), 0, 1)[0];
        assert!(
            first > at,
            "counts on from {at}, not from the boot: {first}"
        );
        made.push(n.session_id);
    }
    for id in &made {
        agent.stop(id).await;
    }
    assert_eq!(layer_dirs(&agent).len(), 1, "the image holds its layer");
    im.delete_image(pb::DeleteImageRequest {
        image_id: "tmpl".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert!(layer_dirs(&agent).is_empty(), "deleted with the image");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_can_be_made_from_one_of_the_sessions_snapshots() {
    let agent = Agent::start(&[]);
    agent.counter_image("count").await;
    let s = agent.create("count", "").await;
    let mut c = agent.sessions().await;
    let snap = c
        .snapshot_session(call(&s.session_id))
        .await
        .unwrap()
        .into_inner();
    let mut im = agent.images().await;
    let err = im
        .register_image(from_session("t", &s.session_id, "/not/its/snapshot"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let image = im
        .register_image(from_session("t", &s.session_id, &snap.snapshot_dir))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(image.golden_snapshot_dir, snap.snapshot_dir);
    let n = agent.create("t", "").await;
    assert_eq!(n.state, S::Running as i32);
}
