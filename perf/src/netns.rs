//! The host side of the frame-level network scenarios: a network namespace
//! private to the measurement, a tap in it for the VM, and a raw packet
//! socket on that tap through which perf reads and writes the VM's frames.
//!
//! The namespace belongs to one thread: [`in_private_netns`] runs a job on
//! a new thread that `unshare`s a network namespace of its own (a network
//! namespace is per thread), and every VMM that thread spawns inherits it,
//! so the VMM opens the tap by name there. Nothing is named on the host:
//! the namespace goes away with its last user (the thread, the socket, the
//! VMM processes), taking the tap with it; the tap is also removed
//! explicitly when its [`Tap`] is dropped.

use std::ffi::CString;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::error::{PerfError, Result};

/// Ethernet type of every frame the net_perf guest sends or counts (IEEE's
/// "local experimental" type).
pub const ETHERTYPE: u16 = 0x88b5;

/// `_IOW('T', 202, int)`.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
/// `_IOW('T', 203, int)`.
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
/// `SOL_PACKET` option: do not deliver the frames this host sends (Linux 4.20).
const PACKET_IGNORE_OUTGOING: libc::c_int = 23;
/// `SOL_PACKET` option: hand frames straight to the tap's driver. Without
/// it they go through the tap's queueing discipline, which drops everything
/// from the moment a VMM detaches until the kernel's link watcher has seen
/// the next one attach, so a frame sent right after a guest says it is
/// ready could be lost; straight to the driver, it is queued for the VMM as
/// soon as the VMM has the tap open.
const PACKET_QDISC_BYPASS: libc::c_int = 20;
/// `sll_pkttype` of a frame this host sent.
const PACKET_OUTGOING: u8 = 4;
/// `SO_RCVBUFFORCE`: a receive buffer beyond `rmem_max` (needs CAP_NET_ADMIN).
const SO_RCVBUFFORCE: libc::c_int = 33;
/// Receive buffer of the raw socket: room for tens of thousands of frames,
/// so a burst from the VM is never dropped while perf is scheduled out.
const RCVBUF: libc::c_int = 64 << 20;

/// Why this host cannot run the frame-level network scenarios, if it cannot.
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some(
            "skipped: needs root (it makes a network namespace and a tap for the VM)".into(),
        );
    }
    if !Path::new("/dev/net/tun").exists() {
        return Some("skipped: /dev/net/tun is missing (load the tun module)".into());
    }
    None
}

fn os_err(action: impl Into<String>) -> PerfError {
    PerfError::Network {
        action: action.into(),
        source: io::Error::last_os_error(),
    }
}

/// Runs `job` on a new thread inside a network namespace of its own, with
/// IPv6 off in it (no router or neighbour solicitations on the tap), and
/// returns what it returns.
pub fn in_private_netns<T: Send>(job: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    std::thread::scope(|s| {
        let thread = std::thread::Builder::new()
            .name("perf-netns".into())
            .spawn_scoped(s, || {
                // SAFETY: unshare changes only this thread's namespaces; the
                // thread is ours and ends with the job.
                if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                    return Err(os_err(
                        "making a private network namespace (unshare CLONE_NEWNET needs \
                         CAP_SYS_ADMIN)",
                    ));
                }
                for knob in ["all", "default"] {
                    let path = format!("/proc/sys/net/ipv6/conf/{knob}/disable_ipv6");
                    // A kernel without IPv6 has nothing to turn off.
                    if Path::new(&path).exists() {
                        std::fs::write(&path, b"1")
                            .map_err(PerfError::io("cannot turn IPv6 off in", &path))?;
                    }
                }
                job()
            })
            .map_err(|source| PerfError::Network {
                action: "starting the network namespace's thread".into(),
                source,
            })?;
        thread.join().unwrap_or_else(|_| {
            Err(PerfError::Net(
                "the network namespace's thread panicked".into(),
            ))
        })
    })
}

#[repr(C)]
struct IfReqFlags {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

impl IfReqFlags {
    fn new(name: &str, flags: libc::c_short) -> Self {
        let mut req = IfReqFlags {
            name: [0; libc::IFNAMSIZ],
            flags,
            _pad: [0; 22],
        };
        // Callers pass names shorter than IFNAMSIZ (checked in Tap::create).
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        req
    }
}

/// Opens /dev/net/tun and attaches to (creating if needed) tap `name`.
fn attach(name: &str) -> Result<OwnedFd> {
    let tun = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/net/tun")
        .map_err(PerfError::io("cannot open", "/dev/net/tun"))?;
    let mut req = IfReqFlags::new(name, IFF_TAP | IFF_NO_PI | IFF_VNET_HDR);
    // SAFETY: TUNSETIFF reads and writes a `struct ifreq` (40 bytes), which
    // `req` is, on a descriptor we own.
    if unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF, &mut req) } != 0 {
        return Err(os_err(format!("attaching to tap {name} (TUNSETIFF)")));
    }
    Ok(tun.into())
}

/// A persistent tap, up, in the calling thread's namespace; removed on drop.
#[derive(Debug)]
pub struct Tap {
    name: String,
    ifindex: libc::c_int,
}

impl Tap {
    /// Creates tap `name` (at most 15 bytes), persistent so the VMM can
    /// attach to it by name, and brings it up.
    pub fn create(name: &str) -> Result<Tap> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('\0') {
            return Err(PerfError::Usage(format!(
                "internal: tap name {name:?} is not 1 to 15 bytes"
            )));
        }
        let fd = attach(name)?;
        // SAFETY: TUNSETPERSIST takes an integer argument on our tap descriptor.
        if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETPERSIST, 1 as libc::c_ulong) } != 0 {
            return Err(os_err(format!("making tap {name} persistent")));
        }
        drop(fd);
        let mut tap = Tap {
            name: name.into(),
            ifindex: 0,
        };
        // From here on `tap`'s drop removes it.
        let sock = socket(
            libc::AF_INET,
            libc::SOCK_DGRAM,
            0,
            "an interface control socket",
        )?;
        let mut req = IfReqFlags::new(name, 0);
        // SAFETY: SIOCGIFFLAGS and SIOCSIFFLAGS read and write the name and
        // flags of a `struct ifreq`, which `req` is laid out as.
        unsafe {
            if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) != 0 {
                return Err(os_err(format!("reading the flags of tap {name}")));
            }
            req.flags |= libc::IFF_UP as libc::c_short;
            if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &mut req) != 0 {
                return Err(os_err(format!("bringing tap {name} up")));
            }
        }
        let cname = CString::new(name).map_err(|_| PerfError::Usage("tap name".into()))?;
        // SAFETY: `cname` is a NUL-terminated string that outlives the call.
        let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
        if ifindex == 0 {
            return Err(os_err(format!("finding the index of tap {name}")));
        }
        tap.ifindex = ifindex as libc::c_int;
        Ok(tap)
    }

    /// The interface name, for the VMM.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        // Attach once more and drop persistence: the tap goes with the
        // descriptor. (Should that fail, the namespace takes it along.)
        if let Ok(fd) = attach(&self.name) {
            // SAFETY: TUNSETPERSIST takes an integer argument on our tap descriptor.
            unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETPERSIST, 0 as libc::c_ulong) };
        }
    }
}

fn socket(
    domain: libc::c_int,
    kind: libc::c_int,
    proto: libc::c_int,
    what: &str,
) -> Result<OwnedFd> {
    // SAFETY: socket has no memory arguments; the result is checked.
    let fd = unsafe { libc::socket(domain, kind | libc::SOCK_CLOEXEC, proto) };
    if fd < 0 {
        return Err(os_err(format!("opening {what}")));
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// One frame read from the tap: its length and when `recv` returned.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    /// Bytes of the frame (Ethernet header included) copied into the buffer.
    pub len: usize,
    /// The instant right after `recv` returned it.
    pub at: Instant,
}

/// A raw packet socket bound to a tap, for frames of type [`ETHERTYPE`]:
/// what it sends goes to the VM, what it receives came from the VM.
#[derive(Debug)]
pub struct FrameSocket {
    fd: OwnedFd,
}

impl FrameSocket {
    /// Opens the socket on `tap`.
    pub fn bind(tap: &Tap) -> Result<FrameSocket> {
        let proto = ETHERTYPE.to_be();
        let fd = socket(
            libc::AF_PACKET,
            libc::SOCK_RAW,
            libc::c_int::from(proto),
            "a raw packet socket (AF_PACKET needs CAP_NET_RAW)",
        )?;
        let one: libc::c_int = 1;
        // SAFETY: setsockopt reads an int from a live local.
        let bypass = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                PACKET_QDISC_BYPASS,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if bypass != 0 {
            return Err(os_err(
                "asking the raw packet socket to bypass the tap's queueing discipline \
                 (PACKET_QDISC_BYPASS, Linux 3.14)",
            ));
        }
        // SAFETY: as above. An old kernel without the option still works:
        // outgoing frames are told apart by their packet type in `recv`.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                PACKET_IGNORE_OUTGOING,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        for opt in [SO_RCVBUFFORCE, libc::SO_RCVBUF] {
            // SAFETY: as above; the forced size needs CAP_NET_ADMIN, the
            // plain one is capped by rmem_max.
            let rc = unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&RCVBUF as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if rc == 0 {
                break;
            }
        }
        // SAFETY: an all-zero sockaddr_ll is a valid value of this plain C struct.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as libc::c_ushort;
        addr.sll_protocol = proto;
        addr.sll_ifindex = tap.ifindex;
        // SAFETY: `addr` is a sockaddr_ll of the length given.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(os_err(format!(
                "binding a raw packet socket to tap {}",
                tap.name
            )));
        }
        Ok(FrameSocket { fd })
    }

    /// Sends one whole Ethernet frame to the VM.
    pub fn send(&self, frame: &[u8]) -> Result<()> {
        // SAFETY: the pointer and length describe `frame`, which outlives the call.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        if n < 0 {
            return Err(os_err("sending a frame to the VM's tap"));
        }
        if n as usize != frame.len() {
            return Err(PerfError::Net(format!(
                "the tap took {n} of a {}-byte frame",
                frame.len()
            )));
        }
        Ok(())
    }

    /// The next frame from the VM, waiting up to `timeout`; `None` when
    /// none came. Frames this host sent are skipped.
    pub fn recv(&self, buf: &mut [u8], timeout: Duration) -> Result<Option<Received>> {
        let deadline = Instant::now() + timeout;
        loop {
            // SAFETY: an all-zero sockaddr_ll is a valid value of this plain C struct.
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut from_len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            // SAFETY: `buf` and `from` are live and of the lengths given;
            // MSG_TRUNC makes the kernel return the frame's real length.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT | libc::MSG_TRUNC,
                    (&mut from as *mut libc::sockaddr_ll).cast(),
                    &mut from_len,
                )
            };
            let at = Instant::now();
            if n >= 0 {
                if from.sll_pkttype == PACKET_OUTGOING {
                    continue;
                }
                // A frame longer than the buffer was cut: report what was kept.
                return Ok(Some(Received {
                    len: (n as usize).min(buf.len()),
                    at,
                }));
            }
            let err = io::Error::last_os_error();
            match err.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => {}
                _ => {
                    return Err(PerfError::Network {
                        action: "reading a frame from the VM's tap".into(),
                        source: err,
                    })
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let wait_ms = (deadline - now).as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
            // SAFETY: one live pollfd.
            unsafe { libc::poll(&mut pfd, 1, wait_ms) };
        }
    }

    /// Throws away every frame already queued (what a previous VM left).
    pub fn drain(&self) -> Result<usize> {
        let mut buf = [0u8; 2048];
        let mut n = 0;
        while self.recv(&mut buf, Duration::ZERO)?.is_some() {
            n += 1;
        }
        Ok(n)
    }
}
