//! StartSession's size fields through the session protocol: a memory limit
//! is refused where turns have no cgroup (naming the field), and a guest-init
//! that does not run the machine leaves its vCPUs and disk alone and says so
//! in the audit log. (The machine side is exercised in a real guest:
//! tests/real-guest's node-sizing scenario.)

mod common;

use common::*;
use guest_init::turn::Backend;
use proto::guest::{error::Code, guest_message::Kind as Out};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_limit_without_a_cgroup_is_refused_naming_the_field() {
    let repo = Repo::new();
    let h = Harness::start_with(Options {
        backend: Some(Backend::ProcessTree),
        ..Default::default()
    })
    .await;
    let mut c = h.connect().await;
    c.hello().await;
    let mut spec = SessionSpec::new("s1", "free", "main");
    spec.size = (0, 256, 0);
    let answer = c.start_session(&spec, &repo.bundle()).await;
    let Out::Error(e) = answer else {
        panic!("expected an error, got {answer:?}");
    };
    assert_eq!(e.code, Code::InvalidArgument as i32, "{e:?}");
    assert!(e.message.contains("mem_mib 256"), "{}", e.message);
    assert!(e.message.contains("needs a cgroup"), "{}", e.message);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vcpus_and_disk_are_left_alone_where_guest_init_does_not_run_the_machine() {
    let repo = Repo::new();
    let h = Harness::start().await;
    let mut c = h.connect().await;
    c.hello().await;
    let mut spec = SessionSpec::new("s1", "free", "main");
    spec.size = (1, 0, 1 << 30);
    let ready = c.start_session(&spec, &repo.bundle()).await;
    assert!(matches!(ready, Out::Ready(_)), "{ready:?}");
    let r = c.run("x", &["echo", "still here"]).await;
    assert_eq!(r.stdout(), "still here\n");
    let log = std::fs::read_to_string(h.audit_log("s1")).unwrap();
    assert!(
        log.lines().any(|l| l.contains("\"session.size\"")
            && l.contains("vcpus and disk left as they are (not PID 1)")),
        "{log}"
    );
}
