//! A fork's copies of its source's TCP connections, on VM networks made by
//! `host_agent::network` as host-agent makes them (test namespaces as in
//! `tests/network.rs`: a "node", an "internet" with the servers, and per VM
//! a "guest" namespace joined where the tap would be by a veth `tap0`).
//!
//! A fork (a VM restored from a snapshot of a running session) wakes up
//! believing it holds its source's established connections, at the same
//! guest address, in a namespace of its own whose conntrack knows none of
//! them. Its first segment of each is answered with a reset by the VM
//! namespace's rules and never reaches the peer, while the source keeps
//! its connection and a fresh SYN of the fork gets through. The guests'
//! segments are written with raw sockets: a mid-stream segment is exactly
//! what a restored guest kernel sends, and no socket API makes one.
//! Needs root, iproute2 and nftables; says so and skips without them.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::time::{Duration, Instant};

mod common;

use common::netns::{
    attach_guest, echo_from, in_ns, missing_tools as missing, node_and_internet, Cleanup,
};
use host_agent::network::addressing::{AddressPool, Cidr, GATEWAY_IP, GUEST_IP};
use host_agent::network::namespace::{VmNetwork, NETNS_PREFIX};
use host_agent::network::rules::{Allow, EgressPolicy, Proto, TABLE, UNTRACKED_COUNTER};

const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const PSH: u8 = 0x08;
const ACK: u8 = 0x10;

/// The allowed server on the test internet.
const SERVER: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 3), 8080);
/// The node's uplink address, which every VM is masqueraded behind.
const NODE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
/// Deadline for anything the test waits for (generous: the network is
/// local, this only bounds a failure).
const DEADLINE: Duration = Duration::from_secs(10);

/// One TCP segment as a raw socket read it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Segment {
    src: SocketAddrV4,
    dst: SocketAddrV4,
    seq: u32,
    ack: u32,
    flags: u8,
    payload: Vec<u8>,
}

/// A raw IPv4 TCP socket: writes segments with any flags and numbers from
/// its bound address, and reads a copy of every TCP segment its namespace
/// receives.
struct RawTcp {
    fd: OwnedFd,
    local: Ipv4Addr,
}

fn sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// One's-complement sum of `bytes` (16-bit big-endian words) onto `sum`.
fn ones_sum(mut sum: u32, bytes: &[u8]) -> u32 {
    for pair in bytes.chunks(2) {
        let word = u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]);
        sum += u32::from(word);
    }
    sum
}

/// A TCP segment (20-byte header, no options) with its checksum.
fn tcp_segment(
    src: SocketAddrV4,
    dst: SocketAddrV4,
    seq: u32,
    ack: u32,
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut seg = Vec::with_capacity(20 + payload.len());
    seg.extend_from_slice(&src.port().to_be_bytes());
    seg.extend_from_slice(&dst.port().to_be_bytes());
    seg.extend_from_slice(&seq.to_be_bytes());
    seg.extend_from_slice(&ack.to_be_bytes());
    seg.push(5 << 4);
    seg.push(flags);
    seg.extend_from_slice(&65535u16.to_be_bytes());
    seg.extend_from_slice(&[0, 0, 0, 0]);
    seg.extend_from_slice(payload);
    let mut pseudo = Vec::with_capacity(12);
    pseudo.extend_from_slice(&src.ip().octets());
    pseudo.extend_from_slice(&dst.ip().octets());
    pseudo.extend_from_slice(&[0, libc::IPPROTO_TCP as u8]);
    pseudo.extend_from_slice(&(seg.len() as u16).to_be_bytes());
    let mut sum = ones_sum(ones_sum(0, &pseudo), &seg);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    seg[16..18].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    seg
}

/// Parses an IPv4 packet carrying TCP, as a raw socket returns it.
fn parse(packet: &[u8]) -> Option<Segment> {
    let ihl = usize::from(packet.first()? & 0x0f) * 4;
    if packet.len() < ihl + 20 || packet[9] != libc::IPPROTO_TCP as u8 {
        return None;
    }
    let ip = |at: usize| Ipv4Addr::new(packet[at], packet[at + 1], packet[at + 2], packet[at + 3]);
    let t = &packet[ihl..];
    let be16 = |at: usize| u16::from_be_bytes([t[at], t[at + 1]]);
    let be32 = |at: usize| u32::from_be_bytes([t[at], t[at + 1], t[at + 2], t[at + 3]]);
    let data_at = usize::from(t[12] >> 4) * 4;
    Some(Segment {
        src: SocketAddrV4::new(ip(12), be16(0)),
        dst: SocketAddrV4::new(ip(16), be16(2)),
        seq: be32(4),
        ack: be32(8),
        flags: t[13],
        payload: t.get(data_at..).unwrap_or_default().to_vec(),
    })
}

impl RawTcp {
    /// A raw TCP socket in namespace `ns`, bound to `local`.
    fn open(ns: &str, local: Ipv4Addr) -> RawTcp {
        let fd = in_ns(ns, move || {
            // SAFETY: plain socket(2); the descriptor is checked and owned below.
            let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_TCP) };
            assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
            // SAFETY: `fd` is a new descriptor nothing else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            let addr = sockaddr(SocketAddrV4::new(local, 0));
            // SAFETY: `addr` is a valid sockaddr_in for the call's duration.
            let rc = unsafe {
                libc::bind(
                    fd.as_raw_fd(),
                    (&addr as *const libc::sockaddr_in).cast(),
                    std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
                )
            };
            assert_eq!(rc, 0, "bind raw: {}", std::io::Error::last_os_error());
            let timeout = libc::timeval {
                tv_sec: 0,
                tv_usec: 100_000,
            };
            // SAFETY: SO_RCVTIMEO reads one timeval, valid for the call.
            let rc = unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    (&timeout as *const libc::timeval).cast(),
                    std::mem::size_of::<libc::timeval>() as libc::socklen_t,
                )
            };
            assert_eq!(rc, 0, "SO_RCVTIMEO: {}", std::io::Error::last_os_error());
            fd
        })
        .join()
        .expect("raw socket thread");
        RawTcp { fd, local }
    }

    /// Sends a segment from `local:src_port` to `dst`.
    fn send(&self, src_port: u16, dst: SocketAddrV4, seq: u32, ack: u32, flags: u8, data: &[u8]) {
        let seg = tcp_segment(
            SocketAddrV4::new(self.local, src_port),
            dst,
            seq,
            ack,
            flags,
            data,
        );
        let to = sockaddr(SocketAddrV4::new(*dst.ip(), 0));
        // SAFETY: `seg` and `to` are valid for the call's duration.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                seg.as_ptr().cast(),
                seg.len(),
                0,
                (&to as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        assert_eq!(
            n,
            seg.len() as isize,
            "raw send: {}",
            std::io::Error::last_os_error()
        );
    }

    /// The next segment received that `wanted` accepts, or `None` once
    /// `deadline` passes without one.
    fn next(&self, deadline: Duration, wanted: impl Fn(&Segment) -> bool) -> Option<Segment> {
        let start = Instant::now();
        let mut buf = [0u8; 65536];
        while start.elapsed() < deadline {
            // SAFETY: `buf` is writable for its whole length during the call.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n <= 0 {
                continue; // the 100 ms receive timeout: look at the deadline
            }
            if let Some(seg) = parse(&buf[..n as usize]) {
                if wanted(&seg) {
                    return Some(seg);
                }
            }
        }
        None
    }
}

/// The packets the `untracked` counter of namespace `ns`'s IPv4 table counted.
fn untracked_in(ns: &str) -> u64 {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "nft",
            "list",
            "counter",
            "ip",
            TABLE,
            UNTRACKED_COUNTER,
        ])
        .output()
        .expect("nft runs");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|w| *w != "packets")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no untracked counter in {ns}: {text}"))
}

/// A TCP server at `addr` in namespace `ns` that echoes everything each
/// connection sends until it closes; returns once it listens.
fn echo_server(ns: &str, addr: SocketAddrV4) {
    let (tx, rx) = std::sync::mpsc::channel();
    in_ns(ns, move || {
        let l = TcpListener::bind(addr).expect("bind the echo server");
        tx.send(()).expect("ready");
        for mut s in l.incoming().flatten() {
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = s.read(&mut buf) {
                    if n == 0 || s.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    rx.recv().expect("echo server up");
}

/// Writes `bytes` on `s` and reads them back.
fn echo(s: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    s.write_all(bytes)?;
    let mut back = vec![0u8; bytes.len()];
    s.read_exact(&mut back)?;
    assert_eq!(back, bytes, "the echo returns what was sent");
    Ok(())
}

/// Two VM networks of one node (`a`: the source, `b`: its fork), their
/// guests attached, the echo server on the internet; the source's
/// connection to it open.
struct Forked {
    // Dropped in this order: the guests, the VM namespaces, then the node.
    guests: Vec<common::netns::Ns>,
    vms: Vec<VmNetwork>,
    _cleanup: Cleanup,
    node: (common::netns::Ns, common::netns::Ns),
}

fn two_vms(tag: &str) -> Forked {
    let pool_block = Cidr::parse("10.214.0.0/16").unwrap();
    let node = node_and_internet(tag, pool_block, None);
    echo_server(&node.1 .0, SERVER);
    let mut pool = AddressPool::new(pool_block, None).unwrap();
    let policy = EgressPolicy::new(
        vec![Allow {
            cidr: Cidr::parse(&SERVER.ip().to_string()).unwrap(),
            proto: Some(Proto::Tcp),
            port: Some(SERVER.port()),
        }],
        &[Cidr::parse(&NODE.to_string()).unwrap()],
        &[pool_block],
        vec![],
    );
    let vms: Vec<VmNetwork> = ["a", "b"]
        .iter()
        .map(|s| {
            let vm = VmNetwork::plan(
                NETNS_PREFIX,
                &format!("{tag}{s}"),
                pool.allocate().unwrap(),
                Some(node.0 .0.clone()),
            );
            vm.create(&policy, None).expect("create the VM's network");
            vm
        })
        .collect();
    let cleanup = Cleanup(vms.iter().map(|v| v.netns.clone()).collect());
    let guests = vms
        .iter()
        .zip(["a", "b"])
        .map(|(vm, s)| attach_guest(&vm.netns, &format!("g{tag}{s}")))
        .collect();
    Forked {
        guests,
        vms,
        _cleanup: cleanup,
        node,
    }
}

/// A connection from guest namespace `guest` to the server.
fn connect_from(guest: &str) -> TcpStream {
    in_ns(guest, || {
        let s = TcpStream::connect_timeout(&SERVER.into(), DEADLINE).expect("connect");
        s.set_read_timeout(Some(DEADLINE)).expect("read timeout");
        s
    })
    .join()
    .expect("connect thread")
}

#[test]
fn a_forks_copies_of_its_sources_connections_are_reset_and_never_reach_the_peer() {
    if let Some(why) = missing() {
        println!("skipped: {why}");
        return;
    }
    let tag = format!("fk{}", std::process::id());
    let net = two_vms(&tag);
    let (source, fork) = (net.guests[0].0.as_str(), net.guests[1].0.as_str());
    // What reaches the server's host: a copy of every TCP segment to it.
    let inet = net.node.1 .0.clone();
    let capture = RawTcp::open(&inet, Ipv4Addr::UNSPECIFIED);

    // The source's connection, established in its own namespace.
    let mut conn = connect_from(source);
    echo(&mut conn, b"before the fork").expect("the source's connection works");
    let port = conn.local_addr().unwrap().port();

    // The fork, at the same guest address, sends what its copy of that
    // connection would: a data segment (ACK|PSH, no SYN before it in this
    // namespace) on the same ports, and a FIN on another of its copies.
    let raw = RawTcp::open(fork, GUEST_IP);
    let (seq, ack) = (0x5eed_0001u32, 0x0ac0_0001u32);
    raw.send(port, SERVER, seq, ack, ACK | PSH, b"stale copy");
    let from_server = |to: u16| move |s: &Segment| s.src == SERVER && s.dst.port() == to;
    let reset = raw
        .next(DEADLINE, from_server(port))
        .expect("the fork's stale data segment is answered");
    assert_eq!(
        (reset.flags & RST, reset.seq),
        (RST, ack),
        "a reset the fork's guest accepts (its sequence is the segment's ack): {reset:?}"
    );
    let fin_port = port.wrapping_add(1).max(1024);
    raw.send(fin_port, SERVER, seq + 100, ack + 100, FIN | ACK, b"");
    let reset = raw
        .next(DEADLINE, from_server(fin_port))
        .expect("the fork's stale FIN is answered");
    assert_eq!(
        (reset.flags & RST, reset.seq),
        (RST, ack + 100),
        "{reset:?}"
    );

    // A stale segment of an exposed port's connection (the guest's side of
    // a connection the namespace made to it) is reset in the input chain.
    let gateway = SocketAddrV4::new(GATEWAY_IP, 45678);
    raw.send(
        8080,
        gateway,
        seq + 200,
        ack + 200,
        ACK | PSH,
        b"stale exposed",
    );
    let reset = raw
        .next(DEADLINE, |s| s.src == gateway && s.dst.port() == 8080)
        .expect("the fork's stale exposed-port segment is answered");
    assert_eq!(
        (reset.flags & RST, reset.seq),
        (RST, ack + 200),
        "{reset:?}"
    );
    assert_eq!(
        untracked_in(&net.vms[1].netns),
        3,
        "the fork's namespace reset three"
    );
    assert_eq!(
        untracked_in(&net.vms[0].netns),
        0,
        "the source's reset none"
    );

    // The source keeps its connection; the fork opens fresh ones.
    echo(&mut conn, b"after the fork").expect("the source's connection still works");
    assert_eq!(
        echo_from(fork, SERVER.into()),
        Ok(()),
        "a fresh SYN gets through"
    );

    // What reached the server: the source's connection and the fork's
    // fresh one, none of the fork's stale segments. Had one been let
    // through, the server's host would have had it before its answer came
    // back, long before the fork's fresh SYN was sent.
    let mut seen = Vec::new();
    let syns = |seen: &[Segment]| seen.iter().filter(|s| s.flags & (SYN | ACK) == SYN).count();
    while syns(&seen) < 2 {
        let seg = capture
            .next(DEADLINE, |s| s.dst == SERVER)
            .unwrap_or_else(|| panic!("the server's host saw only {seen:?}"));
        seen.push(seg);
    }
    assert!(
        seen.iter().all(|s| *s.src.ip() == NODE),
        "every VM masqueraded behind the node: {seen:?}"
    );
    let stale: Vec<&Segment> = seen
        .iter()
        .filter(|s| (seq..seq + 300).contains(&s.seq) || s.payload.starts_with(b"stale"))
        .collect();
    assert!(
        stale.is_empty(),
        "stale segments reached the peer: {stale:?}"
    );
}

#[test]
fn a_live_connections_segment_outside_the_window_is_not_reset() {
    if let Some(why) = missing() {
        println!("skipped: {why}");
        return;
    }
    let tag = format!("fw{}", std::process::id());
    let net = two_vms(&tag);
    let source = net.guests[0].0.as_str();
    let liberal = Command::new("ip")
        .args([
            "netns",
            "exec",
            &net.vms[0].netns,
            "cat",
            "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal",
        ])
        .output()
        .expect("ip runs");
    assert_eq!(String::from_utf8_lossy(&liberal.stdout).trim(), "1");

    let capture = RawTcp::open(&net.node.1 .0, Ipv4Addr::UNSPECIFIED);
    let raw = RawTcp::open(source, GUEST_IP);
    let mut conn = connect_from(source);
    echo(&mut conn, b"live").expect("the connection works");
    let port = conn.local_addr().unwrap().port();
    // The server's echo: its sequence and length give what the guest
    // expects next, its ack what the guest sends next.
    let data = raw
        .next(DEADLINE, |s| {
            s.src == SERVER && s.dst.port() == port && s.payload == b"live"
        })
        .expect("the raw socket saw the echo");
    let rcv_nxt = data.seq.wrapping_add(data.payload.len() as u32);
    // A segment of this connection far beyond the server's window (as a
    // guest kernel may send one): conntrack would call it invalid if it
    // tracked windows strictly, and a reset with the guest's own rcv_nxt
    // would end the live connection.
    raw.send(
        port,
        SERVER,
        data.ack.wrapping_add(0x4000_0000),
        rcv_nxt,
        ACK | PSH,
        b"out of window",
    );
    // It was let through (a segment is either forwarded or reset), and
    // the server's kernel answers it with a duplicate ACK.
    capture
        .next(DEADLINE, |s| {
            s.dst == SERVER && s.payload == b"out of window"
        })
        .expect("the segment reaches the server");
    assert_eq!(untracked_in(&net.vms[0].netns), 0);
    echo(&mut conn, b"still live").expect("the connection still works");
}
