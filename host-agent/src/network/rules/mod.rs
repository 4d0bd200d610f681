//! The nftables rules of a VM's network namespace: egress from the guest is
//! denied unless the session's allowlist names it, checked where the guest
//! cannot reach (its own root can flush the guest's rules, not these).
//!
//! One table per address family (`ip agentvm`, `ip6 agentvm`), written by
//! the same code. Order of each forward chain, first match wins:
//! 1. replies of connections already allowed pass;
//! 2. anything from the tap not sourced at the guest's address
//!    ([`GUEST_IP`], [`GUEST_IP6`]) is dropped (a guest forging addresses);
//! 3. a guest TCP segment of a connection this namespace's conntrack does
//!    not know is answered with a reset ([`untracked_tcp`]): a fork wakes
//!    up holding its source's connections, which exist only in the source's
//!    namespace, and its copies of them end at their first segment instead
//!    of reaching the peer as duplicates;
//! 4. [`EgressPolicy::always_deny`] (link-local with the cloud metadata
//!    address, loopback, the node's own addresses, the VM pools: other VMs;
//!    for IPv6 also the prefixes that carry IPv4 inside, such as NAT64) is
//!    dropped whatever the allowlist says;
//! 5. private ranges are dropped unless the node's policy names them;
//! 6. the allowlist: whole destinations, or protocol, destination and port;
//!    then what the session's DNS resolver learned (the addresses allowed
//!    names resolved to, [`LEARNED_ANY`] and [`LEARNED_PORT`], each element
//!    expiring with its record's TTL);
//! 7. everything else is dropped.
//!
//! The input chains reset untracked guest TCP segments the same way (a
//! fork's copies of its source's exposed-port and resolver connections),
//! and let the guest reach nothing of the namespace but the resolver (UDP
//! and TCP port 53 at [`GATEWAY_IP`]) and, for IPv6, neighbour discovery
//! (solicitations and advertisements from the link itself: hop limit 255);
//! router advertisements, redirects and DHCPv6 from the guest are dropped.
//! A VM without an IPv6 slot gets an `ip6` table that forwards nothing.
//!
//! Drops are counted in each table's `denied` counter, resets of untracked
//! segments in its `untracked` counter, never logged per packet. ARP from
//! the tap is believed only for the guest's own address (table `arp
//! agentvm`): a guest cannot put the node's or anyone else's address in the
//! namespace's neighbour table.

use std::fmt::Write as _;

use std::net::IpAddr;

use super::addressing::{Cidr, Slot, GATEWAY_IP, GUEST_IP, GUEST_IP6, TAP_NAME};

/// Name of the table in every VM namespace.
pub const TABLE: &str = "agentvm";
/// Name of the counter of dropped guest packets in that table.
pub const DENIED_COUNTER: &str = "denied";
/// Name of the counter of guest TCP segments answered with a reset
/// because conntrack knows no connection of theirs ([`untracked_tcp`]).
pub const UNTRACKED_COUNTER: &str = "untracked";
/// Set of whole addresses the DNS resolver learned (timeouts).
pub const LEARNED_ANY: &str = "learned_any";
/// Set of `address . protocol . port` the DNS resolver learned (timeouts).
pub const LEARNED_PORT: &str = "learned_port";

/// An address family, as nftables names its tables and types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// IPv4: table `ip`, `ipv4_addr`.
    V4,
    /// IPv6: table `ip6`, `ipv6_addr`.
    V6,
}

impl Family {
    /// The family of `addr`.
    pub fn of(addr: IpAddr) -> Family {
        if addr.is_ipv4() {
            Family::V4
        } else {
            Family::V6
        }
    }

    /// The table family (`ip`, `ip6`), also the keyword of address matches.
    pub fn table(self) -> &'static str {
        match self {
            Family::V4 => "ip",
            Family::V6 => "ip6",
        }
    }

    fn addr_type(self) -> &'static str {
        match self {
            Family::V4 => "ipv4_addr",
            Family::V6 => "ipv6_addr",
        }
    }

    fn guest(self) -> IpAddr {
        match self {
            Family::V4 => IpAddr::V4(GUEST_IP),
            Family::V6 => IpAddr::V6(GUEST_IP6),
        }
    }

    fn holds(self, c: &Cidr) -> bool {
        Family::of(c.addr) == self
    }
}

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
    /// Destination block (IPv4 or IPv6).
    pub cidr: Cidr,
    /// Protocol (`None`: TCP and UDP, or any protocol when `port` is `None` too).
    pub proto: Option<Proto>,
    /// Destination port (`None`: every port).
    pub port: Option<u16>,
}

impl Allow {
    /// Whether everything `other` allows is allowed by `self` too.
    pub fn covers(&self, other: &Allow) -> bool {
        self.cidr.holds(&other.cidr)
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

/// Private ranges: denied unless the node's policy names them (IPv6:
/// unique-local addresses).
pub const PRIVATE: &[&str] = &[
    "10.0.0.0/8",
    "100.64.0.0/10",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "fc00::/7",
];

/// Denied whatever any policy says: "this network", loopback, link-local
/// (the metadata service at 169.254.169.254 and fd00:ec2::254), multicast
/// and reserved; for IPv6 also IPv4-mapped addresses and the translation
/// and tunnel prefixes (NAT64, Teredo, 6to4) through which an IPv6 packet
/// could reach an IPv4 address the IPv4 rules deny.
pub const ALWAYS_DENIED: &[&str] = &[
    "0.0.0.0/8",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "224.0.0.0/4",
    "240.0.0.0/4",
    "::/127",
    "::ffff:0:0/96",
    "64:ff9b::/96",
    "64:ff9b:1::/48",
    "100::/64",
    "2001::/32",
    "2002::/16",
    "fd00:ec2::254",
    "fe80::/10",
    "fec0::/10",
    "ff00::/8",
];

/// What a VM's guest may reach.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressPolicy {
    /// The session's allowlist.
    pub allow: Vec<Allow>,
    /// Dropped first: [`ALWAYS_DENIED`], the node's addresses, the VM pools.
    pub always_deny: Vec<Cidr>,
    /// Private ranges the node's policy lets allowlists name.
    pub private_allowed: Vec<Cidr>,
}

impl EgressPolicy {
    /// A policy allowing `allow`, denying the fixed ranges plus the node's
    /// own `node_addresses` and its VM `pools`.
    pub fn new(
        allow: Vec<Allow>,
        node_addresses: &[Cidr],
        pools: &[Cidr],
        private_allowed: Vec<Cidr>,
    ) -> Self {
        let mut always_deny: Vec<Cidr> = ALWAYS_DENIED
            .iter()
            .filter_map(|c| Cidr::parse(c).ok())
            .collect();
        always_deny.extend_from_slice(node_addresses);
        always_deny.extend_from_slice(pools);
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
fn disjoint(cidrs: &[Cidr]) -> Vec<Cidr> {
    let mut sorted = cidrs.to_vec();
    // Larger blocks first at an address, so the blocks they hold follow.
    sorted.sort();
    sorted.dedup();
    let mut out: Vec<Cidr> = Vec::with_capacity(sorted.len());
    for c in sorted {
        if !out.iter().any(|o| o.holds(&c)) {
            out.push(c);
        }
    }
    out
}

/// The elements of the address set of `cidrs` of family `f` (see
/// [`disjoint`]).
fn addr_elements(f: Family, cidrs: &[Cidr]) -> Vec<String> {
    let mine: Vec<Cidr> = cidrs.iter().copied().filter(|c| f.holds(c)).collect();
    disjoint(&mine).iter().map(Cidr::to_string).collect()
}

/// Writes an interval set of addresses; a policy may name a block twice.
fn addr_set(out: &mut String, f: Family, name: &str, cidrs: &[Cidr]) {
    let _ = writeln!(
        out,
        "  set {name} {{\n    type {}; flags interval",
        f.addr_type()
    );
    let list = addr_elements(f, cidrs);
    if !list.is_empty() {
        let _ = writeln!(out, "    elements = {{ {} }}", list.join(", "));
    }
    let _ = writeln!(out, "  }}");
}

/// The allowlist entries of family `f` with a protocol or a port, as
/// `proto . block . ports` elements (an entry without a protocol becomes a
/// TCP and a UDP one). An element another one holds is left out: without
/// `auto-merge` (see [`disjoint`]) the set refuses one inside another.
fn port_elements(f: Family, allow: &[Allow]) -> Vec<String> {
    let mut each: Vec<Allow> = Vec::new();
    for a in allow.iter().filter(|a| f.holds(&a.cidr)) {
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

/// The whole blocks of the allowlist (entries without protocol or port).
fn whole_blocks(allow: &[Allow]) -> Vec<Cidr> {
    allow
        .iter()
        .filter(|a| a.proto.is_none() && a.port.is_none())
        .map(|a| a.cidr)
        .collect()
}

/// The whole ruleset for the namespace of the VM at `slot`, whose end of
/// the veth pair is `veth`: replaces any earlier version atomically. The
/// IPv6 table forwards only when the slot has IPv6 addresses.
pub fn vm_ruleset(policy: &EgressPolicy, slot: &Slot, veth: &str) -> String {
    let mut out = String::new();
    family_table(&mut out, Family::V4, policy, IpAddr::V4(slot.vm_ip), veth);
    match slot.v6 {
        Some(v6) => family_table(&mut out, Family::V6, policy, IpAddr::V6(v6.vm_ip), veth),
        None => {
            let _ = write!(
                out,
                r#"table ip6 {TABLE} {{}}
delete table ip6 {TABLE}
table ip6 {TABLE} {{
  counter {DENIED_COUNTER} {{}}
  set {LEARNED_ANY} {{
    type ipv6_addr; flags timeout
  }}
  set {LEARNED_PORT} {{
    type ipv6_addr . inet_proto . inet_service; flags timeout
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    iifname "lo" accept
  }}
}}
"#
            );
        }
    }
    let tap = TAP_NAME;
    let _ = write!(
        out,
        r#"table arp {TABLE} {{}}
delete table arp {TABLE}
table arp {TABLE} {{
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{tap}" arp saddr ip != {GUEST_IP} drop
  }}
}}
"#
    );
    out
}

/// The rules that answer with a TCP reset every guest TCP segment that
/// belongs to no connection this namespace's conntrack knows, for a chain
/// of the table of family `f`: a segment that would open a conntrack entry
/// without being a bare SYN (a mid-stream ACK or PSH, which conntrack
/// would pick up), and one conntrack finds invalid (a FIN or RST without a
/// connection). Only segments from the tap sourced at the guest's address
/// are answered, so a reset goes nowhere but to the guest.
///
/// Why: every VM namespace has its own conntrack, and a fork (a VM restored
/// from a snapshot of another running session) wakes up holding its
/// source's established connections. Its namespace knows none of them; the
/// source's own namespace keeps them, so the source, and a session resumed
/// from disk into that namespace, keep their connections. The clone's
/// copies are reset at their first segment, before anything reaches the
/// peer (a dropped segment would be retransmitted for minutes instead).
/// A segment of a known connection is not invalid for lying outside
/// conntrack's idea of the TCP window, so it is never reset for that: the
/// namespace's conntrack is liberal about windows
/// (`nf_conntrack_tcp_be_liberal`, set by [`super::namespace`]).
pub fn untracked_tcp(f: Family) -> String {
    let t = f.table();
    let tap = TAP_NAME;
    let guest = f.guest();
    let from_guest = format!("iifname \"{tap}\" {t} saddr {guest}");
    format!(
        "{from_guest} ct state new tcp flags & (fin | syn | rst | ack) != syn counter name {UNTRACKED_COUNTER} reject with tcp reset\n    \
         {from_guest} meta l4proto tcp ct state invalid counter name {UNTRACKED_COUNTER} reject with tcp reset"
    )
}

/// Writes the table of family `f`: its sets from `policy`, its learned
/// sets, its counter, its chains and the NAT of the guest to `vm_ip`.
fn family_table(out: &mut String, f: Family, policy: &EgressPolicy, vm_ip: IpAddr, veth: &str) {
    let t = f.table();
    // Declare, then delete, then write: one atomic transaction that works
    // whether or not the table exists yet.
    let _ = writeln!(out, "table {t} {TABLE} {{}}\ndelete table {t} {TABLE}");
    let _ = writeln!(out, "table {t} {TABLE} {{");
    addr_set(out, f, "always_deny", &policy.always_deny);
    let private: Vec<Cidr> = PRIVATE.iter().filter_map(|c| Cidr::parse(c).ok()).collect();
    addr_set(out, f, "private", &private);
    addr_set(out, f, "private_allowed", &policy.private_allowed);
    addr_set(out, f, "allow_any", &whole_blocks(&policy.allow));
    let ty = f.addr_type();
    let _ = writeln!(
        out,
        "  set allow_port {{\n    type inet_proto . {ty} . inet_service; flags interval"
    );
    let elements = port_elements(f, &policy.allow);
    if !elements.is_empty() {
        let _ = writeln!(out, "    elements = {{ {} }}", elements.join(", "));
    }
    let _ = writeln!(out, "  }}");
    let _ = writeln!(
        out,
        "  set {LEARNED_ANY} {{\n    type {ty}; flags timeout\n  }}\n  set {LEARNED_PORT} {{\n    type {ty} . inet_proto . inet_service; flags timeout\n  }}"
    );
    let _ = writeln!(out, "  counter {DENIED_COUNTER} {{}}");
    let _ = writeln!(out, "  counter {UNTRACKED_COUNTER} {{}}");
    let tap = TAP_NAME;
    let guest = f.guest();
    let untracked = untracked_tcp(f);
    // What the guest may reach of the namespace itself.
    let local = match f {
        Family::V4 => format!(
            "iifname \"{tap}\" ip saddr {GUEST_IP} ip daddr {GATEWAY_IP} meta l4proto {{ tcp, udp }} th dport 53 accept"
        ),
        Family::V6 => format!(
            "iifname \"{tap}\" ip6 saddr {{ {GUEST_IP6}, fe80::/10 }} ip6 hoplimit 255 icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert }} accept\n    iifname \"{veth}\" ip6 hoplimit 255 icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert }} accept"
        ),
    };
    let _ = write!(
        out,
        r#"  chain forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "{tap}" {t} saddr != {guest} counter name {DENIED_COUNTER} drop
    {untracked}
    iifname "{tap}" {t} daddr @always_deny counter name {DENIED_COUNTER} drop
    iifname "{tap}" {t} daddr @private {t} daddr != @private_allowed counter name {DENIED_COUNTER} drop
    iifname "{tap}" {t} daddr @allow_any accept
    iifname "{tap}" meta l4proto . {t} daddr . th dport @allow_port accept
    iifname "{tap}" {t} daddr @{LEARNED_ANY} accept
    iifname "{tap}" {t} daddr . meta l4proto . th dport @{LEARNED_PORT} accept
    iifname "{tap}" counter name {DENIED_COUNTER} drop
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    ct state established,related accept
    iifname "lo" accept
    {untracked}
    {local}
    iifname "{tap}" counter name {DENIED_COUNTER} drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat;
    oifname "{veth}" {t} saddr {guest} snat to {vm_ip}
  }}
}}
"#
    );
}

/// The script that gives the namespace's tables (IPv4, and IPv6 with `v6`)
/// the sets of `policy` (deny blocks, private ranges allowed, the
/// allowlist) in one transaction, leaving their chains, their learned sets
/// and their NAT as they are: a live policy change, or a warm VM's handed
/// to its session. With `reset_denied`, the `denied` counters start again
/// from zero (what a warm VM's guest tried before its session is not the
/// session's).
pub fn sets_script(policy: &EgressPolicy, reset_denied: bool, v6: bool) -> String {
    let mut out = String::new();
    let whole = whole_blocks(&policy.allow);
    let families: &[Family] = if v6 {
        &[Family::V4, Family::V6]
    } else {
        &[Family::V4]
    };
    for &f in families {
        let t = f.table();
        for (set, elements) in [
            ("always_deny", addr_elements(f, &policy.always_deny)),
            ("private_allowed", addr_elements(f, &policy.private_allowed)),
            ("allow_any", addr_elements(f, &whole)),
            ("allow_port", port_elements(f, &policy.allow)),
        ] {
            let _ = writeln!(out, "flush set {t} {TABLE} {set}");
            if !elements.is_empty() {
                let _ = writeln!(
                    out,
                    "add element {t} {TABLE} {set} {{ {} }}",
                    elements.join(", ")
                );
            }
        }
        if reset_denied {
            let _ = writeln!(out, "reset counter {t} {TABLE} {DENIED_COUNTER}");
        }
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
    /// The address (its family picks the table).
    pub addr: IpAddr,
    /// What of it is allowed.
    pub target: LearnedTarget,
    /// Seconds until the element expires (at least 1).
    pub ttl_secs: u32,
}

impl Learned {
    fn set_and_key(&self) -> (&'static str, &'static str, String) {
        let t = Family::of(self.addr).table();
        match self.target {
            LearnedTarget::Any => (t, LEARNED_ANY, self.addr.to_string()),
            LearnedTarget::Port(p, port) => (
                t,
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
        let (t, set, key) = e.set_and_key();
        let ttl = e.ttl_secs.max(1);
        let _ = writeln!(
            out,
            "add element {t} {TABLE} {set} {{ {key} }}\ndelete element {t} {TABLE} {set} {{ {key} }}\nadd element {t} {TABLE} {set} {{ {key} timeout {ttl}s }}"
        );
    }
    out
}

/// The script that removes `entries` from the learned sets, whether or not
/// they are still there.
pub fn forget_script(entries: &[Learned]) -> String {
    let mut out = String::new();
    for e in entries {
        let (t, set, key) = e.set_and_key();
        let _ = writeln!(
            out,
            "add element {t} {TABLE} {set} {{ {key} timeout 1s }}\ndelete element {t} {TABLE} {set} {{ {key} }}"
        );
    }
    out
}

/// The script that empties the learned sets of both tables (a VM without
/// IPv6 has empty IPv6 ones).
pub fn flush_learned_script() -> String {
    let mut out = String::new();
    for t in ["ip", "ip6"] {
        let _ = writeln!(
            out,
            "flush set {t} {TABLE} {LEARNED_ANY}\nflush set {t} {TABLE} {LEARNED_PORT}"
        );
    }
    out
}

/// The node's own rules: VMs never reach one another through the node, and
/// their traffic leaves masqueraded behind the node's address (IPv6 too
/// when the node has an IPv6 pool).
pub fn node_ruleset(pool: Cidr, pool6: Option<Cidr>) -> String {
    let mut out = String::new();
    for (t, block) in [("ip", Some(pool)), ("ip6", pool6)] {
        let Some(block) = block else {
            // A node whose IPv6 pool was taken away forwards none.
            let _ = writeln!(
                out,
                "table {t} {TABLE}-node {{}}\ndelete table {t} {TABLE}-node"
            );
            continue;
        };
        let _ = write!(
            out,
            r#"table {t} {TABLE}-node {{}}
delete table {t} {TABLE}-node
table {t} {TABLE}-node {{
  chain forward {{
    type filter hook forward priority filter; policy accept;
    {t} saddr {block} {t} daddr {block} drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat;
    {t} saddr {block} {t} daddr != {block} masquerade
  }}
}}
"#
        );
    }
    out
}

#[cfg(test)]
mod tests;
