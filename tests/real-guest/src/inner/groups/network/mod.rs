//! Group `network`: sessions' networks in the real guest. host-agent runs
//! with `network` configured, the outer VM standing for the node and an
//! "internet" namespace ([`internet`]) holding the servers and the DNS
//! server its per-session resolvers ask. The repository's manifest grants
//! the agent the name [`ALLOWED_NAME`] on the servers' ports and the block
//! 203.0.113.0/24, which the node does not allow.
//!
//! The guest's tools are the image's own: bash (its `/dev/tcp`), perl (a
//! DNS query by hand, straight to the resolver, past `/etc/hosts`; a TCP
//! echo server), getent, hostname, sha256sum.

mod internet;
mod ipv6;
mod scripts;
mod transfer;

use std::io::{BufRead, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use proto::hostagent as pb;
use sha2::{Digest, Sha256};
use tonic::transport::Channel;

use super::node::{
    create_running, exec, expect_ok, git, keep_logs, register_and_build, ExecResult, HostAgent,
};
use crate::inner::{Check, Ctx};
use internet::{
    Internet, ACK_PORT, ALLOWED_NAME, DENIED_NAME, OUTSIDE_IP, PING_PORT, SERVER_IP, SINK_PORT,
    SOURCE_BYTES, SOURCE_PORT, TOGETHER_PORT, UNGRANTED_IP,
};
pub use ipv6::ipv6;
use scripts::*;
pub use transfer::{expose, throughput};

/// The resolver's address as the guest sees it: its gateway.
const RESOLVER: &str = "172.16.0.1";
/// The guest's address in every clone.
const GUEST_IP: &str = "172.16.0.2";
/// The guest port the `net-expose` scenario listens on.
const EXPOSED_PORT: u16 = 8080;
/// Bytes the `net-expose` scenario sends through the exposed port.
const EXPOSE_BYTES: usize = 1 << 20;
/// Bytes the guest uploads in `net-throughput`.
const UPLOAD_BYTES: usize = 8 << 20;

/// What the group's scenarios share: the internet, the repository, the
/// first session (host-agent itself is `Fixtures::agent`).
pub struct Net {
    internet: Internet,
    repo: PathBuf,
    /// Whether the golden snapshot is built.
    golden: bool,
    session: Option<pb::Session>,
}

/// The repository the sessions work on; its manifest grants the egress.
fn repository(ctx: &Ctx) -> Result<PathBuf, String> {
    let repo = ctx.scratch.join("net-repo");
    if repo.join(".git").exists() {
        return Ok(repo);
    }
    std::fs::create_dir_all(repo.join("agents")).map_err(|e| e.to_string())?;
    git(&repo, &["init", "-q", "-b", "main"])?;
    std::fs::write(repo.join("agents/coder.md"), RULES).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(repo.join("net")).map_err(|e| e.to_string())?;
    for (path, text) in SCRIPTS {
        std::fs::write(repo.join(path), text).map_err(|e| e.to_string())?;
    }
    let manifest = format!(
        "version: 1\nagents:\n  coder:\n    egress:\n      - host: {ALLOWED_NAME}\n        ports: [{ACK_PORT}, {SINK_PORT}, {SOURCE_PORT}, {TOGETHER_PORT}, {PING_PORT}]\n      - cidr: 203.0.113.0/24\n        ports: [{ACK_PORT}]\n"
    );
    std::fs::write(repo.join("agent-manifest.yaml"), manifest).map_err(|e| e.to_string())?;
    git(&repo, &["add", "-A"])?;
    git(&repo, &["commit", "-q", "-m", "network scenarios"])?;
    Ok(repo)
}

/// host-agent's `network` settings: the outer VM is the node (host-agent
/// manages its forwarding and masquerading, IPv4 and IPv6), the node allows
/// TCP to the internet's 198.51.100.0/24 and 2001:db8:100::/64 only, and
/// the resolvers ask the internet's DNS server.
fn network_settings() -> serde_json::Value {
    serde_json::json!({
        "pool": ["10.200.0.0/24", "fd00:200::/112"],
        "allow": ["198.51.100.0/24 tcp", "2001:db8:100::/64 tcp"],
        "dns_upstreams": [format!("{SERVER_IP}:53")],
        "expose_address": "127.0.0.1",
    })
}

/// Builds what is missing of the shared fixtures: the internet, host-agent
/// with `network` and the golden snapshot, the first session.
fn ready(ctx: &mut Ctx) -> Result<pb::Session, String> {
    if ctx.fixtures.net.is_none() {
        let internet = Internet::start()?;
        let repo = repository(ctx)?;
        ctx.fixtures.net = Some(Net {
            internet,
            repo,
            golden: false,
            session: None,
        });
    }
    let golden = ctx.fixtures.net.as_ref().is_some_and(|n| n.golden);
    if !golden {
        ctx.fixtures.agent = None;
        let a = HostAgent::start_with(ctx, 0, Some(network_settings()))?;
        ctx.fixtures.agent = Some(a);
        if let Err(e) = register_and_build(ctx) {
            ctx.fixtures.agent = None;
            return Err(e);
        }
        if let Some(n) = ctx.fixtures.net.as_mut() {
            n.golden = true;
        }
    }
    if let Some(s) = ctx.fixtures.net.as_ref().and_then(|n| n.session.clone()) {
        return Ok(s);
    }
    let (a, net) = parts(ctx)?;
    let (s, secs) = create_running(a, &a.channel()?, &net.repo)?;
    ctx.info(
        "net-resolve",
        &format!("session {} RUNNING in {secs:.1} s", s.session_id),
    );
    if let Some(n) = ctx.fixtures.net.as_mut() {
        n.session = Some(s.clone());
    }
    Ok(s)
}

fn parts(ctx: &Ctx) -> Result<(&HostAgent, &Net), String> {
    let a = ctx.fixtures.agent.as_ref().ok_or("no host-agent")?;
    let n = ctx.fixtures.net.as_ref().ok_or("no network fixtures")?;
    Ok((a, n))
}

/// Runs a scenario body on the shared session, keeping the logs after.
fn scenario(
    ctx: &mut Ctx,
    name: &str,
    body: impl FnOnce(&Ctx, &str, &pb::Session) -> Check,
) -> Check {
    let r = ready(ctx).and_then(|s| body(ctx, name, &s));
    keep_logs(ctx);
    if r.as_ref().is_err_and(|e| e.contains("no output for")) {
        // The shared session stopped answering: the next scenario gets a
        // new one rather than the same wait.
        if let Some(n) = ctx.fixtures.net.as_mut() {
            n.session = None;
        }
    }
    r
}

/// Runs `argv` in session `s`, to its end.
fn run(a: &HostAgent, ch: &Channel, s: &pb::Session, argv: &[&str]) -> Result<ExecResult, String> {
    a.block_on(exec(ch.clone(), s, argv))
}

/// Queries `name` (type `qtype`, `A` or `AAAA`) from the guest straight at
/// the resolver; (rcode, answers).
fn guest_dns(
    a: &HostAgent,
    ch: &Channel,
    s: &pb::Session,
    name: &str,
    qtype: &str,
) -> Result<(u8, Vec<IpAddr>), String> {
    let r = run(
        a,
        ch,
        s,
        &["perl", "net/dns.pl", name, RESOLVER, "53", qtype],
    )?;
    expect_ok(&format!("the DNS query for {name}"), &r)?;
    parse_dns_line(&r.stdout).ok_or_else(|| format!("the DNS query printed {:?}", r.stdout))
}

/// Reads `rcode=N answers=A,B` out of [`DNS_QUERY`]'s line.
fn parse_dns_line(text: &str) -> Option<(u8, Vec<IpAddr>)> {
    let mut rcode = None;
    let mut answers = Vec::new();
    for word in text.split_whitespace() {
        if let Some(v) = word.strip_prefix("rcode=") {
            rcode = v.parse().ok();
        } else if let Some(v) = word.strip_prefix("answers=") {
            for a in v.split(',').filter(|a| !a.is_empty()) {
                answers.push(a.parse().ok()?);
            }
        }
    }
    Some((rcode?, answers))
}

/// (a) The guest's resolv.conf names the session's resolver, which answers
/// the granted name (asking the internet's DNS server), and the guest
/// reaches the server by that name.
pub fn resolve(ctx: &mut Ctx, name: &str) -> Check {
    scenario(ctx, name, |ctx, _name, s| {
        let (a, net) = parts(ctx)?;
        let ch = a.channel()?;
        let r = run(a, &ch, s, &["cat", "/etc/resolv.conf"])?;
        expect_ok("cat /etc/resolv.conf", &r)?;
        if !r
            .stdout
            .lines()
            .any(|l| l.trim() == format!("nameserver {RESOLVER}"))
        {
            return Err(format!(
                "the guest's /etc/resolv.conf does not name {RESOLVER}: {:?}",
                r.stdout
            ));
        }
        // guest-init resolved the granted name at session start: through
        // the resolver, which asked the internet's server.
        let at_start = net
            .internet
            .with(|s| s.dns.get(ALLOWED_NAME).copied().unwrap_or(0));
        if at_start == 0 {
            return Err(format!(
                "the internet's DNS server was never asked for {ALLOWED_NAME}"
            ));
        }
        let (rcode, answers) = guest_dns(a, &ch, s, ALLOWED_NAME, "A")?;
        if rcode != 0 || answers != [IpAddr::V4(SERVER_IP)] {
            return Err(format!(
                "the resolver answered {ALLOWED_NAME} with rcode {rcode} and {answers:?}, not {SERVER_IP}"
            ));
        }
        let before = net
            .internet
            .with(|s| s.acks.get(&SERVER_IP.into()).copied().unwrap_or(0));
        let port = ACK_PORT.to_string();
        let r = run(
            a,
            &ch,
            s,
            &["bash", "net/line.sh", ALLOWED_NAME, &port, "by-name"],
        )?;
        expect_ok(&format!("connecting to {ALLOWED_NAME}:{ACK_PORT}"), &r)?;
        let after = net
            .internet
            .with(|s| s.acks.get(&SERVER_IP.into()).copied().unwrap_or(0));
        if r.stdout.trim() != "ack by-name" || after != before + 1 {
            return Err(format!(
                "by name: the guest read {:?}; the server answered {} connection(s)",
                r.stdout,
                after - before
            ));
        }
        Ok(format!(
            "resolv.conf names {RESOLVER}; the resolver answered {ALLOWED_NAME} = {SERVER_IP} (the upstream was asked {at_start} time(s) at session start); by name to {SERVER_IP}:{ACK_PORT}: \"ack by-name\""
        ))
    })
}

/// The first event of session `s` with `reason` whose detail holds `needle`,
/// waiting up to `wait` for it.
fn wait_event(
    a: &HostAgent,
    ch: &Channel,
    s: &pb::Session,
    reason: &str,
    needle: &str,
    wait: Duration,
) -> Result<pb::Event, String> {
    a.block_on(async {
        let mut stream = pb::events_client::EventsClient::new(ch.clone())
            .watch(pb::WatchRequest {
                since_seq: 0,
                session_id: s.session_id.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("Watch: {}", e.message()))?
            .into_inner();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match tokio::time::timeout_at(deadline, stream.message()).await {
                Ok(Ok(Some(e))) if e.reason == reason && e.detail.contains(needle) => return Ok(e),
                Ok(Ok(Some(_))) => continue,
                Ok(Ok(None)) => return Err("the event stream ended".into()),
                Ok(Err(e)) => return Err(format!("Watch: {}", e.message())),
                Err(_) => {
                    return Err(format!(
                        "no {reason} event for {needle} within {} s",
                        wait.as_secs()
                    ))
                }
            }
        }
    })
}

/// (b) A name the manifest does not grant: NXDOMAIN from the resolver (to a
/// direct query and to the guest's own resolver library), never asked
/// upstream, and a `dns_denied` event.
pub fn dns_denied(ctx: &mut Ctx, name: &str) -> Check {
    scenario(ctx, name, |ctx, _name, s| {
        let (a, net) = parts(ctx)?;
        let ch = a.channel()?;
        let (rcode, answers) = guest_dns(a, &ch, s, DENIED_NAME, "A")?;
        if rcode != 3 || !answers.is_empty() {
            return Err(format!(
                "the resolver answered {DENIED_NAME} with rcode {rcode} and {answers:?}, not NXDOMAIN (3)"
            ));
        }
        let r = run(a, &ch, s, &["getent", "hosts", DENIED_NAME])?;
        if r.code() != Some(2) {
            return Err(format!(
                "getent hosts {DENIED_NAME} in the guest: exit {:?}, {:?} (2: not found, expected)",
                r.code(),
                r.stdout
            ));
        }
        let upstream = net
            .internet
            .with(|s| s.dns.get(DENIED_NAME).copied().unwrap_or(0));
        if upstream != 0 {
            return Err(format!(
                "the resolver asked upstream for {DENIED_NAME} {upstream} time(s)"
            ));
        }
        let e = wait_event(
            a,
            &ch,
            s,
            "dns_denied",
            DENIED_NAME,
            Duration::from_secs(60),
        )?;
        Ok(format!(
            "{DENIED_NAME}: NXDOMAIN to a direct query and to getent, never asked upstream; event dns_denied \"{}\"",
            e.detail
        ))
    })
}

/// Connects from the outer VM (the node) to `ip`:[`ACK_PORT`] and expects
/// the ack: the server is there, so a guest that cannot reach it was
/// stopped on the way.
fn node_reaches(ip: IpAddr) -> Result<(), String> {
    let mut c =
        TcpStream::connect_timeout(&SocketAddr::from((ip, ACK_PORT)), Duration::from_secs(10))
            .map_err(|e| format!("the node cannot reach {ip}:{ACK_PORT} itself: {e}"))?;
    c.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    c.write_all(b"from-the-node\n").map_err(|e| e.to_string())?;
    let mut line = String::new();
    std::io::BufReader::new(c)
        .read_line(&mut line)
        .map_err(|e| format!("{ip}:{ACK_PORT} did not answer the node: {e}"))?;
    if line.trim() != "ack from-the-node" {
        return Err(format!("{ip}:{ACK_PORT} answered the node {line:?}"));
    }
    Ok(())
}

/// The guest's attempt at `ip`:[`ACK_PORT`] by literal address: its
/// output and `rc=N` (124: timed out, the packets dropped on the way).
fn guest_connects(
    a: &HostAgent,
    ch: &Channel,
    s: &pb::Session,
    ip: IpAddr,
) -> Result<String, String> {
    let (ip, port) = (ip.to_string(), ACK_PORT.to_string());
    let r = run(a, ch, s, &["bash", "net/try.sh", &ip, &port])?;
    Ok(r.stdout.trim().replace('\n', " | "))
}

/// (c) Literal addresses the session may not reach stay unreachable (the
/// node reaches both): one in the node's allowlist that the manifest does
/// not grant, and one the manifest grants but the node's allowlist does not
/// hold (the guest's own table lets it out; host-agent's rules drop it).
/// The granted server by its literal address still answers.
pub fn ip_denied(ctx: &mut Ctx, name: &str) -> Check {
    scenario(ctx, name, |ctx, _name, s| {
        let (a, net) = parts(ctx)?;
        let ch = a.channel()?;
        let mut notes = Vec::new();
        for ip in [UNGRANTED_IP, OUTSIDE_IP] {
            node_reaches(ip.into())?;
            let before = net
                .internet
                .with(|s| s.acks.get(&ip.into()).copied().unwrap_or(0));
            let out = guest_connects(a, &ch, s, ip.into())?;
            let after = net
                .internet
                .with(|s| s.acks.get(&ip.into()).copied().unwrap_or(0));
            if out.contains("ack by-ip") || out.ends_with("rc=0") || after != before {
                return Err(format!(
                    "the guest reached {ip}:{ACK_PORT}, which it may not: {out:?}"
                ));
            }
            notes.push(format!("{ip}: {out}"));
        }
        let out = guest_connects(a, &ch, s, SERVER_IP.into())?;
        if !out.contains("ack by-ip") {
            return Err(format!(
                "the granted server {SERVER_IP} by literal address: {out:?}"
            ));
        }
        Ok(format!(
            "unreachable from the guest (the node reaches both): {}; {SERVER_IP} answers",
            notes.join("; ")
        ))
    })
}

/// (d) A second session restored from the same golden snapshot: both
/// guests, with the same address, hold a connection to the server at once.
pub fn clones(ctx: &mut Ctx, name: &str) -> Check {
    scenario(ctx, name, |ctx, name, s1| {
        let (a, net) = parts(ctx)?;
        let ch = a.channel()?;
        let (s2, secs) = create_running(a, &ch, &net.repo)?;
        ctx.info(
            name,
            &format!("second session {} RUNNING in {secs:.1} s", s2.session_id),
        );
        let port = TOGETHER_PORT.to_string();
        let argv = ["bash", "net/meet.sh", ALLOWED_NAME, port.as_str()];
        let (r1, r2) = a.block_on(async {
            tokio::join!(exec(ch.clone(), s1, &argv), exec(ch.clone(), &s2, &argv))
        });
        let stop = a.block_on(async {
            let mut c = pb::sessions_client::SessionsClient::new(ch.clone());
            let call = pb::SessionCall {
                session_id: s2.session_id.clone(),
                idempotency_key: String::new(),
            };
            c.stop_session(call.clone())
                .await
                .map_err(|e| format!("StopSession: {}", e.message()))?;
            c.delete_session(call)
                .await
                .map_err(|e| format!("DeleteSession: {}", e.message()))
        });
        let (r1, r2) = (r1?, r2?);
        let mut outs = Vec::new();
        for (i, r) in [(1, &r1), (2, &r2)] {
            expect_ok(&format!("session {i}'s connection"), r)?;
            let words: Vec<&str> = r.stdout.split_whitespace().collect();
            if words.first() != Some(&"together") || !words.contains(&GUEST_IP) {
                return Err(format!(
                    "session {i}: {:?} (expected \"together\" and {GUEST_IP})",
                    r.stdout
                ));
            }
            outs.push(r.stdout.trim().to_string());
        }
        stop?;
        let meetings = net.internet.with(|s| s.meetings.clone());
        let last = meetings.last().cloned().unwrap_or_default();
        Ok(format!(
            "both guests at {GUEST_IP} held a connection at once ({}); the server saw them from {last:?}",
            outs.join(" / ")
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_lines_parse() {
        assert_eq!(
            parse_dns_line("id=16962 rcode=0 answers=198.51.100.1\n"),
            Some((0, vec![IpAddr::V4(SERVER_IP)]))
        );
        assert_eq!(
            parse_dns_line("id=1 rcode=0 answers=2001:0db8:0100:0000:0000:0000:0000:0001\n"),
            Some((0, vec![IpAddr::V6(internet::SERVER_IP6)]))
        );
        assert_eq!(parse_dns_line("id=1 rcode=3 answers=\n"), Some((3, vec![])));
        assert_eq!(parse_dns_line("no answer in 10 s"), None);
    }

    /// The guest's perl query against the internet's DNS server, here.
    #[test]
    fn the_perl_query_reads_the_test_dns_server() {
        if std::process::Command::new("perl")
            .arg("-v")
            .output()
            .is_err()
        {
            println!("SKIPPED: no perl here");
            return;
        }
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = sock.local_addr().unwrap().port().to_string();
        let seen: std::sync::Arc<(std::sync::Mutex<internet::Seen>, std::sync::Condvar)> =
            Default::default();
        let s = seen.clone();
        std::thread::spawn(move || internet::dns(sock, s));
        let ask_type = |name: &str, qtype: &str| {
            let out = std::process::Command::new("perl")
                .args(["-e", DNS_QUERY, name, "127.0.0.1", &port, qtype])
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
            parse_dns_line(&String::from_utf8_lossy(&out.stdout)).unwrap()
        };
        let ask = |name: &str| ask_type(name, "A");
        assert_eq!(ask(ALLOWED_NAME), (0, vec![IpAddr::V4(SERVER_IP)]));
        assert_eq!(ask(DENIED_NAME), (0, vec![IpAddr::V4(SERVER_IP)]));
        assert_eq!(
            ask_type(ALLOWED_NAME, "AAAA"),
            (0, vec![IpAddr::V6(internet::SERVER_IP6)])
        );
        assert_eq!(ask("other.rg.test"), (3, vec![]));
        let counts = seen.0.lock().unwrap().dns.clone();
        assert_eq!(counts.get(ALLOWED_NAME), Some(&2));
        assert_eq!(counts.get("other.rg.test"), Some(&1));
    }
}
