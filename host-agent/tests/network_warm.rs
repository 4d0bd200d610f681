//! Warm VMs of a networked image: restored with their network made ahead
//! (namespace, veth pair, tap, rules with an empty allowlist), which the
//! session that takes one gets, with its own policy loaded; a host-agent
//! restart removes the namespaces of the warm VMs it no longer has and keeps
//! the sessions'. A test namespace stands for the node. Needs root, cgroups,
//! iproute2 and nftables; says so and skips without them.

mod common;

use std::path::Path;
use std::time::Instant;

use common::netns::{ask_udp, PrefixCleanup};
use common::networked::{
    build_net_image, can_run, jailed_vmm, namespaces, net_golden, net_image, netns_inode, netns_of,
    networked_agent, nft_set, nft_tables, wait_gone, wait_namespaces, wait_warm, warm_dirs,
    WarmDir,
};
use common::*;
use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use proto::hostagent as pb;

const NODE_ALLOW: [&str; 2] = ["203.0.113.0/24 tcp 443", "198.51.100.0/24"];

/// The one warm VM of the pool, once restored with its network.
async fn the_warm_vm(agent: &Agent) -> (u32, String) {
    wait_warm(agent, 1).await;
    let warm = warm_dirs(agent);
    assert_eq!(warm.len(), 1, "{warm:?}");
    let WarmDir { pid, netns } = warm[0].clone();
    let netns = netns.expect("the warm VM records its namespace");
    (pid, netns)
}

/// Whether the allowlist sets of `netns` are empty.
fn allows_nothing(netns: &str) -> bool {
    ["allow_port", "allow_any"].iter().all(|set| {
        let listed = nft_set(netns, set);
        // A set nft cannot list (no table) is not an empty allowlist.
        listed.contains(&format!("set {set}")) && !listed.contains("elements")
    })
}

/// Whether `netns` allows what the node's allowlist does.
fn allows_the_nodes(netns: &str) -> bool {
    nft_set(netns, "allow_port").contains("203.0.113.0/24 . 443")
        && nft_set(netns, "allow_any").contains("198.51.100.0/24")
}

/// What the RUNNING event of session `id` says the VM came from.
async fn started_from(agent: &Agent, id: &str) -> String {
    agent
        .session_events(id)
        .await
        .into_iter()
        .find(|e| e.reason == "started")
        .map(|e| e.detail)
        .unwrap_or_default()
}

/// How many `network_granted` events session `id` has.
async fn granted_events(agent: &Agent, id: &str) -> usize {
    agent
        .session_events(id)
        .await
        .iter()
        .filter(|e| e.reason == "network_granted")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_vms_have_their_network_made_ahead_and_sessions_take_it() {
    if !can_run() {
        return;
    }
    let tag = std::process::id();
    let prefix = format!("avp{tag}-");
    // Dropped last: after host-agent and its VMs.
    let _cleanup = PrefixCleanup(prefix.clone());
    let (node, _cfg, mut agent) = networked_agent(
        &format!("sp{tag}"),
        &prefix,
        "10.210.0.0/27",
        &NODE_ALLOW,
        &["--warm-pool", "1"],
    );
    let mut images = agent.images().await;
    images.register_image(net_image()).await.expect("register");
    images
        .build_golden_snapshot(net_golden())
        .await
        .expect("golden snapshot");

    let node_tables = nft_tables(&node.0);

    // Before any session: the warm VM's namespace exists, its jailed vmm is
    // in it, and its guest is allowed nothing.
    let (warm_pid, warm_ns) = the_warm_vm(&agent).await;
    assert_eq!(namespaces(&prefix), std::slice::from_ref(&warm_ns));
    assert_eq!(netns_of(jailed_vmm(warm_pid)), netns_inode(&warm_ns));
    assert!(
        allows_nothing(&warm_ns),
        "{}",
        nft_set(&warm_ns, "allow_any")
    );

    // CreateSession takes it: the same vmm, in the namespace made ahead,
    // which the session records, now with the session's allowlist (the
    // node's: the session has no repository). The network is handed over
    // while the guest resumes, and the session is RUNNING only once that is
    // done: the policy is in force and the resolver answers as the call
    // returns (checked first thing, without waiting).
    let s = agent.create("net", "").await;
    assert!(
        allows_the_nodes(&warm_ns),
        "RUNNING before its policy is in: {}",
        nft_set(&warm_ns, "allow_port")
    );
    let answer = ask_udp(&warm_ns, "not.granted", RecordType::A);
    assert_eq!(
        answer.map(|m| m.response_code()),
        Some(ResponseCode::NXDomain),
        "RUNNING before its resolver answers"
    );
    assert_eq!(s.state, S::Running as i32);
    assert_eq!(s.vmm_pid, warm_pid, "the session got the warm VM");
    assert_eq!(started_from(&agent, &s.session_id).await, "from a warm VM");
    let session_dir = agent.state_dir().join("sessions").join(&s.session_id);
    let recorded = std::fs::read_to_string(session_dir.join("network-namespace")).unwrap();
    assert_eq!(recorded.trim(), warm_ns);
    assert_eq!(netns_of(jailed_vmm(s.vmm_pid)), netns_inode(&warm_ns));
    let net = agent.get(&s.session_id).await.network.expect("a network");
    assert!(net.vm_address.starts_with("10.210.0."), "{net:?}");
    assert_eq!(granted_events(&agent, &s.session_id).await, 1);

    // The pool refills, with a namespace of its own that allows nothing.
    let (next_pid, next_ns) = the_warm_vm(&agent).await;
    assert_ne!(next_pid, warm_pid);
    assert_ne!(next_ns, warm_ns);
    assert!(allows_nothing(&next_ns));
    wait_namespaces(&prefix, &[warm_ns.clone(), next_ns.clone()]);

    // Stopping the session removes its namespace; the warm VM's stays.
    agent.stop(&s.session_id).await;
    wait_gone(&Path::new("/run/netns").join(&warm_ns));
    wait_namespaces(&prefix, std::slice::from_ref(&next_ns));

    // A SIGKILLed host-agent: the session's namespace (made for a warm VM,
    // named after the pool) is taken back, the warm VM left over loses its.
    let s2 = agent.create("net", "").await;
    assert_eq!(s2.vmm_pid, next_pid);
    let (_, left_ns) = the_warm_vm(&agent).await;
    agent.kill9();
    agent.spawn();
    agent.wait_state(&s2.session_id, S::Running).await;
    wait_gone(&Path::new("/run/netns").join(&left_ns));
    assert!(
        namespaces(&prefix).contains(&next_ns),
        "the session's stays"
    );
    // The session's network is what the restarted host-agent knows: an
    // update reaches the namespace the vmm is in.
    let updated = agent
        .sessions()
        .await
        .update_session_network(pb::UpdateSessionNetworkRequest {
            session_id: s2.session_id.clone(),
            allow: vec!["203.0.113.9 tcp 443".into()],
            deny: vec![],
        })
        .await
        .expect("update the network after the restart")
        .into_inner();
    assert_eq!(updated.allow, ["203.0.113.9/32 tcp 443"]);
    assert!(nft_set(&next_ns, "allow_port").contains("203.0.113.9 . 443"));
    // The restarted host-agent fills its pool anew; nothing else is left.
    let (_, refilled) = the_warm_vm(&agent).await;
    assert_ne!(refilled, left_ns);
    wait_namespaces(&prefix, &[next_ns.clone(), refilled.clone()]);
    agent.stop(&s2.session_id).await;
    wait_namespaces(&prefix, std::slice::from_ref(&refilled));

    // Twenty sessions through the warm path leave nothing behind: only the
    // warm VM of the moment has a namespace (its tables are its own), the
    // node's tables are as they were, and one veth is on the node.
    for _ in 0..20 {
        wait_warm(&agent, 1).await;
        let pids: Vec<u32> = warm_dirs(&agent).iter().map(|w| w.pid).collect();
        let s = agent.create("net", "").await;
        assert!(pids.contains(&s.vmm_pid), "the session got a warm VM");
        agent.stop(&s.session_id).await;
    }
    let (_, last) = the_warm_vm(&agent).await;
    wait_namespaces(&prefix, std::slice::from_ref(&last));
    let tables = nft_tables(&last);
    assert!(
        !tables.is_empty() && tables.iter().all(|t| t.ends_with(" agentvm")),
        "{tables:?}"
    );
    assert_eq!(nft_tables(&node.0), node_tables);
    let deadline = Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let links = std::process::Command::new("ip")
            .args(["-n", &node.0, "-o", "link"])
            .output()
            .unwrap();
        let veths = String::from_utf8_lossy(&links.stdout)
            .matches("avh")
            .count();
        if veths == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "{veths} veths on the node");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // Shut down: the warm VM's network goes with it.
    assert!(agent.terminate().success());
    assert_eq!(namespaces(&prefix), Vec::<String>::new());
}

/// A warm VM whose network cannot be handed over (its namespace lost its
/// rules, so the session's policy cannot be loaded) never runs the
/// session: the session is restored from the golden snapshot in a network
/// of its own, RUNNING with its policy in force, said granted once; the
/// warm VM and its namespace are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_vm_whose_network_cannot_be_handed_over_is_replaced_by_a_restore() {
    if !can_run() {
        return;
    }
    let tag = std::process::id();
    let prefix = format!("avf{tag}-");
    let _cleanup = PrefixCleanup(prefix.clone());
    let (_node, _cfg, agent) = networked_agent(
        &format!("sf{tag}"),
        &prefix,
        "10.212.0.0/28",
        &NODE_ALLOW,
        &["--warm-pool", "1"],
    );
    build_net_image(&agent).await;
    let (warm_pid, warm_ns) = the_warm_vm(&agent).await;
    let out = std::process::Command::new("ip")
        .args([
            "netns", "exec", &warm_ns, "nft", "delete", "table", "ip", "agentvm",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");

    let s = agent.create("net", "").await;
    // Checked first, without waiting: in force when RUNNING is reported.
    let ns: Vec<String> = namespaces(&prefix)
        .into_iter()
        .filter(|n| *n != warm_ns)
        .collect();
    let session_ns = ns
        .iter()
        .find(|n| netns_of(jailed_vmm(s.vmm_pid)) == netns_inode(n))
        .unwrap_or_else(|| panic!("the session's vmm is in none of {ns:?}"))
        .clone();
    assert!(
        allows_the_nodes(&session_ns),
        "{}",
        nft_set(&session_ns, "allow_port")
    );
    assert_eq!(s.state, S::Running as i32);
    assert_ne!(s.vmm_pid, warm_pid, "the warm VM did not run the session");
    let from = started_from(&agent, &s.session_id).await;
    assert!(
        from.starts_with("from the golden snapshot (the warm VM failed: ")
            && from.contains("its network could not be handed over"),
        "{from}"
    );
    assert_eq!(granted_events(&agent, &s.session_id).await, 1);
    // Nothing of the warm VM is left: its vmm, its namespace.
    wait_gone(&Path::new("/proc").join(warm_pid.to_string()));
    wait_gone(&Path::new("/run/netns").join(&warm_ns));
    // The session's network is the one the restore made, and a live update
    // reaches it.
    let session_dir = agent.state_dir().join("sessions").join(&s.session_id);
    assert!(!session_dir.join("network-namespace").exists());
    agent
        .sessions()
        .await
        .update_session_network(pb::UpdateSessionNetworkRequest {
            session_id: s.session_id.clone(),
            allow: vec!["198.51.100.7".into()],
            deny: vec![],
        })
        .await
        .expect("update the network");
    assert!(nft_set(&session_ns, "allow_any").contains("198.51.100.7"));
    agent.stop(&s.session_id).await;
    wait_gone(&Path::new("/run/netns").join(&session_ns));
}

fn median(v: &mut [std::time::Duration]) -> std::time::Duration {
    v.sort();
    v[v.len() / 2]
}

/// Creates (and stops) `rounds` sessions of image `image`, each once the
/// pool has a warm VM; returns the median CreateSession time.
async fn warm_creates(agent: &Agent, image: &str, rounds: usize) -> std::time::Duration {
    let mut took = Vec::new();
    for _ in 0..rounds {
        wait_warm(agent, 1).await;
        let pids: Vec<u32> = warm_dirs(agent).iter().map(|w| w.pid).collect();
        let t = Instant::now();
        let s = agent.create(image, "").await;
        took.push(t.elapsed());
        assert!(pids.contains(&s.vmm_pid), "the session got a warm VM");
        agent.stop(&s.session_id).await;
    }
    median(&mut took)
}

/// `line` without its terminal colour codes.
fn strip_ansi(line: &str) -> String {
    let mut out = String::new();
    let mut escape = false;
    for c in line.chars() {
        match (escape, c) {
            (false, '\x1b') => escape = true,
            (false, c) => out.push(c),
            (true, 'm') => escape = false,
            (true, _) => {}
        }
    }
    out
}

/// The hand-over times host-agent logged (`elapsed_us` of "the warm VM's
/// network is the session's"), in microseconds.
fn logged_handovers(agent: &Agent) -> Vec<u64> {
    let log = agent.state_dir().parent().unwrap().join("agent-1.log");
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("network is the session"))
        .map(strip_ansi)
        .filter_map(|l| {
            let at = l.find("elapsed_us=")? + "elapsed_us=".len();
            l[at..]
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// CreateSession from the warm pool, with and without a network: the
/// medians (printed, never asserted). Run with
/// `cargo test -p host-agent --release --test network_warm -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark"]
async fn bench_warm_create_with_and_without_network() {
    if !can_run() {
        return;
    }
    let rounds: usize = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let plain = Agent::start(&["--warm-pool", "1"]);
    plain.counter_image("counter").await;
    let without = warm_creates(&plain, "counter", rounds).await;
    drop(plain);

    let tag = std::process::id();
    let prefix = format!("avb{tag}-");
    let _cleanup = PrefixCleanup(prefix.clone());
    let (_node, _cfg, networked) = networked_agent(
        &format!("sb{tag}"),
        &prefix,
        "10.211.0.0/27",
        &NODE_ALLOW,
        &["--warm-pool", "1"],
    );
    networked.counter_image("counter").await;
    let with = warm_creates(&networked, "counter", rounds).await;
    let mut handovers = logged_handovers(&networked);
    handovers.sort_unstable();
    println!(
        "CreateSession from a warm VM -> RUNNING (median of {rounds}): without network {without:?}, \
         with network {with:?} (+{:?})",
        with.saturating_sub(without)
    );
    if std::env::var("BENCH_KEEP_LOG").is_ok() {
        let log = networked.state_dir().parent().unwrap().join("agent-1.log");
        let _ = std::fs::copy(log, "/tmp/network_warm_bench.log");
    }
    if !handovers.is_empty() {
        println!(
            "network hand-over in CreateSession (policy, resolver): median {} us, max {} us (n={})",
            handovers[handovers.len() / 2],
            handovers[handovers.len() - 1],
            handovers.len()
        );
    }
}
