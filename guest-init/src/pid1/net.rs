//! Interface and route setup with ioctls (no `ip` binary needed).

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use super::cmdline::Cmdline;

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

fn socket() -> std::io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
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
/// the `ip=` DNS servers (if any) to `<root>/etc/resolv.conf`. Failures are
/// logged; the guest still serves the session channel (over vsock).
pub fn configure(cmd: &Cmdline, root: &Path) {
    if let Err(e) = link_up("lo") {
        tracing::warn!(error = %e, "cannot bring up lo");
    }
    let Some(ip) = &cmd.ip else {
        tracing::info!("no ip= on the kernel command line: only lo is configured");
        return;
    };
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
            Ok(routes)
        })
        .join()
        .unwrap();
        match r {
            Ok(routes) => {
                // Default route: destination 00000000 with gateway 10.9.8.1 (little-endian hex 0108090A).
                assert!(routes.lines().any(|l| l.contains("00000000\t0108090A")), "{routes}");
            }
            Err(e) => println!("SKIPPED configures_an_interface_in_a_network_namespace: cannot create a network namespace: {e}"),
        }
    }
}
