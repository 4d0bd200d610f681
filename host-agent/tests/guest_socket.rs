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

/// Creates a session whose fake guest (`agent`: `vanish-once` or
/// `hang-up-once`) hangs up at its first StartSession; checks that the
/// create succeeded on a second VM, the first is gone, and host-agent said
/// why it restored again.
async fn create_past_a_lost_guest(agent_name: &str) {
    let guest = FakeGuest::start();
    let agent = Agent::start(&["--guest-vsock-uds", &guest.sock(), "--no-vsock-device"]);
    agent.guest_init_image().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_main(dir.path());
    let s = tokio::time::timeout(
        Duration::from_secs(60),
        agent.guest_session(&repo, agent_name, "main"),
    )
    .await
    .expect("the create finished")
    .expect("the create succeeded on the second VM");
    let first = guest
        .seen
        .vanished
        .lock()
        .unwrap()
        .get(&s.session_id)
        .cloned()
        .expect("the first VM's guest hung up");
    assert!(
        first.iter().all(|&p| test_harness::process::is_gone(p)),
        "the first VM {first:?} still runs:\n{}",
        agent.log()
    );
    assert_eq!(
        s.state,
        proto::hostagent::SessionState::Running as i32,
        "{s:?}"
    );
    let log = agent.log();
    assert!(
        log.contains("went away before the guest was ready; restoring once more"),
        "host-agent did not say why it restored again:\n{log}"
    );
    agent.stop(&s.session_id).await;
}

/// A VM that dies while its guest is being started (the guest's channel
/// closes first, the vmm's exit is reaped after) is restored once more, and
/// the create succeeds. The create used to fail with "the guest closed the
/// channel" whenever the closed channel was seen before the exit: the
/// retry was only for VMs known to have exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_lost_while_its_guest_starts_is_restored_once_more() {
    create_past_a_lost_guest("vanish-once").await;
}

/// A guest that hangs up while being started, in a VM that runs on (its
/// init died), is replaced the same way: the VM is killed and the session
/// restored once more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_hangs_up_while_starting_is_restored_once_more() {
    create_past_a_lost_guest("hang-up-once").await;
}
