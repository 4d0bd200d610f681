//! A session's memory size reaches guest-init (StartSession.mem_mib): the
//! stand-in guest tracks turns by process tree, so it cannot confine a
//! smaller session and refuses it; the refusal fails the session with the
//! guest's reason, and nothing of it stays committed. A session of the
//! image's own size starts.

use proto::hostagent as pb;
use test_harness::agent::{Agent, S};
use test_harness::guests::counter_kernel;

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_smaller_memory_goes_to_the_guest_which_refuses_what_it_cannot_confine() {
    let guest = start_guest().await;
    let vsock = guest.vsock().display().to_string();
    let agent = Agent::start(&["--guest-vsock-uds", &vsock, "--no-vsock-device"]);
    let mut im = agent.images().await;
    im.register_image(pb::RegisterImageRequest {
        image_id: "gi64".into(),
        kernel_path: counter_kernel(),
        cmdline: "interval=100000000".into(),
        mem_mib: 64,
        guest_init: true,
        ..Default::default()
    })
    .await
    .expect("register");
    im.build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
        image_id: "gi64".into(),
        ..Default::default()
    })
    .await
    .expect("golden snapshot");
    let create = |mem_mib: u32| pb::CreateSessionRequest {
        image_id: "gi64".into(),
        repository_path: guest.repo().display().to_string(),
        agent: "coder".into(),
        base_ref: "main".into(),
        resources: Some(pb::SessionResources {
            mem_mib,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut sessions = agent.sessions().await;
    let e = sessions
        .create_session(create(32))
        .await
        .expect_err("the stand-in guest cannot confine 32 MiB");
    assert!(
        e.message().contains("mem_mib 32") && e.message().contains("needs a cgroup"),
        "{e}"
    );
    let failed = sessions
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sessions;
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].state, S::Failed as i32);
    assert!(failed[0].detail.contains("mem_mib 32"), "{:?}", failed[0]);
    let node = || async {
        agent
            .node()
            .await
            .get_capacity(pb::GetCapacityRequest {})
            .await
            .unwrap()
            .into_inner()
    };
    assert_eq!(
        node().await.memory_mib_used,
        0,
        "a failed session commits nothing"
    );

    let s = sessions
        .create_session(create(64))
        .await
        .expect("the image's own size")
        .into_inner();
    assert_eq!(s.state, S::Running as i32);
    assert_eq!(s.resources.map(|r| r.mem_mib), Some(64));
    assert_eq!(node().await.memory_mib_used, 64);
}
