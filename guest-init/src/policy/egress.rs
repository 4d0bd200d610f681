//! Egress enforcement inside the guest.
//!
//! The agent's manifest entries become an nftables table `inet guest_egress`
//! on the output hook with policy `drop`:
//!
//! 1. replies on established connections pass;
//! 2. each listed CIDR (and each address a listed host resolved to) passes,
//!    for its ports (TCP and UDP) or for every port;
//! 3. private, loopback, link-local, CGNAT and metadata addresses are counted
//!    and logged as denied (they only pass through step 2 when a `cidr` entry
//!    lists them: an address a *host* resolves to never opens them);
//! 4. everything else is counted, logged and dropped.
//!
//! Name resolution is limited to allowed hosts: guest-init resolves them at
//! session start and writes `/etc/hosts`; DNS traffic (port 53) is itself
//! egress and is dropped unless listed, or sent to a nameserver the kernel's
//! `ip=` parameter names ([`EgressPlan::allow_nameservers`]): that is the
//! host's per-session resolver, which answers only the names the session is
//! granted, so the plan's own resolution goes through it. Denials are
//! counted in the named counter `denied` and reported as `egress.denied`
//! audit events.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use super::manifest::{EgressEntry, EgressTarget, EntryError};

/// Name of the nftables table guest-init owns.
pub const TABLE: &str = "guest_egress";

/// An address block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    /// Network address (host bits cleared).
    pub addr: IpAddr,
    /// Prefix length.
    pub prefix: u8,
}

/// Bad egress entries. Any of these stops the session.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EgressError {
    /// Not `ADDRESS/PREFIX` with a valid address and prefix.
    #[error("egress: {0:?} is not a CIDR such as 10.0.0.0/8 or 2001:db8::/32")]
    BadCidr(String),
    /// An entry must name exactly one of `host` and `cidr`.
    #[error("egress: each entry needs exactly one of `host` or `cidr` (entry {0})")]
    BadEntry(usize),
    /// A host name with characters nftables or /etc/hosts cannot take.
    #[error("egress: {0:?} is not a valid host name")]
    BadHost(String),
}

impl From<EntryError> for EgressError {
    fn from(e: EntryError) -> Self {
        match e {
            EntryError::BadEntry(i) => EgressError::BadEntry(i),
            EntryError::BadHost(h) => EgressError::BadHost(h),
        }
    }
}

impl FromStr for Cidr {
    type Err = EgressError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || EgressError::BadCidr(s.to_string());
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p.parse::<u8>().map_err(|_| bad())?,
            None => max,
        };
        if prefix > max {
            return Err(bad());
        }
        Ok(Self::new(addr, prefix))
    }
}

impl Cidr {
    /// The block of `prefix` bits around `addr` (host bits cleared).
    pub fn new(addr: IpAddr, prefix: u8) -> Self {
        let addr = match addr {
            IpAddr::V4(a) => {
                let mask = if prefix == 0 {
                    0
                } else {
                    u32::MAX << (32 - u32::from(prefix))
                };
                IpAddr::V4(Ipv4Addr::from(u32::from(a) & mask))
            }
            IpAddr::V6(a) => {
                let mask = if prefix == 0 {
                    0
                } else {
                    u128::MAX << (128 - u32::from(prefix))
                };
                IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask))
            }
        };
        Self { addr, prefix }
    }

    /// True when `ip` lies in this block.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_)) => {
                Cidr::new(ip, self.prefix).addr == self.addr
            }
            _ => false,
        }
    }

    fn family(&self) -> &'static str {
        if self.addr.is_ipv4() {
            "ip"
        } else {
            "ip6"
        }
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Blocks denied unless a `cidr` entry lists them: private, loopback,
/// link-local (which holds the 169.254.169.254 metadata service), CGNAT
/// (which holds 100.100.100.200), unspecified, IPv4-mapped IPv6, and the
/// IPv6 unique-local block (which holds fd00:ec2::254).
pub fn special_blocks() -> Vec<Cidr> {
    [
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "::/128",
        "::1/128",
        "::ffff:0:0/96",
        "fc00::/7",
        "fe80::/10",
    ]
    .iter()
    .filter_map(|s| s.parse().ok())
    .collect()
}

/// True for an address in [`special_blocks`].
pub fn is_special(ip: IpAddr) -> bool {
    special_blocks().iter().any(|b| b.contains(ip))
}

/// One allowed destination after resolution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allowed {
    /// The block.
    pub cidr: Cidr,
    /// Ports; empty means every port.
    pub ports: Vec<u16>,
    /// The manifest entry it came from, for comments.
    pub origin: String,
}

/// The resolved allowlist, ready to turn into rules.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressPlan {
    /// Destinations that pass.
    pub allowed: Vec<Allowed>,
    /// `/etc/hosts` lines for the allowed host names.
    pub hosts: Vec<(IpAddr, String)>,
    /// Addresses a host resolved to that were dropped as special, with the host.
    pub refused: Vec<(IpAddr, String)>,
}

/// The DNS port a nameserver is allowed on.
pub const DNS_PORT: u16 = 53;

impl EgressPlan {
    /// Lets DNS queries (UDP and TCP port 53) to each of `servers` through,
    /// ahead of every other rule, so that a nameserver on a private address
    /// (the host's resolver at the guest's gateway) is not caught by the
    /// special-block deny. Only port 53 of exactly those addresses opens.
    pub fn allow_nameservers(&mut self, servers: &[IpAddr]) {
        let rules = servers.iter().map(|ip| Allowed {
            cidr: Cidr::new(*ip, if ip.is_ipv4() { 32 } else { 128 }),
            ports: vec![DNS_PORT],
            origin: format!("nameserver {ip}"),
        });
        let rules: Vec<Allowed> = rules.collect();
        self.allowed.splice(0..0, rules);
    }
}

/// Resolves the entries with `resolve` (host name to addresses).
pub fn plan(
    entries: &[EgressEntry],
    mut resolve: impl FnMut(&str) -> Vec<IpAddr>,
) -> Result<EgressPlan, EgressError> {
    let mut plan = EgressPlan::default();
    for (i, e) in entries.iter().enumerate() {
        match e.target(i)? {
            EgressTarget::Host(host) => {
                let host = host.to_string();
                for ip in resolve(&host) {
                    if is_special(ip) {
                        plan.refused.push((ip, host.clone()));
                        continue;
                    }
                    plan.hosts.push((ip, host.clone()));
                    plan.allowed.push(Allowed {
                        cidr: Cidr::new(ip, if ip.is_ipv4() { 32 } else { 128 }),
                        ports: e.ports.clone(),
                        origin: format!("host {host}"),
                    });
                }
            }
            EgressTarget::Cidr(cidr) => plan.allowed.push(Allowed {
                cidr: cidr.parse()?,
                ports: e.ports.clone(),
                origin: format!("cidr {cidr}"),
            }),
        }
    }
    Ok(plan)
}

/// The nftables script (for `nft -f -`) enforcing `plan`. It replaces any
/// previous guest_egress table atomically.
pub fn nft_ruleset(plan: &EgressPlan) -> String {
    let mut s = String::new();
    // Create-then-delete makes the script work whether or not the table exists.
    let _ = writeln!(s, "table inet {TABLE}");
    let _ = writeln!(s, "delete table inet {TABLE}");
    let _ = writeln!(s, "table inet {TABLE} {{");
    let _ = writeln!(s, "  counter denied {{}}");
    let _ = writeln!(s, "  chain output {{");
    let _ = writeln!(s, "    type filter hook output priority 0; policy drop;");
    let _ = writeln!(s, "    ct state established,related accept");
    // IPv6 neighbour discovery on the link itself (hop limit 255): without
    // it the guest cannot resolve its IPv6 gateway, and every IPv6
    // destination is "no route to host" (ARP, for IPv4, is not filtered here).
    let _ = writeln!(
        s,
        "    icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert }} ip6 hoplimit 255 accept"
    );
    for a in &plan.allowed {
        let fam = a.cidr.family();
        if a.ports.is_empty() {
            let _ = writeln!(
                s,
                "    {fam} daddr {} accept comment \"{}\"",
                a.cidr, a.origin
            );
        } else {
            let ports: Vec<String> = a.ports.iter().map(u16::to_string).collect();
            for proto in ["tcp", "udp"] {
                let _ = writeln!(
                    s,
                    "    {fam} daddr {} {proto} dport {{ {} }} accept comment \"{}\"",
                    a.cidr,
                    ports.join(", "),
                    a.origin
                );
            }
        }
    }
    let (v4, v6): (Vec<Cidr>, Vec<Cidr>) =
        special_blocks().into_iter().partition(|c| c.addr.is_ipv4());
    for (fam, blocks) in [("ip", v4), ("ip6", v6)] {
        let list: Vec<String> = blocks.iter().map(Cidr::to_string).collect();
        let _ = writeln!(
            s,
            "    {fam} daddr {{ {} }} counter name denied log prefix \"guest-egress-deny-special \" drop",
            list.join(", ")
        );
    }
    let _ = writeln!(
        s,
        "    counter name denied log prefix \"guest-egress-deny \" drop"
    );
    let _ = writeln!(s, "  }}");
    let _ = writeln!(s, "}}");
    s
}

/// The `/etc/hosts` text for the allowed names.
pub fn hosts_file(plan: &EgressPlan) -> String {
    let mut s = String::from("# written by guest-init: only allowed hosts resolve\n");
    for (ip, host) in &plan.hosts {
        let _ = writeln!(s, "{ip} {host}");
    }
    s
}

/// Parses the packet count out of `nft list counter inet guest_egress denied`.
pub fn parse_denied_packets(nft_output: &str) -> Option<u64> {
    let mut words = nft_output.split_whitespace();
    while let Some(w) = words.next() {
        if w == "packets" {
            return words.next()?.parse().ok();
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(host: Option<&str>, cidr: Option<&str>, ports: &[u16]) -> EgressEntry {
        EgressEntry {
            host: host.map(str::to_string),
            cidr: cidr.map(str::to_string),
            ports: ports.to_vec(),
        }
    }

    #[test]
    fn cidr_parsing() {
        let c: Cidr = "10.1.2.3/8".parse().unwrap();
        assert_eq!(c.to_string(), "10.0.0.0/8");
        assert!(c.contains("10.200.0.1".parse().unwrap()));
        assert!(!c.contains("11.0.0.1".parse().unwrap()));
        assert!(!c.contains("::1".parse().unwrap()));
        assert_eq!(
            "2001:db8::1/32".parse::<Cidr>().unwrap().to_string(),
            "2001:db8::/32"
        );
        assert_eq!("1.2.3.4".parse::<Cidr>().unwrap().prefix, 32);
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!("nope/8".parse::<Cidr>().is_err());
    }

    #[test]
    fn special_addresses() {
        for ip in [
            "127.0.0.1",
            "10.0.0.1",
            "172.20.1.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.100.100.200",
            "::1",
            "fe80::1",
            "fd00:ec2::254",
            "::ffff:10.0.0.1",
        ] {
            assert!(is_special(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["1.1.1.1", "2606:4700::1111", "172.32.0.1"] {
            assert!(!is_special(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn plan_and_rules() {
        let entries = [
            entry(Some("crates.io"), None, &[443]),
            entry(Some("evil.example"), None, &[]),
            entry(None, Some("10.20.0.0/16"), &[5432]),
        ];
        let plan = plan(&entries, |h| match h {
            "crates.io" => vec!["198.51.100.7".parse().unwrap()],
            // Resolves to the metadata address: must not open it.
            "evil.example" => vec!["169.254.169.254".parse().unwrap()],
            _ => vec![],
        })
        .unwrap();
        assert_eq!(plan.allowed.len(), 2);
        assert_eq!(
            plan.refused,
            vec![(
                "169.254.169.254".parse().unwrap(),
                "evil.example".to_string()
            )]
        );
        let rules = nft_ruleset(&plan);
        assert!(rules.contains("policy drop;"));
        assert!(rules.contains("ip daddr 198.51.100.7/32 tcp dport { 443 } accept"));
        assert!(rules.contains("ip daddr 10.20.0.0/16 udp dport { 5432 } accept"));
        assert!(!rules.contains("169.254.169.254/32"));
        // Allow rules come before the special-block deny.
        let allow = rules.find("10.20.0.0/16").unwrap();
        let deny = rules.find("guest-egress-deny-special").unwrap();
        assert!(allow < deny);
        assert!(rules.contains("169.254.0.0/16"));
        assert!(hosts_file(&plan).contains("198.51.100.7 crates.io"));
    }

    #[test]
    fn the_nameserver_is_allowed_on_port_53_only() {
        let entries = [entry(Some("crates.io"), None, &[443])];
        let mut plan = plan(&entries, |_| vec!["198.51.100.7".parse().unwrap()]).unwrap();
        let without = nft_ruleset(&plan);
        assert!(!without.contains("dport { 53 }"), "{without}");
        plan.allow_nameservers(&["172.16.0.1".parse().unwrap()]);
        assert_eq!(plan.allowed.len(), 2);
        assert_eq!(plan.allowed[0].ports, vec![53]);
        assert_eq!(plan.allowed[0].cidr.to_string(), "172.16.0.1/32");
        let rules = nft_ruleset(&plan);
        let udp = rules
            .find(
                "ip daddr 172.16.0.1/32 udp dport { 53 } accept comment \"nameserver 172.16.0.1\"",
            )
            .expect("UDP 53 to the nameserver");
        let tcp = rules
            .find("ip daddr 172.16.0.1/32 tcp dport { 53 } accept")
            .expect("TCP 53 to the nameserver");
        // Before the deny of 172.16.0.0/12, which holds the gateway.
        let deny = rules.find("guest-egress-deny-special").unwrap();
        assert!(udp < deny && tcp < deny);
        // Nothing else of the nameserver's address or of port 53 opens.
        assert_eq!(rules.matches("172.16.0.1/32").count(), 2, "{rules}");
        assert_eq!(rules.matches("dport { 53 }").count(), 2, "{rules}");
        // No address becomes a resolvable host name.
        assert!(!hosts_file(&plan).contains("172.16.0.1"));
        // Without a nameserver nothing changes.
        let mut same = super::plan(&entries, |_| vec!["198.51.100.7".parse().unwrap()]).unwrap();
        same.allow_nameservers(&[]);
        assert_eq!(nft_ruleset(&same), without);
    }

    #[test]
    fn bad_entries() {
        assert_eq!(
            plan(&[entry(None, None, &[])], |_| vec![]),
            Err(EgressError::BadEntry(0))
        );
        assert_eq!(
            plan(&[entry(Some("a\"; flush ruleset"), None, &[])], |_| vec![]),
            Err(EgressError::BadHost("a\"; flush ruleset".into()))
        );
        assert!(matches!(
            plan(&[entry(None, Some("x"), &[])], |_| vec![]),
            Err(EgressError::BadCidr(_))
        ));
    }

    #[test]
    fn counter_parsing() {
        let out =
            "table inet guest_egress {\n\tcounter denied {\n\t\tpackets 3 bytes 180\n\t}\n}\n";
        assert_eq!(parse_denied_packets(out), Some(3));
    }

    #[test]
    fn neighbour_discovery_leaves_the_guest() {
        let p = plan(&[], |_| vec![]).unwrap();
        let rules = nft_ruleset(&p);
        let nd = rules
            .find("nd-neighbor-solicit, nd-neighbor-advert }")
            .expect("neighbour discovery is let out");
        // Before the first rule that drops.
        assert!(nd < rules.find("counter name denied").unwrap(), "{rules}");
        assert!(!rules.contains("nd-router-advert"), "{rules}");
    }
}
