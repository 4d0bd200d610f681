//! Clone-safe addressing. Every VM restored from a golden snapshot keeps the
//! guest address, gateway and MAC the snapshot was taken with, because they
//! are the same for every VM: the guest always sits at [`GUEST_IP`] behind
//! [`GATEWAY_IP`] on the tap in its own network namespace. What differs per
//! VM is the namespace's host-side address, a /30 of the node's pool
//! (`network.pool`): the namespace NATs the guest to it, and the node
//! routes and masquerades the pool to its uplink.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use crate::error::{Error, Result};

/// The guest's address in every VM (a /30 with the gateway).
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 2);
/// The guest's gateway: the tap's address in the VM's namespace.
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
/// Prefix length of the guest's link.
pub const GUEST_PREFIX: u8 = 30;
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

/// An IPv4 CIDR block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr4 {
    /// The first address (host bits zero).
    pub addr: Ipv4Addr,
    /// Prefix length, 0..=32.
    pub prefix: u8,
}

impl Cidr4 {
    /// Parses `a.b.c.d/n` (or a bare address, a /32); host bits must be zero.
    pub fn parse(text: &str) -> Result<Cidr4> {
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, p),
            None => (text, "32"),
        };
        let addr: Ipv4Addr = addr
            .trim()
            .parse()
            .map_err(|_| Error::invalid(format!("{text:?} is not an IPv4 address or CIDR")))?;
        let prefix: u8 = prefix
            .trim()
            .parse()
            .ok()
            .filter(|p| *p <= 32)
            .ok_or_else(|| Error::invalid(format!("{text:?}: the prefix must be 0 to 32")))?;
        let cidr = Cidr4 { addr, prefix };
        if u32::from(addr) & !cidr.mask() != 0 {
            return Err(Error::invalid(format!(
                "{text:?} has host bits set; the block starts at {}/{prefix}",
                Ipv4Addr::from(u32::from(addr) & cidr.mask())
            )));
        }
        Ok(cidr)
    }

    fn mask(&self) -> u32 {
        if self.prefix == 0 {
            0
        } else {
            u32::MAX << (32 - self.prefix)
        }
    }

    /// Whether `ip` lies in the block.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask() == u32::from(self.addr)
    }
}

impl std::fmt::Display for Cidr4 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// One VM's /30 of the pool: the node's end of the veth pair and the VM
/// namespace's end, which is the address the guest is NATed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Index in the pool.
    pub index: u32,
    /// The node's end of the veth pair (`.1` of the /30).
    pub host_ip: Ipv4Addr,
    /// The VM namespace's end (`.2` of the /30): the guest's address as the
    /// node and the internet see it.
    pub vm_ip: Ipv4Addr,
}

/// The node's pool of per-VM /30 blocks, with the slots in use.
#[derive(Debug)]
pub struct AddressPool {
    block: Cidr4,
    used: BTreeSet<u32>,
}

impl AddressPool {
    /// A pool over `block` (a /8 to a /29: at least two /30s).
    pub fn new(block: Cidr4) -> Result<Self> {
        if !(8..=29).contains(&block.prefix) {
            return Err(Error::invalid(format!(
                "network.pool {block} must be a /8 to a /29 (each VM takes a /30)"
            )));
        }
        Ok(Self {
            block,
            used: BTreeSet::new(),
        })
    }

    /// The pool's block.
    pub fn block(&self) -> Cidr4 {
        self.block
    }

    /// How many VMs the pool can address.
    pub fn capacity(&self) -> u32 {
        1u32 << (32 - u32::from(self.block.prefix) - 2)
    }

    /// The addresses of slot `index` (which must be below the capacity).
    pub fn slot(&self, index: u32) -> Slot {
        let base = u32::from(self.block.addr) + index * 4;
        Slot {
            index,
            host_ip: Ipv4Addr::from(base + 1),
            vm_ip: Ipv4Addr::from(base + 2),
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

    /// Marks the slot of `vm_ip` used (a VM found running after a restart).
    pub fn reserve(&mut self, vm_ip: Ipv4Addr) -> Result<Slot> {
        let offset = u32::from(vm_ip).wrapping_sub(u32::from(self.block.addr));
        if !self.block.contains(vm_ip) || offset % 4 != 2 {
            return Err(Error::invalid(format!(
                "{vm_ip} is not a VM address of network.pool {}",
                self.block
            )));
        }
        let index = offset / 4;
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
        let c = Cidr4::parse("10.200.0.0/16").unwrap();
        assert!(c.contains("10.200.255.1".parse().unwrap()));
        assert!(!c.contains("10.201.0.1".parse().unwrap()));
        assert_eq!(Cidr4::parse("1.2.3.4").unwrap().prefix, 32);
        assert_eq!(Cidr4::parse("0.0.0.0/0").unwrap().mask(), 0);
        let e = Cidr4::parse("10.200.0.1/16").unwrap_err().to_string();
        assert!(e.contains("10.200.0.0/16"), "{e}");
        assert!(Cidr4::parse("10.0.0.0/33").is_err());
        assert!(Cidr4::parse("host.example").is_err());
    }

    #[test]
    fn slots_are_distinct_30s_and_come_back() {
        let mut pool = AddressPool::new(Cidr4::parse("10.200.0.0/29").unwrap()).unwrap();
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
        assert!(matches!(pool.allocate(), Err(Error::ResourceExhausted(_))));
        pool.release(&a);
        assert_eq!(pool.allocate().unwrap(), a);
        let mut after_restart = AddressPool::new(pool.block()).unwrap();
        assert_eq!(after_restart.reserve(b.vm_ip).unwrap(), b);
        assert_eq!(after_restart.allocate().unwrap(), a);
        assert!(after_restart.reserve(b.host_ip).is_err());
        assert!(after_restart.reserve("10.9.0.2".parse().unwrap()).is_err());
        assert!(AddressPool::new(Cidr4::parse("10.0.0.0/30").unwrap()).is_err());
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
    }
}
