//! DNS messages, parsed and built with `hickory-proto` (never by hand):
//! what the guest asked and what to do with it, the query sent upstream,
//! the check of the upstream's answer, the reply to the guest, and the
//! addresses an answer opens.

use std::collections::BTreeSet;
use std::net::IpAddr;

use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{DNSClass, Name, RData, RecordType};

use super::names::{normalize_labels, NamePolicy, Ports};
use crate::network::addressing::Cidr;
use crate::network::rules::{Allow, Learned, LearnedTarget, Proto};

/// Shortest time a learned address stays allowed, whatever the record's TTL
/// (a guest caching the answer a little longer still connects).
pub const MIN_TTL_SECS: u32 = 30;
/// Longest time a learned address stays allowed without a new query.
pub const MAX_TTL_SECS: u32 = 3600;
/// The EDNS payload asked of upstreams.
pub const UPSTREAM_PAYLOAD: u16 = 4096;
/// CNAME links followed within one answer.
const MAX_CHAIN: usize = 16;
/// A records of one answer that are learned.
const MAX_ADDRESSES: usize = 32;

/// What to do with a datagram from the guest.
#[derive(Debug)]
pub enum Decision {
    /// Not a DNS message: dropped without a reply.
    Drop,
    /// Answer at once with these bytes, counted as malformed (a response, a
    /// message with no or several questions, an opcode other than QUERY).
    Refused(Vec<u8>),
    /// A name or type the session may not resolve: answer with these bytes
    /// and report the query.
    Denied {
        /// The name asked (normalized where possible, escaped otherwise).
        name: String,
        /// The record type asked.
        qtype: String,
        /// The reply.
        reply: Vec<u8>,
    },
    /// An allowed name's AAAA for a VM without IPv6: no records.
    NoData(Vec<u8>),
    /// An allowed name's A, CNAME or (with IPv6) AAAA: forward.
    Forward(Box<Forward>),
}

/// An allowed query to forward.
#[derive(Debug, Clone)]
pub struct Forward {
    /// The guest's message.
    pub request: Message,
    /// The question.
    pub query: Query,
    /// The normalized name asked.
    pub name: String,
    /// The ports its addresses open.
    pub ports: Ports,
}

/// A reply to `request` with `rcode`, echoing its question.
pub fn reply(request: &Message, rcode: ResponseCode) -> Vec<u8> {
    let mut m = Message::error_msg(request.id(), request.op_code(), rcode);
    m.set_recursion_desired(request.recursion_desired())
        .set_recursion_available(true);
    if request.queries().len() == 1 {
        m.add_queries(request.queries().iter().cloned());
    }
    // Built from a parsed message: encoding it cannot fail but on a name
    // too long, which parsing refused already; then no reply at all.
    m.to_vec().unwrap_or_default()
}

/// The dotted form of a name for the policy, or `None` when it has labels
/// no rule can match.
fn policy_name(name: &Name) -> Option<String> {
    normalize_labels(name.iter())
}

/// Decides what to do with `bytes` from the guest under `policy`; AAAA is
/// forwarded only with `ipv6` (the VM has IPv6).
pub fn decide(bytes: &[u8], policy: &NamePolicy, ipv6: bool) -> Decision {
    let Ok(request) = Message::from_vec(bytes) else {
        return Decision::Drop;
    };
    if request.message_type() != MessageType::Query
        || request.op_code() != OpCode::Query
        || request.queries().len() != 1
    {
        return Decision::Refused(reply(&request, ResponseCode::Refused));
    }
    let query = request.queries()[0].clone();
    let qtype = query.query_type();
    let normalized = policy_name(query.name());
    let ports = match &normalized {
        Some(n) if query.query_class() == DNSClass::IN => policy.ports(n),
        _ => None,
    };
    let denied = |rcode| Decision::Denied {
        name: normalized
            .clone()
            .unwrap_or_else(|| query.name().to_ascii()),
        qtype: qtype.to_string(),
        reply: reply(&request, rcode),
    };
    let forwarded =
        matches!(qtype, RecordType::A | RecordType::CNAME) || (ipv6 && qtype == RecordType::AAAA);
    match (ports, qtype) {
        (None, _) => denied(ResponseCode::NXDomain),
        (Some(ports), _) if forwarded => Decision::Forward(Box::new(Forward {
            name: normalized.unwrap_or_default(),
            request,
            query,
            ports,
        })),
        (Some(_), RecordType::AAAA) => Decision::NoData(reply(&request, ResponseCode::NoError)),
        // Another type of an allowed name: no records (an NXDOMAIN would make
        // the guest's cache forget the name's A record too), and reported.
        (Some(_), _) => denied(ResponseCode::NoError),
    }
}

/// The query sent upstream for `query` with transaction id `id`.
pub fn upstream_query(query: &Query, id: u16) -> Vec<u8> {
    let mut m = Message::new();
    m.set_id(id)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(true)
        .add_query(query.clone());
    let mut edns = Edns::new();
    edns.set_max_payload(UPSTREAM_PAYLOAD);
    m.set_edns(edns);
    m.to_vec().unwrap_or_default()
}

/// The upstream's answer in `bytes`, if it answers query `id` for `query`
/// (anything else, a stray or spoofed datagram, is `None`).
pub fn upstream_answer(bytes: &[u8], id: u16, query: &Query) -> Option<Message> {
    let m = Message::from_vec(bytes).ok()?;
    let same = m.id() == id
        && m.message_type() == MessageType::Response
        && m.queries().len() == 1
        && m.queries()[0].query_type() == query.query_type()
        && m.queries()[0].query_class() == query.query_class()
        && policy_name(m.queries()[0].name()) == policy_name(query.name());
    same.then_some(m)
}

/// The reply to the guest from the upstream's `answer`: the guest's id and
/// question, at most `limit` bytes (over it, truncated for a retry on TCP).
pub fn guest_reply(answer: &Message, request: &Message, limit: usize) -> Vec<u8> {
    let mut m = answer.clone();
    m.set_id(request.id());
    m.queries_mut().clone_from(&request.queries().to_vec());
    // The guest's EDNS, not the one host-agent sent.
    *m.extensions_mut() = request.extensions().clone();
    let bytes = m.to_vec().unwrap_or_default();
    if bytes.len() <= limit {
        return bytes;
    }
    m.truncate().to_vec().unwrap_or_default()
}

/// The largest UDP reply the guest's `request` takes.
pub fn udp_limit(request: &Message) -> usize {
    usize::from(request.max_payload()).min(usize::from(UPSTREAM_PAYLOAD))
}

/// The A and AAAA records of `answer` for `name` (normalized), following
/// CNAME chains within the answer, with their TTLs.
pub fn addresses(answer: &Message, name: &str) -> Vec<(IpAddr, u32)> {
    let mut chain: BTreeSet<String> = BTreeSet::from([name.to_string()]);
    // Each pass adds the targets of CNAMEs whose owner is on the chain.
    for _ in 0..MAX_CHAIN {
        let before = chain.len();
        for r in answer.answers() {
            if let RData::CNAME(target) = r.data() {
                let owner = policy_name(r.name());
                if owner.is_some_and(|o| chain.contains(&o)) {
                    if let Some(t) = policy_name(&target.0) {
                        chain.insert(t);
                    }
                }
            }
        }
        if chain.len() == before {
            break;
        }
    }
    answer
        .answers()
        .iter()
        .filter_map(|r| match r.data() {
            RData::A(a) if policy_name(r.name()).is_some_and(|o| chain.contains(&o)) => {
                Some((IpAddr::V4(a.0), r.ttl()))
            }
            RData::AAAA(a) if policy_name(r.name()).is_some_and(|o| chain.contains(&o)) => {
                Some((IpAddr::V6(a.0), r.ttl()))
            }
            _ => None,
        })
        .take(MAX_ADDRESSES)
        .collect()
}

/// A record's TTL as the time its address stays allowed.
pub fn clamp_ttl(ttl: u32) -> u32 {
    ttl.clamp(MIN_TTL_SECS, MAX_TTL_SECS)
}

/// What `addresses` open for `ports`, within the node's `ceiling`: an
/// element only where some ceiling entry covers it. For every port, the
/// whole address if the ceiling allows it, else the ports the ceiling names
/// for it.
pub fn learned(addresses: &[(IpAddr, u32)], ports: &Ports, ceiling: &[Allow]) -> Vec<Learned> {
    let covered = |a: Allow| ceiling.iter().any(|c| c.covers(&a));
    let mut out = BTreeSet::new();
    for &(addr, ttl) in addresses {
        let cidr = Cidr::host(addr);
        let mut targets = Vec::new();
        match ports {
            Ports::Any
                if covered(Allow {
                    cidr,
                    proto: None,
                    port: None,
                }) =>
            {
                targets.push(LearnedTarget::Any)
            }
            Ports::Any => {
                for c in ceiling.iter().filter(|c| c.cidr.contains(addr)) {
                    if let Some(port) = c.port {
                        match c.proto {
                            Some(p) => targets.push(LearnedTarget::Port(p, port)),
                            None => targets.extend([
                                LearnedTarget::Port(Proto::Tcp, port),
                                LearnedTarget::Port(Proto::Udp, port),
                            ]),
                        }
                    }
                }
            }
            Ports::Some(set) => {
                for &port in set {
                    for p in [Proto::Tcp, Proto::Udp] {
                        if covered(Allow {
                            cidr,
                            proto: Some(p),
                            port: Some(port),
                        }) {
                            targets.push(LearnedTarget::Port(p, port));
                        }
                    }
                }
            }
        }
        for target in targets {
            out.insert((addr, target, clamp_ttl(ttl)));
        }
    }
    // One element per address and target, with the longest TTL.
    let mut merged: Vec<Learned> = Vec::new();
    for (addr, target, ttl_secs) in out {
        match merged.last_mut() {
            Some(last) if last.addr == addr && last.target == target => {
                last.ttl_secs = last.ttl_secs.max(ttl_secs)
            }
            _ => merged.push(Learned {
                addr,
                target,
                ttl_secs,
            }),
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::dns::names::NameRule;
    use hickory_proto::rr::rdata::{A, AAAA, CNAME, TXT};
    use hickory_proto::rr::Record;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn name(s: &str) -> Name {
        Name::from_ascii(s).unwrap()
    }

    fn query_bytes(id: u16, n: &str, t: RecordType) -> Vec<u8> {
        let mut m = Message::new();
        m.set_id(id)
            .set_recursion_desired(true)
            .add_query(Query::query(name(n), t));
        m.to_vec().unwrap()
    }

    fn policy() -> NamePolicy {
        NamePolicy::new(&[
            NameRule {
                name: "allowed.test".into(),
                ports: vec![443],
            },
            NameRule {
                name: "*.wild.test".into(),
                ports: vec![],
            },
        ])
        .unwrap()
    }

    fn answer(records: Vec<Record>) -> Message {
        let mut m = Message::new();
        m.set_id(7)
            .set_message_type(MessageType::Response)
            .add_query(Query::query(name("allowed.test."), RecordType::A))
            .add_answers(records);
        m
    }

    fn a(owner: &str, ip: [u8; 4], ttl: u32) -> Record {
        Record::from_rdata(name(owner), ttl, RData::A(A(Ipv4Addr::from(ip))))
    }

    fn cname(owner: &str, target: &str) -> Record {
        Record::from_rdata(name(owner), 300, RData::CNAME(CNAME(name(target))))
    }

    #[test]
    fn allowed_a_queries_are_forwarded_and_others_answered_here() {
        let p = policy();
        match decide(&query_bytes(1, "Allowed.Test.", RecordType::A), &p, false) {
            Decision::Forward(f) => {
                assert_eq!(f.name, "allowed.test");
                assert_eq!(f.ports, Ports::Some([443].into()));
            }
            d => panic!("{d:?}"),
        }
        let Decision::Denied {
            name: asked,
            qtype,
            reply,
        } = decide(&query_bytes(2, "evil.test", RecordType::A), &p, false)
        else {
            panic!("denied");
        };
        assert_eq!((asked.as_str(), qtype.as_str()), ("evil.test", "A"));
        let r = Message::from_vec(&reply).unwrap();
        assert_eq!((r.id(), r.response_code()), (2, ResponseCode::NXDomain));
        assert_eq!(r.message_type(), MessageType::Response);
        assert_eq!(r.queries()[0].name(), &name("evil.test."));
        // AAAA of an allowed name: no records, not reported.
        let Decision::NoData(reply) =
            decide(&query_bytes(3, "x.wild.test", RecordType::AAAA), &p, false)
        else {
            panic!("no data");
        };
        let r = Message::from_vec(&reply).unwrap();
        assert_eq!(r.response_code(), ResponseCode::NoError);
        assert!(r.answers().is_empty());
        // TXT of an allowed name: no records, reported.
        let d = decide(&query_bytes(4, "allowed.test", RecordType::TXT), &p, false);
        assert!(
            matches!(&d, Decision::Denied { qtype, .. } if qtype == "TXT"),
            "{d:?}"
        );
        // The apex of a wildcard is not allowed.
        assert!(matches!(
            decide(&query_bytes(5, "wild.test", RecordType::A), &p, false),
            Decision::Denied { .. }
        ));
    }

    #[test]
    fn malformed_messages_are_dropped_or_refused() {
        let p = policy();
        for garbage in [
            &b""[..],
            b"\x00",
            b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",
        ] {
            assert!(matches!(decide(garbage, &p, false), Decision::Drop));
        }
        // Two questions.
        let mut m = Message::new();
        m.set_id(9)
            .add_query(Query::query(name("allowed.test"), RecordType::A))
            .add_query(Query::query(name("evil.test"), RecordType::A));
        let Decision::Refused(reply) = decide(&m.to_vec().unwrap(), &p, false) else {
            panic!("refused");
        };
        let r = Message::from_vec(&reply).unwrap();
        assert_eq!((r.id(), r.response_code()), (9, ResponseCode::Refused));
        // A response sent as a query.
        let resp = answer(vec![]).to_vec().unwrap();
        assert!(matches!(decide(&resp, &p, false), Decision::Refused(_)));
    }

    #[test]
    fn upstream_answers_must_match_id_and_question() {
        let q = Query::query(name("allowed.test."), RecordType::A);
        let good = answer(vec![a("allowed.test.", [203, 0, 113, 3], 60)]);
        let bytes = good.to_vec().unwrap();
        assert!(upstream_answer(&bytes, 7, &q).is_some());
        assert!(upstream_answer(&bytes, 8, &q).is_none(), "other id");
        let other = Query::query(name("evil.test."), RecordType::A);
        assert!(
            upstream_answer(&bytes, 7, &other).is_none(),
            "other question"
        );
        assert!(upstream_answer(b"junk", 7, &q).is_none());
        let sent = Message::from_vec(&upstream_query(&q, 77)).unwrap();
        assert_eq!(sent.id(), 77);
        assert!(sent.recursion_desired());
        assert_eq!(sent.max_payload(), UPSTREAM_PAYLOAD);
    }

    #[test]
    fn replies_take_the_guests_id_and_are_truncated_to_its_limit() {
        let request = Message::from_vec(&query_bytes(42, "allowed.test", RecordType::A)).unwrap();
        let records = (0..60)
            .map(|i| a("allowed.test.", [203, 0, 113, i], 60))
            .collect();
        let big = answer(records);
        let r = Message::from_vec(&guest_reply(&big, &request, 65535)).unwrap();
        assert_eq!((r.id(), r.answers().len(), r.truncated()), (42, 60, false));
        assert_eq!(udp_limit(&request), 512);
        let bytes = guest_reply(&big, &request, udp_limit(&request));
        assert!(bytes.len() <= 512);
        let r = Message::from_vec(&bytes).unwrap();
        assert!(r.truncated() && r.answers().is_empty());
    }

    #[test]
    fn a_records_follow_cname_chains_and_ttls_are_clamped() {
        let m = answer(vec![
            cname("Allowed.Test.", "edge.cdn.test."),
            cname("edge.cdn.test.", "node.cdn.test."),
            a("node.cdn.test.", [203, 0, 113, 10], 5),
            a("node.cdn.test.", [203, 0, 113, 11], 86400),
            // Not on the chain: a hostile upstream's extra.
            a("other.test.", [203, 0, 113, 12], 60),
            Record::from_rdata(
                name("allowed.test."),
                60,
                RData::TXT(TXT::new(vec!["x".into()])),
            ),
        ]);
        let found = addresses(&m, "allowed.test");
        assert_eq!(
            found,
            [
                (IpAddr::V4(Ipv4Addr::new(203, 0, 113, 10)), 5),
                (IpAddr::V4(Ipv4Addr::new(203, 0, 113, 11)), 86400)
            ]
        );
        assert_eq!(clamp_ttl(5), MIN_TTL_SECS);
        assert_eq!(clamp_ttl(86400), MAX_TTL_SECS);
        assert_eq!(clamp_ttl(300), 300);
        // A CNAME loop ends.
        let looped = answer(vec![
            cname("allowed.test.", "b.test."),
            cname("b.test.", "allowed.test."),
            a("b.test.", [203, 0, 113, 1], 60),
        ]);
        assert_eq!(addresses(&looped, "allowed.test").len(), 1);
    }

    fn allow(c: &str, proto: Option<Proto>, port: Option<u16>) -> Allow {
        Allow {
            cidr: Cidr::parse(c).unwrap(),
            proto,
            port,
        }
    }

    #[test]
    fn only_what_the_ceiling_covers_is_learned() {
        let ip = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 10));
        let outside = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1));
        let addrs = [(ip, 10), (outside, 60), (ip, 120)];
        let ceiling = [
            allow("203.0.113.0/24", Some(Proto::Tcp), None),
            allow("198.51.100.0/24", Some(Proto::Udp), Some(53)),
        ];
        let ports = Ports::Some([443, 80].into());
        let l = learned(&addrs, &ports, &ceiling);
        let port = |p, n| Learned {
            addr: ip,
            target: LearnedTarget::Port(p, n),
            ttl_secs: 120,
        };
        assert_eq!(l, [port(Proto::Tcp, 80), port(Proto::Tcp, 443)]);
        // Every port asked, the ceiling names ports: those ports.
        let l = learned(&addrs, &Ports::Any, &ceiling);
        assert_eq!(
            l,
            [Learned {
                addr: outside,
                target: LearnedTarget::Port(Proto::Udp, 53),
                ttl_secs: 60
            }]
        );
        // A ceiling allowing the whole block: the whole address.
        let l = learned(&addrs[..1], &Ports::Any, &[allow("0.0.0.0/0", None, None)]);
        assert_eq!(
            l,
            [Learned {
                addr: ip,
                target: LearnedTarget::Any,
                ttl_secs: MIN_TTL_SECS
            }]
        );
        assert!(
            learned(&addrs, &ports, &[]).is_empty(),
            "no ceiling, nothing"
        );
    }

    #[test]
    fn with_ipv6_aaaa_is_forwarded_and_its_addresses_learned() {
        let p = policy();
        match decide(&query_bytes(6, "allowed.test", RecordType::AAAA), &p, true) {
            Decision::Forward(f) => assert_eq!(f.query.query_type(), RecordType::AAAA),
            d => panic!("{d:?}"),
        }
        // A name not allowed is still NXDOMAIN, whatever the type.
        assert!(matches!(
            decide(&query_bytes(7, "evil.test", RecordType::AAAA), &p, true),
            Decision::Denied { .. }
        ));
        let v6 = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 10);
        let m = answer(vec![
            cname("allowed.test.", "node.cdn.test."),
            Record::from_rdata(name("node.cdn.test."), 90, RData::AAAA(AAAA(v6))),
            Record::from_rdata(
                name("other.test."),
                90,
                RData::AAAA(AAAA(Ipv6Addr::LOCALHOST)),
            ),
        ]);
        let found = addresses(&m, "allowed.test");
        assert_eq!(found, [(IpAddr::V6(v6), 90)]);
        // Learned within the IPv6 ceiling only.
        let l = learned(&found, &Ports::Any, &[allow("2001:db8::/32", None, None)]);
        assert_eq!(
            l,
            [Learned {
                addr: IpAddr::V6(v6),
                target: LearnedTarget::Any,
                ttl_secs: 90
            }]
        );
        assert!(learned(&found, &Ports::Any, &[allow("0.0.0.0/0", None, None)]).is_empty());
    }
}
