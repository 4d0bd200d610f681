//! Egress rules applied with nftables inside a private network namespace:
//! the generated ruleset loads, lets a listed destination through, and
//! drops and counts loopback and unlisted traffic; over IPv6 on a real link
//! (a veth to another namespace), the guest still resolves its gateway.

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use guest_init::pid1::net;
use guest_init::policy::egress::{nft_ruleset, parse_denied_packets, plan};
use guest_init::policy::manifest::EgressEntry;

fn nft(args: &[&str], stdin: Option<&str>) -> Result<String, String> {
    let mut child = Command::new("nft")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    if let Some(text) = stdin {
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    drop(child.stdin.take());
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn connects(addr: (Ipv4Addr, u16)) -> bool {
    TcpStream::connect_timeout(&addr.into(), Duration::from_millis(300)).is_ok()
}

#[test]
fn rules_apply_in_a_network_namespace() {
    if Command::new("nft").arg("--version").output().is_err() {
        println!("SKIPPED rules_apply_in_a_network_namespace: the nft binary is not installed (apt-get install nftables)");
        return;
    }
    // Its own thread: only this thread (and what it spawns) enters the namespace.
    let result = std::thread::spawn(|| -> Result<(), String> {
        // SAFETY: unshare(2) with CLONE_NEWNET affects only the calling thread.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } < 0 {
            return Err(format!(
                "SKIP cannot create a network namespace: {}",
                std::io::Error::last_os_error()
            ));
        }
        net::link_up("lo").map_err(|e| e.to_string())?;
        // Two loopback addresses stand in for destinations: one listed, one not.
        let allowed =
            TcpListener::bind((Ipv4Addr::new(127, 0, 0, 1), 0)).map_err(|e| e.to_string())?;
        let port = allowed.local_addr().unwrap().port();
        let other =
            TcpListener::bind((Ipv4Addr::new(127, 0, 0, 1), 0)).map_err(|e| e.to_string())?;
        let other_port = other.local_addr().unwrap().port();
        assert!(
            connects((Ipv4Addr::LOCALHOST, other_port)),
            "no rules yet: loopback connects"
        );

        let entries = [EgressEntry {
            host: None,
            cidr: Some("127.0.0.1/32".into()),
            ports: vec![port],
        }];
        let p = plan(&entries, |_| vec![]).map_err(|e| e.to_string())?;
        nft(&["-f", "-"], Some(&nft_ruleset(&p)))?;
        // Loading twice replaces the table instead of failing.
        nft(&["-f", "-"], Some(&nft_ruleset(&p)))?;
        let listed = nft(&["list", "table", "inet", "guest_egress"], None)?;
        assert!(listed.contains("policy drop"), "{listed}");

        assert!(
            connects((Ipv4Addr::LOCALHOST, port)),
            "the listed destination must pass"
        );
        assert!(
            !connects((Ipv4Addr::LOCALHOST, other_port)),
            "an unlisted port must be dropped"
        );
        let counter = nft(&["list", "counter", "inet", "guest_egress", "denied"], None)?;
        let denied = parse_denied_packets(&counter).unwrap_or(0);
        assert!(denied >= 1, "denials are counted: {counter}");
        Ok(())
    })
    .join()
    .expect("namespace thread");
    match result {
        Ok(()) => {}
        Err(e) if e.starts_with("SKIP") => {
            println!("SKIPPED rules_apply_in_a_network_namespace: {e}")
        }
        Err(e) => panic!("{e}"),
    }
}

/// Runs `ip args...` (in the calling thread's namespace).
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Found by the real guest (`net-ipv6`): guest-init's own table dropped
/// the guest's neighbour solicitations, so its IPv6 gateway never resolved.
/// Here the guest's end is configured as guest-init configures it (ip6=),
/// the gateway's end lives in another namespace, and the listed IPv6
/// destination must connect with the rules loaded.
#[test]
fn ipv6_neighbour_discovery_passes_the_rules() {
    use std::net::{Ipv6Addr, SocketAddr};
    if Command::new("nft").arg("--version").output().is_err()
        || Command::new("ip").arg("-V").output().is_err()
    {
        println!("SKIPPED ipv6_neighbour_discovery_passes_the_rules: needs nft and ip");
        return;
    }
    let gw_ns = format!("gi6gw{}", std::process::id());
    if let Err(e) = ip(&["netns", "add", &gw_ns]) {
        println!("SKIPPED ipv6_neighbour_discovery_passes_the_rules: {e}");
        return;
    }
    let gateway: Ipv6Addr = "fd00:ac10::1".parse().unwrap();
    let ns = gw_ns.clone();
    let result = std::thread::spawn(move || -> Result<(), String> {
        // SAFETY: unshare(2) with CLONE_NEWNET affects only the calling thread.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } < 0 {
            return Err(format!(
                "SKIP cannot create a network namespace: {}",
                std::io::Error::last_os_error()
            ));
        }
        ip(&[
            "link", "add", "eth0", "type", "veth", "peer", "name", "gw0", "netns", &ns,
        ])?;
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            "fd00:ac10::1/126",
            "dev",
            "gw0",
            "nodad",
        ])?;
        ip(&["-n", &ns, "link", "set", "gw0", "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        net::link_up("lo").map_err(|e| e.to_string())?;
        net::link_up("eth0").map_err(|e| e.to_string())?;
        net::set_address6("eth0", "fd00:ac10::2".parse().unwrap(), 126)
            .map_err(|e| e.to_string())?;
        net::add_default_route6("eth0", gateway).map_err(|e| e.to_string())?;
        // The address is tentative until the veth's carrier is up
        // (asynchronous); wait for that, as a guest's NIC is up at boot.
        for _ in 0..100 {
            let addrs = std::fs::read_to_string("/proc/thread-self/net/if_inet6")
                .map_err(|e| e.to_string())?;
            let ready = addrs.lines().any(|l| {
                l.starts_with("fd00ac10000000000000000000000002")
                    && l.split_whitespace()
                        .nth(4)
                        .and_then(|f| u32::from_str_radix(f, 16).ok())
                        .is_some_and(|f| f & 0x40 == 0)
            });
            if ready {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // The listener in the gateway's namespace, from a thread that joined it.
        let path = format!("/run/netns/{ns}");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            let f = std::fs::File::open(&path).expect("the gateway's namespace");
            // SAFETY: setns(2) on an open namespace file; this thread only.
            assert_eq!(unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) }, 0);
            let l = TcpListener::bind((gateway, 0)).expect("bind in the gateway's namespace");
            tx.send(l.local_addr().unwrap().port()).unwrap();
            for s in l.incoming() {
                drop(s);
            }
        });
        let port = rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        let entries = [EgressEntry {
            host: None,
            cidr: Some("fd00:ac10::1/128".into()),
            ports: vec![port],
        }];
        let p = plan(&entries, |_| vec![]).map_err(|e| e.to_string())?;
        nft(&["-f", "-"], Some(&nft_ruleset(&p)))?;
        let to = SocketAddr::from((gateway, port));
        TcpStream::connect_timeout(&to, Duration::from_secs(5))
            .map_err(|e| format!("[{gateway}]:{port} through the egress rules: {e}"))?;
        Ok(())
    })
    .join()
    .expect("namespace thread");
    let _ = Command::new("ip").args(["netns", "del", &gw_ns]).output();
    match result {
        Ok(()) => {}
        Err(e) if e.starts_with("SKIP") => {
            println!("SKIPPED ipv6_neighbour_discovery_passes_the_rules: {e}")
        }
        Err(e) => panic!("{e}"),
    }
}
