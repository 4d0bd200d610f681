//! Exposed ports through a VM's namespace: a node listener made by
//! `host_agent::network::expose` carries connections to a TCP server in a
//! "guest" namespace joined where the tap would be (the guest's fixed
//! address), 100 MiB each way, checked by hash. Needs root, iproute2 and
//! nftables; says so and skips without them.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;

use common::netns::{attach_guest, in_ns, ip, missing_tools, Cleanup, Ns};
use host_agent::network::addressing::{AddressPool, Cidr4, GUEST_IP};
use host_agent::network::expose::expose;
use host_agent::network::namespace::{enable_forwarding, VmNetwork, NETNS_PREFIX};
use host_agent::network::rules::EgressPolicy;
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
    enable_forwarding(Some(&node.0)).unwrap();
    let block = Cidr4::parse("10.207.0.0/29").unwrap();
    let mut pool = AddressPool::new(block).unwrap();
    // The guest may reach nothing: an exposed port needs no egress.
    let policy = EgressPolicy::new(vec![], &[], block, vec![]);
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
