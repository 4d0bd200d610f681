//! Nothing of a session's network outlives it: 50 sessions, each with a
//! network, a DNS query answered by its resolver and an exposed port, are
//! created and stopped in turn; afterwards no VM namespace, no node-side
//! veth end and no host-agent file descriptor is left over, and a
//! SIGKILLed host-agent's session network is cleaned up by the next one
//! once the session ends. Needs root, cgroups, iproute2 and nftables; says
//! so and skips without them.

mod common;

use std::time::{Duration, Instant};

use common::netns::{ask_udp, PrefixCleanup};
use common::networked::{
    build_net_image, can_run, namespaces, networked_agent, wait_no_namespaces,
};
use common::*;
use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use proto::hostagent as pb;

/// Open file descriptors of process `pid`.
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Links in namespace `ns` (the node's veth ends among them).
fn links(ns: &str) -> usize {
    let out = std::process::Command::new("ip")
        .args(["-n", ns, "-o", "link", "show"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).lines().count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_networked_sessions_leave_nothing_behind() {
    if !can_run() {
        return;
    }
    let tag = std::process::id();
    let prefix = format!("avc{tag}-");
    let _cleanup = PrefixCleanup(prefix.clone());
    let (node, _cfg, mut agent) =
        networked_agent(&format!("sc{tag}"), &prefix, "10.210.0.0/28", &[], &[]);
    build_net_image(&agent).await;
    let node_links = links(&node.0);
    let mut sessions = agent.sessions().await;
    let mut settled_fds = 0;
    for n in 0..50 {
        let s = agent.create("net", "").await;
        agent.wait_state(&s.session_id, S::Running).await;
        let ns = namespaces(&prefix);
        assert_eq!(ns.len(), 1, "cycle {n}: {ns:?}");
        let m = ask_udp(&ns[0], "not.granted", RecordType::A).expect("an answer");
        assert_eq!(m.response_code(), ResponseCode::NXDomain);
        sessions
            .expose_port(pb::ExposePortRequest {
                session_id: s.session_id.clone(),
                guest_port: 8080,
                protocol: "tcp".into(),
            })
            .await
            .expect("expose");
        agent.stop(&s.session_id).await;
        wait_no_namespaces(&prefix);
        if n == 4 {
            // After a few cycles: what host-agent keeps open for good
            // (database, listeners, gRPC connections) is open by now.
            settled_fds = fds(agent.pid());
        }
    }
    // host-agent deletes each node-side veth end before the namespace, so
    // none should be left once the namespaces are gone; the kernel's own
    // cleanup is asynchronous, so allow it a moment before calling it a leak.
    let deadline = Instant::now() + Duration::from_secs(5);
    while links(&node.0) != node_links && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(links(&node.0), node_links, "node-side veth ends left over");
    // Sockets and files of stopped sessions (resolver sockets, exposed
    // listeners, control connections) are closed: allow only noise.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = fds(agent.pid());
        if now <= settled_fds + 4 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "host-agent holds {now} descriptors, {settled_fds} after five cycles"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A SIGKILLed host-agent: its session's network stays with the VM, and
    // goes with the session under the next host-agent.
    let s = agent.create("net", "").await;
    agent.wait_state(&s.session_id, S::Running).await;
    assert_eq!(namespaces(&prefix).len(), 1);
    agent.kill9();
    agent.spawn();
    assert_eq!(namespaces(&prefix).len(), 1, "kept for the live VM");
    agent.stop(&s.session_id).await;
    wait_no_namespaces(&prefix);
    assert_eq!(links(&node.0), node_links);
    agent.terminate();
}
