//! Sessions with a network: host-agent configured with `network` builds the
//! golden snapshot with a virtio-net device and gives each session's VM a
//! namespace of its own, which the jailed vmm joins and which goes when the
//! session ends, or, after a SIGKILLed host-agent, when nothing owns it.
//! A test namespace stands for the node. Needs root, cgroups, iproute2 and
//! nftables; says so and skips without them.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::netns::{ask_udp, ip, PrefixCleanup};
use common::networked::{
    build_net_image, can_run, jailed_vmm, namespaces, net_golden, net_image, networked_agent,
    nft_set, wait_gone, wait_no_namespaces,
};
use common::*;
use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use proto::hostagent as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_networked_session_runs_in_its_own_namespace_until_it_ends() {
    if !can_run() {
        return;
    }
    let tag = std::process::id();
    let prefix = format!("avs{tag}-");
    // Dropped last: after host-agent and its VMs.
    let _cleanup = PrefixCleanup(prefix.clone());
    let (node, _cfg, mut agent) = networked_agent(
        &format!("sn{tag}"),
        &prefix,
        "10.204.0.0/26",
        &["203.0.113.0/24 tcp 443"],
        &[],
    );

    // The golden snapshot: booted with a NIC in a namespace of its own,
    // which goes after the build; the snapshot is marked as networked.
    build_net_image(&agent).await;
    let golden: Vec<_> = std::fs::read_dir(agent.state_dir().join("images/net"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("golden-"))
        })
        .collect();
    assert_eq!(golden.len(), 1, "{golden:?}");
    assert!(
        golden[0].join("network").exists(),
        "the golden snapshot is marked as having a network device"
    );
    assert!(
        namespaces(&prefix).is_empty(),
        "the build's namespace is gone"
    );

    // A session: its jailed vmm is in the session's namespace, on its tap.
    let s = agent.create("net", "").await;
    let s = agent.wait_state(&s.session_id, S::Running).await;
    let vmm = jailed_vmm(s.vmm_pid);
    let ours = namespaces(&prefix);
    assert_eq!(ours.len(), 1, "{ours:?}");
    let netns = format!("/run/netns/{}", ours[0]);
    let ino = std::fs::metadata(&netns).unwrap().ino();
    let vmm_ns = std::fs::read_link(format!("/proc/{vmm}/ns/net")).unwrap();
    assert_eq!(vmm_ns.to_string_lossy(), format!("net:[{ino}]"));
    let on_tap = std::fs::read_dir(format!("/proc/{vmm}/fdinfo"))
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.unwrap().path()).ok())
        .any(|info| info.contains("iff:\ttap0"));
    assert!(on_tap, "the restored vmm serves the namespace's tap");
    // No IPv6 there: nothing is sent down the tap that the guest did not ask for.
    let v6 = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ours[0],
            "cat",
            "/proc/sys/net/ipv6/conf/tap0/disable_ipv6",
        ])
        .output()
        .unwrap();
    if v6.status.success() {
        assert_eq!(String::from_utf8_lossy(&v6.stdout).trim(), "1");
    }
    let rules = nft_set(&ours[0], "allow_port");
    assert!(
        rules.contains("203.0.113.0/24 . 443"),
        "the node's allowlist is loaded: {}",
        rules
    );

    // The allowlist of the live session changes at once (the local caller
    // is an admin here, so it may widen it), is recorded as an event, and
    // bad entries are refused with their reason.
    let mut sessions = agent.sessions().await;
    let net = sessions
        .update_session_network(pb::UpdateSessionNetworkRequest {
            session_id: s.session_id.clone(),
            allow: vec!["203.0.113.0/24 tcp 443".into(), "198.51.100.0/24".into()],
            deny: vec!["203.0.113.66".into()],
        })
        .await
        .expect("update the network")
        .into_inner();
    assert_eq!(net.allow, ["203.0.113.0/24 tcp 443", "198.51.100.0/24"]);
    assert_eq!(net.deny, ["203.0.113.66/32"]);
    assert!(net.vm_address.starts_with("10.204.0."), "{net:?}");
    let set = |name: &str| nft_set(&ours[0], name);
    assert!(
        set("allow_any").contains("198.51.100.0/24"),
        "{}",
        set("allow_any")
    );
    assert!(
        set("always_deny").contains("203.0.113.66"),
        "{}",
        set("always_deny")
    );
    let events = agent.session_events(&s.session_id).await;
    assert!(
        events.iter().any(|e| e.reason == "network_updated"),
        "{events:?}"
    );
    // The operator's CLI: narrowing through `sessions network`, as JSON.
    let addr = agent.addr.clone();
    let out = Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .args(["--addr", &addr, "--output", "json", "sessions", "network"])
        .arg(&s.session_id)
        .args([
            "--allow",
            "203.0.113.0/24 tcp 443",
            "--deny",
            "203.0.113.67",
        ])
        .output()
        .unwrap();
    if !out.status.success() {
        let events = agent.session_events(&s.session_id).await;
        panic!(
            "{}; events: {events:?}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        printed["allow"],
        serde_json::json!(["203.0.113.0/24 tcp 443"])
    );
    assert_eq!(
        printed["deny"],
        serde_json::json!(["203.0.113.66/32", "203.0.113.67/32"]),
        "deny blocks are added, never dropped"
    );
    for (allow, says) in [
        ("300.1.1.1", "not an IP address"),
        ("1.2.3.4 icmp", "tcp or udp"),
        // This node has no IPv6 pool.
        ("2001:db8::/32", "gives VMs no IPv6"),
    ] {
        let e = sessions
            .update_session_network(pb::UpdateSessionNetworkRequest {
                session_id: s.session_id.clone(),
                allow: vec![allow.into()],
                deny: vec![],
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(says), "{}", e.message());
    }

    // Stopped: the namespace goes.
    agent.stop(&s.session_id).await;
    wait_gone(Path::new(&netns));

    // Fifty sessions made and stopped leave nothing behind: no namespace,
    // no veth on the node, every /30 back in the pool (a /26: 16 of them,
    // so a leak of more than a few would also run the pool out).
    for _ in 0..50 {
        let s = agent.create("net", "").await;
        agent.wait_state(&s.session_id, S::Running).await;
        agent.stop(&s.session_id).await;
    }
    wait_no_namespaces(&prefix);
    let links = Command::new("ip")
        .args(["-n", &node.0, "-o", "link"])
        .output()
        .unwrap();
    let links = String::from_utf8_lossy(&links.stdout);
    assert!(!links.contains("avh"), "veths left on the node: {links}");

    // A SIGKILLed host-agent: the running session keeps its namespace, a
    // namespace nothing owns is removed at the restart.
    let s2 = agent.create("net", "").await;
    agent.wait_state(&s2.session_id, S::Running).await;
    let kept = namespaces(&prefix);
    assert_eq!(kept.len(), 1, "{kept:?}");
    agent.kill9();
    let stray = format!("{prefix}stray");
    ip(&["netns", "add", &stray]);
    agent.spawn();
    agent.wait_state(&s2.session_id, S::Running).await;
    wait_gone(&Path::new("/run/netns").join(&stray));
    assert_eq!(
        namespaces(&prefix),
        kept,
        "the live session's namespace stays"
    );
    agent.stop(&s2.session_id).await;
    wait_gone(&Path::new("/run/netns").join(&kept[0]));
}

/// A request carrying bearer `token`.
fn as_client<T>(token: &str, msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_admin_scope_a_sessions_allowlist_only_narrows() {
    if !can_run() {
        return;
    }
    const ADMIN: &str = "net-admin-token-0123456789";
    const ALICE: &str = "net-alice-token-0123456789";
    let sha = |t: &str| {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(t.as_bytes()))
    };
    let tag = std::process::id();
    let prefix = format!("avw{tag}-");
    let _cleanup = PrefixCleanup(prefix.clone());
    let dir = tempfile::tempdir().unwrap();
    let clients = dir.path().join("clients");
    std::fs::write(
        &clients,
        format!(
            "ops admin sha256:{}\nalice sessions sha256:{}\n",
            sha(ADMIN),
            sha(ALICE)
        ),
    )
    .unwrap();
    let (_node, _cfg, agent) = networked_agent(
        &format!("sw{tag}"),
        &prefix,
        "10.205.0.0/28",
        &["203.0.113.0/24 tcp 443", "198.51.100.0/24"],
        &["--clients-file", clients.to_str().unwrap()],
    );
    let ch = agent.channel().await;
    let mut images = proto::hostagent::images_client::ImagesClient::new(ch.clone());
    images
        .register_image(as_client(ADMIN, net_image()))
        .await
        .expect("register");
    images
        .build_golden_snapshot(as_client(ADMIN, net_golden()))
        .await
        .expect("golden snapshot");
    let mut sessions = proto::hostagent::sessions_client::SessionsClient::new(ch);
    let s = sessions
        .create_session(as_client(
            ALICE,
            pb::CreateSessionRequest {
                image_id: "net".into(),
                ..Default::default()
            },
        ))
        .await
        .expect("alice creates a session")
        .into_inner();
    let update = |token: &'static str, allow: &[&str]| {
        as_client(
            token,
            pb::UpdateSessionNetworkRequest {
                session_id: s.session_id.clone(),
                allow: allow.iter().map(|a| a.to_string()).collect(),
                deny: vec![],
            },
        )
    };
    // Narrower entries: fine for a `sessions` client.
    let narrowed = sessions
        .update_session_network(update(
            ALICE,
            &["203.0.113.7 tcp 443", "198.51.100.9 udp 53"],
        ))
        .await
        .expect("alice narrows")
        .into_inner();
    assert_eq!(
        narrowed.allow,
        ["203.0.113.7/32 tcp 443", "198.51.100.9/32 udp 53"]
    );
    // Wider again (what the node allowed before): refused, and nothing changes.
    let e = sessions
        .update_session_network(update(ALICE, &["203.0.113.0/24 tcp 443"]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("admin scope"), "{}", e.message());
    let ns = namespaces(&prefix);
    let set = nft_set(&ns[0], "allow_port");

    assert!(
        set.contains("203.0.113.7") && !set.contains("203.0.113.0/24"),
        "{set}"
    );
    // An admin may widen it.
    sessions
        .update_session_network(update(ADMIN, &["203.0.113.0/24 tcp 443"]))
        .await
        .expect("the admin widens");
    sessions
        .stop_session(as_client(
            ALICE,
            pb::SessionCall {
                session_id: s.session_id.clone(),
                ..Default::default()
            },
        ))
        .await
        .expect("stop");
    wait_no_namespaces(&prefix);
}

/// A session of `agent` in repository `repo` at `main`.
fn with_repo(repo: &Path, agent: &str) -> pb::CreateSessionRequest {
    pb::CreateSessionRequest {
        image_id: "net".into(),
        repository_path: repo.display().to_string(),
        agent: agent.into(),
        base_ref: "main".into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_allowlist_is_what_its_manifest_grants_within_the_nodes() {
    if !can_run() {
        return;
    }
    let tag = std::process::id();
    let prefix = format!("avm{tag}-");
    let _cleanup = PrefixCleanup(prefix.clone());
    let (_node, _cfg, mut agent) = networked_agent(
        &format!("sm{tag}"),
        &prefix,
        "10.206.0.0/27",
        &["203.0.113.0/24 tcp 443", "198.51.100.0/24"],
        &[],
    );
    build_net_image(&agent).await;
    let repos = agent.state_dir().join("repositories");
    std::fs::create_dir_all(&repos).unwrap();
    let manifest = "version: 1\nagents:\n  coder:\n    egress:\n      \
                    - cidr: 203.0.113.7/32\n        ports: [443, 80]\n      \
                    - cidr: 198.51.100.0/25\n      \
                    - cidr: 192.0.2.0/24\n      \
                    - host: crates.io\n        ports: [443]\n";
    let repo = test_harness::git::repo_with_files(&repos, &[("agent-manifest.yaml", manifest)]);
    let mut sessions = agent.sessions().await;

    // `coder`: 203.0.113.7 TCP 443 (not 80, not UDP: the node allows
    // neither), 198.51.100.0/25 whole, and not 192.0.2.0/24 (the node does
    // not allow it at all), said in the session's events.
    let coder = sessions
        .create_session(with_repo(&repo, "coder"))
        .await
        .expect("create")
        .into_inner();
    let coder = agent.wait_state(&coder.session_id, S::Running).await;
    let ns = namespaces(&prefix);
    assert_eq!(ns.len(), 1, "{ns:?}");
    let (ports, any) = (nft_set(&ns[0], "allow_port"), nft_set(&ns[0], "allow_any"));
    assert!(ports.contains("203.0.113.7 . 443"), "{ports}");
    assert!(!ports.contains(". 80") && !ports.contains("udp"), "{ports}");
    assert!(!ports.contains("203.0.113.0/24"), "{ports}");
    assert!(any.contains("198.51.100.0/25"), "{any}");
    assert!(!any.contains("192.0.2"), "{any}");
    // Its resolver answers at the gateway in its namespace: a name the
    // manifest does not grant is NXDOMAIN (upstream never asked), and an
    // event says so.
    let m = ask_udp(&ns[0], "evil.example", RecordType::A).expect("an answer");
    assert_eq!(m.response_code(), ResponseCode::NXDomain);
    // Counted in the session's usage records (read every usage interval).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let usage = agent.usage_of(&coder.session_id).await;
        if usage.last().is_some_and(|u| u.dns_denied_queries == 1) {
            break;
        }
        assert!(Instant::now() < deadline, "{usage:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let events = agent.session_events(&coder.session_id).await;
    let denied: Vec<_> = events.iter().filter(|e| e.reason == "dns_denied").collect();
    assert_eq!(denied.len(), 1, "{events:?}");
    assert_eq!(denied[0].detail, "evil.example A");
    let granted: Vec<_> = events
        .into_iter()
        .filter(|e| e.reason == "network_granted")
        .collect();
    assert_eq!(granted.len(), 1, "{granted:?}");
    let d = &granted[0].detail;
    assert!(d.contains("hosts: [crates.io]"), "{d}");
    assert!(
        d.contains("192.0.2.0/24: outside the node's allowlist"),
        "{d}"
    );
    // The kept policy is the granted one, for a restarted host-agent.
    let kept = agent
        .state_dir()
        .join("sessions")
        .join(&coder.session_id)
        .join("network-policy.json");
    let kept = std::fs::read_to_string(kept).expect("kept policy");
    assert!(kept.contains("203.0.113.7/32 tcp 443") && kept.contains("crates.io"));
    agent.stop(&coder.session_id).await;

    // An agent the manifest does not name reaches nothing.
    let other = sessions
        .create_session(with_repo(&repo, "reviewer"))
        .await
        .expect("create")
        .into_inner();
    agent.wait_state(&other.session_id, S::Running).await;
    let ns = namespaces(&prefix);
    assert_eq!(ns.len(), 1, "{ns:?}");
    assert!(!nft_set(&ns[0], "allow_port").contains("elements"));
    assert!(!nft_set(&ns[0], "allow_any").contains("elements"));
    agent.stop(&other.session_id).await;

    // A manifest host-agent cannot read fails the session, naming it.
    test_harness::git::git(&repo, &["rm", "-q", "agent-manifest.yaml"]);
    std::fs::write(repo.join("agent-manifest.yaml"), "version: 1\nagents: [\n").unwrap();
    test_harness::git::git(&repo, &["add", "-A"]);
    test_harness::git::git(&repo, &["commit", "-q", "-m", "broken manifest"]);
    let err = sessions
        .create_session(with_repo(&repo, "coder"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("agent-manifest.yaml"),
        "{}",
        err.message()
    );
    wait_no_namespaces(&prefix);
    agent.terminate();
}
