//! `net-ipv6`: a session's IPv6 in the real guest. host-agent's node has an
//! IPv6 pool, so the guest's fixed `fd00:ac10::2/126` (guest-init applies
//! the golden boot's `ip6=` parameter) is forwarded through the VM's
//! namespace and masqueraded behind the node's IPv6 address.

use std::net::IpAddr;

use super::internet::{ACK_PORT, ALLOWED_NAME, NODE_IP6, SERVER_IP6, UNGRANTED_IP6};
use super::{expect_ok, guest_connects, guest_dns, node_reaches, parts, run, scenario};
use crate::inner::{Check, Ctx};

/// The guest's IPv6 address as `/proc/net/if_inet6` writes it.
const GUEST_IP6_HEX: &str = "fd00ac10000000000000000000000002";

/// (g) The guest has its fixed IPv6 address (not tentative) and route; the
/// resolver answers the granted name's AAAA with the server's IPv6 address,
/// which then answers the guest, seeing it from the node's address; an
/// IPv6 address the session is not granted stays unreachable (the node
/// reaches it).
pub fn ipv6(ctx: &mut Ctx, name: &str) -> Check {
    scenario(ctx, name, |ctx, _name, s| {
        let (a, net) = parts(ctx)?;
        let ch = a.channel()?;
        let r = run(a, &ch, s, &["cat", "/proc/net/if_inet6"])?;
        expect_ok("cat /proc/net/if_inet6", &r)?;
        let line = r
            .stdout
            .lines()
            .find(|l| l.starts_with(GUEST_IP6_HEX))
            .ok_or_else(|| format!("the guest has no fd00:ac10::2: {:?}", r.stdout))?
            .to_string();
        let fields: Vec<&str> = line.split_whitespace().collect();
        let flags = fields
            .get(4)
            .and_then(|f| u32::from_str_radix(f, 16).ok())
            .ok_or_else(|| format!("an if_inet6 line without flags: {line:?}"))?;
        if fields.get(2) != Some(&"7e") || flags & 0x40 != 0 {
            return Err(format!(
                "fd00:ac10::2 is not a usable /126 (prefix {:?}, flags {flags:#x}): {line:?}",
                fields.get(2)
            ));
        }
        let r = run(a, &ch, s, &["cat", "/proc/net/ipv6_route"])?;
        if !r.stdout.lines().any(|l| {
            l.starts_with("00000000000000000000000000000000 00 ")
                && l.contains("fd00ac10000000000000000000000001")
        }) {
            return Err(format!(
                "the guest has no IPv6 default route via fd00:ac10::1: {:?}",
                r.stdout
            ));
        }

        let (rcode, answers) = guest_dns(a, &ch, s, ALLOWED_NAME, "AAAA")?;
        if rcode != 0 || answers != [IpAddr::V6(SERVER_IP6)] {
            return Err(format!(
                "the resolver answered {ALLOWED_NAME} AAAA with rcode {rcode} and {answers:?}, not {SERVER_IP6}"
            ));
        }
        let out = guest_connects(a, &ch, s, SERVER_IP6.into())?;
        if !out.contains("ack by-ip") {
            return Err(format!(
                "the granted server at {SERVER_IP6} after its AAAA answer: {out:?}"
            ));
        }
        let peer = net.internet.with(|seen| seen.ack_peers.last().copied());
        if peer != Some(IpAddr::V6(NODE_IP6)) {
            return Err(format!(
                "the server saw the guest from {peer:?}, not masqueraded behind the node's {NODE_IP6}"
            ));
        }

        node_reaches(UNGRANTED_IP6.into())?;
        let before = net.internet.with(|seen| {
            seen.acks
                .get(&IpAddr::V6(UNGRANTED_IP6))
                .copied()
                .unwrap_or(0)
        });
        let denied = guest_connects(a, &ch, s, UNGRANTED_IP6.into())?;
        let after = net.internet.with(|seen| {
            seen.acks
                .get(&IpAddr::V6(UNGRANTED_IP6))
                .copied()
                .unwrap_or(0)
        });
        if denied.contains("ack by-ip") || denied.ends_with("rc=0") || after != before {
            return Err(format!(
                "the guest reached [{UNGRANTED_IP6}]:{ACK_PORT}, which it may not: {denied:?}"
            ));
        }
        Ok(format!(
            "guest at fd00:ac10::2/126 (not tentative) with its default route; {ALLOWED_NAME} AAAA = {SERVER_IP6}; [{SERVER_IP6}]:{ACK_PORT} answered \"{out}\", seeing {NODE_IP6}; [{UNGRANTED_IP6}]:{ACK_PORT} unreachable from the guest (the node reaches it): {denied}"
        ))
    })
}
