//! The jail's network namespace: host taps moved into it (and back out when
//! the VM ends), taps created inside it, all persistent, owned by the jail's
//! uid and up, so the unprivileged vmm can attach to them by name.
//!
//! Moving a link between namespaces and setting it up takes one rtnetlink
//! request each (RTM_NEWLINK with IFLA_NET_NS_FD or IFF_UP). They are built by
//! hand here: the kept crates have no netlink support, and one fixed message
//! does not justify an async netlink stack in a process that has no runtime.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use super::JailError;
use crate::devices::virtio::net::tap;

/// Largest interface name (IFNAMSIZ - 1).
pub(super) const MAX_IFNAME: usize = 15;

/// Checks a tap name given to `--tap`.
pub(super) fn valid_tap_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_IFNAME
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && name != "."
        && name != ".."
}

fn netns_error(what: &'static str) -> impl FnOnce(io::Error) -> JailError {
    move |source| JailError::Network { what, source }
}

/// Opens the calling thread's network namespace.
pub(super) fn current_netns() -> Result<OwnedFd, JailError> {
    File::open("/proc/thread-self/ns/net")
        .map(OwnedFd::from)
        .map_err(netns_error("opening this thread's network namespace"))
}

fn enter(ns: &OwnedFd) -> io::Result<()> {
    // SAFETY: setns on a namespace fd we own; it only changes this thread's network
    // namespace (the jailer has no other threads that could depend on it).
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn link_exists(name: &str) -> bool {
    let Ok(c) = CString::new(name) else {
        return false;
    };
    // SAFETY: `c` is a NUL-terminated string valid for the call.
    unsafe { libc::if_nametoindex(c.as_ptr()) != 0 }
}

/// Reads a tap's owner or group from sysfs (`-1` there means none).
fn tun_id(name: &str, which: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/sys/class/net/{name}/{which}"))
        .ok()?
        .trim()
        .parse::<u32>()
        .ok()
}

const RTM_NEWLINK: u16 = 16;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLMSG_ERROR: u16 = 2;
const IFLA_IFNAME: u16 = 3;
const IFLA_NET_NS_FD: u16 = 28;
const IFF_UP: u32 = 1;

fn push_attr(msg: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    msg.extend_from_slice(&(len as u16).to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(payload);
    msg.resize(msg.len().next_multiple_of(4), 0);
}

/// Builds an RTM_NEWLINK request for the link `name`: set it up, and/or move it
/// into the namespace `netns_fd`.
fn setlink_request(name: &str, up: bool, netns_fd: Option<RawFd>) -> Vec<u8> {
    let mut msg = Vec::with_capacity(64);
    msg.extend_from_slice(&0u32.to_ne_bytes()); // nlmsg_len, patched below
    msg.extend_from_slice(&RTM_NEWLINK.to_ne_bytes());
    msg.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    msg.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel
    msg.push(libc::AF_UNSPEC as u8);
    msg.push(0);
    msg.extend_from_slice(&0u16.to_ne_bytes()); // device type
    msg.extend_from_slice(&0i32.to_ne_bytes()); // index 0: look the link up by name
    let flags = if up { IFF_UP } else { 0 };
    msg.extend_from_slice(&flags.to_ne_bytes());
    msg.extend_from_slice(&flags.to_ne_bytes()); // change mask
    let mut ifname = name.as_bytes().to_vec();
    ifname.push(0);
    push_attr(&mut msg, IFLA_IFNAME, &ifname);
    if let Some(fd) = netns_fd {
        push_attr(&mut msg, IFLA_NET_NS_FD, &(fd as u32).to_ne_bytes());
    }
    let len = msg.len() as u32;
    msg[..4].copy_from_slice(&len.to_ne_bytes());
    msg
}

/// Reads the kernel's answer to one request: Ok for an acknowledgement, the
/// errno it carries otherwise.
fn parse_ack(reply: &[u8]) -> io::Result<()> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "malformed rtnetlink reply");
    let header = reply.get(..16).ok_or_else(bad)?;
    let kind = u16::from_ne_bytes([header[4], header[5]]);
    if kind != NLMSG_ERROR {
        return Err(bad());
    }
    let code = reply.get(16..20).ok_or_else(bad)?;
    match i32::from_ne_bytes([code[0], code[1], code[2], code[3]]) {
        0 => Ok(()),
        errno => Err(io::Error::from_raw_os_error(errno.saturating_neg())),
    }
}

/// Sends one link request through a NETLINK_ROUTE socket of the calling
/// thread's network namespace and waits for its acknowledgement.
fn setlink(name: &str, up: bool, netns_fd: Option<RawFd>) -> io::Result<()> {
    // SAFETY: plain socket(2); the returned fd is owned by the File below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and nothing else owns it.
    let mut sock = unsafe { File::from_raw_fd(fd) };
    sock.write_all(&setlink_request(name, up, netns_fd))?;
    let mut reply = [0u8; 4096];
    let n = sock.read(&mut reply)?;
    parse_ack(&reply[..n])
}

/// A tap moved in from the host, with what to restore when it goes back.
struct MovedTap {
    name: String,
    owner: Option<u32>,
    group: Option<u32>,
}

/// The jail's network namespace with its taps. Dropping it moves the taps
/// that came from the host back there.
pub(super) struct JailNetwork {
    host: OwnedFd,
    jail: OwnedFd,
    moved: Vec<MovedTap>,
}

impl JailNetwork {
    /// Called right after the jailer unshared its network namespace, with the
    /// host's namespace opened before: moves the host taps among `taps` into
    /// the jail's namespace, creates the others there, makes them persistent and
    /// owned by `uid`, and brings them and `lo` up.
    pub(super) fn setup(host: OwnedFd, taps: &[String], uid: u32) -> Result<Self, JailError> {
        let jail = current_netns()?;
        let mut network = JailNetwork {
            host,
            jail,
            moved: Vec::new(),
        };
        enter(&network.host).map_err(netns_error("returning to the host network namespace"))?;
        for name in taps {
            if !link_exists(name) {
                continue;
            }
            let moved = MovedTap {
                name: name.clone(),
                owner: tun_id(name, "owner"),
                group: tun_id(name, "group"),
            };
            setlink(name, false, Some(network.jail.as_raw_fd())).map_err(|source| {
                JailError::Tap {
                    tap: name.clone(),
                    what: "move into the jail's network namespace",
                    source,
                }
            })?;
            network.moved.push(moved);
        }
        enter(&network.jail).map_err(netns_error("entering the jail's network namespace"))?;
        setlink("lo", true, None).map_err(|source| JailError::Tap {
            tap: "lo".into(),
            what: "bring up",
            source,
        })?;
        for name in taps {
            tap::make_persistent(name, Some(uid), None).map_err(|source| JailError::TapSetup {
                tap: name.clone(),
                source,
            })?;
            setlink(name, true, None).map_err(|source| JailError::Tap {
                tap: name.clone(),
                what: "bring up",
                source,
            })?;
        }
        Ok(network)
    }

    /// Names of the taps that came from the host.
    #[cfg(test)]
    fn moved(&self) -> Vec<&str> {
        self.moved.iter().map(|t| t.name.as_str()).collect()
    }
}

impl Drop for JailNetwork {
    fn drop(&mut self) {
        if self.moved.is_empty() {
            return;
        }
        if let Err(e) = enter(&self.jail) {
            tracing::error!("cannot enter the jail's network namespace to return its taps: {e}");
            return;
        }
        for tap in &self.moved {
            if let Err(e) = setlink(&tap.name, false, Some(self.host.as_raw_fd())) {
                tracing::error!(tap = %tap.name, "cannot move the tap back to the host: {e}");
            }
        }
        if let Err(e) = enter(&self.host) {
            tracing::error!("cannot return to the host network namespace: {e}");
            return;
        }
        for t in &self.moved {
            if t.owner.is_some() || t.group.is_some() {
                if let Err(e) = tap::make_persistent(&t.name, t.owner, t.group) {
                    tracing::warn!(tap = %t.name, "cannot restore the tap's owner: {e}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tap_names_are_checked() {
        assert!(valid_tap_name("tap0"));
        assert!(valid_tap_name("vm-1_a.b"));
        assert!(!valid_tap_name(""));
        assert!(!valid_tap_name("a-name-of-16-chr"));
        assert!(!valid_tap_name("a/b"));
        assert!(!valid_tap_name(".."));
        assert!(!valid_tap_name("tap 0"));
    }

    #[test]
    fn setlink_requests_are_well_formed() {
        let msg = setlink_request("tap0", true, Some(7));
        assert_eq!(msg.len() % 4, 0);
        assert_eq!(
            u32::from_ne_bytes(msg[..4].try_into().unwrap()) as usize,
            msg.len()
        );
        assert_eq!(u16::from_ne_bytes([msg[4], msg[5]]), RTM_NEWLINK);
        // ifinfomsg: flags and change mask both IFF_UP.
        assert_eq!(u32::from_ne_bytes(msg[24..28].try_into().unwrap()), IFF_UP);
        assert_eq!(u32::from_ne_bytes(msg[28..32].try_into().unwrap()), IFF_UP);
        // IFLA_IFNAME "tap0\0" padded to 8 bytes of payload, then IFLA_NET_NS_FD 7.
        assert_eq!(&msg[32..36], &[9, 0, 3, 0]);
        assert_eq!(&msg[36..41], b"tap0\0");
        assert_eq!(u16::from_ne_bytes([msg[46], msg[47]]), IFLA_NET_NS_FD);
        assert_eq!(u32::from_ne_bytes(msg[48..52].try_into().unwrap()), 7);
    }

    #[test]
    fn acks_and_errors_are_read_from_replies() {
        let mut ack = vec![0u8; 36];
        ack[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        assert!(parse_ack(&ack).is_ok());
        ack[16..20].copy_from_slice(&(-libc::ENODEV).to_ne_bytes());
        assert_eq!(
            parse_ack(&ack).unwrap_err().raw_os_error(),
            Some(libc::ENODEV)
        );
        assert!(parse_ack(&ack[..10]).is_err());
        ack[4..6].copy_from_slice(&16u16.to_ne_bytes());
        assert!(parse_ack(&ack).is_err());
    }

    #[test]
    fn host_taps_move_into_a_new_namespace_and_back() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || !std::path::Path::new("/dev/net/tun").exists() {
            println!("skipped: moving taps between namespaces needs root and /dev/net/tun");
            return;
        }
        // Runs on its own thread: setns and unshare change only the calling thread.
        std::thread::spawn(|| {
            let name = format!("jn{}", std::process::id() % 100_000);
            tap::make_persistent(&name, None, None).expect("create a host tap");
            assert!(link_exists(&name));
            let host = current_netns().unwrap();
            // SAFETY: unshare(CLONE_NEWNET) affects this thread only.
            assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
            let fresh = format!("jf{}", std::process::id() % 100_000);
            let network = JailNetwork::setup(host, &[name.clone(), fresh.clone()], 65534).unwrap();
            assert_eq!(network.moved(), vec![name.as_str()]);
            assert!(
                link_exists(&name),
                "the host tap is in the jail's namespace"
            );
            assert!(link_exists(&fresh), "the new tap was created there");
            let host_again = network.host.try_clone().unwrap();
            drop(network);
            enter(&host_again).unwrap();
            assert!(link_exists(&name), "the tap is back on the host");
            assert!(!link_exists(&fresh), "the jail's own tap stayed behind");
            let _ = std::process::Command::new("ip")
                .args(["link", "del", &name])
                .status();
        })
        .join()
        .unwrap();
    }
}
