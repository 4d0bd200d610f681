//! IPv6 on VM networks made by `host_agent::network`, on namespaces this
//! test makes (the topology of `tests/network.rs`: a "node" namespace, an
//! "internet" namespace of servers behind it, and per VM a "guest"
//! namespace joined where the tap would be, configured as guest-init
//! configures a guest). The node has an IPv6 pool, so each VM gets a /126
//! beside its /30, and the same rules hold for IPv6 as for IPv4.
//! Needs root, iproute2 and nftables; says so and skips without them.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::sync::mpsc;
use std::time::Duration;

mod common;

use common::netns::{
    attach_guest, echo_from, echo_from_all, in_ns, ip, missing_tools as missing, node_and_internet,
    Cleanup, Ns,
};
use host_agent::network::addressing::{AddressPool, Cidr, GUEST_IP6};
use host_agent::network::namespace::{list_namespaces, VmNetwork};
use host_agent::network::node::node_addresses;
use host_agent::network::rules::{Allow, EgressPolicy, Proto};

/// The internet's addresses this test serves on: an allowed server, one not
/// allowed, the IPv6 metadata address and 203.0.113.3 through NAT64.
const SERVED: [&str; 4] = [
    "2001:db8:113::3",
    "2001:db8:113::4",
    "fd00:ec2::254",
    "64:ff9b::cb00:7103",
];

fn at(addr: &str, port: u16) -> SocketAddr {
    SocketAddr::new(addr.parse().unwrap(), port)
}

#[test]
fn clones_share_an_ipv6_guest_address_and_its_egress_is_enforced_on_the_host_side() {
    if let Some(why) = missing() {
        println!("skipped: {why}");
        return;
    }
    let tag = format!("6{}", std::process::id());
    let block = Cidr::parse("10.204.0.0/16").unwrap();
    let block6 = Cidr::parse("fd00:204::/112").unwrap();
    let (node, inet) = node_and_internet(&tag, block, Some(block6));
    // Addresses the node routes to the internet but no rule may let through.
    for extra in &SERVED[2..] {
        ip(&[
            "-n",
            &inet.0,
            "addr",
            "add",
            &format!("{extra}/128"),
            "dev",
            "wan0",
            "nodad",
        ]);
    }

    // Echo servers on every served address, and a UDP sink.
    let (ready_tx, ready_rx) = mpsc::channel();
    let (udp_tx, udp_rx) = mpsc::channel::<SocketAddr>();
    let _servers = in_ns(&inet.0, move || {
        for addr in SERVED {
            let l = TcpListener::bind(at(addr, 8080)).expect("bind");
            std::thread::spawn(move || {
                for mut s in l.incoming().flatten() {
                    let mut b = [0u8; 1];
                    if s.read_exact(&mut b).is_ok() {
                        let _ = s.write_all(&b);
                    }
                }
            });
        }
        let u = UdpSocket::bind(at(SERVED[0], 5353)).expect("bind udp");
        ready_tx.send(()).expect("ready");
        let mut buf = [0u8; 64];
        while let Ok((_, from)) = u.recv_from(&mut buf) {
            if udp_tx.send(from).is_err() {
                break;
            }
        }
    });
    ready_rx.recv().expect("servers up");

    let mut pool = AddressPool::new(block, Some(block6)).unwrap();
    let allow = |cidr: &str, proto, port| Allow {
        cidr: Cidr::parse(cidr).unwrap(),
        proto: Some(proto),
        port: Some(port),
    };
    let node_own = node_addresses(Some(&node.0)).unwrap();
    assert!(
        node_own
            .iter()
            .any(|c| c.to_string() == "2001:db8:113::1/128"),
        "the node's IPv6 address is one of its own: {node_own:?}"
    );
    let policy = EgressPolicy::new(
        vec![
            allow("2001:db8:113::3", Proto::Tcp, 8080),
            allow("2001:db8:113::3", Proto::Udp, 5353),
        ],
        &node_own,
        &[block, block6],
        vec![],
    );
    let vms: Vec<VmNetwork> = ["a", "b"]
        .iter()
        .map(|s| {
            let vm = VmNetwork::plan(
                "agentvm6-",
                &format!("t{tag}{s}"),
                pool.allocate().unwrap(),
                Some(node.0.clone()),
            );
            vm.create(&policy, None).expect("create the VM's network");
            vm
        })
        .collect();
    let _cleanup = Cleanup(vms.iter().map(|v| v.netns.clone()).collect());
    let v6 = |vm: &VmNetwork| vm.slot.v6.expect("an IPv6 slot");
    assert_eq!(v6(&vms[0]).vm_ip.to_string(), "fd00:204::2");
    assert_eq!(v6(&vms[1]).vm_ip.to_string(), "fd00:204::6");
    let guests: Vec<Ns> = vms
        .iter()
        .zip(["a", "b"])
        .map(|(vm, s)| attach_guest(&vm.netns, &format!("g{tag}{s}")))
        .collect();

    // Two clones with the same IPv6 guest address reach the internet at once.
    let server = at(SERVED[0], 8080);
    for (i, got) in echo_from_all(&guests, server).into_iter().enumerate() {
        assert_eq!(got, Ok(()), "guest {i} reaches the allowed IPv6 server");
    }

    // Denied: dropped on the host side (a timeout, never a refusal).
    let g = guests[0].0.as_str();
    let node_veth = v6(&vms[0]).host_ip.to_string();
    let other_vm = v6(&vms[1]).vm_ip.to_string();
    let denied_always = [
        ("the node's own address", at("2001:db8:113::1", 22)),
        ("the node's end of the veth", at(&node_veth, 22)),
        ("the other VM", at(&other_vm, 8080)),
        ("the IPv6 metadata address", at(SERVED[2], 8080)),
        ("an IPv4 address through NAT64", at(SERVED[3], 8080)),
    ];
    let denied = [
        ("a server not in the allowlist", at(SERVED[1], 8080)),
        ("an allowed address on another port", at(SERVED[0], 9090)),
    ];
    for (what, to) in denied.iter().chain(&denied_always) {
        assert_eq!(
            echo_from(g, *to),
            Err(std::io::ErrorKind::TimedOut),
            "{what} ({to}) must be dropped"
        );
    }

    // A guest forging its IPv6 source gets nothing through; the honest
    // datagram arrives masqueraded behind the node.
    ip(&[
        "-n",
        g,
        "addr",
        "add",
        "2001:db8:99::77/128",
        "dev",
        "eth0",
        "nodad",
    ]);
    in_ns(g, || {
        let honest = UdpSocket::bind((GUEST_IP6, 0)).unwrap();
        honest.send_to(b"honest", at(SERVED[0], 5353)).unwrap();
        let forged = UdpSocket::bind(at("2001:db8:99::77", 0)).unwrap();
        forged.send_to(b"forged", at(SERVED[0], 5353)).unwrap();
    })
    .join()
    .unwrap();
    let first = udp_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the honest datagram");
    assert_eq!(first.ip().to_string(), "2001:db8:113::1", "masqueraded");
    assert!(
        udp_rx.recv_timeout(Duration::from_secs(1)).is_err(),
        "the forged datagram must be dropped"
    );
    assert!(
        vms[0].denied_packets().unwrap() >= 8,
        "IPv6 drops are counted"
    );

    // Narrowing the allowlist of a live VM takes effect at once for IPv6.
    let mut narrowed = policy.clone();
    narrowed.allow.retain(|a| a.proto == Some(Proto::Udp));
    vms[0].update_policy(&narrowed, false).unwrap();
    assert_eq!(echo_from(g, server), Err(std::io::ErrorKind::TimedOut));
    assert_eq!(
        echo_from(&guests[1].0, server),
        Ok(()),
        "the other VM keeps its policy"
    );

    // Even allowing every address keeps the node, the other VM, the
    // metadata address and NAT64 out.
    let mut everything = policy.clone();
    everything.allow = ["::/0", "0.0.0.0/0"]
        .iter()
        .map(|c| Allow {
            cidr: Cidr::parse(c).unwrap(),
            proto: None,
            port: None,
        })
        .collect();
    vms[1].update_policy(&everything, false).unwrap();
    let g = guests[1].0.as_str();
    assert_eq!(echo_from(g, at(SERVED[1], 8080)), Ok(()));
    let node_veth = v6(&vms[1]).host_ip.to_string();
    let other_vm = v6(&vms[0]).vm_ip.to_string();
    for (what, to) in [
        ("the node's own address", at("2001:db8:113::1", 22)),
        ("the node's end of the veth", at(&node_veth, 22)),
        ("the other VM", at(&other_vm, 8080)),
        ("the IPv6 metadata address", at(SERVED[2], 8080)),
        ("an IPv4 address through NAT64", at(SERVED[3], 8080)),
    ] {
        assert_eq!(
            echo_from(g, to),
            Err(std::io::ErrorKind::TimedOut),
            "{what} ({to}) must be dropped whatever the allowlist says"
        );
    }

    // The namespace routes for the guest and takes no configuration from
    // it: forwarding on, router advertisements and redirects ignored.
    let sysctl = |key: &str| {
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", &vms[0].netns, "sysctl", "-n", key])
            .output()
            .expect("sysctl runs");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(sysctl("net.ipv6.conf.all.forwarding"), "1");
    for key in [
        "net.ipv6.conf.tap0.accept_ra",
        "net.ipv6.conf.tap0.autoconf",
        "net.ipv6.conf.tap0.accept_redirects",
    ] {
        assert_eq!(sysctl(key), "0", "{key}");
    }

    // Nothing is left once the VMs' networks are removed.
    drop(guests);
    for vm in &vms {
        vm.remove();
        pool.release(&vm.slot);
    }
    assert!(list_namespaces("agentvm6-").is_empty());
    let veths = std::process::Command::new("ip")
        .args(["-n", &node.0, "-o", "link", "show"])
        .output()
        .unwrap();
    let veths = String::from_utf8_lossy(&veths.stdout);
    assert!(!veths.contains("avh"), "node-side veths left: {veths}");
}

/// host-agent on a node whose `network.pool` names an IPv6 block too: a
/// session's VM gets its /126 beside its /30 (in its namespace, its row's
/// addresses, GetSession and a `network_attached` event), its IPv6
/// allowlist is loaded, a live change reaches the ip6 table, and it all
/// goes at Stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_on_a_node_with_an_ipv6_pool_gets_ipv6() {
    use common::netns::PrefixCleanup;
    use common::networked::{
        build_net_image, can_run, namespaces, networked_agent, wait_no_namespaces,
    };
    use common::S;
    use proto::hostagent as pb;

    if !can_run() {
        return;
    }
    let tag = std::process::id();
    let prefix = format!("av6s{tag}-");
    let _cleanup = PrefixCleanup(prefix.clone());
    let (_node, _cfg, agent) = networked_agent(
        &format!("s6n{tag}"),
        &prefix,
        serde_json::json!(["10.206.0.0/29", "fd00:206::/112"]),
        &["0.0.0.0/0 tcp 443", "2001:db8::/32 tcp 443"],
        &[],
    );
    build_net_image(&agent).await;
    let s = agent.create("net", "").await;
    agent.wait_state(&s.session_id, S::Running).await;

    let ours = namespaces(&prefix);
    assert_eq!(ours.len(), 1, "{ours:?}");
    let show = |args: &[&str]| {
        let out = std::process::Command::new("ip")
            .args(["-n", &ours[0]])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let addrs = show(&["-6", "addr", "show"]);
    assert!(addrs.contains("inet6 fd00:206::2/126"), "{addrs}");
    assert!(addrs.contains("inet6 fd00:ac10::1/126"), "{addrs}");
    assert!(
        show(&["-6", "route", "show"]).contains("default via fd00:206::1"),
        "the namespace routes IPv6 to the node"
    );
    let ip6_set = |name: &str| {
        let out = std::process::Command::new("ip")
            .args([
                "netns", "exec", &ours[0], "nft", "list", "set", "ip6", "agentvm", name,
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(
        ip6_set("allow_port").contains("2001:db8::/32 . 443"),
        "the node's IPv6 allowlist is loaded: {}",
        ip6_set("allow_port")
    );

    // Reported: GetSession's network and an event with both addresses.
    let got = agent.get(&s.session_id).await;
    let net = got.network.expect("the session's network");
    assert_eq!(
        (net.vm_address.as_str(), net.vm_address6.as_str()),
        ("10.206.0.2", "fd00:206::2")
    );
    let events = agent.session_events(&s.session_id).await;
    let attached = events
        .iter()
        .find(|e| e.reason == "network_attached")
        .expect("a network_attached event");
    assert!(
        attached.detail.contains("10.206.0.2, fd00:206::2"),
        "{attached:?}"
    );

    // A live change reaches the ip6 table.
    let mut sessions = agent.sessions().await;
    sessions
        .update_session_network(pb::UpdateSessionNetworkRequest {
            session_id: s.session_id.clone(),
            allow: vec!["2001:db8:1::/48".into()],
            deny: vec![],
        })
        .await
        .expect("update the network");
    assert!(
        ip6_set("allow_any").contains("2001:db8:1::/48"),
        "{}",
        ip6_set("allow_any")
    );
    assert!(!ip6_set("allow_port").contains("2001:db8::/32"));

    agent.stop(&s.session_id).await;
    wait_no_namespaces(&prefix);
    drop(agent);
}
