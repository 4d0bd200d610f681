//! Packets arriving at an interface, through a packet socket: what a VM's
//! namespace let out, as the node sees it (`tests/hostile_frames.rs`).

use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use super::netns::in_ns;

/// The tag the guest put in a datagram (`hostile:<name>`), if any.
pub fn tag(payload: &[u8]) -> Option<String> {
    let at = payload.windows(8).position(|w| w == b"hostile:")?;
    let tag: Vec<u8> = payload[at..]
        .iter()
        .copied()
        .take_while(|b| b.is_ascii_graphic())
        .collect();
    Some(String::from_utf8_lossy(&tag).into_owned())
}

/// A packet the node received on a VM's veth.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Captured {
    /// An IPv4 packet.
    Ipv4 {
        src: Ipv4Addr,
        dst: Ipv4Addr,
        proto: u8,
        fragment: bool,
        tag: Option<String>,
    },
    /// An IPv6 packet.
    Ipv6 {
        src: Ipv6Addr,
        dst: Ipv6Addr,
        /// The next header of the fixed header (17: UDP, 58: ICMPv6, 0:
        /// hop-by-hop options).
        next: u8,
        tag: Option<String>,
    },
}

/// Packets arriving at interface `dev` of namespace `ns` (not those it
/// sends), IPv4 and IPv6, through a packet socket; stops when dropped.
pub struct Capture {
    /// The packets, in order.
    pub rx: mpsc::Receiver<Captured>,
    stop: Arc<AtomicBool>,
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn parse_ipv6(p: &[u8]) -> Option<Captured> {
    if p.len() < 40 {
        return None;
    }
    let addr = |at: usize| -> Option<Ipv6Addr> {
        let bytes: [u8; 16] = p.get(at..at + 16)?.try_into().ok()?;
        Some(Ipv6Addr::from(bytes))
    };
    Some(Captured::Ipv6 {
        src: addr(8)?,
        dst: addr(24)?,
        next: p[6],
        tag: tag(&p[40..]),
    })
}

fn parse_ipv4(p: &[u8]) -> Option<Captured> {
    let ihl = usize::from(p.first()? & 0x0f) * 4;
    if ihl < 20 || p.len() < ihl {
        return None;
    }
    let frag = u16::from_be_bytes([p[6], p[7]]);
    Some(Captured::Ipv4 {
        src: Ipv4Addr::new(p[12], p[13], p[14], p[15]),
        dst: Ipv4Addr::new(p[16], p[17], p[18], p[19]),
        proto: p[9],
        fragment: frag & 0x3fff != 0,
        tag: tag(&p[ihl..]),
    })
}

pub fn capture(ns: &str, dev: &str) -> Capture {
    let (ready_tx, ready_rx) = mpsc::channel();
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let dev = std::ffi::CString::new(dev).expect("an interface name");
    in_ns(ns, move || {
        let all = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2); the descriptor is owned right below.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                i32::from(all),
            )
        };
        assert!(
            fd >= 0,
            "packet socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: fd was just created and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a NUL-terminated name.
        let ifindex = unsafe { libc::if_nametoindex(dev.as_ptr()) };
        assert!(ifindex > 0, "no interface {dev:?}");
        // SAFETY: sockaddr_ll is plain data; all zeros is a valid value.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = all;
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: binds to a sockaddr_ll of the size given.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                std::ptr::addr_of!(sll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
        let timeout = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: SO_RCVTIMEO reads one timeval of the size given.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                std::ptr::addr_of!(timeout).cast(),
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        assert_eq!(rc, 0, "SO_RCVTIMEO: {}", std::io::Error::last_os_error());
        ready_tx.send(()).expect("ready");
        let mut buf = vec![0u8; 65536];
        while !stopped.load(Ordering::Relaxed) {
            // SAFETY: as above.
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
            // SAFETY: recvfrom writes at most buf.len() bytes into buf and at
            // most `len` bytes into `from`.
            let n = unsafe {
                libc::recvfrom(
                    fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    0,
                    std::ptr::addr_of_mut!(from).cast(),
                    &mut len,
                )
            };
            let Ok(n) = usize::try_from(n) else { continue };
            if from.sll_pkttype == libc::PACKET_OUTGOING {
                continue;
            }
            let packet = match u16::from_be(from.sll_protocol) {
                0x0800 => parse_ipv4(&buf[..n]),
                0x86dd => parse_ipv6(&buf[..n]),
                _ => None,
            };
            if let Some(p) = packet {
                if tx.send(p).is_err() {
                    return;
                }
            }
        }
    });
    ready_rx.recv().expect("capture up");
    Capture { rx, stop }
}
