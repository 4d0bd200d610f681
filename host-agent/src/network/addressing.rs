//! Clone-safe addressing. Every VM restored from a golden snapshot keeps the
//! guest addresses, gateways and MAC the snapshot was taken with, because
//! they are the same for every VM: the guest always sits at [`GUEST_IP`]
//! (and [`GUEST_IP6`]) behind [`GATEWAY_IP`] (and [`GATEWAY_IP6`]) on the
//! tap in its own network namespace. What differs per VM is the namespace's
//! host-side address, a /30 of the node's IPv4 pool and, when the node has
//! an IPv6 pool, a /126 of it (`network.pool`): the namespace NATs the
//! guest to them, and the node routes and masquerades the pools to its
//! uplink.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::error::{Error, Result};

/// The guest's address in every VM (a /30 with the gateway).
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 2);
/// The guest's gateway: the tap's address in the VM's namespace.
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
/// Prefix length of the guest's link.
pub const GUEST_PREFIX: u8 = 30;
/// The guest's IPv6 address in every VM (a unique-local /126 with the
/// gateway; forwarded only on a node with an IPv6 pool).
pub const GUEST_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xac10, 0, 0, 0, 0, 0, 2);
/// The guest's IPv6 gateway: the tap's IPv6 address in the VM's namespace.
pub const GATEWAY_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xac10, 0, 0, 0, 0, 0, 1);
/// Prefix length of the guest's IPv6 link.
pub const GUEST_PREFIX6: u8 = 126;
/// The guest NIC's MAC in every VM (locally administered, unicast).
pub const GUEST_MAC: &str = "06:00:ac:10:00:02";
/// The tap's name inside the VM's namespace.
pub const TAP_NAME: &str = "tap0";

/// The kernel's `ip=` parameter that configures the guest's NIC at boot, the
/// same in every clone: `ip=<guest>::<gateway>:<netmask>::eth0:off:<dns0>`.
/// The DNS server (`dns0`, after `autoconf` in the kernel's syntax) is the
/// gateway, where the session's resolver listens
/// ([`crate::network::dns`]); guest-init writes it to `/etc/resolv.conf`.
pub fn guest_kernel_ip_param() -> String {
    format!("ip={GUEST_IP}::{GATEWAY_IP}:255.255.255.252::eth0:off:{GATEWAY_IP}")
}

/// The guest's IPv6 configuration on its command line, the same in every
/// clone: `ip6=<guest>/<prefix>,<gateway>,eth0`. The kernel has no such
/// parameter; guest-init applies it (static, no router advertisements), so
/// a golden snapshot carries it whether or not the node forwards IPv6.
pub fn guest_kernel_ip6_param() -> String {
    format!("ip6={GUEST_IP6}/{GUEST_PREFIX6},{GATEWAY_IP6},eth0")
}

/// An IPv4 or IPv6 CIDR block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr {
    /// The first address (host bits zero).
    pub addr: IpAddr,
    /// Prefix length, 0..=32 (IPv4) or 0..=128 (IPv6).
    pub prefix: u8,
}

impl Cidr {
    /// Parses `a.b.c.d/n` or `x:y::z/n` (or a bare address: a /32 or /128);
    /// host bits must be zero.
    pub fn parse(text: &str) -> Result<Cidr> {
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let addr: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| Error::invalid(format!("{text:?} is not an IP address or CIDR")))?;
        let width = width(addr);
        let prefix: u8 = match prefix {
            None => width,
            Some(p) => p
                .trim()
                .parse()
                .ok()
                .filter(|p| *p <= width)
                .ok_or_else(|| {
                    Error::invalid(format!("{text:?}: the prefix must be 0 to {width}"))
                })?,
        };
        let cidr = Cidr { addr, prefix };
        if bits(addr) & !cidr.mask() != 0 {
            return Err(Error::invalid(format!(
                "{text:?} has host bits set; the block starts at {}/{prefix}",
                from_bits(addr, bits(addr) & cidr.mask())
            )));
        }
        Ok(cidr)
    }

    /// The block holding just `ip` (a /32 or a /128).
    pub fn host(ip: IpAddr) -> Cidr {
        Cidr {
            addr: ip,
            prefix: width(ip),
        }
    }

    /// Whether this is an IPv4 block.
    pub fn is_v4(&self) -> bool {
        self.addr.is_ipv4()
    }

    /// The netmask in the family's width, right-aligned in a u128.
    fn mask(&self) -> u128 {
        let w = u32::from(width(self.addr));
        let all = if w == 128 {
            u128::MAX
        } else {
            (1u128 << w) - 1
        };
        // The host bits are `all` shifted right by the prefix (none left
        // for a /128, where the shift would overflow).
        all & !all.checked_shr(u32::from(self.prefix)).unwrap_or(0)
    }

    /// Whether `ip` lies in the block (never across families).
    pub fn contains(&self, ip: IpAddr) -> bool {
        ip.is_ipv4() == self.is_v4() && bits(ip) & self.mask() == bits(self.addr)
    }

    /// Whether every address of `other` lies in this block.
    pub fn holds(&self, other: &Cidr) -> bool {
        self.prefix <= other.prefix && self.contains(other.addr)
    }
}

/// Address width of `ip`'s family in bits.
fn width(ip: IpAddr) -> u8 {
    if ip.is_ipv4() {
        32
    } else {
        128
    }
}

/// `ip` as a number.
fn bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

/// The address of `like`'s family whose number is `n` (truncated to it).
fn from_bits(like: IpAddr, n: u128) -> IpAddr {
    match like {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::from(n as u32)),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::from(n)),
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// One VM's block of the pools: the node's end of the veth pair and the VM
/// namespace's end, which is the address the guest is NATed to; for IPv4
/// always, for IPv6 on a node with an IPv6 pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Index in the pool.
    pub index: u32,
    /// The node's end of the veth pair (`.1` of the /30).
    pub host_ip: Ipv4Addr,
    /// The VM namespace's end (`.2` of the /30): the guest's address as the
    /// node and the internet see it.
    pub vm_ip: Ipv4Addr,
    /// The IPv6 pair (`::1` and `::2` of the slot's /126), if any.
    pub v6: Option<Slot6>,
}

/// One VM's /126 of the node's IPv6 pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot6 {
    /// The node's end of the veth pair.
    pub host_ip: Ipv6Addr,
    /// The VM namespace's end: the guest's IPv6 address as others see it.
    pub vm_ip: Ipv6Addr,
}

/// The node's pools of per-VM blocks (IPv4 /30s and, optionally, as many
/// IPv6 /126s, slot `i` taking the `i`-th of each), with the slots in use.
#[derive(Debug)]
pub struct AddressPool {
    block: Cidr,
    block6: Option<Cidr>,
    used: BTreeSet<u32>,
}

impl AddressPool {
    /// A pool over IPv4 `block` (a /8 to a /29: at least two /30s) and, if
    /// given, IPv6 `block6` (a /16 to a /124, with at least as many /126s).
    pub fn new(block: Cidr, block6: Option<Cidr>) -> Result<Self> {
        if !block.is_v4() || !(8..=29).contains(&block.prefix) {
            return Err(Error::invalid(format!(
                "network.pool {block} must be an IPv4 /8 to /29 (each VM takes a /30)"
            )));
        }
        if let Some(b6) = block6 {
            let slots = 30 - u32::from(block.prefix);
            if b6.is_v4() || !(16..=124).contains(&b6.prefix) {
                return Err(Error::invalid(format!(
                    "network.pool {b6} must be an IPv6 /16 to /124 (each VM takes a /126)"
                )));
            }
            if 126 - u32::from(b6.prefix) < slots {
                return Err(Error::invalid(format!(
                    "network.pool {b6} has fewer /126s than {block} has /30s: use a /{} or larger",
                    126 - slots
                )));
            }
        }
        Ok(Self {
            block,
            block6,
            used: BTreeSet::new(),
        })
    }

    /// The pool's IPv4 block.
    pub fn block(&self) -> Cidr {
        self.block
    }

    /// The pool's IPv6 block, if it has one.
    pub fn block6(&self) -> Option<Cidr> {
        self.block6
    }

    /// How many VMs the pool can address.
    pub fn capacity(&self) -> u32 {
        1u32 << (32 - u32::from(self.block.prefix) - 2)
    }

    /// The addresses of slot `index` (which must be below the capacity).
    pub fn slot(&self, index: u32) -> Slot {
        let base = bits(self.block.addr) as u32 + index * 4;
        Slot {
            index,
            host_ip: Ipv4Addr::from(base + 1),
            vm_ip: Ipv4Addr::from(base + 2),
            v6: self.block6.map(|b6| {
                let base = bits(b6.addr) + u128::from(index) * 4;
                Slot6 {
                    host_ip: Ipv6Addr::from(base + 1),
                    vm_ip: Ipv6Addr::from(base + 2),
                }
            }),
        }
    }

    /// Takes the lowest free slot.
    pub fn allocate(&mut self) -> Result<Slot> {
        let free = (0..self.capacity())
            .find(|i| !self.used.contains(i))
            .ok_or_else(|| {
                Error::ResourceExhausted(format!(
                    "network.pool {} is used up ({} VMs); configure a larger pool",
                    self.block,
                    self.capacity()
                ))
            })?;
        self.used.insert(free);
        Ok(self.slot(free))
    }

    /// The slot whose VM-side IPv4 address is `vm_ip`, if it is one.
    pub fn index_of(&self, vm_ip: Ipv4Addr) -> Option<u32> {
        let offset = u32::from(vm_ip).wrapping_sub(bits(self.block.addr) as u32);
        (self.block.contains(IpAddr::V4(vm_ip)) && offset % 4 == 2).then_some(offset / 4)
    }

    /// Marks the slot of `vm_ip` used (a VM found running after a restart).
    pub fn reserve(&mut self, vm_ip: Ipv4Addr) -> Result<Slot> {
        let index = self.index_of(vm_ip).ok_or_else(|| {
            Error::invalid(format!(
                "{vm_ip} is not a VM address of network.pool {}",
                self.block
            ))
        })?;
        self.used.insert(index);
        Ok(self.slot(index))
    }

    /// Gives a slot back.
    pub fn release(&mut self, slot: &Slot) {
        self.used.remove(&slot.index);
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_parse_and_refuse_host_bits() {
        let c = Cidr::parse("10.200.0.0/16").unwrap();
        assert!(c.contains("10.200.255.1".parse().unwrap()));
        assert!(!c.contains("10.201.0.1".parse().unwrap()));
        assert_eq!(Cidr::parse("1.2.3.4").unwrap().prefix, 32);
        assert_eq!(Cidr::parse("0.0.0.0/0").unwrap().mask(), 0);
        let e = Cidr::parse("10.200.0.1/16").unwrap_err().to_string();
        assert!(e.contains("10.200.0.0/16"), "{e}");
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("host.example").is_err());
    }

    #[test]
    fn ipv6_cidrs_parse_and_never_hold_ipv4() {
        let c = Cidr::parse("2001:db8::/32").unwrap();
        assert!(c.contains("2001:db8:ffff::1".parse().unwrap()));
        assert!(!c.contains("2001:db9::1".parse().unwrap()));
        assert_eq!(Cidr::parse("2001:db8::7").unwrap().prefix, 128);
        assert!(Cidr::parse("::/0")
            .unwrap()
            .contains("::1".parse().unwrap()));
        assert!(!Cidr::parse("::/0")
            .unwrap()
            .contains("10.0.0.1".parse().unwrap()));
        assert!(!Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("::1".parse().unwrap()));
        let e = Cidr::parse("2001:db8::1/64").unwrap_err().to_string();
        assert!(e.contains("2001:db8::/64"), "{e}");
        assert!(Cidr::parse("2001:db8::/129")
            .unwrap_err()
            .to_string()
            .contains("0 to 128"));
        let wide = Cidr::parse("fc00::/7").unwrap();
        assert!(wide.holds(&Cidr::parse("fd00:ec2::254").unwrap()));
        assert!(!Cidr::parse("fd00:ec2::254").unwrap().holds(&wide));
        assert!(!wide.holds(&Cidr::parse("10.0.0.0/8").unwrap()));
        assert_eq!(
            Cidr::host("fd00::1".parse().unwrap()).to_string(),
            "fd00::1/128"
        );
    }

    #[test]
    fn slots_are_distinct_30s_and_come_back() {
        let mut pool = AddressPool::new(Cidr::parse("10.200.0.0/29").unwrap(), None).unwrap();
        assert_eq!(pool.capacity(), 2);
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        assert_eq!(
            (a.host_ip, a.vm_ip, b.host_ip, b.vm_ip),
            (
                "10.200.0.1".parse().unwrap(),
                "10.200.0.2".parse().unwrap(),
                "10.200.0.5".parse().unwrap(),
                "10.200.0.6".parse().unwrap()
            )
        );
        assert_eq!(a.v6, None);
        assert!(matches!(pool.allocate(), Err(Error::ResourceExhausted(_))));
        pool.release(&a);
        assert_eq!(pool.allocate().unwrap(), a);
        let mut after_restart = AddressPool::new(pool.block(), None).unwrap();
        assert_eq!(after_restart.reserve(b.vm_ip).unwrap(), b);
        assert_eq!(after_restart.allocate().unwrap(), a);
        assert!(after_restart.reserve(b.host_ip).is_err());
        assert!(after_restart.reserve("10.9.0.2".parse().unwrap()).is_err());
        assert!(AddressPool::new(Cidr::parse("10.0.0.0/30").unwrap(), None).is_err());
        assert!(AddressPool::new(Cidr::parse("fd00::/64").unwrap(), None).is_err());
    }

    #[test]
    fn ipv6_slots_follow_the_ipv4_ones() {
        let v4 = Cidr::parse("10.200.0.0/16").unwrap();
        let v6 = Cidr::parse("fd00:200::/112").unwrap();
        let mut pool = AddressPool::new(v4, Some(v6)).unwrap();
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        let six = |s: &Slot| {
            let s6 = s.v6.unwrap();
            (s6.host_ip.to_string(), s6.vm_ip.to_string())
        };
        assert_eq!(six(&a), ("fd00:200::1".into(), "fd00:200::2".into()));
        assert_eq!(six(&b), ("fd00:200::5".into(), "fd00:200::6".into()));
        let last = pool.slot(pool.capacity() - 1);
        assert!(v6.contains(IpAddr::V6(last.v6.unwrap().vm_ip)));
        // After a restart, the IPv4 address found brings its IPv6 pair back.
        let mut again = AddressPool::new(v4, Some(v6)).unwrap();
        assert_eq!(again.reserve(b.vm_ip).unwrap(), b);
        // Too few /126s for the /30s, or the wrong family.
        let e = AddressPool::new(v4, Some(Cidr::parse("fd00:200::/113").unwrap()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/112 or larger"), "{e}");
        assert!(AddressPool::new(v4, Some(Cidr::parse("10.0.0.0/8").unwrap())).is_err());
    }

    #[test]
    fn the_guest_is_configured_the_same_in_every_clone() {
        assert_eq!(
            guest_kernel_ip_param(),
            "ip=172.16.0.2::172.16.0.1:255.255.255.252::eth0:off:172.16.0.1"
        );
        // The DNS server is the resolver's address: the gateway.
        let param = guest_kernel_ip_param();
        let fields: Vec<&str> = param.trim_start_matches("ip=").split(':').collect();
        assert_eq!(fields.get(7), Some(&GATEWAY_IP.to_string().as_str()));
        assert_eq!(fields.get(2), Some(&GATEWAY_IP.to_string().as_str()));
        assert_eq!(
            guest_kernel_ip6_param(),
            "ip6=fd00:ac10::2/126,fd00:ac10::1,eth0"
        );
        let link = Cidr::parse("fd00:ac10::/126").unwrap();
        assert!(link.contains(IpAddr::V6(GUEST_IP6)) && link.contains(IpAddr::V6(GATEWAY_IP6)));
    }
}
