//! Exposed ports through a VM's namespace: a node listener made by
//! `host_agent::network::expose` carries connections to a TCP server in a
//! "guest" namespace joined where the tap would be (the guest's fixed
//! address), 100 MiB each way, checked by hash; and through the API, a
//! session's exposed ports are listed with it, closed when it stops, and
//! opened again at the same addresses by a host-agent restarted after a
//! SIGKILL (one whose address is taken meanwhile is dropped, saying why).
//! Needs root, iproute2 and nftables (and cgroups for sessions); says so
//! and skips without them.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;

use std::time::{Duration, Instant};

use common::netns::{
    attach_guest, echo_servers, in_ns, ip, missing_tools, Cleanup, Ns, PrefixCleanup,
};
use common::networked::{build_net_image, can_run, namespaces, networked_agent, wait_gone};
use common::*;
use host_agent::network::addressing::{AddressPool, Cidr, GUEST_IP};
use host_agent::network::expose::expose;
use host_agent::network::namespace::{enable_forwarding, VmNetwork, NETNS_PREFIX};
use host_agent::network::rules::EgressPolicy;
use proto::hostagent as pb;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MIB: usize = 1 << 20;
const SIZE: usize = 100 * MIB;

/// `len` bytes of a pattern `seed` picks (not all zeros: a copy that drops
/// or reorders a chunk changes the hash).
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[i % 4] ^ seed)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exposed_port_carries_100_mib_each_way_to_the_guest() {
    if let Some(why) = missing_tools() {
        println!("skipped: {why}");
        return;
    }
    let tag = std::process::id();
    let node = Ns::new(format!("xn{tag}"));
    ip(&[
        "-n", &node.0, "link", "add", "d0", "type", "veth", "peer", "name", "d1",
    ]);
    ip(&["-n", &node.0, "addr", "add", "192.0.2.9/24", "dev", "d0"]);
    enable_forwarding(Some(&node.0), false).unwrap();
    let block = Cidr::parse("10.207.0.0/29").unwrap();
    let mut pool = AddressPool::new(block, None).unwrap();
    // The guest may reach nothing: an exposed port needs no egress.
    let policy = EgressPolicy::new(vec![], &[], &[block], vec![]);
    let vm = VmNetwork::plan(
        NETNS_PREFIX,
        &format!("x{tag}"),
        pool.allocate().unwrap(),
        Some(node.0.clone()),
    );
    vm.create(&policy, None).expect("create the VM's network");
    let _cleanup = Cleanup(vec![vm.netns.clone()]);
    let guest = attach_guest(&vm.netns, &format!("xg{tag}"));

    // The guest's server: hashes what it reads until the client shuts its
    // side, then sends its own 100 MiB and the hash of what it read.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let server = in_ns(&guest.0, move || {
        let l = TcpListener::bind((GUEST_IP, 8080)).expect("bind in the guest");
        ready_tx.send(()).unwrap();
        let (mut s, peer) = l.accept().expect("accept");
        let mut h = Sha256::new();
        let mut buf = vec![0u8; MIB];
        let mut got = 0usize;
        loop {
            let n = s.read(&mut buf).expect("read");
            if n == 0 {
                break;
            }
            got += n;
            h.update(&buf[..n]);
        }
        s.write_all(&pattern(7, SIZE)).expect("write");
        s.write_all(&h.finalize()).expect("write the hash");
        (got, peer)
    });
    ready_rx.recv().unwrap();

    let port = expose(&vm.netns, 8080, "127.0.0.1".parse().unwrap())
        .await
        .expect("expose");
    assert!(port.host.ip().is_loopback(), "{}", port.host);
    let mut c = tokio::net::TcpStream::connect(port.host).await.unwrap();
    let sent = pattern(3, SIZE);
    let (mut rd, mut wr) = c.split();
    let writer = async {
        wr.write_all(&sent).await.unwrap();
        wr.shutdown().await.unwrap();
    };
    let reader = async {
        let mut back = Vec::with_capacity(SIZE + 32);
        rd.read_to_end(&mut back).await.unwrap();
        back
    };
    let ((), back) = tokio::join!(writer, reader);
    let (got, peer) = server.join().unwrap();
    assert_eq!(got, SIZE, "the guest read all of it");
    assert_eq!(back.len(), SIZE + 32, "all of the guest's bytes came back");
    assert_eq!(
        &back[SIZE..],
        Sha256::digest(&sent).as_slice(),
        "what the guest read is what was sent"
    );
    assert_eq!(
        Sha256::digest(&back[..SIZE]),
        Sha256::digest(pattern(7, SIZE)),
        "what came back is what the guest sent"
    );
    // The guest saw the connection come from its gateway, in its namespace.
    assert_eq!(
        peer.ip(),
        host_agent::network::addressing::GATEWAY_IP,
        "{peer}"
    );

    // Unexposed: the node's port is closed.
    let host = port.host;
    port.close().await;
    assert!(tokio::net::TcpStream::connect(host).await.is_err());
    drop(guest);
    vm.remove();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exposed_ports_are_listed_with_the_session_and_go_when_it_stops() {
    if !can_run() {
        return;
    }
    let tag = std::process::id();
    let prefix = format!("avx{tag}-");
    let _cleanup = PrefixCleanup(prefix.clone());
    let (_node, _cfg, mut agent) =
        networked_agent(&format!("sx{tag}"), &prefix, "10.208.0.0/29", &[], &[]);
    build_net_image(&agent).await;
    let s = agent.create("net", "").await;
    agent.wait_state(&s.session_id, S::Running).await;
    let mut sessions = agent.sessions().await;
    let req = |port: u32, protocol: &str| pb::ExposePortRequest {
        session_id: s.session_id.clone(),
        guest_port: port,
        protocol: protocol.into(),
    };
    let first = sessions
        .expose_port(req(8080, "tcp"))
        .await
        .expect("expose")
        .into_inner();
    let addr: std::net::SocketAddr = first.host_address.parse().unwrap();
    assert!(addr.ip().is_loopback(), "{addr}");
    // Exposing it again gives the same address; a second port another.
    let again = sessions
        .expose_port(req(8080, ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again, first);
    let second = sessions
        .expose_port(req(22, "tcp"))
        .await
        .unwrap()
        .into_inner();
    assert_ne!(second.host_address, first.host_address);
    for (bad, says) in [(req(0, "tcp"), "1 to 65535"), (req(53, "udp"), "only tcp")] {
        let e = sessions.expose_port(bad).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(says), "{}", e.message());
    }
    // Listed with the session, and listening.
    let net = agent.get(&s.session_id).await.network.expect("a network");
    let ports: Vec<u32> = net.exposed_ports.iter().map(|p| p.guest_port).collect();
    assert_eq!(ports, [22, 8080]);
    assert!(std::net::TcpStream::connect(addr).is_ok());
    // Unexposed: gone from the list, and closed.
    let net = sessions
        .unexpose_port(req(8080, "tcp"))
        .await
        .expect("unexpose")
        .into_inner();
    assert_eq!(net.exposed_ports, std::slice::from_ref(&second));
    assert!(std::net::TcpStream::connect(addr).is_err());
    let e = sessions.unexpose_port(req(8080, "tcp")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    // The session stops: its ports close with it (on the runtime's next
    // turn after the transition).
    agent.stop(&s.session_id).await;
    let addr: std::net::SocketAddr = second.host_address.parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(addr).is_ok() {
        assert!(Instant::now() < deadline, "{addr} still listens");
        std::thread::sleep(Duration::from_millis(20));
    }
    let e = sessions.expose_port(req(8080, "tcp")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    let events: Vec<String> = agent
        .session_events(&s.session_id)
        .await
        .into_iter()
        .map(|e| e.reason)
        .filter(|r| r.starts_with("port_"))
        .collect();
    assert_eq!(events, ["port_exposed", "port_exposed", "port_unexposed"]);
    agent.terminate();
}

/// A TCP server at the guest's address, port `port`, in VM namespace
/// `netns`, answering each connection's first byte: the address is added
/// to the namespace's loopback (local delivery wins over the tap's route),
/// where host-agent's connections for an exposed port reach it as they
/// would reach the guest. The test guests have no TCP of their own.
fn guest_server(netns: &str, port: u16) {
    let guest = format!("{GUEST_IP}/32");
    ip(&["-n", netns, "link", "set", "lo", "up"]);
    ip(&["-n", netns, "addr", "add", &guest, "dev", "lo"]);
    echo_servers(netns, &[&format!("{GUEST_IP}:{port}")]);
}

/// Sends a byte to `addr`; whether it comes back.
fn echoes(addr: std::net::SocketAddr) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut b = [0u8; 1];
    s.write_all(b"e").is_ok() && s.read_exact(&mut b).is_ok() && b == *b"e"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exposed_ports_are_opened_again_at_their_addresses_after_a_restart() {
    if !can_run() {
        return;
    }
    let tag = std::process::id();
    let prefix = format!("avr{tag}-");
    let _cleanup = PrefixCleanup(prefix.clone());
    let (_node, _cfg, mut agent) =
        networked_agent(&format!("sr{tag}"), &prefix, "10.209.0.0/29", &[], &[]);
    build_net_image(&agent).await;
    let s = agent.create("net", "").await;
    agent.wait_state(&s.session_id, S::Running).await;
    let ns = namespaces(&prefix);
    assert_eq!(ns.len(), 1, "{ns:?}");
    guest_server(&ns[0], 8080);
    let mut sessions = agent.sessions().await;
    let req = |port: u32| pb::ExposePortRequest {
        session_id: s.session_id.clone(),
        guest_port: port,
        protocol: "tcp".into(),
    };
    let web = sessions.expose_port(req(8080)).await.expect("expose");
    let web: std::net::SocketAddr = web.into_inner().host_address.parse().unwrap();
    let ssh = sessions.expose_port(req(22)).await.expect("expose");
    let ssh: std::net::SocketAddr = ssh.into_inner().host_address.parse().unwrap();
    assert!(echoes(web), "{web} carries bytes to the guest's port");
    let kept = agent
        .state_dir()
        .join("sessions")
        .join(&s.session_id)
        .join("exposed-ports.json");
    assert!(kept.exists());

    // SIGKILLed; meanwhile someone else listens at the second port's
    // address (no connection ever went through it: nothing of the old
    // listener is left there).
    agent.kill9();
    let squatter = std::net::TcpListener::bind(ssh).expect("take the second port's address");
    agent.spawn();
    agent.wait_state(&s.session_id, S::Running).await;

    // The first is at the same address and reaches the guest again.
    assert!(echoes(web), "{web} carries bytes after the restart");
    let net = agent.get(&s.session_id).await.network.expect("a network");
    let listed: Vec<(u32, String)> = net
        .exposed_ports
        .iter()
        .map(|p| (p.guest_port, p.host_address.clone()))
        .collect();
    assert_eq!(listed, [(8080, web.to_string())]);
    let mut sessions = agent.sessions().await;
    let again = sessions.expose_port(req(8080)).await.expect("expose");
    assert_eq!(again.into_inner().host_address, web.to_string());
    // The second is dropped, saying why, and the session lives on.
    let events = agent.session_events(&s.session_id).await;
    let dropped: Vec<&str> = events
        .iter()
        .filter(|e| e.reason == "port_unexposed")
        .map(|e| e.detail.as_str())
        .collect();
    assert_eq!(dropped.len(), 1, "{events:?}");
    assert!(
        dropped[0].starts_with(&format!("tcp 22 at {ssh}: not opened again"))
            && dropped[0].contains("in use"),
        "{}",
        dropped[0]
    );
    drop(squatter);

    // Stopped: closed, and nothing is kept to open again.
    agent.stop(&s.session_id).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(web).is_ok() {
        assert!(Instant::now() < deadline, "{web} still listens");
        std::thread::sleep(Duration::from_millis(20));
    }
    wait_gone(&kept);
    agent.terminate();
}
