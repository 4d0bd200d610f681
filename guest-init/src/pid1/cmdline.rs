//! Settings from the kernel command line (/proc/cmdline):
//!
//! * `ip=CLIENT:SERVER:GATEWAY:NETMASK:HOSTNAME:DEVICE:AUTOCONF` — the
//!   kernel's own syntax; guest-init applies CLIENT/NETMASK to DEVICE
//!   (default eth0), adds a default route via GATEWAY, and takes HOSTNAME.
//! * `guest_init.hostname=NAME` — overrides the hostname.
//! * `guest_init.port=PORT` — the vsock port (default 700; it must be below 1024).

use std::net::Ipv4Addr;

/// An interface address from `ip=`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpConfig {
    /// The guest's address.
    pub addr: Ipv4Addr,
    /// Netmask.
    pub netmask: Ipv4Addr,
    /// Default gateway.
    pub gateway: Option<Ipv4Addr>,
    /// Interface name.
    pub device: String,
}

/// Parsed command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cmdline {
    /// Hostname to set.
    pub hostname: Option<String>,
    /// Static address for the network device.
    pub ip: Option<IpConfig>,
    /// vsock port to listen on.
    pub vsock_port: u32,
}

impl Cmdline {
    /// Reads /proc/cmdline (an empty line if unreadable).
    pub fn read() -> Self {
        Self::parse(&std::fs::read_to_string("/proc/cmdline").unwrap_or_default())
    }

    /// Parses a command line.
    pub fn parse(line: &str) -> Self {
        let mut c = Self {
            hostname: None,
            ip: None,
            vsock_port: proto::guest::DEFAULT_VSOCK_PORT,
        };
        let mut explicit_host = None;
        for word in line.split_whitespace() {
            if let Some(v) = word.strip_prefix("ip=") {
                let f: Vec<&str> = v.split(':').collect();
                let get = |i: usize| f.get(i).copied().filter(|s| !s.is_empty());
                if let (Some(addr), Some(mask)) = (
                    get(0).and_then(|s| s.parse().ok()),
                    get(3).and_then(|s| s.parse().ok()),
                ) {
                    c.ip = Some(IpConfig {
                        addr,
                        netmask: mask,
                        gateway: get(2).and_then(|s| s.parse().ok()),
                        device: get(5).unwrap_or("eth0").to_string(),
                    });
                }
                if let Some(h) = get(4) {
                    c.hostname = Some(h.to_string());
                }
            } else if let Some(v) = word.strip_prefix("guest_init.hostname=") {
                explicit_host = Some(v.to_string());
            } else if let Some(v) = word.strip_prefix("guest_init.port=") {
                if let Ok(p) = v.parse() {
                    c.vsock_port = p;
                }
            }
        }
        if explicit_host.is_some() {
            c.hostname = explicit_host;
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kernel_ip_syntax() {
        let c = Cmdline::parse("console=ttyS0 ip=172.16.0.2::172.16.0.1:255.255.255.0:box1:eth0:off guest_init.port=600");
        assert_eq!(c.vsock_port, 600);
        assert_eq!(c.hostname.as_deref(), Some("box1"));
        let ip = c.ip.unwrap();
        assert_eq!(ip.addr, Ipv4Addr::new(172, 16, 0, 2));
        assert_eq!(ip.gateway, Some(Ipv4Addr::new(172, 16, 0, 1)));
        assert_eq!(ip.device, "eth0");
        let c = Cmdline::parse("ip=dhcp guest_init.hostname=x");
        assert_eq!(c.ip, None);
        assert_eq!(c.hostname.as_deref(), Some("x"));
        assert_eq!(c.vsock_port, proto::guest::DEFAULT_VSOCK_PORT);
    }
}
