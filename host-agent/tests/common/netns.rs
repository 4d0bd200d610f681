//! Network namespaces for the network tests: `ip` that must succeed, and a
//! namespace removed when dropped.

use std::process::Command;

/// Runs `ip args...`, panicking with its message when it fails.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip runs");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A namespace (with loopback up), removed when dropped.
pub struct Ns(pub String);

impl Ns {
    /// Makes namespace `name`, replacing a stale one of that name.
    pub fn new(name: String) -> Ns {
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        ip(&["netns", "add", &name]);
        ip(&["-n", &name, "link", "set", "lo", "up"]);
        Ns(name)
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

/// Why this machine cannot run the network tests (root, iproute2,
/// nftables, /dev/net/tun), if it cannot.
pub fn missing_tools() -> Option<String> {
    if !super::is_root() {
        return Some("not root".into());
    }
    for tool in ["ip", "nft"] {
        if Command::new(tool).arg("-V").output().is_err() {
            return Some(format!("{tool} is not installed (iproute2, nftables)"));
        }
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        return Some("/dev/net/tun is missing".into());
    }
    None
}

/// Namespaces a test's code under test made, removed when dropped (also when
/// the test fails half-way); removing one already gone is fine.
pub struct Cleanup(pub Vec<String>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// Every namespace whose name starts with the prefix, removed when dropped:
/// what a host-agent under test made, even when the test fails half-way.
pub struct PrefixCleanup(pub String);

impl Drop for PrefixCleanup {
    fn drop(&mut self) {
        for ns in host_agent::network::namespace::list_namespaces(&self.0) {
            let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        }
    }
}

/// Runs `f` on a thread inside namespace `ns`.
pub fn in_ns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    use std::os::fd::AsRawFd;
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).expect("open the namespace");
        // SAFETY: setns on an open namespace file; it changes only this
        // thread's network namespace.
        let rc = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
}

/// Connects from namespace `ns`; `Ok(())` when the connection is made and
/// echoes a byte, the error kind otherwise.
pub fn echo_from(ns: &str, to: std::net::SocketAddr) -> Result<(), std::io::ErrorKind> {
    use std::io::{Read, Write};
    use std::time::Duration;
    in_ns(ns, move || {
        let mut s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(2))
            .map_err(|e| e.kind())?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.kind())?;
        s.write_all(b"x").map_err(|e| e.kind())?;
        let mut b = [0u8; 1];
        s.read_exact(&mut b).map_err(|e| e.kind())?;
        Ok(())
    })
    .join()
    .expect("client thread")
}

/// Connects from every guest namespace of `guests` to `server` at the same
/// time (threads); what each got, in order.
pub fn echo_from_all(
    guests: &[Ns],
    server: std::net::SocketAddr,
) -> Vec<Result<(), std::io::ErrorKind>> {
    let all: Vec<_> = guests
        .iter()
        .map(|g| {
            let g = g.0.clone();
            std::thread::spawn(move || echo_from(&g, server))
        })
        .collect();
    all.into_iter()
        .map(|t| t.join().expect("client thread"))
        .collect()
}

/// A "guest" namespace `name` joined to VM namespace `vm_netns` where the
/// tap would be, by a veth named `tap0` (the guest's end is `eth0`), with
/// the guest's address and its default route via the gateway (IPv6 too,
/// as guest-init configures it, when the VM's namespace has IPv6).
pub fn attach_guest(vm_netns: &str, name: &str) -> Ns {
    use host_agent::network::addressing::{
        GATEWAY_IP, GATEWAY_IP6, GUEST_IP, GUEST_IP6, GUEST_PREFIX6, TAP_NAME,
    };
    let g = Ns::new(name.to_string());
    let ipv6 = Command::new("ip")
        .args(["-n", vm_netns, "-6", "addr", "show", "dev", TAP_NAME])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains(&GATEWAY_IP6.to_string()))
        .unwrap_or(false);
    ip(&["-n", vm_netns, "link", "del", TAP_NAME]);
    ip(&[
        "link", "add", TAP_NAME, "netns", vm_netns, "type", "veth", "peer", "name", "eth0",
        "netns", &g.0,
    ]);
    let gateway = format!("{GATEWAY_IP}/30");
    ip(&["-n", vm_netns, "addr", "add", &gateway, "dev", TAP_NAME]);
    let guest = format!("{GUEST_IP}/30");
    ip(&["-n", &g.0, "addr", "add", &guest, "dev", "eth0"]);
    if ipv6 {
        let gateway6 = format!("{GATEWAY_IP6}/{GUEST_PREFIX6}");
        ip(&[
            "-n", vm_netns, "addr", "add", &gateway6, "dev", TAP_NAME, "nodad",
        ]);
        let guest6 = format!("{GUEST_IP6}/{GUEST_PREFIX6}");
        ip(&["-n", &g.0, "addr", "add", &guest6, "dev", "eth0", "nodad"]);
    }
    ip(&["-n", vm_netns, "link", "set", TAP_NAME, "up"]);
    ip(&["-n", &g.0, "link", "set", "eth0", "up"]);
    let via = GATEWAY_IP.to_string();
    ip(&["-n", &g.0, "route", "add", "default", "via", &via]);
    if ipv6 {
        let via6 = GATEWAY_IP6.to_string();
        ip(&["-n", &g.0, "route", "add", "::/0", "via", &via6]);
    }
    g
}

/// TCP echo servers (one byte back) at `addrs`, bound inside namespace
/// `ns`; returns once they listen.
pub fn echo_servers(ns: &str, addrs: &[&str]) {
    use std::io::{Read, Write};
    let addrs: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    in_ns(ns, move || {
        for addr in addrs {
            let l = std::net::TcpListener::bind(&addr).expect("bind the echo server");
            std::thread::spawn(move || {
                for mut s in l.incoming().flatten() {
                    let mut b = [0u8; 1];
                    if s.read_exact(&mut b).is_ok() {
                        let _ = s.write_all(&b);
                    }
                }
            });
        }
        tx.send(()).expect("ready");
    });
    rx.recv().expect("echo servers up");
}

/// A DNS query for `name` of type `qtype` with transaction `id`.
pub fn query_bytes(id: u16, name: &str, qtype: hickory_proto::rr::RecordType) -> Vec<u8> {
    let mut m = hickory_proto::op::Message::new();
    m.set_id(id)
        .set_recursion_desired(true)
        .add_query(hickory_proto::op::Query::query(
            hickory_proto::rr::Name::from_ascii(name).unwrap(),
            qtype,
        ));
    m.to_vec().unwrap()
}

/// Asks the resolver at the gateway's port 53 over UDP from namespace
/// `guest`; `None`: no answer in 5 s.
pub fn ask_udp(
    guest: &str,
    name: &str,
    qtype: hickory_proto::rr::RecordType,
) -> Option<hickory_proto::op::Message> {
    let q = query_bytes(0x1234, name, qtype);
    in_ns(guest, move || {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        s.send_to(&q, (host_agent::network::addressing::GATEWAY_IP, 53))
            .unwrap();
        let mut buf = [0u8; 4096];
        let n = s.recv(&mut buf).ok()?;
        let m = hickory_proto::op::Message::from_vec(&buf[..n]).expect("a DNS answer");
        assert_eq!(m.id(), 0x1234, "the guest's id comes back");
        Some(m)
    })
    .join()
    .unwrap()
}

/// A "node" namespace `nd<tag>` with the uplink 203.0.113.1/24 (and
/// 2001:db8:113::1/64) and an "internet" namespace `in<tag>` behind it
/// holding 203.0.113.2 to .5 and 2001:db8:113::2 to ::5 (the node's default
/// routes), with forwarding on and the node's rules for VM pool `pool` (and
/// IPv6 pool `pool6`) loaded: the topology of `tests/network.rs`.
pub fn node_and_internet(
    tag: &str,
    pool: host_agent::network::addressing::Cidr,
    pool6: Option<host_agent::network::addressing::Cidr>,
) -> (Ns, Ns) {
    use host_agent::network::namespace::{apply_rules, enable_forwarding};
    use host_agent::network::rules::node_ruleset;
    let node = Ns::new(format!("nd{tag}"));
    let inet = Ns::new(format!("in{tag}"));
    ip(&[
        "link", "add", "up0", "netns", &node.0, "type", "veth", "peer", "name", "wan0", "netns",
        &inet.0,
    ]);
    ip(&["-n", &node.0, "addr", "add", "203.0.113.1/24", "dev", "up0"]);
    ip(&[
        "-n",
        &node.0,
        "addr",
        "add",
        "2001:db8:113::1/64",
        "dev",
        "up0",
        "nodad",
    ]);
    ip(&["-n", &node.0, "link", "set", "up0", "up"]);
    ip(&[
        "-n",
        &node.0,
        "route",
        "add",
        "default",
        "via",
        "203.0.113.2",
    ]);
    ip(&[
        "-n",
        &node.0,
        "route",
        "add",
        "::/0",
        "via",
        "2001:db8:113::2",
    ]);
    for a in [
        "203.0.113.2/24",
        "203.0.113.3/24",
        "203.0.113.4/24",
        "203.0.113.5/24",
    ] {
        ip(&["-n", &inet.0, "addr", "add", a, "dev", "wan0"]);
    }
    for a in [
        "2001:db8:113::2/64",
        "2001:db8:113::3/64",
        "2001:db8:113::4/64",
        "2001:db8:113::5/64",
    ] {
        ip(&["-n", &inet.0, "addr", "add", a, "dev", "wan0", "nodad"]);
    }
    ip(&["-n", &inet.0, "link", "set", "wan0", "up"]);
    enable_forwarding(Some(&node.0), pool6.is_some()).expect("forwarding on the node");
    apply_rules(Some(&node.0), &node_ruleset(pool, pool6)).expect("the node's rules");
    (node, inet)
}

/// A UDP socket bound inside a namespace ([`udp_sink`]), its datagrams
/// (payload and sender) on a channel; the socket closes when this is dropped.
pub struct UdpSink {
    /// The datagrams received, in order.
    pub rx: std::sync::mpsc::Receiver<(Vec<u8>, std::net::SocketAddr)>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl UdpSink {
    /// Every datagram received until `quiet` passes without one.
    pub fn drain(&self, quiet: std::time::Duration) -> Vec<(Vec<u8>, std::net::SocketAddr)> {
        std::iter::from_fn(|| self.rx.recv_timeout(quiet).ok()).collect()
    }
}

impl Drop for UdpSink {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A UDP socket bound to `addr` inside namespace `ns`; returns once it is
/// bound.
pub fn udp_sink(ns: &str, addr: std::net::SocketAddr) -> UdpSink {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (tx, rx) = std::sync::mpsc::channel();
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    in_ns(ns, move || {
        let s = std::net::UdpSocket::bind(addr)
            .unwrap_or_else(|e| panic!("bind UDP {addr} in the namespace: {e}"));
        s.set_read_timeout(Some(std::time::Duration::from_millis(100)))
            .expect("read timeout");
        ready_tx.send(()).expect("ready");
        let mut buf = vec![0u8; 65536];
        while !stopped.load(Ordering::Relaxed) {
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                if tx.send((buf[..n].to_vec(), from)).is_err() {
                    return;
                }
            }
        }
    });
    ready_rx.recv().expect("UDP sink bound");
    UdpSink { rx, stop }
}

/// The MAC address of interface `dev` in namespace `ns`.
pub fn link_mac(ns: &str, dev: &str) -> String {
    let out = Command::new("ip")
        .args(["-n", ns, "-o", "link", "show", "dev", dev])
        .output()
        .expect("ip runs");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .unwrap_or_else(|| panic!("no MAC for {dev} in {ns}: {text}"))
        .to_string()
}
