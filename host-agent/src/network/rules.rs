//! The nftables rules of a VM's network namespace: egress from the guest is
//! denied unless the session's allowlist names it, checked where the guest
//! cannot reach (its own root can flush the guest's rules, not these).
//!
//! Order of the forward chain, first match wins:
//! 1. replies of connections already allowed pass;
//! 2. anything from the tap not sourced at [`GUEST_IP`] is dropped (a
//!    guest forging addresses);
//! 3. [`EgressPolicy::always_deny`] (link-local with the cloud metadata
//!    address, loopback, the node's own addresses, the VM pool: other VMs)
//!    is dropped whatever the allowlist says;
//! 4. private ranges are dropped unless the node's policy names them;
//! 5. the allowlist: whole destinations, or protocol, destination and port;
//!    then what the session's DNS resolver learned (the addresses allowed
//!    names resolved to, [`LEARNED_ANY`] and [`LEARNED_PORT`], each element
//!    expiring with its record's TTL);
//! 6. everything else is dropped.
//!
//! The input chain lets the guest reach nothing of the namespace but the
//! resolver: UDP and TCP port 53 at [`GATEWAY_IP`].
//!
//! Drops are counted in the table's `denied` counter, never logged per packet.
//! IPv6 is not forwarded at all (the guest link is IPv4-only). ARP from the
//! tap is believed only for the guest's own address (table `arp agentvm`):
//! a guest cannot put the node's or anyone else's address in the
//! namespace's neighbour table.

use std::fmt::Write as _;

use std::net::Ipv4Addr;

use super::addressing::{Cidr4, Slot, GATEWAY_IP, GUEST_IP, TAP_NAME};

/// Name of the table in every VM namespace.
pub const TABLE: &str = "agentvm";
/// Name of the counter of dropped guest packets in that table.
pub const DENIED_COUNTER: &str = "denied";
/// Set of whole addresses the DNS resolver learned (`ipv4_addr`, timeouts).
pub const LEARNED_ANY: &str = "learned_any";
/// Set of `address . protocol . port` the DNS resolver learned (timeouts).
pub const LEARNED_PORT: &str = "learned_port";

/// A transport protocol of an allow rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proto {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl Proto {
    fn name(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// One allowed destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Allow {
    /// Destination block.
    pub cidr: Cidr4,
    /// Protocol (`None`: TCP and UDP, or any protocol when `port` is `None` too).
    pub proto: Option<Proto>,
    /// Destination port (`None`: every port).
    pub port: Option<u16>,
}

impl Allow {
    /// Whether everything `other` allows is allowed by `self` too.
    pub fn covers(&self, other: &Allow) -> bool {
        self.cidr.prefix <= other.cidr.prefix
            && self.cidr.contains(other.cidr.addr)
            && (self.proto.is_none() || self.proto == other.proto)
            && (self.port.is_none() || self.port == other.port)
    }
}

impl std::fmt::Display for Allow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.cidr)?;
        if let Some(p) = self.proto {
            write!(f, " {}", p.name())?;
        }
        if let Some(port) = self.port {
            if self.proto.is_none() {
                // `CIDR PORT` is not an entry: a port needs its protocol.
                return write!(f, " tcp {port}");
            }
            write!(f, " {port}")?;
        }
        Ok(())
    }
}

/// Private ranges: denied unless the node's policy names them.
pub const PRIVATE: &[&str] = &[
    "10.0.0.0/8",
    "100.64.0.0/10",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "198.18.0.0/15",
];

/// Denied whatever any policy says: "this network", loopback, link-local
/// (the metadata service at 169.254.169.254), multicast and reserved.
pub const ALWAYS_DENIED: &[&str] = &[
    "0.0.0.0/8",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "224.0.0.0/4",
    "240.0.0.0/4",
];

/// What a VM's guest may reach.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressPolicy {
    /// The session's allowlist.
    pub allow: Vec<Allow>,
    /// Dropped first: [`ALWAYS_DENIED`], the node's addresses, the VM pool.
    pub always_deny: Vec<Cidr4>,
    /// Private ranges the node's policy lets allowlists name.
    pub private_allowed: Vec<Cidr4>,
}

impl EgressPolicy {
    /// A policy allowing `allow`, denying the fixed ranges plus the node's
    /// own `node_addresses` and its VM `pool`.
    pub fn new(
        allow: Vec<Allow>,
        node_addresses: &[Cidr4],
        pool: Cidr4,
        private_allowed: Vec<Cidr4>,
    ) -> Self {
        let mut always_deny: Vec<Cidr4> = ALWAYS_DENIED
            .iter()
            .filter_map(|c| Cidr4::parse(c).ok())
            .collect();
        always_deny.extend_from_slice(node_addresses);
        always_deny.push(pool);
        Self {
            allow,
            always_deny,
            private_allowed,
        }
    }
}

/// `cidrs` without duplicates and without blocks another one holds, in
/// address order: elements an interval set takes as they are. Two blocks
/// either nest or do not meet, so what is left is disjoint.
///
/// The sets are written without nft's `auto-merge`, which makes nft read
/// the set back from the kernel on every change: adding one block to a
/// small table's set took 18-20 ms a run with it and 4-5 ms without
/// (`nft -f` from a shell on the development machine), so the merging is
/// done here.
fn disjoint(cidrs: &[Cidr4]) -> Vec<Cidr4> {
    let mut sorted = cidrs.to_vec();
    // Larger blocks first at an address, so the blocks they hold follow.
    sorted.sort_by_key(|c| (u32::from(c.addr), c.prefix));
    sorted.dedup();
    let mut out: Vec<Cidr4> = Vec::with_capacity(sorted.len());
    for c in sorted {
        if !out
            .iter()
            .any(|o| o.prefix <= c.prefix && o.contains(c.addr))
        {
            out.push(c);
        }
    }
    out
}

/// The elements of the address set of `cidrs` (see [`disjoint`]).
fn addr_elements(cidrs: &[Cidr4]) -> Vec<String> {
    disjoint(cidrs).iter().map(Cidr4::to_string).collect()
}

/// Writes an interval set of addresses; a policy may name a block twice.
fn addr_set(out: &mut String, name: &str, cidrs: &[Cidr4]) {
    let _ = writeln!(out, "  set {name} {{\n    type ipv4_addr; flags interval");
    let list = addr_elements(cidrs);
    if !list.is_empty() {
        let _ = writeln!(out, "    elements = {{ {} }}", list.join(", "));
    }
    let _ = writeln!(out, "  }}");
}

/// The allowlist entries with a protocol or a port, as
/// `proto . block . ports` elements (an entry without a protocol becomes a
/// TCP and a UDP one). An element another one holds is left out: without
/// `auto-merge` (see [`disjoint`]) the set refuses one inside another.
fn port_elements(allow: &[Allow]) -> Vec<String> {
    let mut each: Vec<Allow> = Vec::new();
    for a in allow {
        let protos = match (a.proto, a.port) {
            (None, None) => continue,
            (Some(p), _) => vec![p],
            (None, Some(_)) => vec![Proto::Tcp, Proto::Udp],
        };
        each.extend(protos.into_iter().map(|p| Allow {
            proto: Some(p),
            ..*a
        }));
    }
    let mut out = Vec::new();
    for (i, a) in each.iter().enumerate() {
        let held = each
            .iter()
            .enumerate()
            .any(|(j, o)| j != i && o.covers(a) && (o != a || j < i));
        if held {
            continue;
        }
        let ports = match a.port {
            Some(p) => p.to_string(),
            None => "0-65535".to_string(),
        };
        if let Some(p) = a.proto {
            out.push(format!("{} . {} . {ports}", p.name(), a.cidr));
        }
    }
    out
}

/// The whole ruleset for the namespace of the VM at `slot`, whose end of
/// the veth pair is `veth`: replaces any earlier version atomically.
pub fn vm_ruleset(policy: &EgressPolicy, slot: &Slot, veth: &str) -> String {
    let mut out = String::new();
    // Declare, then delete, then write: one atomic transaction that works
    // whether or not the table exists yet.
    let _ = writeln!(out, "table ip {TABLE} {{}}\ndelete table ip {TABLE}");
    let _ = writeln!(out, "table ip {TABLE} {{");
    addr_set(&mut out, "always_deny", &policy.always_deny);
    let private: Vec<Cidr4> = PRIVATE
        .iter()
        .filter_map(|c| Cidr4::parse(c).ok())
        .collect();
    addr_set(&mut out, "private", &private);
    addr_set(&mut out, "private_allowed", &policy.private_allowed);
    let whole: Vec<Cidr4> = policy
        .allow
        .iter()
        .filter(|a| a.proto.is_none() && a.port.is_none())
        .map(|a| a.cidr)
        .collect();
    addr_set(&mut out, "allow_any", &whole);
    let _ = writeln!(
        out,
        "  set allow_port {{\n    type inet_proto . ipv4_addr . inet_service; flags interval"
    );
    let elements = port_elements(&policy.allow);
    if !elements.is_empty() {
        let _ = writeln!(out, "    elements = {{ {} }}", elements.join(", "));
    }
    let _ = writeln!(out, "  }}");
    let _ = writeln!(
        out,
        "  set {LEARNED_ANY} {{\n    type ipv4_addr; flags timeout\n  }}\n  set {LEARNED_PORT} {{\n    type ipv4_addr . inet_proto . inet_service; flags timeout\n  }}"
    );
    let _ = writeln!(out, "  counter {DENIED_COUNTER} {{}}");
    let tap = TAP_NAME;
    let _ = write!(
        out,
        r#"  chain forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "{tap}" ip saddr != {GUEST_IP} counter name {DENIED_COUNTER} drop
    iifname "{tap}" ip daddr @always_deny counter name {DENIED_COUNTER} drop
    iifname "{tap}" ip daddr @private ip daddr != @private_allowed counter name {DENIED_COUNTER} drop
    iifname "{tap}" ip daddr @allow_any accept
    iifname "{tap}" meta l4proto . ip daddr . th dport @allow_port accept
    iifname "{tap}" ip daddr @{LEARNED_ANY} accept
    iifname "{tap}" ip daddr . meta l4proto . th dport @{LEARNED_PORT} accept
    iifname "{tap}" counter name {DENIED_COUNTER} drop
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    ct state established,related accept
    iifname "lo" accept
    iifname "{tap}" ip saddr {GUEST_IP} ip daddr {GATEWAY_IP} meta l4proto {{ tcp, udp }} th dport 53 accept
    iifname "{tap}" counter name {DENIED_COUNTER} drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat;
    oifname "{veth}" ip saddr {GUEST_IP} snat to {vm_ip}
  }}
}}
table ip6 {TABLE} {{}}
delete table ip6 {TABLE}
table ip6 {TABLE} {{
  chain forward {{
    type filter hook forward priority filter; policy drop;
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    iifname "lo" accept
  }}
}}
table arp {TABLE} {{}}
delete table arp {TABLE}
table arp {TABLE} {{
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{tap}" arp saddr ip != {GUEST_IP} drop
  }}
}}
"#,
        vm_ip = slot.vm_ip
    );
    out
}

/// The script that gives the namespace's table the sets of `policy` (deny
/// blocks, private ranges allowed, the allowlist) in one transaction,
/// leaving its chains, its learned sets and its NAT as they are: a live
/// policy change, or a warm VM's handed to its session. With
/// `reset_denied`, the `denied` counter starts again from zero (what a warm
/// VM's guest tried before its session is not the session's).
pub fn sets_script(policy: &EgressPolicy, reset_denied: bool) -> String {
    let mut out = String::new();
    let whole: Vec<Cidr4> = policy
        .allow
        .iter()
        .filter(|a| a.proto.is_none() && a.port.is_none())
        .map(|a| a.cidr)
        .collect();
    for (set, elements) in [
        ("always_deny", addr_elements(&policy.always_deny)),
        ("private_allowed", addr_elements(&policy.private_allowed)),
        ("allow_any", addr_elements(&whole)),
        ("allow_port", port_elements(&policy.allow)),
    ] {
        let _ = writeln!(out, "flush set ip {TABLE} {set}");
        if !elements.is_empty() {
            let _ = writeln!(
                out,
                "add element ip {TABLE} {set} {{ {} }}",
                elements.join(", ")
            );
        }
    }
    if reset_denied {
        let _ = writeln!(out, "reset counter ip {TABLE} {DENIED_COUNTER}");
    }
    out
}

/// What one learned element allows of its address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LearnedTarget {
    /// Every protocol and port (an element of [`LEARNED_ANY`]).
    Any,
    /// One protocol and port (an element of [`LEARNED_PORT`]).
    Port(Proto, u16),
}

/// An address an allowed name resolved to, for as long as its record lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Learned {
    /// The address.
    pub addr: Ipv4Addr,
    /// What of it is allowed.
    pub target: LearnedTarget,
    /// Seconds until the element expires (at least 1).
    pub ttl_secs: u32,
}

impl Learned {
    fn set_and_key(&self) -> (&'static str, String) {
        match self.target {
            LearnedTarget::Any => (LEARNED_ANY, self.addr.to_string()),
            LearnedTarget::Port(p, port) => (
                LEARNED_PORT,
                format!("{} . {} . {port}", self.addr, p.name()),
            ),
        }
    }
}

/// The script that adds `entries` to the learned sets, replacing the timeout
/// of any already there: each element is added, deleted and added again
/// with its timeout, in one transaction (a plain add keeps the old timeout,
/// a plain delete fails on an element already expired).
pub fn learned_script(entries: &[Learned]) -> String {
    let mut out = String::new();
    for e in entries {
        let (set, key) = e.set_and_key();
        let ttl = e.ttl_secs.max(1);
        let _ = writeln!(
            out,
            "add element ip {TABLE} {set} {{ {key} }}\ndelete element ip {TABLE} {set} {{ {key} }}\nadd element ip {TABLE} {set} {{ {key} timeout {ttl}s }}"
        );
    }
    out
}

/// The script that removes `entries` from the learned sets, whether or not
/// they are still there.
pub fn forget_script(entries: &[Learned]) -> String {
    let mut out = String::new();
    for e in entries {
        let (set, key) = e.set_and_key();
        let _ = writeln!(
            out,
            "add element ip {TABLE} {set} {{ {key} timeout 1s }}\ndelete element ip {TABLE} {set} {{ {key} }}"
        );
    }
    out
}

/// The script that empties both learned sets.
pub fn flush_learned_script() -> String {
    format!("flush set ip {TABLE} {LEARNED_ANY}\nflush set ip {TABLE} {LEARNED_PORT}\n")
}

/// The node's own rules: VMs never reach one another through the node, and
/// their traffic leaves masqueraded behind the node's address.
pub fn node_ruleset(pool: Cidr4) -> String {
    format!(
        r#"table ip {TABLE}-node {{}}
delete table ip {TABLE}-node
table ip {TABLE}-node {{
  chain forward {{
    type filter hook forward priority filter; policy accept;
    ip saddr {pool} ip daddr {pool} drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat;
    ip saddr {pool} ip daddr != {pool} masquerade
  }}
}}
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn cidr(s: &str) -> Cidr4 {
        Cidr4::parse(s).unwrap()
    }

    #[test]
    fn address_sets_get_disjoint_blocks_and_port_sets_no_covered_entry() {
        let c = |t: &str| Cidr4::parse(t).unwrap();
        assert_eq!(
            disjoint(&[
                c("10.1.0.0/16"),
                c("192.0.2.7"),
                c("10.0.0.0/8"),
                c("192.0.2.7"),
                c("10.1.2.0/24"),
                c("9.0.0.0/8"),
            ]),
            [c("9.0.0.0/8"), c("10.0.0.0/8"), c("192.0.2.7")]
        );
        let allow = |cidr: &str, proto: Option<Proto>, port: Option<u16>| Allow {
            cidr: c(cidr),
            proto,
            port,
        };
        assert_eq!(
            port_elements(&[
                allow("10.0.0.0/8", Some(Proto::Tcp), None),
                allow("10.1.0.0/16", Some(Proto::Tcp), Some(443)),
                allow("10.1.0.0/16", None, Some(53)),
                allow("10.1.0.0/16", Some(Proto::Udp), Some(53)),
                allow("10.1.0.0/16", None, Some(53)),
            ]),
            ["tcp . 10.0.0.0/8 . 0-65535", "udp . 10.1.0.0/16 . 53"]
        );
    }

    #[test]
    fn a_policy_change_rewrites_the_sets_only() {
        let allow = vec![
            Allow {
                cidr: Cidr4::parse("203.0.113.0/24").unwrap(),
                proto: None,
                port: None,
            },
            Allow {
                cidr: Cidr4::parse("198.51.100.7").unwrap(),
                proto: Some(Proto::Tcp),
                port: Some(443),
            },
        ];
        let policy = EgressPolicy::new(
            allow,
            &[Cidr4::parse("192.0.2.1").unwrap()],
            Cidr4::parse("10.200.0.0/16").unwrap(),
            vec![],
        );
        let script = sets_script(&policy, true);
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
        assert!(
            !script.contains("chain") && !script.contains("learned") && !script.contains("table")
        );
        assert!(!sets_script(&policy, false).contains("reset"));
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
            port_elements(&allow),
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
        };
        let policy = EgressPolicy::new(allow, &[cidr("192.0.2.1")], cidr("10.200.0.0/16"), vec![]);
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
                addr: Ipv4Addr::new(203, 0, 113, 5),
                target: LearnedTarget::Port(Proto::Tcp, 443),
                ttl_secs: 60,
            },
            Learned {
                addr: Ipv4Addr::new(203, 0, 113, 6),
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
        let r = node_ruleset(cidr("10.200.0.0/16"));
        assert!(r.contains("ip saddr 10.200.0.0/16 ip daddr 10.200.0.0/16 drop"));
        assert!(r.contains("masquerade"));
    }
}
