//! A host tap for the virtio-net tests: created with `ip`, up, IPv6 off (so
//! the host sends the guest nothing it did not ask for), deleted on drop.

use std::path::Path;
use std::process::Command;

/// A tap on the host, deleted when dropped.
pub struct HostTap(pub String);

impl HostTap {
    /// Creates tap `name`; why not, when it cannot (no /dev/net/tun, `ip`
    /// missing or refusing).
    pub fn create(name: &str) -> Result<HostTap, String> {
        if !Path::new("/dev/net/tun").exists() {
            return Err("/dev/net/tun is missing".into());
        }
        let ip = |args: &[&str]| -> Result<(), String> {
            let out = Command::new("ip")
                .args(args)
                .output()
                .map_err(|e| format!("cannot run ip: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "ip {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                ))
            }
        };
        ip(&["tuntap", "add", "dev", name, "mode", "tap"])?;
        let tap = HostTap(name.into());
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1");
        ip(&["link", "set", name, "up"])?;
        Ok(tap)
    }

    /// The host side's receive counters (packets, bytes): what the guest sent.
    pub fn received(&self) -> (u64, u64) {
        let stat = |what: &str| -> u64 {
            std::fs::read_to_string(format!("/sys/class/net/{}/statistics/{what}", self.0))
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or_else(|| panic!("reading {what} of tap {}", self.0))
        };
        (stat("rx_packets"), stat("rx_bytes"))
    }
}

impl Drop for HostTap {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.0]).status();
    }
}
