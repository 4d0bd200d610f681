//! Settings from the kernel command line (/proc/cmdline):
//!
//! * `ip=CLIENT:SERVER:GATEWAY:NETMASK:HOSTNAME:DEVICE:AUTOCONF:DNS0:DNS1` —
//!   the kernel's own syntax; guest-init applies CLIENT/NETMASK to DEVICE
//!   (default eth0), adds a default route via GATEWAY, takes HOSTNAME, and
//!   writes DNS0 and DNS1 (when given) to `/etc/resolv.conf`.
//! * `ip6=ADDRESS/PREFIX,GATEWAY,DEVICE` — a static IPv6 address (host-agent's
//!   fixed guest address, the same in every clone) for DEVICE (default eth0),
//!   with a default route via GATEWAY (optional); no router advertisements,
//!   no duplicate address detection. The kernel has no such parameter.
//! * `guest_init.hostname=NAME` — overrides the hostname.
//! * `guest_init.port=PORT` — the vsock port (default 700; it must be below 1024).

use std::net::{Ipv4Addr, Ipv6Addr};

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
    /// DNS servers (`dns0`, `dns1`), in order; empty when none is given.
    pub dns: Vec<Ipv4Addr>,
}

/// A static IPv6 address from `ip6=`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ip6Config {
    /// The guest's address.
    pub addr: Ipv6Addr,
    /// Its prefix length (1 to 128).
    pub prefix: u8,
    /// Default gateway.
    pub gateway: Option<Ipv6Addr>,
    /// Interface name.
    pub device: String,
}

impl Ip6Config {
    /// Parses the value of `ip6=`; `None` when the address or prefix is
    /// not one (the parameter is then ignored, as a bad `ip=` is).
    fn parse(v: &str) -> Option<Self> {
        let mut f = v.split(',');
        let (addr, prefix) = f.next()?.split_once('/')?;
        let prefix: u8 = prefix.parse().ok().filter(|p| (1..=128).contains(p))?;
        let gateway = match f.next().filter(|g| !g.is_empty()) {
            Some(g) => Some(g.parse().ok()?),
            None => None,
        };
        let device = f.next().filter(|d| !d.is_empty()).unwrap_or("eth0");
        Some(Self {
            addr: addr.parse().ok()?,
            prefix,
            gateway,
            device: device.to_string(),
        })
    }
}

/// Parsed command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cmdline {
    /// Hostname to set.
    pub hostname: Option<String>,
    /// Static address for the network device.
    pub ip: Option<IpConfig>,
    /// Static IPv6 address for the network device.
    pub ip6: Option<Ip6Config>,
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
            ip6: None,
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
                        dns: [7, 8]
                            .into_iter()
                            .filter_map(|i| get(i).and_then(|s| s.parse().ok()))
                            .collect(),
                    });
                }
                if let Some(h) = get(4) {
                    c.hostname = Some(h.to_string());
                }
            } else if let Some(v) = word.strip_prefix("ip6=") {
                c.ip6 = Ip6Config::parse(v);
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
        assert!(ip.dns.is_empty(), "no dns0 without the field");
        let c = Cmdline::parse("ip=dhcp guest_init.hostname=x");
        assert_eq!(c.ip, None);
        assert_eq!(c.hostname.as_deref(), Some("x"));
        assert_eq!(c.vsock_port, proto::guest::DEFAULT_VSOCK_PORT);
    }

    #[test]
    fn parses_dns_servers_after_autoconf() {
        // host-agent's parameter: dns0 is the gateway (the session's resolver).
        let c = Cmdline::parse("ip=172.16.0.2::172.16.0.1:255.255.255.252::eth0:off:172.16.0.1");
        let ip = c.ip.unwrap();
        assert_eq!(ip.dns, vec![Ipv4Addr::new(172, 16, 0, 1)]);
        assert_eq!(ip.device, "eth0");
        assert_eq!(c.hostname, None);
        let c = Cmdline::parse("ip=10.0.0.2::10.0.0.1:255.255.255.0::eth1:off:10.0.0.53:10.0.0.54");
        let ip = c.ip.unwrap();
        assert_eq!(
            ip.dns,
            vec![Ipv4Addr::new(10, 0, 0, 53), Ipv4Addr::new(10, 0, 0, 54)]
        );
        assert_eq!(ip.device, "eth1");
        // An empty or unparsable dns0 is no server; dns1 alone still counts.
        let c = Cmdline::parse("ip=10.0.0.2::10.0.0.1:255.255.255.0::eth0:off::10.0.0.54");
        assert_eq!(c.ip.unwrap().dns, vec![Ipv4Addr::new(10, 0, 0, 54)]);
        let c = Cmdline::parse("ip=10.0.0.2::10.0.0.1:255.255.255.0::eth0:off:resolver");
        assert!(c.ip.unwrap().dns.is_empty());
    }

    #[test]
    fn parses_the_static_ipv6_address() {
        // host-agent's parameter.
        let c = Cmdline::parse("ip=172.16.0.2::172.16.0.1:255.255.255.252::eth0:off ip6=fd00:ac10::2/126,fd00:ac10::1,eth0");
        let ip6 = c.ip6.unwrap();
        assert_eq!(ip6.addr, "fd00:ac10::2".parse::<Ipv6Addr>().unwrap());
        assert_eq!(ip6.prefix, 126);
        assert_eq!(ip6.gateway, Some("fd00:ac10::1".parse().unwrap()));
        assert_eq!(ip6.device, "eth0");
        // Gateway and device are optional.
        let c = Cmdline::parse("ip6=2001:db8::5/64");
        assert_eq!(
            c.ip6.as_ref().map(|i| (i.gateway, i.device.as_str())),
            Some((None, "eth0"))
        );
        let c = Cmdline::parse("ip6=2001:db8::5/64,,eth1");
        assert_eq!(c.ip6.unwrap().device, "eth1");
        // Anything not an address with a prefix is no configuration.
        for bad in [
            "ip6=2001:db8::5",
            "ip6=2001:db8::5/0",
            "ip6=2001:db8::5/129",
            "ip6=nope/64",
            "ip6=2001:db8::5/64,gateway",
            "ip6=",
        ] {
            assert_eq!(Cmdline::parse(bad).ip6, None, "{bad}");
        }
    }
}
