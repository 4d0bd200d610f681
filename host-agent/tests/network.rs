//! VM networks made by `host_agent::network` on namespaces this test makes:
//! a "node" namespace stands for the host, an "internet" namespace behind
//! it holds the servers, and for each VM a "guest" namespace is joined where
//! the tap would be by a veth named `tap0` (the same layer-3 path a guest's
//! packets take through the tap; the rules match the interface by name).
//! Needs root, iproute2 and nftables; says so and skips without them.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

mod common;

use common::netns::{
    attach_guest, echo_from, echo_from_all, in_ns, ip, missing_tools as missing, node_and_internet,
    Cleanup, Ns,
};
use host_agent::network::addressing::{AddressPool, Cidr, GUEST_IP};
use host_agent::network::namespace::{list_namespaces, VmNetwork, NETNS_PREFIX};
use host_agent::network::node::{NodeNetwork, NodeSettings};
use host_agent::network::rules::{Allow, EgressPolicy, Proto};

#[test]
fn clones_share_a_guest_address_and_egress_is_enforced_on_the_host_side() {
    if let Some(why) = missing() {
        println!("skipped: {why}");
        return;
    }
    let tag = std::process::id();
    let pool_block = Cidr::parse("10.200.0.0/16").unwrap();
    let (node, inet) = node_and_internet(&tag.to_string(), pool_block, None);

    // Servers on the internet: an echo on two addresses, a UDP sink.
    let (ready_tx, ready_rx) = mpsc::channel();
    let (udp_tx, udp_rx) = mpsc::channel::<SocketAddr>();
    let _servers = in_ns(&inet.0, move || {
        for addr in ["203.0.113.3:8080", "203.0.113.4:8080"] {
            let l = TcpListener::bind(addr).expect("bind");
            std::thread::spawn(move || {
                for mut s in l.incoming().flatten() {
                    let mut b = [0u8; 1];
                    if s.read_exact(&mut b).is_ok() {
                        let _ = s.write_all(&b);
                    }
                }
            });
        }
        let u = UdpSocket::bind("203.0.113.3:5353").expect("bind udp");
        ready_tx.send(()).expect("ready");
        let mut buf = [0u8; 64];
        while let Ok((_, from)) = u.recv_from(&mut buf) {
            if udp_tx.send(from).is_err() {
                break;
            }
        }
    });
    ready_rx.recv().expect("servers up");

    let mut pool = AddressPool::new(pool_block, None).unwrap();
    let policy = EgressPolicy::new(
        vec![
            Allow {
                cidr: Cidr::parse("203.0.113.3").unwrap(),
                proto: Some(Proto::Tcp),
                port: Some(8080),
            },
            Allow {
                cidr: Cidr::parse("203.0.113.3").unwrap(),
                proto: Some(Proto::Udp),
                port: Some(5353),
            },
        ],
        &[Cidr::parse("203.0.113.1").unwrap()],
        &[pool_block],
        vec![],
    );
    let vms: Vec<VmNetwork> = ["a", "b"]
        .iter()
        .map(|s| {
            let vm = VmNetwork::plan(
                NETNS_PREFIX,
                &format!("t{tag}{s}"),
                pool.allocate().unwrap(),
                Some(node.0.clone()),
            );
            vm.create(&policy, None).expect("create the VM's network");
            vm
        })
        .collect();
    let _cleanup = Cleanup(vms.iter().map(|v| v.netns.clone()).collect());
    let guests: Vec<Ns> = vms
        .iter()
        .zip(["a", "b"])
        .map(|(vm, s)| attach_guest(&vm.netns, &format!("g{tag}{s}")))
        .collect();

    // Two clones with the same guest address reach the internet at once.
    let server: SocketAddr = "203.0.113.3:8080".parse().unwrap();
    for (i, got) in echo_from_all(&guests, server).into_iter().enumerate() {
        assert_eq!(got, Ok(()), "guest {i} reaches the allowed server");
    }

    // Denied: dropped on the host side (a timeout, never a refusal that
    // would show the packet got through).
    let g = guests[0].0.as_str();
    for (what, to) in [
        ("a server not in the allowlist", "203.0.113.4:8080"),
        ("an allowed address on another port", "203.0.113.3:9090"),
        ("the node's own address", "203.0.113.1:22"),
        ("the node's end of the veth", "10.200.0.1:22"),
        ("the other VM", "10.200.0.6:8080"),
        ("the metadata service", "169.254.169.254:80"),
    ] {
        assert_eq!(
            echo_from(g, to.parse().unwrap()),
            Err(std::io::ErrorKind::TimedOut),
            "{what} ({to}) must be dropped"
        );
    }

    // A guest forging its source address gets nothing through.
    ip(&["-n", g, "addr", "add", "192.0.2.77/32", "dev", "eth0"]);
    let sent = in_ns(g, || {
        let honest = UdpSocket::bind((GUEST_IP, 0)).unwrap();
        honest.send_to(b"honest", "203.0.113.3:5353").unwrap();
        let forged = UdpSocket::bind("192.0.2.77:0").unwrap();
        forged.send_to(b"forged", "203.0.113.3:5353").unwrap();
    });
    sent.join().unwrap();
    let first = udp_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the honest datagram");
    assert_eq!(
        first.ip().to_string(),
        "203.0.113.1",
        "masqueraded behind the node"
    );
    assert!(
        udp_rx.recv_timeout(Duration::from_secs(1)).is_err(),
        "the forged datagram must be dropped"
    );
    assert!(vms[0].denied_packets().unwrap() >= 7, "drops are counted");

    // Narrowing the allowlist of a live VM takes effect at once.
    let mut narrowed = policy.clone();
    narrowed.allow.retain(|a| a.proto == Some(Proto::Udp));
    vms[0].update_policy(&narrowed, false).unwrap();
    assert_eq!(echo_from(g, server), Err(std::io::ErrorKind::TimedOut));
    assert_eq!(
        echo_from(&guests[1].0, server),
        Ok(()),
        "the other VM keeps its policy"
    );

    // Even a policy that allows everything keeps the node, the other VMs
    // and the metadata service out.
    let mut everything = policy.clone();
    everything.allow = vec![Allow {
        cidr: Cidr::parse("0.0.0.0/0").unwrap(),
        proto: None,
        port: None,
    }];
    vms[1].update_policy(&everything, false).unwrap();
    let g = guests[1].0.as_str();
    assert_eq!(echo_from(g, "203.0.113.4:8080".parse().unwrap()), Ok(()));
    for (what, to) in [
        ("the node's own address", "203.0.113.1:22"),
        ("the node's end of the veth", "10.200.0.5:22"),
        ("the other VM", "10.200.0.2:8080"),
        ("the metadata service", "169.254.169.254:80"),
    ] {
        assert_eq!(
            echo_from(g, to.parse().unwrap()),
            Err(std::io::ErrorKind::TimedOut),
            "{what} ({to}) must be dropped whatever the allowlist says"
        );
    }

    // Nothing is left once the VMs' networks are removed.
    drop(guests);
    for vm in &vms {
        vm.remove();
        pool.release(&vm.slot);
    }
    let left: Vec<String> = list_namespaces(NETNS_PREFIX)
        .into_iter()
        .filter(|n| n.contains(&format!("t{tag}")))
        .collect();
    assert!(left.is_empty(), "namespaces left: {left:?}");
    let links = Command::new("ip")
        .args(["-n", &node.0, "-o", "link"])
        .output()
        .unwrap();
    let links = String::from_utf8_lossy(&links.stdout);
    assert!(!links.contains("avh"), "veths left on the node: {links}");
}

#[test]
fn the_node_hands_out_addresses_takes_vms_back_and_removes_orphans() {
    if let Some(why) = missing() {
        println!("skipped: {why}");
        return;
    }
    let tag = std::process::id();
    let node = Ns::new(format!("nn{tag}"));
    ip(&[
        "-n", &node.0, "link", "add", "d0", "type", "veth", "peer", "name", "d1",
    ]);
    ip(&["-n", &node.0, "addr", "add", "192.0.2.9/24", "dev", "d0"]);
    let prefix = format!("avt{tag}-");
    let settings = NodeSettings {
        pool: "10.202.0.0/29".into(),
        allow: vec!["203.0.113.3 tcp 8080".into()],
        node_netns: Some(node.0.clone()),
        netns_prefix: prefix.clone(),
        ..Default::default()
    };
    let net = NodeNetwork::start(&settings).unwrap();
    // The node's own address is denied to every VM; its rules are loaded.
    assert!(
        net.policy()
            .always_deny
            .contains(&Cidr::parse("192.0.2.9").unwrap()),
        "{:?}",
        net.policy()
    );
    let rules = Command::new("ip")
        .args([
            "netns",
            "exec",
            &node.0,
            "nft",
            "list",
            "table",
            "ip",
            "agentvm-node",
        ])
        .output()
        .unwrap();
    assert!(rules.status.success(), "the node's table is loaded");

    let _cleanup = Cleanup(
        ["a", "b", "c"]
            .iter()
            .map(|v| format!("{prefix}{v}"))
            .collect(),
    );
    let a = net
        .make("a", Some((65534, 65534)), &net.policy().allow)
        .unwrap();
    let b = net.make("b", None, &net.policy().allow).unwrap();
    assert_ne!(a.slot.vm_ip, b.slot.vm_ip);
    // The pool (a /29: two VMs) is used up, with an error that says so.
    let e = net
        .make("c", None, &net.policy().allow)
        .unwrap_err()
        .to_string();
    assert!(e.contains("used up"), "{e}");
    assert!(
        !Path::new(&format!("/run/netns/{prefix}c")).exists(),
        "a failed make leaves nothing"
    );

    // After a restart: VM a is found running, b is not: b's namespace goes.
    let restarted = NodeNetwork::start(&settings).unwrap();
    let a2 = restarted.adopt("a", a.slot.vm_ip).unwrap();
    assert_eq!(a2, a);
    let live: HashSet<String> = [a.netns.clone()].into();
    assert_eq!(restarted.remove_orphans(&live), 1);
    assert!(!Path::new(&format!("/run/netns/{}", b.netns)).exists());
    // b's addresses are free again; a's are not.
    let c = restarted
        .make("c", None, &restarted.policy().allow)
        .unwrap();
    assert_eq!(c.slot, b.slot);
    restarted.release(&a2);
    restarted.release(&c);
    assert!(list_namespaces(&prefix).is_empty());
}

/// A VM namespace removed on its own (an orphan after a restart) takes its
/// veth's node end with it only asynchronously: a new VM of the same slot
/// made right after finds that veth still there. Here it is left there on
/// purpose; the make replaces it.
#[test]
fn a_stale_veth_of_the_slot_is_replaced() {
    if let Some(why) = missing() {
        println!("skipped: {why}");
        return;
    }
    let tag = std::process::id();
    let node = Ns::new(format!("ns{tag}"));
    let prefix = format!("avs{tag}-");
    let _cleanup = Cleanup(vec![format!("{prefix}a")]);
    let settings = NodeSettings {
        pool: "10.213.0.0/29".into(),
        node_netns: Some(node.0.clone()),
        netns_prefix: prefix.clone(),
        ..Default::default()
    };
    let net = NodeNetwork::start(&settings).unwrap();
    // The first slot's veth name, held by a stale veth pair on the node.
    ip(&[
        "-n", &node.0, "link", "add", "avh0", "type", "veth", "peer", "name", "stale0",
    ]);
    let vm = net.make("a", None, &[]).expect("made over the stale veth");
    assert_eq!(vm.veth_host, "avh0");
    let links = Command::new("ip")
        .args(["-n", &node.0, "-o", "link", "show"])
        .output()
        .unwrap();
    let links = String::from_utf8_lossy(&links.stdout);
    assert!(!links.contains("stale0"), "the stale pair is gone: {links}");
    net.release(&vm);
    assert!(list_namespaces(&prefix).is_empty());
}

/// Benchmark (run with `--ignored`): making and removing one VM's network,
/// the time it adds to a CreateSession that makes it on the way.
#[test]
#[ignore]
fn bench_network_setup_and_teardown() {
    if let Some(why) = missing() {
        println!("skipped: {why}");
        return;
    }
    let tag = std::process::id();
    let node = Ns::new(format!("nb{tag}"));
    let mut pool = AddressPool::new(Cidr::parse("10.201.0.0/16").unwrap(), None).unwrap();
    let pool_block = pool.block();
    let policy = EgressPolicy::new(vec![], &[], &[pool_block], vec![]);
    let mut create = vec![];
    let mut remove = vec![];
    for i in 0..20 {
        let vm = VmNetwork::plan(
            NETNS_PREFIX,
            &format!("b{tag}x{i}"),
            pool.allocate().unwrap(),
            Some(node.0.clone()),
        );
        let t = std::time::Instant::now();
        vm.create(&policy, None).unwrap();
        create.push(t.elapsed().as_secs_f64() * 1000.0);
        let t = std::time::Instant::now();
        vm.remove();
        remove.push(t.elapsed().as_secs_f64() * 1000.0);
        pool.release(&vm.slot);
    }
    create.sort_by(f64::total_cmp);
    remove.sort_by(f64::total_cmp);
    println!(
        "VM network over 20 runs: create median {:.1} ms (min {:.1}), remove median {:.1} ms (min {:.1})",
        create[10], create[0], remove[10], remove[0]
    );
}

/// Rules the kernel takes from policies whose entries nest, repeat or
/// overlap in part: the sets are written without nft's auto-merge, so
/// host-agent must hand them elements that do not conflict.
#[test]
fn overlapping_policy_entries_load_at_create_and_on_update() {
    if let Some(why) = missing() {
        println!("skipped: {why}");
        return;
    }
    let tag = std::process::id();
    let node = Ns::new(format!("no{tag}"));
    let block = Cidr::parse("10.212.0.0/16").unwrap();
    let mut pool = AddressPool::new(block, None).unwrap();
    let allow = |cidr: &str, proto: Option<Proto>, port: Option<u16>| Allow {
        cidr: Cidr::parse(cidr).unwrap(),
        proto,
        port,
    };
    let entries = vec![
        allow("198.51.0.0/16", None, None),
        allow("198.51.100.0/24", None, None),
        allow("198.51.100.0/24", None, None),
        allow("10.0.0.0/8", Some(Proto::Tcp), Some(443)),
        allow("10.1.0.0/16", Some(Proto::Tcp), None),
        allow("10.1.0.0/16", None, Some(53)),
        allow("10.1.2.0/24", Some(Proto::Udp), Some(53)),
        allow("203.0.113.7", Some(Proto::Tcp), Some(22)),
        allow("203.0.113.7", Some(Proto::Tcp), Some(22)),
    ];
    // The node's addresses inside the pool, a deny block twice.
    let deny = [
        Cidr::parse("10.212.0.1").unwrap(),
        Cidr::parse("127.0.0.0/16").unwrap(),
    ];
    let mut policy = EgressPolicy::new(entries.clone(), &deny, &[block], vec![]);
    policy
        .always_deny
        .push(Cidr::parse("10.212.0.0/24").unwrap());
    let vm = VmNetwork::plan(
        NETNS_PREFIX,
        &format!("o{tag}"),
        pool.allocate().unwrap(),
        Some(node.0.clone()),
    );
    let _cleanup = Cleanup(vec![vm.netns.clone()]);
    vm.create(&policy, None).expect("the rules load");
    policy.allow.reverse();
    vm.update_policy(&policy, true).expect("the sets load");
    let out = Command::new("ip")
        .args([
            "netns", "exec", &vm.netns, "nft", "list", "table", "ip", "agentvm",
        ])
        .output()
        .unwrap();
    let rules = String::from_utf8_lossy(&out.stdout);
    assert!(
        rules.contains("198.51.0.0/16") && !rules.contains("198.51.100.0/24"),
        "{rules}"
    );
    assert!(rules.contains("tcp . 10.0.0.0/8 . 443"), "{rules}");
    vm.remove();
}
