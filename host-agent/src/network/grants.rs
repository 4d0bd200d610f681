//! A session's egress allowlist from the repository: the `egress` entries
//! the manifest (`agent-manifest.yaml` at the base commit) grants the
//! session's agent, intersected with the node's allowlist, which is the
//! ceiling no repository can raise.
//!
//! `cidr` entries become allowlist entries (TCP and UDP on each listed port,
//! or every protocol and port when none is listed), each cut down to what
//! the node allows. `host` entries become names the session's DNS resolver
//! answers; the addresses it learns for them are checked against the node's
//! allowlist when they are added. IPv6 blocks are treated alike on a node
//! that gives VMs IPv6 (an IPv6 pool); elsewhere they are noted and skipped.

use agent_manifest::{EgressEntry, EgressTarget};

use super::addressing::Cidr;
use super::rules::{Allow, Proto};
use crate::error::{Error, Result};

/// A host name the manifest grants, with its ports (empty: every port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostGrant {
    /// The name as written (validated by [`agent_manifest::valid_host`]).
    pub host: String,
    /// TCP/UDP destination ports; empty means every port.
    pub ports: Vec<u16>,
}

/// What a session may reach, from its manifest grant and the node's policy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionEgress {
    /// Address allowlist entries, already within the node's allowlist.
    pub allow: Vec<Allow>,
    /// Host names for the DNS resolver.
    pub hosts: Vec<HostGrant>,
    /// Entries that could not take effect here, each with why (IPv6 blocks,
    /// blocks the node does not allow at all), for the session's events.
    pub skipped: Vec<String>,
}

/// The part of `a` that `b` also allows, if any.
pub fn intersect(a: &Allow, b: &Allow) -> Option<Allow> {
    // Two blocks overlap only when one holds the other.
    let cidr = if b.cidr.holds(&a.cidr) {
        a.cidr
    } else if a.cidr.holds(&b.cidr) {
        b.cidr
    } else {
        return None;
    };
    let port = match (a.port, b.port) {
        (Some(x), Some(y)) if x != y => return None,
        (x, y) => x.or(y),
    };
    let proto = match (a.proto, b.proto) {
        (Some(x), Some(y)) if x != y => return None,
        (x, y) => x.or(y),
    };
    // An entry with a port needs a protocol (`Allow`'s display and rules
    // read a port without one as TCP and UDP; keep that meaning explicit).
    Some(Allow { cidr, proto, port })
}

/// Drops entries another one covers, and duplicates; keeps order otherwise.
fn minimal(entries: Vec<Allow>) -> Vec<Allow> {
    let mut out: Vec<Allow> = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        let covered = entries
            .iter()
            .enumerate()
            .any(|(j, o)| j != i && o.covers(e) && (o != e || j < i));
        if !covered {
            out.push(*e);
        }
    }
    out
}

/// The session's egress from the manifest's `entries` for its agent and the
/// node's allowlist `node`; IPv6 blocks count only with `ipv6` (the node
/// gives VMs IPv6). An entry the manifest cannot mean (no target, a bad
/// host name, a block that is not an address block) is an error, as it is
/// in the guest: the session does not start on a manifest half read.
pub fn session_egress(
    entries: &[EgressEntry],
    node: &[Allow],
    ipv6: bool,
) -> Result<SessionEgress> {
    let mut out = SessionEgress::default();
    let mut allow = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let target = e
            .target(i)
            .map_err(|err| Error::FailedPrecondition(format!("agent-manifest.yaml: {err}")))?;
        match target {
            EgressTarget::Host(host) => out.hosts.push(HostGrant {
                host: host.to_string(),
                ports: e.ports.clone(),
            }),
            EgressTarget::Cidr(text) => {
                let cidr = Cidr::parse(text).map_err(|err| {
                    Error::FailedPrecondition(format!("agent-manifest.yaml: egress {err}"))
                })?;
                if !cidr.is_v4() && !ipv6 {
                    out.skipped.push(format!(
                        "{text}: IPv6, and this node gives VMs none (network.pool has no IPv6 block)"
                    ));
                    continue;
                }
                let wanted: Vec<Allow> = if e.ports.is_empty() {
                    vec![Allow {
                        cidr,
                        proto: None,
                        port: None,
                    }]
                } else {
                    e.ports
                        .iter()
                        .flat_map(|p| {
                            [Proto::Tcp, Proto::Udp].map(|proto| Allow {
                                cidr,
                                proto: Some(proto),
                                port: Some(*p),
                            })
                        })
                        .collect()
                };
                let before = allow.len();
                for w in &wanted {
                    allow.extend(node.iter().filter_map(|n| intersect(w, n)));
                }
                if allow.len() == before {
                    out.skipped
                        .push(format!("{text}: outside the node's allowlist"));
                }
            }
        }
    }
    out.allow = minimal(allow);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::node::parse_allow;

    fn allow(list: &[&str]) -> Vec<Allow> {
        list.iter().map(|a| parse_allow(a).unwrap()).collect()
    }

    fn entry(host: Option<&str>, cidr: Option<&str>, ports: &[u16]) -> EgressEntry {
        EgressEntry {
            host: host.map(Into::into),
            cidr: cidr.map(Into::into),
            ports: ports.to_vec(),
        }
    }

    fn shown(a: &[Allow]) -> Vec<String> {
        a.iter().map(Allow::to_string).collect()
    }

    #[test]
    fn intersection_of_blocks_protocols_and_ports() {
        let a = allow(&["10.0.0.0/8", "10.1.0.0/16 tcp 443", "0.0.0.0/0 udp"]);
        // The smaller block wins, in either order.
        assert_eq!(
            intersect(&a[0], &a[1]).unwrap().to_string(),
            "10.1.0.0/16 tcp 443"
        );
        assert_eq!(
            intersect(&a[1], &a[0]).unwrap().to_string(),
            "10.1.0.0/16 tcp 443"
        );
        // Disjoint protocols, blocks or ports meet nowhere.
        assert_eq!(intersect(&a[1], &a[2]), None);
        let b = allow(&["192.168.0.0/16", "10.1.0.0/16 tcp 80"]);
        assert_eq!(intersect(&a[0], &b[0]), None);
        assert_eq!(intersect(&a[1], &b[1]), None);
        // A port meets a protocol without one.
        assert_eq!(
            intersect(&allow(&["10.2.0.0/16 tcp 22"])[0], &a[2]),
            None,
            "tcp 22 and udp: nothing in common"
        );
        assert_eq!(
            intersect(&allow(&["10.2.0.0/16 udp 53"])[0], &a[2])
                .unwrap()
                .to_string(),
            "10.2.0.0/16 udp 53"
        );
    }

    #[test]
    fn manifest_entries_are_cut_to_the_node_ceiling() {
        let node = allow(&["0.0.0.0/0 tcp 443", "0.0.0.0/0 tcp 80", "203.0.113.0/24"]);
        let entries = [
            // Every port of a block: only what the node allows of it.
            entry(None, Some("198.51.100.0/24"), &[]),
            // A block the node allows whole, on two ports, TCP and UDP.
            entry(None, Some("203.0.113.7/32"), &[5432, 53]),
            // A name: the resolver's.
            entry(Some("crates.io"), None, &[443]),
            // IPv6: skipped on a node without IPv6.
            entry(None, Some("2001:db8::/32"), &[]),
        ];
        let got = session_egress(&entries, &node, false).unwrap();
        assert_eq!(
            shown(&got.allow),
            [
                "198.51.100.0/24 tcp 443",
                "198.51.100.0/24 tcp 80",
                "203.0.113.7/32 tcp 5432",
                "203.0.113.7/32 udp 5432",
                "203.0.113.7/32 tcp 53",
                "203.0.113.7/32 udp 53",
            ]
        );
        assert_eq!(
            got.hosts,
            [HostGrant {
                host: "crates.io".into(),
                ports: vec![443]
            }]
        );
        assert_eq!(got.skipped.len(), 1, "{:?}", got.skipped);
        assert!(got.skipped[0].contains("IPv6"));
    }

    #[test]
    fn what_the_node_does_not_allow_is_dropped_and_said() {
        let node = allow(&["203.0.113.0/24 tcp 443"]);
        let got =
            session_egress(&[entry(None, Some("198.51.100.0/24"), &[443])], &node, true).unwrap();
        assert!(got.allow.is_empty());
        assert!(got.skipped[0].contains("outside the node's allowlist"));
        // No node allowlist: nothing at all, whatever the manifest says.
        let got = session_egress(&[entry(None, Some("0.0.0.0/0"), &[])], &[], true).unwrap();
        assert!(got.allow.is_empty());
    }

    #[test]
    fn covered_entries_are_merged() {
        let node = allow(&["0.0.0.0/0"]);
        let got = session_egress(
            &[
                entry(None, Some("10.0.0.0/8"), &[]),
                entry(None, Some("10.1.0.0/16"), &[22]),
                entry(None, Some("10.0.0.0/8"), &[]),
            ],
            &node,
            false,
        )
        .unwrap();
        assert_eq!(shown(&got.allow), ["10.0.0.0/8"]);
    }

    #[test]
    fn a_manifest_it_cannot_mean_is_an_error() {
        for (e, says) in [
            (entry(None, None, &[]), "exactly one"),
            (entry(Some("a b"), None, &[]), "not a valid host name"),
            (entry(None, Some("300.1.2.3/8"), &[]), "not an IP address"),
            (entry(None, Some("10.0.0.1/8"), &[]), "host bits"),
            (entry(None, Some("fe80::zz/10"), &[]), "not an IP address"),
        ] {
            let err = session_egress(&[e], &[], true).unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
            assert!(err.contains("agent-manifest.yaml"), "{err}");
        }
    }

    #[test]
    fn ipv6_blocks_count_on_a_node_with_ipv6() {
        let node = allow(&["0.0.0.0/0 tcp 443", "2001:db8::/32", "::/0 tcp 443"]);
        let entries = [
            entry(None, Some("2001:db8:5::/48"), &[]),
            entry(None, Some("2001:db9::/32"), &[]),
            entry(None, Some("203.0.113.0/24"), &[443]),
        ];
        let got = session_egress(&entries, &node, true).unwrap();
        assert_eq!(
            shown(&got.allow),
            [
                "2001:db8:5::/48",
                "2001:db9::/32 tcp 443",
                "203.0.113.0/24 tcp 443",
            ]
        );
        assert!(got.skipped.is_empty(), "{:?}", got.skipped);
        // The IPv4 ceiling never lets an IPv6 block through, nor the reverse.
        let v4_only = allow(&["0.0.0.0/0"]);
        let got = session_egress(&entries[..1], &v4_only, true).unwrap();
        assert!(got.allow.is_empty());
        assert!(got.skipped[0].contains("outside the node's allowlist"));
    }
}
