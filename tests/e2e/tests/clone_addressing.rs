//! The network address every clone of a golden snapshot keeps, as the two
//! ends see it: host-agent puts `ip=` on the golden boot's kernel command
//! line and routes the namespace for that address; guest-init, as PID 1,
//! reads the same parameter and configures the guest's NIC from it (the
//! project's kernel has no IP autoconfiguration of its own).

use std::net::Ipv4Addr;

use guest_init::pid1::cmdline::Cmdline;
use host_agent::network::addressing::{
    guest_kernel_ip6_param, guest_kernel_ip_param, GATEWAY_IP, GATEWAY_IP6, GUEST_IP, GUEST_IP6,
    GUEST_PREFIX, GUEST_PREFIX6,
};

#[test]
fn guest_init_configures_the_address_host_agent_routes() {
    let line = format!(
        "console=ttyS0 root=/dev/vda rw init=/sbin/init {}",
        guest_kernel_ip_param()
    );
    let ip = Cmdline::parse(&line)
        .ip
        .expect("guest-init reads the ip= parameter");
    assert_eq!(ip.addr, GUEST_IP);
    assert_eq!(ip.gateway, Some(GATEWAY_IP));
    let prefix = u32::from(ip.netmask).leading_ones();
    assert_eq!(prefix, u32::from(GUEST_PREFIX));
    assert_eq!(ip.netmask, Ipv4Addr::new(255, 255, 255, 252));
    assert_eq!(ip.device, "eth0");
    // The gateway is on the guest's link.
    let mask = u32::from(ip.netmask);
    assert_eq!(u32::from(GUEST_IP) & mask, u32::from(GATEWAY_IP) & mask);
}

#[test]
fn guest_init_configures_the_ipv6_address_host_agent_routes() {
    let line = format!(
        "console=ttyS0 {} {}",
        guest_kernel_ip_param(),
        guest_kernel_ip6_param()
    );
    let ip6 = Cmdline::parse(&line)
        .ip6
        .expect("guest-init reads the ip6= parameter");
    assert_eq!(ip6.addr, GUEST_IP6);
    assert_eq!(ip6.gateway, Some(GATEWAY_IP6));
    assert_eq!(ip6.prefix, GUEST_PREFIX6);
    assert_eq!(ip6.device, "eth0");
    // The gateway is on the guest's link.
    let mask = u128::MAX << (128 - u32::from(ip6.prefix));
    assert_eq!(u128::from(GUEST_IP6) & mask, u128::from(GATEWAY_IP6) & mask);
}
