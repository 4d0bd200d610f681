//! A hostile guest against a VM's host-side network rules, with real frames:
//! the `net_hostile` test guest runs in the vmm on the tap of a VM network
//! made by `host_agent::network::namespace::VmNetwork` and sends through
//! virtio-net what a hostile guest kernel could (forged sources, denied
//! destinations, the namespace itself, DHCP, ARP claims, an IPv6 router
//! advertisement, IPv4 options and fragments), then, last, one legitimate
//! datagram. The legitimate one must arrive, masqueraded; nothing else may
//! arrive anywhere: not at the internet's servers, the node, the metadata
//! address, another VM or the namespace; the namespace's neighbour table
//! and IPv6 state must not take the guest's claims.
//!
//! Topology as in `tests/network.rs`: a "node" namespace (uplink
//! 203.0.113.1, the metadata address 169.254.169.254 on its loopback), an
//! "internet" namespace behind it (203.0.113.2 to .4, and 2001:db8:ffff::3),
//! the hostile VM's network (its tap served by the vmm) and another VM's
//! network with a guest namespace where its tap would be.
//!
//! Needs root, iproute2, nftables, /dev/net/tun and /dev/kvm; says so and
//! skips without them.

mod common;

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::netns::{
    attach_guest, in_ns, ip, link_mac, missing_tools, node_and_internet, udp_sink, Cleanup, UdpSink,
};
use host_agent::network::addressing::{AddressPool, Cidr, GUEST_IP, GUEST_MAC, TAP_NAME};
use host_agent::network::namespace::{VmNetwork, NETNS_PREFIX};
use host_agent::network::node::node_addresses;
use host_agent::network::rules::{Allow, EgressPolicy, Proto};

const ALLOWED: &str = "203.0.113.3";
const ALLOWED_PORT: u16 = 5353;
const DENIED_PORT: u16 = 9999;
const PROBE_PORT: u16 = 7777;
const NODE: &str = "203.0.113.1";
const INET_PEER: &str = "203.0.113.2";
const V6_SERVER: &str = "2001:db8:ffff::3";
const METADATA: &str = "169.254.169.254";
/// The MAC the guest forges in its ARP poisoning (see net_hostile.c).
const FORGED_MAC: &str = "06:66:66:66:66:66";

/// The tag the guest put in a datagram (`hostile:<name>`), if any.
fn tag(payload: &[u8]) -> Option<String> {
    let at = payload.windows(8).position(|w| w == b"hostile:")?;
    let tag: Vec<u8> = payload[at..]
        .iter()
        .copied()
        .take_while(|b| b.is_ascii_graphic())
        .collect();
    Some(String::from_utf8_lossy(&tag).into_owned())
}

/// A packet the node received on a VM's veth.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Captured {
    Ipv4 {
        src: Ipv4Addr,
        dst: Ipv4Addr,
        proto: u8,
        fragment: bool,
        tag: Option<String>,
    },
    Ipv6 {
        len: usize,
    },
}

/// Packets arriving at interface `dev` of namespace `ns` (not those it
/// sends), IPv4 and IPv6, through a packet socket; stops when dropped.
struct Capture {
    rx: mpsc::Receiver<Captured>,
    stop: Arc<AtomicBool>,
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn parse_ipv4(p: &[u8]) -> Option<Captured> {
    let ihl = usize::from(p.first()? & 0x0f) * 4;
    if ihl < 20 || p.len() < ihl {
        return None;
    }
    let frag = u16::from_be_bytes([p[6], p[7]]);
    Some(Captured::Ipv4 {
        src: Ipv4Addr::new(p[12], p[13], p[14], p[15]),
        dst: Ipv4Addr::new(p[16], p[17], p[18], p[19]),
        proto: p[9],
        fragment: frag & 0x3fff != 0,
        tag: tag(&p[ihl..]),
    })
}

fn capture(ns: &str, dev: &str) -> Capture {
    let (ready_tx, ready_rx) = mpsc::channel();
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let dev = std::ffi::CString::new(dev).expect("an interface name");
    in_ns(ns, move || {
        let all = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2); the descriptor is owned right below.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                i32::from(all),
            )
        };
        assert!(
            fd >= 0,
            "packet socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: fd was just created and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a NUL-terminated name.
        let ifindex = unsafe { libc::if_nametoindex(dev.as_ptr()) };
        assert!(ifindex > 0, "no interface {dev:?}");
        // SAFETY: sockaddr_ll is plain data; all zeros is a valid value.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = all;
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: binds to a sockaddr_ll of the size given.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                std::ptr::addr_of!(sll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
        let timeout = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: SO_RCVTIMEO reads one timeval of the size given.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                std::ptr::addr_of!(timeout).cast(),
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        assert_eq!(rc, 0, "SO_RCVTIMEO: {}", std::io::Error::last_os_error());
        ready_tx.send(()).expect("ready");
        let mut buf = vec![0u8; 65536];
        while !stopped.load(Ordering::Relaxed) {
            // SAFETY: as above.
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
            // SAFETY: recvfrom writes at most buf.len() bytes into buf and at
            // most `len` bytes into `from`.
            let n = unsafe {
                libc::recvfrom(
                    fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    0,
                    std::ptr::addr_of_mut!(from).cast(),
                    &mut len,
                )
            };
            let Ok(n) = usize::try_from(n) else { continue };
            if from.sll_pkttype == libc::PACKET_OUTGOING {
                continue;
            }
            let packet = match u16::from_be(from.sll_protocol) {
                0x0800 => parse_ipv4(&buf[..n]),
                0x86dd => Some(Captured::Ipv6 { len: n }),
                _ => None,
            };
            if let Some(p) = packet {
                if tx.send(p).is_err() {
                    return;
                }
            }
        }
    });
    ready_rx.recv().expect("capture up");
    Capture { rx, stop }
}

/// `ip args...`'s output (it must succeed).
fn ip_out(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().expect("ip runs");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The effective `rp_filter` of `dev` in namespace `ns` (the larger of
/// `all` and the device's).
fn rp_filter(ns: &str, dev: &str) -> u32 {
    let read = |conf: &str| -> u32 {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                "cat",
                &format!("/proc/sys/net/ipv4/conf/{conf}/rp_filter"),
            ])
            .output()
            .expect("ip runs");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(0)
    };
    read("all").max(read(dev))
}

/// The vmm's serial output, line by line, until it exits.
fn serial_lines(child: &mut Child) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().expect("piped stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// Kills the vmm when the test ends, however it ends.
struct Vmm(Child);

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What one run of the hostile guest left behind.
struct Outcome {
    /// IPv4 that got further than the rules allow (or a control that did not
    /// get through, or a miscounted drop).
    rules: Vec<String>,
    /// Claims the namespace believed: neighbour entries, IPv6 state.
    claims: Vec<String>,
    /// The guest's serial output.
    serial: Vec<String>,
}

/// Whether this machine can run the hostile guest (printing why not).
fn can_run() -> bool {
    if let Some(why) = missing_tools() {
        println!("skipped: {why}");
        return false;
    }
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        println!("skipped: /dev/kvm cannot be opened");
        return false;
    }
    true
}

/// Builds the networks (names ending in `t`), runs the hostile guest in
/// the vmm on the VM's tap and checks where its frames went.
fn run_hostile_guest(t: &str) -> Outcome {
    let tag_id = format!("{}{t}", std::process::id());
    let pool_block = Cidr::parse("10.203.0.0/16").unwrap();
    let (node, inet) = node_and_internet(&format!("hf{tag_id}"), pool_block, None);
    // The metadata service lives on the node.
    ip(&[
        "-n",
        &node.0,
        "addr",
        "add",
        "169.254.169.254/32",
        "dev",
        "lo",
    ]);
    ip(&[
        "-n",
        &inet.0,
        "addr",
        "add",
        "2001:db8:ffff::3/64",
        "dev",
        "wan0",
        "nodad",
    ]);

    let mut pool = AddressPool::new(pool_block, None).unwrap();
    let policy = EgressPolicy::new(
        vec![Allow {
            cidr: Cidr::parse(ALLOWED).unwrap(),
            proto: Some(Proto::Udp),
            port: Some(ALLOWED_PORT),
        }],
        &node_addresses(Some(&node.0)).unwrap(),
        &[pool_block],
        vec![],
    );
    assert!(
        policy.always_deny.contains(&Cidr::parse(NODE).unwrap()),
        "{policy:?}"
    );
    let vms: Vec<VmNetwork> = ["h", "o"]
        .iter()
        .map(|s| {
            VmNetwork::plan(
                NETNS_PREFIX,
                &format!("hf{tag_id}{s}"),
                pool.allocate().unwrap(),
                Some(node.0.clone()),
            )
        })
        .collect();
    let _cleanup = Cleanup(vms.iter().map(|v| v.netns.clone()).collect());
    for vm in &vms {
        vm.create(&policy, None).expect("create the VM's network");
    }
    let (vm, other) = (&vms[0], &vms[1]);
    let other_guest = attach_guest(&other.netns, &format!("hg{tag_id}"));

    // Everywhere a packet could land.
    let sock = |a: &str, port: u16| -> SocketAddr { SocketAddr::new(a.parse().unwrap(), port) };
    let allowed = udp_sink(&inet.0, sock(ALLOWED, ALLOWED_PORT));
    let mut sinks: Vec<(String, UdpSink)> = vec![
        (
            format!("the allowed address's port {DENIED_PORT} (not allowed)"),
            udp_sink(&inet.0, sock(ALLOWED, DENIED_PORT)),
        ),
        (
            "the internet's IPv6 server".into(),
            udp_sink(&inet.0, sock(V6_SERVER, ALLOWED_PORT)),
        ),
        (
            format!("the node (any of its addresses, {METADATA} too)"),
            udp_sink(&node.0, sock("0.0.0.0", PROBE_PORT)),
        ),
        (
            "the hostile VM's namespace".into(),
            udp_sink(&vm.netns, sock("0.0.0.0", PROBE_PORT)),
        ),
        (
            "a DHCP server in the hostile VM's namespace".into(),
            udp_sink(&vm.netns, sock("0.0.0.0", 67)),
        ),
        (
            "the other VM's namespace".into(),
            udp_sink(&other.netns, sock("0.0.0.0", PROBE_PORT)),
        ),
        (
            "the other VM's guest".into(),
            udp_sink(&other_guest.0, sock("0.0.0.0", PROBE_PORT)),
        ),
    ];
    let captured = capture(&node.0, &vm.veth_host);

    let gw_mac = link_mac(&vm.netns, TAP_NAME);
    let cmdline = format!(
        "console=ttyS0 gw_mac={gw_mac} allowed={ALLOWED} allowed_port={ALLOWED_PORT} \
         denied_port={DENIED_PORT} probe_port={PROBE_PORT} node={NODE} node_veth={} vm_ip={} \
         other_vm={} inet_peer={INET_PEER} v6=20010db8ffff00000000000000000003 hold=1",
        vm.slot.host_ip, vm.slot.vm_ip, other.slot.vm_ip
    );
    let denied_before = vm.denied_packets().unwrap();
    let kernel = test_harness::guests::path("net_hostile");
    let vmm_bin = common::vmm_path();
    let net = format!("{TAP_NAME},mac={GUEST_MAC}");
    let mut child = test_harness::process::command("ip")
        .args(["netns", "exec", &vm.netns])
        .arg(&vmm_bin)
        .arg("run")
        .arg("--kernel")
        .arg(&kernel)
        .args(["--cmdline", &cmdline])
        .args(["--net", &net])
        .args(["--mem-mib", "32", "--serial", "stdout"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the vmm");
    let lines = serial_lines(&mut child);
    let mut vmm = Vmm(child);

    // The guest says when it sent everything.
    let mut serial = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let total: usize = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                let done = line
                    .strip_prefix("hostile: sent=")
                    .map(|n| n.trim().parse::<usize>().expect("a count"));
                let bad = line.starts_with("hostile: bad") || line.contains("timeout");
                serial.push(line);
                assert!(!bad, "the guest failed:\n{}", serial.join("\n"));
                if let Some(n) = done {
                    break n;
                }
            }
            Err(_) => panic!(
                "the guest never finished sending (vmm {:?}):\n{}",
                vmm.0.try_wait(),
                serial.join("\n")
            ),
        }
    };
    let names: Vec<&str> = serial
        .iter()
        .filter_map(|l| l.strip_prefix("hostile: sent "))
        .collect();
    assert_eq!(names.len(), total, "{}", serial.join("\n"));
    assert_eq!(names.last(), Some(&"control"), "the control goes last");
    println!("the guest sent {total} frames: {names:?}");

    // The positive control arrives (generously waited for), masqueraded
    // behind the node: the guest's traffic works at all.
    let control_deadline = Instant::now() + Duration::from_secs(30);
    let mut at_allowed = Vec::new();
    while !at_allowed
        .iter()
        .any(|(t, _): &(Option<String>, SocketAddr)| t.as_deref() == Some("hostile:control"))
    {
        let left = control_deadline.saturating_duration_since(Instant::now());
        match allowed.rx.recv_timeout(left) {
            Ok((payload, from)) => at_allowed.push((tag(&payload), from)),
            Err(_) => panic!(
                "the positive control never arrived at {ALLOWED}:{ALLOWED_PORT}; got {at_allowed:?}"
            ),
        }
    }
    // Every earlier frame went through the host's stack before it; a short
    // settle for anything still in flight on another CPU.
    let settle = Duration::from_millis(500);
    at_allowed.extend(
        allowed
            .drain(settle)
            .into_iter()
            .map(|(p, from)| (tag(&p), from)),
    );
    let mut failures = Vec::new();
    let mut claims = Vec::new();
    for (t, from) in &at_allowed {
        match t.as_deref() {
            Some("hostile:control") => {
                if from.ip().to_string() != NODE {
                    failures.push(format!(
                        "the control arrived from {from}, not masqueraded behind the node ({NODE})"
                    ));
                }
            }
            // An overlapping fragment reassembled first-wins lands at the
            // allowed port: within the policy (Linux drops the datagram).
            Some("hostile:frag-overlap") => println!("note: frag-overlap arrived from {from}"),
            other => failures.push(format!(
                "{other:?} arrived at the allowed {ALLOWED}:{ALLOWED_PORT} from {from}"
            )),
        }
    }
    let controls = at_allowed
        .iter()
        .filter(|(t, _)| t.as_deref() == Some("hostile:control"))
        .count();
    if controls != 1 {
        failures.push(format!("the control arrived {controls} times"));
    }

    // Nothing arrived anywhere else.
    for (where_, sink) in sinks.iter_mut() {
        for (payload, from) in sink.drain(Duration::from_millis(50)) {
            failures.push(format!(
                "{:?} ({} bytes) from {from} arrived at {where_}",
                tag(&payload),
                payload.len()
            ));
        }
    }

    // What left the VM's namespace: only the control, from the VM's pool
    // address (the namespace's SNAT), no fragment, no IPv6.
    let left_ns: Vec<Captured> = std::iter::from_fn(|| captured.rx.try_recv().ok()).collect();
    let mut control_left = false;
    for p in &left_ns {
        match p {
            Captured::Ipv4 {
                src,
                dst,
                proto,
                fragment,
                tag,
            } => {
                if *src != vm.slot.vm_ip {
                    failures.push(format!(
                        "the namespace let out a packet from {src} (not its SNAT address {}): {p:?}",
                        vm.slot.vm_ip
                    ));
                }
                if *fragment {
                    failures.push(format!("the namespace let out a fragment: {p:?}"));
                }
                match tag.as_deref() {
                    None | Some("hostile:frag-overlap") => {}
                    Some("hostile:control") => {
                        control_left = *proto == 17 && dst.to_string() == ALLOWED;
                    }
                    Some(other) => failures.push(format!(
                        "{other} left the namespace ({src} -> {dst}, protocol {proto})"
                    )),
                }
            }
            Captured::Ipv6 { len } => {
                failures.push(format!("an IPv6 packet ({len} bytes) left the namespace"))
            }
        }
    }
    if !control_left {
        failures.push(format!(
            "the control was not seen leaving the namespace from {}: {left_ns:?}",
            vm.slot.vm_ip
        ));
    }

    // The namespace's rules counted their drops: each denied IPv4 packet
    // that reached them (the kernel drops some earlier: a source that is
    // the namespace's own address, a source route, fragments that never
    // reassemble; with rp_filter on, forged sources too).
    let denied = vm.denied_packets().unwrap() - denied_before;
    // metadata, node, node-veth, other-vm, denied-port (forward);
    // gateway-port, ns-addr, dhcp-discover (input); frag-denied (forward,
    // reassembled).
    let mut expected = 9;
    if rp_filter(&vm.netns, TAP_NAME) == 0 {
        // forged-guestnet, forged-inet: the anti-spoofing rule.
        expected += 2;
    }
    if denied != expected {
        failures.push(format!(
            "the denied counter grew by {denied}, expected {expected}"
        ));
    }

    // The neighbour table: nobody but the guest is at the guest's MACs on
    // the tap, the gateway's own address has no entry, the veth has none
    // of the guest's MACs, and routes still go out the veth.
    let neigh = ip_out(&["-n", &vm.netns, "neigh", "show"]);
    let guest_macs = [GUEST_MAC, FORGED_MAC];
    for line in neigh.lines() {
        let addr = line.split_whitespace().next().unwrap_or("");
        let has_guest_mac = guest_macs.iter().any(|m| line.contains(m));
        if addr == "172.16.0.1" {
            claims.push(format!("the gateway's own address got an entry: {line}"));
        }
        if has_guest_mac && !line.contains(&format!("dev {TAP_NAME} ")) {
            claims.push(format!("a guest MAC off the tap: {line}"));
        }
        if has_guest_mac && addr != GUEST_IP.to_string() {
            claims.push(format!(
                "the namespace believes the guest's MAC is {addr}: {line}"
            ));
        }
    }
    for to in [vm.slot.host_ip.to_string(), ALLOWED.to_string()] {
        let route = ip_out(&["-n", &vm.netns, "route", "get", &to]);
        if !route.contains(&format!("dev {} ", vm.veth_vm)) {
            claims.push(format!("{to} is no longer routed out the veth: {route}"));
        }
    }

    // No IPv6 learned from the router advertisement.
    let routes6 = ip_out(&["-6", "-n", &vm.netns, "route", "show"]);
    if !routes6.trim().is_empty() {
        claims.push(format!("IPv6 routes in the namespace: {routes6}"));
    }
    let addrs6 = ip_out(&["-6", "-n", &vm.netns, "addr", "show"]);
    if addrs6.contains("scope global") || addrs6.contains("2001:db8") {
        claims.push(format!("IPv6 addresses in the namespace: {addrs6}"));
    }

    println!("denied counter grew by {denied}; neighbours:\n{neigh}");
    assert!(
        vmm.0.try_wait().expect("try_wait").is_none(),
        "the vmm kept running"
    );
    drop(vmm);
    Outcome {
        rules: failures,
        claims,
        serial,
    }
}

#[test]
fn raw_frames_from_a_hostile_guest_get_no_further_than_the_rules_allow() {
    if !can_run() {
        return;
    }
    let out = run_hostile_guest("r");
    assert!(
        out.rules.is_empty(),
        "the hostile guest got past the rules:\n{}\nserial:\n{}",
        out.rules.join("\n"),
        out.serial.join("\n")
    );
}

/// Finding (issue 14): the namespace has no ARP anti-spoofing to match the
/// IPv4 one. An ARP request on the tap from a sender address other than the
/// guest's (here the node's end of the veth) for the gateway's address is
/// answered and its sender entered in the neighbour table on the tap
/// (Linux's arp_process with the defaults arp_ignore=0, arp_filter=0). Not
/// used for routing (the veth's own entry stays right), but the guest picks
/// which addresses the namespace's neighbour table holds, and neighbour
/// tables count against limits shared by every namespace of the host.
#[test]
fn arp_and_ipv6_claims_of_a_hostile_guest_are_not_believed() {
    if !can_run() {
        return;
    }
    let out = run_hostile_guest("c");
    assert!(
        out.claims.is_empty(),
        "the VM's namespace believed the hostile guest:\n{}\nserial:\n{}",
        out.claims.join("\n"),
        out.serial.join("\n")
    );
}
