//! StartSession's virtio-fs shares through the session protocol: a
//! guest-init that does not run the machine (a host process) checks them,
//! mounts nothing and says so in the audit log; a share it cannot accept is
//! refused naming its tag. (Mounting is exercised in a real guest.)

mod common;

use common::*;
use proto::guest::{error::Code, guest_message::Kind as Out, Mount};

fn mount(tag: &str, path: &str, read_only: bool) -> Mount {
    Mount {
        tag: tag.into(),
        path: path.into(),
        read_only,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_are_not_mounted_where_guest_init_does_not_run_the_machine() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.connect().await;
    c.hello().await;
    let mut spec = SessionSpec::new("s1", "free", "main");
    spec.mounts = vec![
        mount("cargo-registry", "/mnt/cargo-registry", true),
        mount("scratch", "/mnt/scratch", false),
    ];
    let ready = c.start_session(&spec, &repo.bundle()).await;
    assert!(matches!(ready, Out::Ready(_)), "{ready:?}");
    let log = std::fs::read_to_string(h.audit_log("s1")).unwrap();
    assert!(
        log.lines().any(|l| l.contains("\"session.shares\"")
            && l.contains("not mounted (not PID 1): cargo-registry on /mnt/cargo-registry (ro), scratch on /mnt/scratch (rw)")),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_on_a_reserved_path_refuses_the_session_naming_its_tag() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.connect().await;
    c.hello().await;
    let mut spec = SessionSpec::new("s1", "free", "main");
    spec.mounts = vec![mount("cache", "/proc/cache", true)];
    let answer = c.start_session(&spec, &repo.bundle()).await;
    let Out::Error(e) = answer else {
        panic!("expected an error, got {answer:?}");
    };
    assert_eq!(e.code, Code::InvalidArgument as i32, "{e:?}");
    assert!(e.message.contains("share \"cache\""), "{}", e.message);
    assert!(e.message.contains("/proc"), "{}", e.message);
}
