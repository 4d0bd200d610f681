//! A Linux tap interface opened by name through /dev/net/tun (TUNSETIFF),
//! created if it does not exist, with a virtio-net header on every frame.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

/// `_IOW('T', 202, int)`.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
/// `_IOW('T', 216, int)`.
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
/// `_IOW('T', 203, int)`.
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
/// `_IOW('T', 204, int)`.
const TUNSETOWNER: libc::c_ulong = 0x4004_54cc;
/// `_IOW('T', 206, int)`.
const TUNSETGROUP: libc::c_ulong = 0x4004_54ce;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;

/// Size of `struct virtio_net_hdr_v1`, which every frame on the tap carries.
pub const VNET_HDR_LEN: usize = 12;

/// Errors opening a tap.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// /dev/net/tun cannot be opened.
    #[error("cannot open /dev/net/tun: {0} (is the tun module loaded?)")]
    OpenTun(#[source] io::Error),
    /// TUNSETIFF failed.
    #[error("cannot attach to tap {name}: {source} (creating a tap needs CAP_NET_ADMIN; an existing one must be a tap, not a tun, and be owned by this user)")]
    SetIff {
        /// Interface name.
        name: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Making a tap persistent or setting its owner failed.
    #[error("cannot set {what} of tap {name}: {source}")]
    Configure {
        /// Interface name.
        name: String,
        /// The setting.
        what: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// TUNSETVNETHDRSZ failed.
    #[error("cannot set the virtio-net header size on tap {name}: {source}")]
    VnetHdr {
        /// Interface name.
        name: String,
        /// Why.
        #[source]
        source: io::Error,
    },
}

#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// An open tap interface (non-blocking).
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

/// Opens /dev/net/tun and attaches to (or creates) the tap `name`.
fn attach(name: &str) -> Result<File, TapError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open("/dev/net/tun")
        .map_err(TapError::OpenTun)?;
    let mut req = IfReq {
        name: [0; 16],
        flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
        _pad: [0; 22],
    };
    let n = name.len().min(15);
    req.name[..n].copy_from_slice(&name.as_bytes()[..n]);
    // SAFETY: TUNSETIFF reads and writes a `struct ifreq` (40 bytes, name then flags),
    // which `IfReq` lays out with repr(C); the pointer is valid for the call.
    let ret = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF as _, &mut req) };
    if ret < 0 {
        return Err(TapError::SetIff {
            name: name.into(),
            source: io::Error::last_os_error(),
        });
    }
    Ok(file)
}

/// Makes the tap `name` (created if missing) persistent and, where given,
/// owned by `owner` and `group`, so an unprivileged vmm with that uid or gid
/// can attach to it. Needs CAP_NET_ADMIN. (The kernel cannot reset an owner to
/// "none" once set, so `None` leaves the current one.)
pub fn make_persistent(name: &str, owner: Option<u32>, group: Option<u32>) -> Result<(), TapError> {
    let file = attach(name)?;
    let settings = [
        (TUNSETOWNER, owner, "the owner"),
        (TUNSETGROUP, group, "the group"),
        (TUNSETPERSIST, Some(1), "persistence"),
    ];
    for (request, value, what) in settings {
        let Some(value) = value else { continue };
        // SAFETY: these tun ioctls take their argument by value (no pointer is read).
        let ret =
            unsafe { libc::ioctl(file.as_raw_fd(), request as _, libc::c_ulong::from(value)) };
        if ret < 0 {
            return Err(TapError::Configure {
                name: name.into(),
                what,
                source: io::Error::last_os_error(),
            });
        }
    }
    Ok(())
}

impl Tap {
    /// Opens (or creates) the tap `name`. `name` must be 1..=15 bytes.
    pub fn open(name: &str) -> Result<Tap, TapError> {
        let file = attach(name)?;
        let hdr_len = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer, valid for the call.
        let ret = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETVNETHDRSZ as _, &hdr_len) };
        if ret < 0 {
            return Err(TapError::VnetHdr {
                name: name.into(),
                source: io::Error::last_os_error(),
            });
        }
        Ok(Tap {
            file,
            name: name.into(),
        })
    }

    /// A tap-like endpoint over `file`, which must keep frame boundaries and
    /// carry the 12-byte virtio-net header on every frame, such as one end of a
    /// non-blocking `SOCK_SEQPACKET` socket pair: for tests and fuzzing without
    /// CAP_NET_ADMIN.
    pub fn from_file(file: File, name: &str) -> Tap {
        Tap {
            file,
            name: name.into(),
        }
    }

    /// A tap stand-in that needs no privilege: one end of a non-blocking
    /// `SOCK_SEQPACKET` pair as the tap, the other as the network side (each
    /// message one frame, virtio-net header first). For tests and fuzzing.
    pub fn pair(name: &str) -> io::Result<(Tap, std::os::unix::net::UnixDatagram)> {
        use std::os::fd::{FromRawFd, OwnedFd};
        let mut fds = [0i32; 2];
        // SAFETY: socketpair writes two new descriptors into `fds`, owned below.
        let rc = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just created and nothing else owns them.
        let (tap, network) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // A UnixDatagram sends and receives whole messages, as a seqpacket peer needs.
        Ok((
            Tap::from_file(File::from(tap), name),
            std::os::unix::net::UnixDatagram::from(network),
        ))
    }

    /// The interface name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Reads one frame (with its virtio-net header); `WouldBlock` when none is queued.
    pub fn read_frame(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.file).read(buf)
    }

    /// Writes one frame (with its virtio-net header).
    pub fn write_frame(&self, frame: &[u8]) -> io::Result<usize> {
        (&self.file).write(frame)
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}
