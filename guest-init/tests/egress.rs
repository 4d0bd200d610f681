//! Egress rules applied with nftables inside a private network namespace:
//! the generated ruleset loads, lets a listed destination through, and
//! drops and counts loopback and unlisted traffic.

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
