//! A host tap for the virtio-net tests: created with `ip`, up, IPv6 off (so
//! the host sends the guest nothing it did not ask for), deleted on drop.

use std::ffi::CString;
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

/// A raw AF_PACKET socket bound to one interface.
pub struct PacketSocket(i32);

impl PacketSocket {
    /// Binds a socket to `ifname` (a 1 s receive timeout).
    pub fn bind(ifname: &str) -> PacketSocket {
        let eth_p_all = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2) call; the fd is owned by the returned value.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(eth_p_all)) };
        assert!(
            fd >= 0,
            "AF_PACKET socket: {}",
            std::io::Error::last_os_error()
        );
        let name = CString::new(ifname).unwrap();
        // SAFETY: `name` is a valid NUL-terminated string.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        assert!(index > 0);
        // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = eth_p_all;
        addr.sll_ifindex = index as i32;
        // SAFETY: `addr` is a valid sockaddr_ll and the length matches it.
        let rc = unsafe {
            libc::bind(
                fd,
                &addr as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
        let tv = libc::timeval {
            tv_sec: 1,
            tv_usec: 0,
        };
        // SAFETY: SO_RCVTIMEO takes a timeval; the pointer and length describe `tv`.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const libc::timeval as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        PacketSocket(fd)
    }

    /// One frame, or none within the timeout.
    pub fn recv(&self) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; 2048];
        // SAFETY: the buffer is valid for writes of its length.
        let n = unsafe { libc::recv(self.0, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
        (n > 0).then(|| {
            buf.truncate(n as usize);
            buf
        })
    }

    /// Sends `frame` out of the interface (to the tap's reader: the guest).
    pub fn send(&self, frame: &[u8]) {
        // SAFETY: the buffer is valid for reads of its length.
        let n = unsafe {
            libc::send(
                self.0,
                frame.as_ptr() as *const libc::c_void,
                frame.len(),
                0,
            )
        };
        assert_eq!(
            n,
            frame.len() as isize,
            "send: {}",
            std::io::Error::last_os_error()
        );
    }
}

impl Drop for PacketSocket {
    fn drop(&mut self) {
        // SAFETY: the fd is owned by this value and closed once.
        unsafe { libc::close(self.0) };
    }
}
