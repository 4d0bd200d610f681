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
