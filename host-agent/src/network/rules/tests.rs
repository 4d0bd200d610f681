//! The rules' text for policies, slots and learned addresses.
use super::*;
use crate::network::addressing::Slot6;
use std::net::{Ipv4Addr, Ipv6Addr};

fn cidr(s: &str) -> Cidr {
    Cidr::parse(s).unwrap()
}

#[test]
fn address_sets_get_disjoint_blocks_and_port_sets_no_covered_entry() {
    let c = |t: &str| Cidr::parse(t).unwrap();
    assert_eq!(
        disjoint(&[
            c("2001:db8::/32"),
            c("10.1.0.0/16"),
            c("2001:db8:1::/48"),
            c("192.0.2.7"),
            c("10.0.0.0/8"),
            c("192.0.2.7"),
            c("10.1.2.0/24"),
            c("9.0.0.0/8"),
        ]),
        [
            c("9.0.0.0/8"),
            c("10.0.0.0/8"),
            c("192.0.2.7"),
            c("2001:db8::/32")
        ]
    );
    let allow = |cidr: &str, proto: Option<Proto>, port: Option<u16>| Allow {
        cidr: c(cidr),
        proto,
        port,
    };
    assert_eq!(
        port_elements(
            Family::V4,
            &[
                allow("2001:db8::/32", Some(Proto::Tcp), None),
                allow("10.0.0.0/8", Some(Proto::Tcp), None),
                allow("10.1.0.0/16", Some(Proto::Tcp), Some(443)),
                allow("10.1.0.0/16", None, Some(53)),
                allow("10.1.0.0/16", Some(Proto::Udp), Some(53)),
                allow("10.1.0.0/16", None, Some(53)),
            ]
        ),
        ["tcp . 10.0.0.0/8 . 0-65535", "udp . 10.1.0.0/16 . 53"]
    );
}

#[test]
fn a_policy_change_rewrites_the_sets_only() {
    let allow = vec![
        Allow {
            cidr: Cidr::parse("203.0.113.0/24").unwrap(),
            proto: None,
            port: None,
        },
        Allow {
            cidr: Cidr::parse("198.51.100.7").unwrap(),
            proto: Some(Proto::Tcp),
            port: Some(443),
        },
    ];
    let policy = EgressPolicy::new(
        allow,
        &[Cidr::parse("192.0.2.1").unwrap()],
        &[Cidr::parse("10.200.0.0/16").unwrap()],
        vec![],
    );
    let script = sets_script(&policy, true, false);
    for set in ["always_deny", "private_allowed", "allow_any", "allow_port"] {
        assert!(
            script.contains(&format!("flush set ip agentvm {set}\n")),
            "{set}: {script}"
        );
    }
    assert!(script.contains("add element ip agentvm allow_any { 203.0.113.0/24 }"));
    assert!(script.contains("tcp . 198.51.100.7/32 . 443"), "{script}");
    assert!(
        script.contains("0.0.0.0/8, 10.200.0.0/16, 127.0.0.0/8, 169.254.0.0/16, 192.0.2.1/32,"),
        "{script}"
    );
    assert!(script.contains("reset counter ip agentvm denied"));
    // Nothing else: no chain, no learned set, no table is touched.
    assert!(!script.contains("chain") && !script.contains("learned") && !script.contains("table"));
    assert!(!sets_script(&policy, false, false).contains("reset"));
    // With IPv6, the ip6 table's sets get the IPv6 blocks (and only them).
    let both = sets_script(&policy, true, true);
    assert!(
        both.contains("flush set ip6 agentvm allow_port\n"),
        "{both}"
    );
    assert!(both.contains("reset counter ip6 agentvm denied"), "{both}");
    let v6_deny = both
        .lines()
        .find(|l| l.starts_with("add element ip6 agentvm always_deny"))
        .unwrap();
    assert!(
        v6_deny.contains("fe80::/10") && !v6_deny.contains("10.200.0.0"),
        "{v6_deny}"
    );
    assert!(
        !both.contains("add element ip6 agentvm allow_any"),
        "{both}"
    );
}

#[test]
fn allow_entries_become_set_elements() {
    let allow = vec![
        Allow {
            cidr: cidr("203.0.113.0/24"),
            proto: None,
            port: None,
        },
        Allow {
            cidr: cidr("198.51.100.7"),
            proto: Some(Proto::Tcp),
            port: Some(443),
        },
        Allow {
            cidr: cidr("198.51.100.8"),
            proto: None,
            port: Some(53),
        },
        Allow {
            cidr: cidr("198.51.100.9"),
            proto: Some(Proto::Udp),
            port: None,
        },
    ];
    assert_eq!(
        port_elements(Family::V4, &allow),
        [
            "tcp . 198.51.100.7/32 . 443",
            "tcp . 198.51.100.8/32 . 53",
            "udp . 198.51.100.8/32 . 53",
            "udp . 198.51.100.9/32 . 0-65535",
        ]
    );
    let slot = Slot {
        index: 0,
        host_ip: Ipv4Addr::new(10, 200, 0, 1),
        vm_ip: Ipv4Addr::new(10, 200, 0, 2),
        v6: None,
    };
    let policy = EgressPolicy::new(
        allow,
        &[cidr("192.0.2.1")],
        &[cidr("10.200.0.0/16")],
        vec![],
    );
    let rules = vm_ruleset(&policy, &slot, "avv0");
    assert!(rules.contains("elements = { 203.0.113.0/24 }"), "{rules}");
    assert!(rules.contains("snat to 10.200.0.2"), "{rules}");
    assert!(
        rules.contains("169.254.0.0/16"),
        "the metadata range is always denied"
    );
    assert!(rules.contains("10.200.0.0/16, 127.0.0.0/8"), "{rules}");
    assert!(rules.contains("169.254.0.0/16, 192.0.2.1/32"), "{rules}");
    assert!(!rules.contains("auto-merge"), "{rules}");
    assert!(rules.contains("ip saddr != 172.16.0.2"), "anti-spoofing");
    assert!(
        rules.contains("iifname \"tap0\" arp saddr ip != 172.16.0.2 drop"),
        "ARP anti-spoofing"
    );
    // The learned sets are accepted after the deny checks, and the
    // guest reaches the gateway's port 53 and nothing else of it.
    let at = |what: &str| {
        rules
            .find(what)
            .unwrap_or_else(|| panic!("{what}: {rules}"))
    };
    assert!(at("@private ip daddr") < at("@learned_any accept"));
    assert!(at("@always_deny") < at("@learned_port accept"));
    assert!(rules.contains("ip daddr 172.16.0.1 meta l4proto { tcp, udp } th dport 53 accept"));
}

#[test]
fn learned_elements_replace_their_timeout() {
    let entries = [
        Learned {
            addr: Ipv4Addr::new(203, 0, 113, 5).into(),
            target: LearnedTarget::Port(Proto::Tcp, 443),
            ttl_secs: 60,
        },
        Learned {
            addr: Ipv4Addr::new(203, 0, 113, 6).into(),
            target: LearnedTarget::Any,
            ttl_secs: 0,
        },
    ];
    let s = learned_script(&entries);
    assert!(s.contains("add element ip agentvm learned_port { 203.0.113.5 . tcp . 443 }\ndelete element ip agentvm learned_port { 203.0.113.5 . tcp . 443 }\nadd element ip agentvm learned_port { 203.0.113.5 . tcp . 443 timeout 60s }"), "{s}");
    assert!(s.contains("learned_any { 203.0.113.6 timeout 1s }"), "{s}");
    let f = forget_script(&entries[..1]);
    assert!(
        f.ends_with("delete element ip agentvm learned_port { 203.0.113.5 . tcp . 443 }\n"),
        "{f}"
    );
}

#[test]
fn narrower_entries_are_covered_and_wider_ones_not() {
    let a = |c: &str, proto, port| Allow {
        cidr: cidr(c),
        proto,
        port,
    };
    let wide = a("203.0.113.0/24", None, None);
    let https = a("203.0.113.0/24", Some(Proto::Tcp), Some(443));
    assert!(wide.covers(&https));
    assert!(https.covers(&a("203.0.113.7", Some(Proto::Tcp), Some(443))));
    assert!(!https.covers(&wide));
    assert!(!https.covers(&a("203.0.113.7", Some(Proto::Udp), Some(443))));
    assert!(!https.covers(&a("203.0.113.7", Some(Proto::Tcp), None)));
    assert!(!wide.covers(&a("203.0.112.0/23", None, None)));
    assert!(!wide.covers(&a("198.51.100.1", None, None)));
    assert_eq!(https.to_string(), "203.0.113.0/24 tcp 443");
    assert_eq!(wide.to_string(), "203.0.113.0/24");
}

#[test]
fn the_node_masquerades_the_pool_and_keeps_vms_apart() {
    let r = node_ruleset(cidr("10.200.0.0/16"), None);
    assert!(r.contains("ip saddr 10.200.0.0/16 ip daddr 10.200.0.0/16 drop"));
    assert!(r.contains("masquerade"));
    assert!(r.contains("delete table ip6 agentvm-node\n"), "{r}");
    assert!(!r.contains("table ip6 agentvm-node {\n"), "{r}");
    let r = node_ruleset(cidr("10.200.0.0/16"), Some(cidr("fd00:200::/112")));
    assert!(
        r.contains("ip6 saddr fd00:200::/112 ip6 daddr fd00:200::/112 drop"),
        "{r}"
    );
    assert!(r.contains("ip6 saddr fd00:200::/112 ip6 daddr != fd00:200::/112 masquerade"));
}

#[test]
fn an_ipv6_slot_gets_a_forwarding_ip6_table_with_its_own_sets() {
    let allow = vec![
        Allow {
            cidr: cidr("2001:db8:1::/48"),
            proto: None,
            port: None,
        },
        Allow {
            cidr: cidr("2001:db8:2::7"),
            proto: Some(Proto::Tcp),
            port: Some(443),
        },
        Allow {
            cidr: cidr("203.0.113.0/24"),
            proto: None,
            port: None,
        },
    ];
    let policy = EgressPolicy::new(
        allow,
        &[cidr("192.0.2.1"), cidr("2001:db8:ffff::1")],
        &[cidr("10.200.0.0/16"), cidr("fd00:200::/112")],
        vec![],
    );
    let v6_slot = Slot {
        index: 0,
        host_ip: Ipv4Addr::new(10, 200, 0, 1),
        vm_ip: Ipv4Addr::new(10, 200, 0, 2),
        v6: Some(Slot6 {
            host_ip: Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, 1),
            vm_ip: Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, 2),
        }),
    };
    let rules = vm_ruleset(&policy, &v6_slot, "avv0");
    let v6 = &rules[rules.find("table ip6 agentvm {\n").unwrap()..rules.find("table arp").unwrap()];
    let v4 = &rules[..rules.find("table ip6").unwrap()];
    assert!(v6.contains("type ipv6_addr; flags interval"), "{v6}");
    assert!(v6.contains("elements = { 2001:db8:1::/48 }"), "{v6}");
    assert!(v6.contains("tcp . 2001:db8:2::7/128 . 443"), "{v6}");
    assert!(
        !v6.contains("203.0.113.0/24") && !v4.contains("2001:db8"),
        "{rules}"
    );
    assert!(
        v6.contains("ip6 saddr != fd00:ac10::2 counter name denied drop"),
        "{v6}"
    );
    assert!(v6.contains("snat to fd00:200::2"), "{v6}");
    // Always denied: the metadata address, link-local, NAT64, the node
    // and the pool; unique-local is private.
    for deny in [
        "fd00:ec2::254/128",
        "fe80::/10",
        "64:ff9b::/96",
        "2001:db8:ffff::1/128",
        "fd00:200::/112",
    ] {
        assert!(v6.contains(deny), "{deny}: {v6}");
    }
    assert!(v6.contains("elements = { fc00::/7 }"), "{v6}");
    // Neighbour discovery only, and from the link itself.
    assert!(
        v6.contains(
            "ip6 hoplimit 255 icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } accept"
        ),
        "{v6}"
    );
    assert!(!v6.contains("nd-router-advert"), "{v6}");
    // Without an IPv6 slot the ip6 table forwards nothing.
    let v4_only = vm_ruleset(
        &policy,
        &Slot {
            v6: None,
            ..v6_slot
        },
        "avv0",
    );
    let ip6 = &v4_only[v4_only.find("table ip6 agentvm {\n").unwrap()..];
    assert!(!ip6.contains("ct state") && !ip6.contains("snat"), "{ip6}");
    assert!(
        ip6.contains("policy drop") && ip6.contains("set learned_any"),
        "{ip6}"
    );
    // Learned IPv6 addresses go to the ip6 table.
    let s = learned_script(&[Learned {
        addr: "2001:db8:2::9".parse().unwrap(),
        target: LearnedTarget::Any,
        ttl_secs: 30,
    }]);
    assert!(
        s.ends_with("add element ip6 agentvm learned_any { 2001:db8:2::9 timeout 30s }\n"),
        "{s}"
    );
    assert!(flush_learned_script().contains("flush set ip6 agentvm learned_port"));
    assert!(flush_learned_script().contains("flush set ip agentvm learned_any"));
}

#[test]
fn untracked_guest_tcp_is_reset_in_forward_and_input_of_both_families() {
    let policy = EgressPolicy::new(vec![], &[], &[cidr("10.200.0.0/16")], vec![]);
    let slot = Slot {
        index: 0,
        host_ip: Ipv4Addr::new(10, 200, 0, 1),
        vm_ip: Ipv4Addr::new(10, 200, 0, 2),
        v6: Some(Slot6 {
            host_ip: Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, 1),
            vm_ip: Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, 2),
        }),
    };
    let rules = vm_ruleset(&policy, &slot, "avv0");
    let v4 = &rules[..rules.find("table ip6").unwrap()];
    let v6 = &rules[rules.find("table ip6 agentvm {\n").unwrap()..rules.find("table arp").unwrap()];
    for (table, t, guest) in [(v4, "ip", "172.16.0.2"), (v6, "ip6", "fd00:ac10::2")] {
        assert!(table.contains("counter untracked {}"), "{table}");
        let new_not_syn = format!(
            "iifname \"tap0\" {t} saddr {guest} ct state new tcp flags & (fin | syn | rst | ack) != syn counter name untracked reject with tcp reset"
        );
        let invalid = format!(
            "iifname \"tap0\" {t} saddr {guest} meta l4proto tcp ct state invalid counter name untracked reject with tcp reset"
        );
        let forward =
            &table[table.find("chain forward").unwrap()..table.find("chain input").unwrap()];
        let input =
            &table[table.find("chain input").unwrap()..table.find("chain postrouting").unwrap()];
        for chain in [forward, input] {
            let at = |what: &str| {
                chain
                    .find(what)
                    .unwrap_or_else(|| panic!("{what}: {chain}"))
            };
            // After the connections conntrack knows, before anything that
            // accepts a new one.
            assert!(at("ct state established,related accept") < at(&new_not_syn));
            assert!(at(&new_not_syn) < at(&invalid));
            let accepts: Vec<usize> = chain.match_indices(" accept").map(|(i, _)| i).collect();
            // Only the established and loopback accepts come before.
            let before = accepts.iter().filter(|&&i| i < at(&new_not_syn)).count();
            assert!(before <= 2, "{chain}");
            assert!(accepts.iter().any(|&i| i > at(&invalid)), "{chain}");
        }
        // Forged sources are dropped before: no reset goes to an address
        // the guest made up.
        assert!(
            forward.find(&format!("{t} saddr != {guest}")).unwrap()
                < forward.find(&new_not_syn).unwrap(),
            "{forward}"
        );
        assert!(
            forward.find(&new_not_syn).unwrap() < forward.find("@always_deny").unwrap(),
            "{forward}"
        );
        assert!(
            input.find(&invalid).unwrap()
                < input
                    .find("iifname \"tap0\" counter name denied drop")
                    .unwrap(),
            "{input}"
        );
    }
    // Without an IPv6 slot the ip6 table forwards nothing: nothing to reset.
    let v4_only = vm_ruleset(&policy, &Slot { v6: None, ..slot }, "avv0");
    let ip6 = &v4_only[v4_only.find("table ip6 agentvm {\n").unwrap()..];
    assert!(!ip6.contains("reject"), "{ip6}");
}
