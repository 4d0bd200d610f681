//! The per-session DNS resolver (`host_agent::network::dns`) in a VM's
//! network namespace made by `host_agent::network`, on namespaces this test
//! makes as `tests/network.rs` does: a "node" namespace, an "internet"
//! namespace behind it with TCP echo servers, and a "guest" namespace
//! joined to the VM's namespace by a veth named `tap0`.
//!
//! The upstream resolver is a small DNS server (hickory-proto messages)
//! on 127.0.0.1 of this test's own namespace: the resolver asks upstreams
//! from host-agent's namespace, which is this process's. It answers with
//! addresses of the internet namespace and counts the queries it receives.
//! Needs root, iproute2 and nftables; says so and skips without them.

use std::collections::HashMap;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, CNAME};
use hickory_proto::rr::{Name, RData, Record, RecordType};

mod common;

use common::netns::{
    ask_udp, attach_guest, echo_from, echo_servers, in_ns, missing_tools as missing,
    node_and_internet, query_bytes, Cleanup,
};
use host_agent::network::addressing::{AddressPool, Cidr, GATEWAY_IP};
use host_agent::network::dns::{DnsConfig, DnsResolver, NameRule};
use host_agent::network::namespace::{apply_rules, VmNetwork, NETNS_PREFIX};
use host_agent::network::rules::{Allow, EgressPolicy, Proto};

/// Queries received, by lowercase name.
type Seen = Arc<Mutex<HashMap<String, u32>>>;

/// The upstream: A records for a few names (and an AAAA record for
/// `allowed.test`), NXDOMAIN for the rest.
fn upstream_server() -> (SocketAddr, Seen) {
    let sock = UdpSocket::bind("127.0.0.1:0").expect("bind the upstream");
    let addr = sock.local_addr().unwrap();
    let seen: Seen = Arc::default();
    let counts = seen.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok((n, from)) = sock.recv_from(&mut buf) {
            let Ok(q) = Message::from_vec(&buf[..n]) else {
                continue;
            };
            let Some(query) = q.queries().first().cloned() else {
                continue;
            };
            let asked = query.name().to_ascii().to_lowercase();
            *counts.lock().unwrap().entry(asked.clone()).or_default() += 1;
            let a = |name: &str, ip: [u8; 4]| {
                Record::from_rdata(
                    Name::from_ascii(name).unwrap(),
                    60,
                    RData::A(A(Ipv4Addr::from(ip))),
                )
            };
            let answers = match asked.as_str() {
                "allowed.test." if query.query_type() == RecordType::AAAA => {
                    vec![Record::from_rdata(
                        Name::from_ascii("allowed.test.").unwrap(),
                        60,
                        RData::AAAA(AAAA("2001:db8:113::3".parse::<Ipv6Addr>().unwrap())),
                    )]
                }
                "allowed.test." => vec![a("allowed.test.", [203, 0, 113, 3])],
                "second.test." => vec![a("second.test.", [203, 0, 113, 4])],
                "alias.test." => vec![
                    Record::from_rdata(
                        Name::from_ascii("alias.test.").unwrap(),
                        60,
                        RData::CNAME(CNAME(Name::from_ascii("edge.test.").unwrap())),
                    ),
                    a("edge.test.", [203, 0, 113, 5]),
                ],
                "outside.test." => vec![a("outside.test.", [198, 51, 100, 9])],
                _ => vec![],
            };
            let mut r = Message::new();
            r.set_id(q.id())
                .set_message_type(MessageType::Response)
                .set_recursion_desired(true)
                .set_recursion_available(true)
                .add_query(query)
                .add_answers(answers.clone());
            if answers.is_empty() {
                r.set_response_code(ResponseCode::NXDomain);
            }
            let _ = sock.send_to(&r.to_vec().unwrap(), from);
        }
    });
    (addr, seen)
}

/// Asks the resolver from the guest over TCP.
fn ask_tcp(guest: &str, name: &str) -> Message {
    use std::io::{Read, Write};
    let q = query_bytes(0x4321, name, RecordType::A);
    in_ns(guest, move || {
        let mut s =
            TcpStream::connect_timeout(&SocketAddr::from((GATEWAY_IP, 53)), Duration::from_secs(5))
                .expect("TCP to the resolver");
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut out = (q.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(&q);
        s.write_all(&out).unwrap();
        let mut len = [0u8; 2];
        s.read_exact(&mut len).unwrap();
        let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
        s.read_exact(&mut msg).unwrap();
        Message::from_vec(&msg).unwrap()
    })
    .join()
    .unwrap()
}

fn addresses(m: &Message) -> Vec<Ipv4Addr> {
    m.answers()
        .iter()
        .filter_map(|r| match r.data() {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect()
}

fn learned_sets(netns: &str) -> String {
    learned_sets_of(netns, "ip")
}

fn learned_sets_of(netns: &str, family: &str) -> String {
    let out = Command::new("ip")
        .args([
            "netns", "exec", netns, "nft", "list", "table", family, "agentvm",
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn rule(name: &str, ports: &[u16]) -> NameRule {
    NameRule {
        name: name.into(),
        ports: ports.to_vec(),
    }
}

#[test]
fn the_resolver_answers_allowed_names_and_opens_their_addresses_only() {
    if let Some(why) = missing() {
        println!("skipped: {why}");
        return;
    }
    let tag = std::process::id();
    let pool_block = Cidr::parse("10.203.0.0/16").unwrap();
    let (node, inet) = node_and_internet(&format!("d{tag}"), pool_block, None);
    echo_servers(
        &inet.0,
        &["203.0.113.3:8080", "203.0.113.4:8080", "203.0.113.5:8080"],
    );

    // The session's own allowlist is empty: only what the resolver learns
    // opens anything.
    let mut pool = AddressPool::new(pool_block, None).unwrap();
    let policy = EgressPolicy::new(
        vec![],
        &[Cidr::parse("203.0.113.1").unwrap()],
        &[pool_block],
        vec![],
    );
    let vm = VmNetwork::plan(
        NETNS_PREFIX,
        &format!("dns{tag}"),
        pool.allocate().unwrap(),
        Some(node.0.clone()),
    );
    vm.create(&policy, None).expect("create the VM's network");
    let _cleanup = Cleanup(vec![vm.netns.clone()]);
    let guest = attach_guest(&vm.netns, &format!("dg{tag}"));
    let g = guest.0.as_str();

    let (upstream, seen) = upstream_server();
    let count = |name: &str| seen.lock().unwrap().get(name).copied().unwrap_or(0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ceiling = vec![Allow {
        cidr: Cidr::parse("203.0.113.0/24").unwrap(),
        proto: Some(Proto::Tcp),
        port: None,
    }];
    let names = vec![
        rule("allowed.test", &[8080]),
        rule("second.test", &[8080]),
        rule("alias.test", &[8080]),
        rule("outside.test", &[8080]),
    ];
    let config = DnsConfig::new(vm.netns.clone(), names, vec![upstream], ceiling);
    let mut dns = rt
        .block_on(DnsResolver::start(config))
        .expect("start the resolver");
    let mut events = dns.take_denied_events().expect("the events, once");
    assert!(dns.take_denied_events().is_none());

    // Before any query the address is not in the allowlist.
    let server: SocketAddr = "203.0.113.3:8080".parse().unwrap();
    assert_eq!(echo_from(g, server), Err(std::io::ErrorKind::TimedOut));

    // An allowed name: the upstream's answer, and the address opens.
    let m = ask_udp(g, "Allowed.Test", RecordType::A).expect("an answer");
    assert_eq!(m.response_code(), ResponseCode::NoError);
    assert_eq!(addresses(&m), [Ipv4Addr::new(203, 0, 113, 3)]);
    assert_eq!(echo_from(g, server), Ok(()));
    let sets = learned_sets(&vm.netns);
    assert!(
        sets.contains("203.0.113.3 . tcp . 8080 timeout 1m"),
        "{sets}"
    );
    assert!(
        !sets.contains("203.0.113.3 . udp"),
        "the ceiling allows TCP only: {sets}"
    );
    // Only the port the name's rule names.
    assert_eq!(
        echo_from(g, "203.0.113.3:8081".parse().unwrap()),
        Err(std::io::ErrorKind::TimedOut)
    );

    // A CNAME chain: the address at its end opens.
    let m = ask_udp(g, "alias.test", RecordType::A).expect("an answer");
    assert_eq!(addresses(&m), [Ipv4Addr::new(203, 0, 113, 5)]);
    assert_eq!(echo_from(g, "203.0.113.5:8080".parse().unwrap()), Ok(()));

    // An address outside the node's ceiling is answered but never opened.
    let m = ask_udp(g, "outside.test", RecordType::A).expect("an answer");
    assert_eq!(addresses(&m), [Ipv4Addr::new(198, 51, 100, 9)]);
    assert!(!learned_sets(&vm.netns).contains("198.51.100.9"));

    // A name not allowed: NXDOMAIN, upstream never asked, reported.
    let m = ask_udp(g, "denied.test", RecordType::A).expect("an answer");
    assert_eq!(m.response_code(), ResponseCode::NXDomain);
    assert_eq!(count("denied.test."), 0, "the upstream saw no query for it");
    let event = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(10), events.recv()).await })
        .expect("the denied event arrives")
        .expect("the channel is open");
    assert_eq!(
        (event.name.as_str(), event.qtype.as_str()),
        ("denied.test", "A")
    );
    // AAAA of an allowed name: no records, nothing asked upstream.
    let before = count("allowed.test.");
    let m = ask_udp(g, "allowed.test", RecordType::AAAA).expect("an answer");
    assert_eq!(m.response_code(), ResponseCode::NoError);
    assert!(m.answers().is_empty());
    assert_eq!(count("allowed.test."), before);

    // Over TCP.
    let m = ask_tcp(g, "second.test");
    assert_eq!(addresses(&m), [Ipv4Addr::new(203, 0, 113, 4)]);
    assert_eq!(echo_from(g, "203.0.113.4:8080".parse().unwrap()), Ok(()));

    // A flood of garbage does not stop it answering.
    in_ns(g, || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        let mut state = 0x2545_f491_u32;
        for i in 0..5000usize {
            let len = [0, 1, 2, 12, 13, 100, 512, 4000, 9000][i % 9];
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    state as u8
                })
                .collect();
            let _ = s.send_to(&bytes, (GATEWAY_IP, 53));
        }
    })
    .join()
    .unwrap();
    // The flood may still fill the resolver's socket buffer when the query
    // is sent, and the kernel then drops it: ask again, as a stub resolver
    // retransmits over UDP.
    let m = (0..5)
        .find_map(|_| ask_udp(g, "allowed.test", RecordType::A))
        .expect("still answering");
    assert_eq!(addresses(&m), [Ipv4Addr::new(203, 0, 113, 3)]);
    let stats = dns.stats();
    assert!(stats.malformed > 0, "{stats:?}");
    assert!(stats.answered >= 5 && stats.denied >= 1, "{stats:?}");

    // Narrowing: the removed name gets NXDOMAIN without asking upstream,
    // and what it opened closes; the remaining name's address stays open.
    rt.block_on(dns.set_names(vec![rule("second.test", &[8080])]))
        .expect("narrow the names");
    let before = count("allowed.test.");
    let m = ask_udp(g, "allowed.test", RecordType::A).expect("an answer");
    assert_eq!(m.response_code(), ResponseCode::NXDomain);
    assert_eq!(count("allowed.test."), before);
    assert_eq!(echo_from(g, server), Err(std::io::ErrorKind::TimedOut));
    assert_eq!(echo_from(g, "203.0.113.4:8080".parse().unwrap()), Ok(()));

    // A policy change (the sets) keeps what was learned.
    vm.update_policy(&policy, true).unwrap();
    assert_eq!(echo_from(g, "203.0.113.4:8080".parse().unwrap()), Ok(()));
    // Rewriting the whole ruleset empties the learned sets; restoring puts
    // back what has not expired.
    apply_rules(
        Some(&vm.netns),
        &host_agent::network::rules::vm_ruleset(&policy, &vm.slot, &vm.veth_vm),
    )
    .unwrap();
    assert_eq!(
        echo_from(g, "203.0.113.4:8080".parse().unwrap()),
        Err(std::io::ErrorKind::TimedOut)
    );
    rt.block_on(dns.restore_learned()).unwrap();
    assert_eq!(echo_from(g, "203.0.113.4:8080".parse().unwrap()), Ok(()));

    // Stopped: the sockets are closed, another resolver can bind.
    rt.block_on(dns.stop());
    let again = DnsConfig::new(vm.netns.clone(), vec![], vec![upstream], vec![]);
    let again = rt
        .block_on(DnsResolver::start(again))
        .expect("the port is free again");
    drop(again);

    drop(guest);
    vm.remove();
}

#[test]
fn with_ipv6_aaaa_answers_open_their_ipv6_addresses() {
    if let Some(why) = missing() {
        println!("skipped: {why}");
        return;
    }
    let tag = std::process::id();
    let pool_block = Cidr::parse("10.205.0.0/16").unwrap();
    let pool6 = Cidr::parse("fd00:205::/112").unwrap();
    let (node, inet) = node_and_internet(&format!("d6{tag}"), pool_block, Some(pool6));
    echo_servers(&inet.0, &["[2001:db8:113::3]:8080"]);
    let mut pool = AddressPool::new(pool_block, Some(pool6)).unwrap();
    let policy = EgressPolicy::new(
        vec![],
        &[Cidr::parse("203.0.113.1").unwrap()],
        &[pool_block, pool6],
        vec![],
    );
    let vm = VmNetwork::plan(
        "agentvm6d-",
        &format!("dns{tag}"),
        pool.allocate().unwrap(),
        Some(node.0.clone()),
    );
    vm.create(&policy, None).expect("create the VM's network");
    let _cleanup = Cleanup(vec![vm.netns.clone()]);
    let guest = attach_guest(&vm.netns, &format!("d6g{tag}"));
    let g = guest.0.as_str();

    let (upstream, _seen) = upstream_server();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ceiling = vec![Allow {
        cidr: Cidr::parse("2001:db8::/32").unwrap(),
        proto: Some(Proto::Tcp),
        port: None,
    }];
    let mut config = DnsConfig::new(
        vm.netns.clone(),
        vec![rule("allowed.test", &[8080])],
        vec![upstream],
        ceiling,
    );
    config.ipv6 = true;
    let dns = rt
        .block_on(DnsResolver::start(config))
        .expect("start the resolver");

    let server: SocketAddr = "[2001:db8:113::3]:8080".parse().unwrap();
    assert_eq!(echo_from(g, server), Err(std::io::ErrorKind::TimedOut));
    let m = ask_udp(g, "allowed.test", RecordType::AAAA).expect("an answer");
    let six: Vec<Ipv6Addr> = m
        .answers()
        .iter()
        .filter_map(|r| match r.data() {
            RData::AAAA(a) => Some(a.0),
            _ => None,
        })
        .collect();
    assert_eq!(six, ["2001:db8:113::3".parse::<Ipv6Addr>().unwrap()]);
    assert_eq!(echo_from(g, server), Ok(()), "the AAAA answer opened it");
    let sets = learned_sets_of(&vm.netns, "ip6");
    assert!(
        sets.contains("2001:db8:113::3 . tcp . 8080 timeout 1m"),
        "{sets}"
    );
    // The A answer is outside this IPv6-only ceiling: answered, not opened.
    let m = ask_udp(g, "allowed.test", RecordType::A).expect("an answer");
    assert_eq!(addresses(&m), [Ipv4Addr::new(203, 0, 113, 3)]);
    assert!(!learned_sets(&vm.netns).contains("203.0.113.3"));
    rt.block_on(dns.stop());
    drop(guest);
    vm.remove();
}
