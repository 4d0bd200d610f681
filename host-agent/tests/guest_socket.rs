//! Without a vsock device (`--no-vsock-device`), `--guest-vsock-uds` names
//! a socket host-agent does not own (here the stand-in guest's, shared by
//! every session): a session's stop leaves it, so the next session still
//! reaches its guest. (A stop used to delete it, and every later session
//! hung in RESTORING until its guest-ready timeout.)

mod common;

use std::time::Duration;

use common::fake_guest::FakeGuest;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_leaves_a_guest_socket_it_does_not_own() {
    let guest = FakeGuest::start();
    let agent = Agent::start(&["--guest-vsock-uds", &guest.sock(), "--no-vsock-device"]);
    agent.guest_init_image().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_main(dir.path());
    let first = agent.guest_session(&repo, "good", "main").await.unwrap();
    agent.stop(&first.session_id).await;
    assert!(
        std::path::Path::new(&guest.sock()).exists(),
        "the stop removed the stand-in guest's socket"
    );
    let second = tokio::time::timeout(
        Duration::from_secs(60),
        agent.guest_session(&repo, "good", "main"),
    )
    .await
    .unwrap_or_else(|_| panic!("the second session hung: {}", agent.log()))
    .expect("second session");
    assert_eq!(second.state, S::Running as i32, "{second:?}");
}
