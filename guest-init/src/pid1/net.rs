//! Interface and route setup with ioctls (no `ip` binary needed, and the
//! few calls guest-init makes do not need a netlink library).

use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use super::cmdline::{Cmdline, Ip6Config};

const SIOCGIFFLAGS: libc::c_ulong = 0x8913;
const SIOCSIFFLAGS: libc::c_ulong = 0x8914;
const SIOCSIFADDR: libc::c_ulong = 0x8916;
const SIOCSIFNETMASK: libc::c_ulong = 0x891c;
const SIOCADDRT: libc::c_ulong = 0x890b;
const IFF_UP: i16 = 0x1;
const RTF_UP: u16 = 0x1;
const RTF_GATEWAY: u16 = 0x2;

/// `struct ifreq` with the flags member of its union.
#[repr(C)]
struct IfreqFlags {
    name: [u8; 16],
    flags: i16,
    _pad: [u8; 22],
}

/// `struct ifreq` with the address member of its union.
#[repr(C)]
struct IfreqAddr {
    name: [u8; 16],
    addr: libc::sockaddr_in,
    _pad: [u8; 8],
}

/// `struct rtentry` (linux/route.h).
#[repr(C)]
struct RtEntry {
    pad1: libc::c_ulong,
    dst: libc::sockaddr_in,
    gateway: libc::sockaddr_in,
    genmask: libc::sockaddr_in,
    flags: u16,
    pad2: i16,
    pad3: libc::c_ulong,
    pad4: *mut libc::c_void,
    metric: i16,
    dev: *mut libc::c_char,
    mtu: libc::c_ulong,
    window: libc::c_ulong,
    irtt: u16,
}

/// `struct in6_rtmsg` (linux/ipv6_route.h; libc does not have it).
#[repr(C)]
struct RtMsg6 {
    dst: libc::in6_addr,
    src: libc::in6_addr,
    gateway: libc::in6_addr,
    kind: u32,
    dst_len: u16,
    src_len: u16,
    metric: u32,
    info: libc::c_ulong,
    flags: u32,
    ifindex: libc::c_int,
}

fn socket() -> std::io::Result<OwnedFd> {
    socket_of(libc::AF_INET)
}

fn socket_of(family: libc::c_int) -> std::io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe { libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ifname(name: &str) -> std::io::Result<[u8; 16]> {
    let mut out = [0u8; 16];
    if name.is_empty() || name.len() > 15 || name.contains('\0') {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("bad interface name {name:?}"),
        ));
    }
    out[..name.len()].copy_from_slice(name.as_bytes());
    Ok(out)
}

fn sockaddr(ip: Ipv4Addr) -> libc::sockaddr_in {
    // SAFETY: sockaddr_in is plain data; all-zero is valid.
    let mut a: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    a.sin_family = libc::AF_INET as libc::sa_family_t;
    a.sin_addr.s_addr = u32::from(ip).to_be();
    a
}

fn ioctl<T>(fd: &OwnedFd, req: libc::c_ulong, arg: &mut T) -> std::io::Result<()> {
    // SAFETY: `arg` is a valid, initialised repr(C) struct of the layout `req` expects.
    if unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg as *mut T) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Sets IFF_UP on `name`.
pub fn link_up(name: &str) -> std::io::Result<()> {
    let fd = socket()?;
    let mut req = IfreqFlags {
        name: ifname(name)?,
        flags: 0,
        _pad: [0; 22],
    };
    ioctl(&fd, SIOCGIFFLAGS, &mut req)?;
    req.flags |= IFF_UP;
    ioctl(&fd, SIOCSIFFLAGS, &mut req)
}

/// True when `name` has IFF_UP.
pub fn is_up(name: &str) -> std::io::Result<bool> {
    let fd = socket()?;
    let mut req = IfreqFlags {
        name: ifname(name)?,
        flags: 0,
        _pad: [0; 22],
    };
    ioctl(&fd, SIOCGIFFLAGS, &mut req)?;
    Ok(req.flags & IFF_UP != 0)
}

/// Gives `name` the address `addr` with `netmask`.
pub fn set_address(name: &str, addr: Ipv4Addr, netmask: Ipv4Addr) -> std::io::Result<()> {
    let fd = socket()?;
    let mut req = IfreqAddr {
        name: ifname(name)?,
        addr: sockaddr(addr),
        _pad: [0; 8],
    };
    ioctl(&fd, SIOCSIFADDR, &mut req)?;
    req.addr = sockaddr(netmask);
    ioctl(&fd, SIOCSIFNETMASK, &mut req)
}

/// Adds a default route via `gateway`.
pub fn add_default_route(gateway: Ipv4Addr) -> std::io::Result<()> {
    let fd = socket()?;
    let mut rt = RtEntry {
        pad1: 0,
        dst: sockaddr(Ipv4Addr::UNSPECIFIED),
        gateway: sockaddr(gateway),
        genmask: sockaddr(Ipv4Addr::UNSPECIFIED),
        flags: RTF_UP | RTF_GATEWAY,
        pad2: 0,
        pad3: 0,
        pad4: std::ptr::null_mut(),
        metric: 0,
        dev: std::ptr::null_mut(),
        mtu: 0,
        window: 0,
        irtt: 0,
    };
    ioctl(&fd, SIOCADDRT, &mut rt)
}

fn in6(ip: Ipv6Addr) -> libc::in6_addr {
    libc::in6_addr {
        s6_addr: ip.octets(),
    }
}

/// The index of interface `name`.
fn ifindex(name: &str) -> std::io::Result<libc::c_int> {
    let c = std::ffi::CString::new(name).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("bad interface name {name:?}"),
        )
    })?;
    // SAFETY: `c` is a NUL-terminated string that outlives the call.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if index == 0 {
        return Err(std::io::Error::last_os_error());
    }
    libc::c_int::try_from(index)
        .map_err(|_| std::io::Error::other(format!("interface index {index} out of range")))
}

/// Writes `value` to `/proc/sys/net/ipv6/conf/<dev>/<key>`.
fn ipv6_conf(dev: &str, key: &str, value: &str) -> std::io::Result<()> {
    std::fs::write(format!("/proc/sys/net/ipv6/conf/{dev}/{key}"), value)
}

/// Gives `name` the IPv6 address `addr/prefix`, usable at once: duplicate
/// address detection, router advertisements and autoconfiguration are
/// turned off on it first (the address is fixed and the link has no
/// router that advertises).
pub fn set_address6(name: &str, addr: Ipv6Addr, prefix: u8) -> std::io::Result<()> {
    for key in ["accept_dad", "accept_ra", "autoconf"] {
        ipv6_conf(name, key, "0")?;
    }
    let fd = socket_of(libc::AF_INET6)?;
    let mut req = libc::in6_ifreq {
        ifr6_addr: in6(addr),
        ifr6_prefixlen: u32::from(prefix),
        ifr6_ifindex: ifindex(name)?,
    };
    ioctl(&fd, SIOCSIFADDR, &mut req)
}

/// Adds a default IPv6 route via `gateway` on `name`.
pub fn add_default_route6(name: &str, gateway: Ipv6Addr) -> std::io::Result<()> {
    let fd = socket_of(libc::AF_INET6)?;
    let mut rt = RtMsg6 {
        dst: in6(Ipv6Addr::UNSPECIFIED),
        src: in6(Ipv6Addr::UNSPECIFIED),
        gateway: in6(gateway),
        kind: 0,
        dst_len: 0,
        src_len: 0,
        // The kernel's own default for a route added without one.
        metric: 1024,
        info: 0,
        flags: u32::from(RTF_UP | RTF_GATEWAY),
        ifindex: ifindex(name)?,
    };
    ioctl(&fd, SIOCADDRT, &mut rt)
}

/// Applies `ip6=`: the address on its (already up) device and the route.
fn configure6(ip6: &Ip6Config) -> std::io::Result<()> {
    set_address6(&ip6.device, ip6.addr, ip6.prefix)?;
    match ip6.gateway {
        Some(gw) => add_default_route6(&ip6.device, gw),
        None => Ok(()),
    }
}

/// Sets the hostname.
pub fn set_hostname(name: &str) -> std::io::Result<()> {
    // SAFETY: the pointer and length describe `name`'s bytes.
    if unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The text of `/etc/resolv.conf` naming `servers`, in order.
pub fn resolv_conf(servers: &[Ipv4Addr]) -> String {
    let mut s = String::from("# written by guest-init from the kernel's ip= parameter\n");
    for ip in servers {
        s.push_str(&format!("nameserver {ip}\n"));
    }
    s
}

/// Writes `resolv.conf` under `etc` naming `servers`. It replaces the file
/// by a rename, so a symbolic link there (to a resolver daemon's file that
/// does not exist in the guest) is replaced too, never followed.
pub fn write_resolv_conf(etc: &Path, servers: &[Ipv4Addr]) -> std::io::Result<()> {
    let tmp = etc.join(".resolv.conf.guest-init");
    std::fs::write(&tmp, resolv_conf(servers))?;
    std::fs::rename(&tmp, etc.join("resolv.conf"))
}

/// Brings up lo, and the `ip=` device with its address and route, and writes
/// the `ip=` DNS servers (if any) to `<root>/etc/resolv.conf`; then the
/// `ip6=` address and route, if given. Failures are logged; the guest still
/// serves the session channel (over vsock).
pub fn configure(cmd: &Cmdline, root: &Path) {
    if let Err(e) = link_up("lo") {
        tracing::warn!(error = %e, "cannot bring up lo");
    }
    match &cmd.ip {
        Some(ip) => configure4(ip, root),
        None => tracing::info!("no ip= on the kernel command line"),
    }
    let Some(ip6) = &cmd.ip6 else {
        return;
    };
    if !Path::new("/proc/sys/net/ipv6").exists() {
        tracing::warn!("ip6= given, but this kernel has no IPv6: skipped");
        return;
    }
    match link_up(&ip6.device).and_then(|_| configure6(ip6)) {
        Ok(()) => tracing::info!(device = %ip6.device, addr = %ip6.addr, "IPv6 configured"),
        Err(e) => tracing::warn!(error = %e, device = %ip6.device, "IPv6 configuration failed"),
    }
}

/// Applies `ip=`: address, link, route, resolv.conf.
fn configure4(ip: &super::cmdline::IpConfig, root: &Path) {
    let r = set_address(&ip.device, ip.addr, ip.netmask)
        .and_then(|_| link_up(&ip.device))
        .and_then(|_| ip.gateway.map_or(Ok(()), add_default_route));
    match r {
        Ok(()) => tracing::info!(device = %ip.device, addr = %ip.addr, "network configured"),
        Err(e) => tracing::warn!(error = %e, device = %ip.device, "network configuration failed"),
    }
    if !ip.dns.is_empty() {
        match write_resolv_conf(&root.join("etc"), &ip.dns) {
            Ok(()) => tracing::info!(servers = ?ip.dns, "resolv.conf written"),
            Err(e) => tracing::warn!(error = %e, "cannot write /etc/resolv.conf"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_sizes_match_the_kernel() {
        assert_eq!(std::mem::size_of::<IfreqFlags>(), 40);
        assert_eq!(std::mem::size_of::<IfreqAddr>(), 40);
        #[cfg(target_pointer_width = "64")]
        assert_eq!(std::mem::size_of::<RtEntry>(), 120);
        #[cfg(target_pointer_width = "64")]
        assert_eq!(std::mem::size_of::<RtMsg6>(), 80);
        assert_eq!(std::mem::size_of::<libc::in6_ifreq>(), 24);
    }

    #[test]
    fn resolv_conf_names_the_servers_and_replaces_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let etc = dir.path();
        // A dangling link, as a systemd-resolved image leaves it.
        std::os::unix::fs::symlink(
            "/run/systemd/resolve/stub-resolv.conf",
            etc.join("resolv.conf"),
        )
        .unwrap();
        write_resolv_conf(etc, &[Ipv4Addr::new(172, 16, 0, 1)]).unwrap();
        let meta = std::fs::symlink_metadata(etc.join("resolv.conf")).unwrap();
        assert!(meta.file_type().is_file());
        let text = std::fs::read_to_string(etc.join("resolv.conf")).unwrap();
        assert!(text.lines().any(|l| l == "nameserver 172.16.0.1"), "{text}");
        assert_eq!(
            text.lines().filter(|l| l.starts_with("nameserver")).count(),
            1
        );
        assert!(!etc.join(".resolv.conf.guest-init").exists());
        let two = resolv_conf(&[Ipv4Addr::new(10, 0, 0, 53), Ipv4Addr::new(10, 0, 0, 54)]);
        let servers: Vec<&str> = two.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(servers, ["nameserver 10.0.0.53", "nameserver 10.0.0.54"]);
    }

    #[test]
    fn configures_an_interface_in_a_network_namespace() {
        // A thread of its own, so only this thread enters the new namespace.
        let r = std::thread::spawn(|| {
            // SAFETY: unshare(2) with CLONE_NEWNET affects only this thread.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
            assert!(!is_up("lo").unwrap());
            link_up("lo").unwrap();
            assert!(is_up("lo").unwrap());
            set_address(
                "lo",
                Ipv4Addr::new(10, 9, 8, 7),
                Ipv4Addr::new(255, 255, 255, 0),
            )
            .unwrap();
            add_default_route(Ipv4Addr::new(10, 9, 8, 1)).unwrap();
            let routes = std::fs::read_to_string("/proc/thread-self/net/route").unwrap();
            // IPv6 as host-agent's ip6= asks it, on a veth eth0 made with
            // `ip` (a child forked here is in this thread's namespace).
            let dummy = std::process::Command::new("ip")
                .args([
                    "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
                ])
                .status();
            if !dummy.is_ok_and(|s| s.success()) {
                return Ok((routes, None));
            }
            link_up("eth1").unwrap();
            link_up("eth0").unwrap();
            set_address6("eth0", "fd00:ac10::2".parse().unwrap(), 126).unwrap();
            add_default_route6("eth0", "fd00:ac10::1".parse().unwrap()).unwrap();
            // Tentative only until the veth's carrier is up (asynchronous);
            // with DAD off it is usable as soon as it is.
            let mut addrs = String::new();
            for _ in 0..100 {
                addrs = std::fs::read_to_string("/proc/thread-self/net/if_inet6").unwrap();
                let tentative = addrs
                    .lines()
                    .find(|l| l.starts_with("fd00ac10000000000000000000000002"))
                    .and_then(|l| l.split_whitespace().nth(4))
                    .and_then(|f| u32::from_str_radix(f, 16).ok())
                    .is_none_or(|f| f & 0x40 != 0);
                if !tentative {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            let routes6 = std::fs::read_to_string("/proc/thread-self/net/ipv6_route").unwrap();
            Ok((routes, Some((addrs, routes6))))
        })
        .join()
        .unwrap();
        match r {
            Ok((routes, six)) => {
                // Default route: destination 00000000 with gateway 10.9.8.1 (little-endian hex 0108090A).
                assert!(routes.lines().any(|l| l.contains("00000000\t0108090A")), "{routes}");
                let Some((addrs, routes6)) = six else {
                    println!("SKIPPED the IPv6 part: `ip link add eth0 type veth` failed");
                    return;
                };
                // The address, prefix 126 (0x7e), not tentative once the
                // link is up (no DAD).
                let line = addrs
                    .lines()
                    .find(|l| l.starts_with("fd00ac10000000000000000000000002"))
                    .unwrap_or_else(|| panic!("no fd00:ac10::2 in {addrs}"));
                let fields: Vec<&str> = line.split_whitespace().collect();
                assert_eq!(fields[2], "7e", "{line}");
                let flags = u32::from_str_radix(fields[4], 16).unwrap();
                assert_eq!(flags & 0x40, 0, "tentative: {line}");
                // The default route via fd00:ac10::1.
                assert!(
                    routes6.lines().any(|l| l.starts_with("00000000000000000000000000000000 00 ")
                        && l.contains("fd00ac10000000000000000000000001")),
                    "{routes6}"
                );
            }
            Err(e) => println!("SKIPPED configures_an_interface_in_a_network_namespace: cannot create a network namespace: {e}"),
        }
    }
}
