//! The "internet" the `network` group's guests reach: a network namespace
//! joined to the outer VM's own (which stands for the node) by a veth pair,
//! with the servers the scenarios talk to and a DNS server that host-agent's
//! per-session resolvers ask.
//!
//! ```text
//! outer VM (the node)  rg-up 198.51.100.254/24 ──veth── eth0 in rg-inet:
//!                      route 203.0.113.0/24 via .1        198.51.100.1/24 (allowed, named)
//!                                                         198.51.100.2/24 (never granted)
//!                                                         203.0.113.1/24  (granted, outside the node's allowlist)
//!                      rg-up 2001:db8:100::fe/64          2001:db8:100::1/64 (allowed, named: AAAA)
//!                                                         2001:db8:100::2/64 (never granted)
//! ```
//!
//! Servers, bound on every address of rg-inet: an `ack` line server
//! ([`ACK_PORT`]), a sink ([`SINK_PORT`]) and a source ([`SOURCE_PORT`])
//! that time bulk transfers, a meeting point ([`TOGETHER_PORT`]) that answers
//! only once two connections wait at once, and a ping server ([`PING_PORT`])
//! that times line round trips; the `ack` server also listens on the two
//! IPv6 addresses. The DNS server ([`DNS_PORT`], UDP) answers both
//! [`ALLOWED_NAME`] and [`DENIED_NAME`] with [`SERVER_IP`] (A) and
//! [`SERVER_IP6`] (AAAA) and counts every query by name, so a scenario can
//! tell what host-agent forwarded.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, ResponseCode};

use crate::inner::net::ip;
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{RData, Record, RecordType};

/// The namespace.
pub const NETNS: &str = "rg-inet";
/// The node's end of the veth pair.
const NODE_IF: &str = "rg-up";
/// The node's address on the link.
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 254);
/// The node's IPv6 address on the link.
pub const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0xfe);
/// The server the allowed name's AAAA record points at.
pub const SERVER_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 1);
/// An IPv6 address in the node's allowlist that no session is granted.
pub const UNGRANTED_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 2);
/// The server the allowed name points at.
pub const SERVER_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
/// An address in the node's allowlist that no session is granted.
pub const UNGRANTED_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
/// An address the manifest grants (as a `cidr`) but the node does not allow.
pub const OUTSIDE_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
/// The name the manifest grants.
pub const ALLOWED_NAME: &str = "allowed.rg.test";
/// A name the DNS server knows but no manifest grants.
pub const DENIED_NAME: &str = "denied.rg.test";
/// Answers each line with `ack <line>`.
pub const ACK_PORT: u16 = 7000;
/// Reads to EOF, timing it.
pub const SINK_PORT: u16 = 7001;
/// Sends [`SOURCE_BYTES`], timing it, then closes.
pub const SOURCE_PORT: u16 = 7002;
/// Answers a line once two connections wait at once.
pub const TOGETHER_PORT: u16 = 7003;
/// Sends [`PING_ROUNDS`] lines, each after the last came back, timing each.
pub const PING_PORT: u16 = 7004;
/// The DNS server's port.
pub const DNS_PORT: u16 = 53;
/// What the source sends.
pub const SOURCE_BYTES: usize = 16 << 20;
/// Round trips the ping server times.
pub const PING_ROUNDS: usize = 100;

/// One timed bulk transfer, as the server saw it.
#[derive(Debug, Clone, Copy)]
pub struct Transfer {
    /// Bytes carried.
    pub bytes: usize,
    /// From the first byte (sink) or the connection (source) to the last.
    pub secs: f64,
}

/// What the servers saw.
#[derive(Debug, Default)]
pub struct Seen {
    /// `ack` connections answered, by the local address they came to.
    pub acks: HashMap<IpAddr, usize>,
    /// The peer of each `ack` connection, in order.
    pub ack_peers: Vec<IpAddr>,
    /// DNS queries, by lower-case name without the final dot.
    pub dns: HashMap<String, usize>,
    /// Sink transfers.
    pub sunk: Vec<Transfer>,
    /// Source transfers.
    pub sourced: Vec<Transfer>,
    /// Round-trip times of each ping connection, in seconds.
    pub pings: Vec<Vec<f64>>,
    /// Meetings: the peers that were answered together.
    pub meetings: Vec<Vec<SocketAddr>>,
    /// Connections waiting at the meeting point.
    waiting: Vec<SocketAddr>,
    /// Meetings completed so far (the generation waiting connections wait for).
    met: usize,
}

/// The namespace and its servers; the namespace goes on drop (the servers'
/// sockets with it).
pub struct Internet {
    /// What the servers saw.
    pub seen: Arc<(Mutex<Seen>, Condvar)>,
}

/// Locks `m`, whatever a panicking holder left (the counters stay usable).
fn lock(m: &Mutex<Seen>) -> std::sync::MutexGuard<'_, Seen> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Internet {
    /// Makes the namespace and the link, and starts the servers in it.
    pub fn start() -> Result<Internet, String> {
        let _ = ip(&["netns", "del", NETNS]);
        let _ = ip(&["link", "del", NODE_IF]);
        ip(&["netns", "add", NETNS])?;
        ip(&[
            "link", "add", NODE_IF, "type", "veth", "peer", "name", "eth0", "netns", NETNS,
        ])?;
        ip(&["addr", "add", &format!("{NODE_IP}/24"), "dev", NODE_IF])?;
        ip(&["link", "set", NODE_IF, "up"])?;
        for a in [
            format!("{SERVER_IP}/24"),
            format!("{UNGRANTED_IP}/24"),
            format!("{OUTSIDE_IP}/24"),
        ] {
            ip(&["-n", NETNS, "addr", "add", &a, "dev", "eth0"])?;
        }
        for a in [format!("{SERVER_IP6}/64"), format!("{UNGRANTED_IP6}/64")] {
            ip(&["-n", NETNS, "addr", "add", &a, "dev", "eth0", "nodad"])?;
        }
        ip(&[
            "addr",
            "add",
            &format!("{NODE_IP6}/64"),
            "dev",
            NODE_IF,
            "nodad",
        ])?;
        ip(&["-n", NETNS, "link", "set", "lo", "up"])?;
        ip(&["-n", NETNS, "link", "set", "eth0", "up"])?;
        ip(&[
            "-n",
            NETNS,
            "route",
            "add",
            "default",
            "via",
            &NODE_IP.to_string(),
        ])?;
        ip(&[
            "-n",
            NETNS,
            "route",
            "add",
            "::/0",
            "via",
            &NODE_IP6.to_string(),
        ])?;
        ip(&[
            "route",
            "add",
            "203.0.113.0/24",
            "via",
            &SERVER_IP.to_string(),
        ])?;
        let seen: Arc<(Mutex<Seen>, Condvar)> = Arc::default();
        let (tx, rx) = std::sync::mpsc::channel();
        let s = seen.clone();
        // The servers' sockets are made by a thread that joined the
        // namespace (a thread's namespace is its own; the process stays in
        // the outer VM's), and belong to it for good.
        std::thread::spawn(move || {
            let _ = tx.send(enter_and_serve(s));
        });
        rx.recv_timeout(Duration::from_secs(30))
            .map_err(|_| "the internet's servers did not start within 30 s".to_string())??;
        Ok(Internet { seen })
    }

    /// A snapshot of a counter, read under the lock.
    pub fn with<T>(&self, f: impl FnOnce(&Seen) -> T) -> T {
        f(&lock(&self.seen.0))
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        let _ = ip(&["route", "del", "203.0.113.0/24"]);
        let _ = ip(&["link", "del", NODE_IF]);
        let _ = ip(&["netns", "del", NETNS]);
    }
}

fn enter_and_serve(seen: Arc<(Mutex<Seen>, Condvar)>) -> Result<(), String> {
    let ns = std::fs::File::open(format!("/run/netns/{NETNS}"))
        .map_err(|e| format!("opening /run/netns/{NETNS}: {e}"))?;
    // SAFETY: setns(2) on a namespace file we hold open; it changes only
    // this thread's network namespace.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!(
            "joining {NETNS}: {}",
            std::io::Error::last_os_error()
        ));
    }
    let tcp = |port: u16| {
        TcpListener::bind((Ipv4Addr::UNSPECIFIED, port))
            .map_err(|e| format!("binding port {port} in {NETNS}: {e}"))
    };
    serve(tcp(ACK_PORT)?, seen.clone(), ack);
    for v6 in [SERVER_IP6, UNGRANTED_IP6] {
        let l = TcpListener::bind((v6, ACK_PORT))
            .map_err(|e| format!("binding [{v6}]:{ACK_PORT} in {NETNS}: {e}"))?;
        serve(l, seen.clone(), ack);
    }
    serve(tcp(SINK_PORT)?, seen.clone(), sink);
    serve(tcp(SOURCE_PORT)?, seen.clone(), source);
    serve(tcp(TOGETHER_PORT)?, seen.clone(), together);
    serve(tcp(PING_PORT)?, seen.clone(), ping);
    let udp = UdpSocket::bind((SERVER_IP, DNS_PORT))
        .map_err(|e| format!("binding {SERVER_IP}:{DNS_PORT} in {NETNS}: {e}"))?;
    std::thread::spawn(move || dns(udp, seen));
    Ok(())
}

type Handler = fn(TcpStream, &(Mutex<Seen>, Condvar)) -> std::io::Result<()>;

fn serve(listener: TcpListener, seen: Arc<(Mutex<Seen>, Condvar)>, handler: Handler) {
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let seen = seen.clone();
            std::thread::spawn(move || {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(300)));
                let _ = stream.set_write_timeout(Some(Duration::from_secs(300)));
                let _ = handler(stream, &seen);
            });
        }
    });
}

fn ack(stream: TcpStream, seen: &(Mutex<Seen>, Condvar)) -> std::io::Result<()> {
    let local = stream.local_addr()?.ip();
    let peer = stream.peer_addr()?.ip();
    let mut w = stream.try_clone()?;
    let mut first = true;
    for line in BufReader::new(stream).lines() {
        let line = line?;
        // Counted before the answer goes, so a client that has its answer
        // finds its connection counted.
        if first {
            let mut s = lock(&seen.0);
            *s.acks.entry(local).or_default() += 1;
            s.ack_peers.push(peer);
            first = false;
        }
        writeln!(w, "ack {}", line.trim())?;
    }
    Ok(())
}

fn sink(mut stream: TcpStream, seen: &(Mutex<Seen>, Condvar)) -> std::io::Result<()> {
    let mut buf = vec![0u8; 256 << 10];
    let mut bytes = stream.read(&mut buf)?;
    let t0 = Instant::now();
    loop {
        match stream.read(&mut buf)? {
            0 => break,
            n => bytes += n,
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    lock(&seen.0).sunk.push(Transfer { bytes, secs });
    Ok(())
}

fn source(mut stream: TcpStream, seen: &(Mutex<Seen>, Condvar)) -> std::io::Result<()> {
    let chunk = vec![0x5au8; 256 << 10];
    let t0 = Instant::now();
    let mut sent = 0;
    while sent < SOURCE_BYTES {
        let n = chunk.len().min(SOURCE_BYTES - sent);
        stream.write_all(&chunk[..n])?;
        sent += n;
    }
    stream.shutdown(std::net::Shutdown::Write)?;
    // The last bytes are with the guest when it closes its end.
    let mut rest = [0u8; 64];
    while stream.read(&mut rest)? > 0 {}
    let secs = t0.elapsed().as_secs_f64();
    lock(&seen.0).sourced.push(Transfer { bytes: sent, secs });
    Ok(())
}

/// How long a connection waits at the meeting point for the other one.
const MEETING_WAIT: Duration = Duration::from_secs(240);

fn together(stream: TcpStream, seen: &(Mutex<Seen>, Condvar)) -> std::io::Result<()> {
    let peer = stream.peer_addr()?;
    let mut w = stream.try_clone()?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    let (m, cv) = seen;
    let mut g = lock(m);
    let generation = g.met;
    g.waiting.push(peer);
    if g.waiting.len() >= 2 {
        let met = std::mem::take(&mut g.waiting);
        g.meetings.push(met);
        g.met += 1;
        cv.notify_all();
    }
    let deadline = Instant::now() + MEETING_WAIT;
    while g.met == generation {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            g.waiting.retain(|p| *p != peer);
            drop(g);
            return writeln!(w, "alone");
        }
        g = cv
            .wait_timeout(g, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
    drop(g);
    writeln!(w, "together")
}

fn ping(stream: TcpStream, seen: &(Mutex<Seen>, Condvar)) -> std::io::Result<()> {
    let mut w = stream.try_clone()?;
    let mut r = BufReader::new(stream);
    let mut rtts = Vec::with_capacity(PING_ROUNDS);
    let mut line = String::new();
    for i in 0..PING_ROUNDS {
        let t0 = Instant::now();
        writeln!(w, "p{i}")?;
        line.clear();
        if r.read_line(&mut line)? == 0 {
            break;
        }
        rtts.push(t0.elapsed().as_secs_f64());
    }
    writeln!(w, "done")?;
    lock(&seen.0).pings.push(rtts);
    Ok(())
}

/// The upstream DNS server: A and AAAA records for the two test names, no
/// records for their other types, NXDOMAIN for the rest; every query
/// counted.
pub(super) fn dns(sock: UdpSocket, seen: Arc<(Mutex<Seen>, Condvar)>) {
    let mut buf = [0u8; 4096];
    loop {
        let Ok((n, from)) = sock.recv_from(&mut buf) else {
            continue;
        };
        let Ok(q) = Message::from_vec(&buf[..n]) else {
            continue;
        };
        let Some(query) = q.queries().first().cloned() else {
            continue;
        };
        let name = query
            .name()
            .to_ascii()
            .trim_end_matches('.')
            .to_ascii_lowercase();
        *lock(&seen.0).dns.entry(name.clone()).or_default() += 1;
        let known = name == ALLOWED_NAME || name == DENIED_NAME;
        let mut m = Message::new();
        m.set_id(q.id())
            .set_message_type(MessageType::Response)
            .set_op_code(q.op_code())
            .set_recursion_desired(q.recursion_desired())
            .set_recursion_available(true)
            .set_authoritative(true)
            .set_response_code(if known {
                ResponseCode::NoError
            } else {
                ResponseCode::NXDomain
            })
            .add_query(query.clone());
        if known && query.query_type() == RecordType::A {
            m.add_answer(Record::from_rdata(
                query.name().clone(),
                300,
                RData::A(A(SERVER_IP)),
            ));
        }
        if known && query.query_type() == RecordType::AAAA {
            m.add_answer(Record::from_rdata(
                query.name().clone(),
                300,
                RData::AAAA(AAAA(SERVER_IP6)),
            ));
        }
        if let Ok(bytes) = m.to_vec() {
            let _ = sock.send_to(&bytes, from);
        }
    }
}
