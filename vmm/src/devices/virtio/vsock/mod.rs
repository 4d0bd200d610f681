//! virtio-vsock with a host side in Firecracker's convention:
//!
//! * One Unix socket per VM at `uds_path`. A host process connects, writes
//!   `CONNECT <port>\n` and, once the guest accepts, reads `OK <hostport>\n`
//!   followed by the byte stream of the guest listener on `<port>`.
//! * A guest connecting to CID 2 port P reaches the Unix socket `<uds_path>_P`
//!   if something listens there; otherwise the guest gets a reset.
//!
//! Flow control is the spec's credit scheme: the device never sends the
//! guest more than the guest's advertised free buffer (`buf_alloc` minus
//! bytes in flight), and reads from a host socket only when it can; guest
//! data waiting for a slow host reader is bounded by the `buf_alloc` the
//! device advertises, and a guest that exceeds it is reset. A guest that
//! never consumes data therefore costs the host at most one scratch buffer:
//! the rest stays in the host socket, whose writer blocks.
//!
//! All connection work runs on the event thread. Work requested from a
//! vCPU thread (activation, reset) is handed over through `kick_evt`.

pub mod conn;
pub mod handshake;
mod host_socket;
pub mod packet;
pub mod persist;
pub mod reset_hold;
mod rx;
mod tx;

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::num::Wrapping;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use virtio_bindings::virtio_ids::VIRTIO_ID_VSOCK;
use virtio_queue::{DescriptorChain, QueueOwnedT, QueueT, Reader, Writer};
use vmm_sys_util::eventfd::EventFd;

use super::{read_config_bytes, ActivateError, DeviceCommon, Interrupt, VirtioDevice};
use crate::memory::GuestMemoryMmap;
use conn::{Conn, ConnState};
use handshake::{DeadlineTimer, HandshakeLimits};
use packet::*;

/// Receive queue.
pub const RX_QUEUE: usize = 0;
/// Transmit queue.
pub const TX_QUEUE: usize = 1;
/// Event queue.
pub const EVENT_QUEUE: usize = 2;
/// Queue size offered.
pub const QUEUE_SIZE: u16 = 256;
/// Most connections (established, pending, and host sockets still sending
/// their CONNECT line) at once; more are refused.
pub const MAX_CONNECTIONS: usize = 1024;
/// Most control packets waiting for guest receive buffers.
pub const MAX_PENDING_CONTROL: usize = 2 * MAX_CONNECTIONS;
/// Longest `CONNECT <port>\n` line accepted.
const MAX_CONNECT_LINE: usize = 32;
/// First port the device picks for host-initiated connections.
const FIRST_LOCAL_PORT: u32 = 1 << 30;
/// Largest payload in one packet to the guest (also the scratch buffer size).
const MAX_PKT_PAYLOAD: usize = 64 * 1024;

/// Errors creating the device.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    /// The host socket cannot be created.
    #[error("cannot listen on vsock socket {path}: {source} (is another vmm using it?)")]
    Listen {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// An eventfd could not be created.
    #[error("cannot create the virtio-vsock eventfds: {0}")]
    Eventfd(#[source] io::Error),
    /// A timer (reset hold, handshake deadlines) could not be created.
    #[error("cannot create the virtio-vsock timers (timerfd): {0}")]
    Timer(#[source] io::Error),
}

/// A host socket that connected to `uds_path` and is not a connection yet:
/// its CONNECT line is unfinished, or the device cannot ask the guest yet.
struct PendingHost {
    stream: UnixStream,
    line: Vec<u8>,
    /// The guest port, once the CONNECT line is complete.
    port: Option<u32>,
    /// When it is closed if still waiting ([`handshake::ADMISSION_LIMIT`]).
    deadline: Instant,
    dead: bool,
}

/// Connection key: (host-side port, guest-side port).
type Key = (u32, u32);

/// Counters, for tests and logs.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct VsockStats {
    /// Packets taken from the transmit queue.
    pub tx_packets: u64,
    /// Packets put on the receive queue.
    pub rx_packets: u64,
    /// Resets sent to the guest.
    pub rst_sent: u64,
    /// Control packets dropped because too many were waiting.
    pub control_dropped: u64,
    /// Host connections closed because their handshake took too long
    /// (see [`handshake`]).
    pub handshake_timeouts: u64,
}

/// The virtio-vsock device.
pub struct Vsock {
    common: DeviceCommon,
    cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    kick_evt: EventFd,
    conns: HashMap<Key, Conn>,
    conn_fds: HashMap<RawFd, Key>,
    pending_hosts: HashMap<RawFd, PendingHost>,
    /// Control packets for the guest, sent before any data.
    rx_control: VecDeque<PacketHeader>,
    /// Connections the guest opened whose sockets are not watched yet.
    new_fds: Vec<Key>,
    next_local_port: u32,
    /// A transport-reset event must be sent (a restored VM has run).
    reset_event_pending: bool,
    /// A restored device owes the guest a transport-reset event once the
    /// VM first runs ([`Vsock::announce_restore`]); until then it writes
    /// nothing into guest memory.
    reset_event_owed: bool,
    /// Host connections wait while the guest handles that event.
    reset_hold: reset_hold::ResetHold,
    /// Wakes the event loop when a host connection's wait is over.
    deadlines: DeadlineTimer,
    limits: HandshakeLimits,
    scratch: Vec<u8>,
    stats: VsockStats,
}

/// Binds `path`, replacing a stale socket file nobody listens on.
fn listen(path: &Path) -> Result<UnixListener, VsockError> {
    let err = |source| VsockError::Listen {
        path: path.into(),
        source,
    };
    let listener = match UnixListener::bind(path) {
        Ok(l) => l,
        Err(e) if e.kind() == io::ErrorKind::AddrInUse && UnixStream::connect(path).is_err() => {
            std::fs::remove_file(path).map_err(err)?;
            UnixListener::bind(path).map_err(err)?
        }
        Err(e) => return Err(err(e)),
    };
    listener.set_nonblocking(true).map_err(err)?;
    Ok(listener)
}

/// Connects to the Unix socket at `path` without blocking: a listener whose
/// backlog is full refuses (EAGAIN) instead of stalling the event thread.
fn connect_nonblocking(path: &std::ffi::OsStr) -> io::Result<UnixStream> {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;

    // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let bytes = path.as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: plain socket(2) call with constant arguments.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nothing else; the stream closes it.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    // SAFETY: `addr` is a valid, NUL-terminated sockaddr_un and the length is its size.
    let rc = unsafe {
        libc::connect(
            fd,
            &addr as *const libc::sockaddr_un as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stream)
}

impl Vsock {
    /// A device for guest `cid`, with its host socket at `uds_path`.
    pub fn new(cid: u32, uds_path: &Path) -> Result<Vsock, VsockError> {
        let listener = listen(uds_path)?;
        Ok(Vsock {
            common: DeviceCommon::new(0, &[QUEUE_SIZE; 3]).map_err(VsockError::Eventfd)?,
            cid: u64::from(cid),
            uds_path: uds_path.into(),
            listener,
            kick_evt: EventFd::new(libc::EFD_NONBLOCK).map_err(VsockError::Eventfd)?,
            conns: HashMap::new(),
            conn_fds: HashMap::new(),
            pending_hosts: HashMap::new(),
            rx_control: VecDeque::new(),
            new_fds: Vec::new(),
            next_local_port: FIRST_LOCAL_PORT,
            reset_event_pending: false,
            reset_event_owed: false,
            reset_hold: reset_hold::ResetHold::new().map_err(VsockError::Timer)?,
            deadlines: DeadlineTimer::new().map_err(VsockError::Timer)?,
            limits: HandshakeLimits::default(),
            scratch: vec![0; MAX_PKT_PAYLOAD],
            stats: VsockStats::default(),
        })
    }

    /// The guest's context ID.
    pub fn cid(&self) -> u64 {
        self.cid
    }

    /// Counters.
    pub fn stats(&self) -> VsockStats {
        self.stats
    }

    /// Open connections.
    pub fn connection_count(&self) -> usize {
        self.conns.values().filter(|c| !c.dead).count()
    }

    /// Bytes of guest data held on the host side, over all connections.
    pub fn buffered_bytes(&self) -> usize {
        self.conns.values().map(|c| c.tx_buf.len()).sum()
    }

    /// Tells the guest, once its restored VM runs, that every connection it
    /// had is gone (the transport-reset event); the event thread delivers it
    /// as soon as the guest has an event buffer posted. A device that was
    /// not restored owes nothing.
    pub fn announce_restore(&mut self) {
        if std::mem::take(&mut self.reset_event_owed) {
            self.reset_event_pending = true;
            self.reset_hold.announced();
            self.kick();
        }
    }

    fn kick(&self) {
        if let Err(e) = self.kick_evt.write(1) {
            tracing::warn!(error = %e, "cannot wake the vsock event handler");
        }
    }

    fn header(&self, local_port: u32, peer_port: u32, op: u16) -> PacketHeader {
        PacketHeader {
            src_cid: HOST_CID,
            dst_cid: self.cid,
            src_port: local_port,
            dst_port: peer_port,
            len: 0,
            type_: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: conn::TX_BUF_ALLOC,
            fwd_cnt: 0,
        }
    }

    fn push_control(&mut self, hdr: PacketHeader) {
        if self.rx_control.len() >= MAX_PENDING_CONTROL {
            self.stats.control_dropped += 1;
            let op = hdr.op;
            tracing::debug!(op, "vsock control queue full: packet dropped");
            return;
        }
        self.rx_control.push_back(hdr);
    }

    fn send_rst(&mut self, local_port: u32, peer_port: u32) {
        let hdr = self.header(local_port, peer_port, OP_RST);
        self.push_control(hdr);
    }

    /// Ends a connection: the guest gets a reset unless it asked for it.
    fn kill(&mut self, key: Key, notify_guest: bool) {
        if let Some(c) = self.conns.get_mut(&key) {
            if !c.dead {
                c.dead = true;
                if notify_guest {
                    self.send_rst(key.0, key.1);
                }
            }
        }
    }

    fn alloc_local_port(&mut self) -> u32 {
        loop {
            let port = self.next_local_port;
            self.next_local_port = self
                .next_local_port
                .checked_add(1)
                .unwrap_or(FIRST_LOCAL_PORT);
            if !self.conns.keys().any(|k| k.0 == port) {
                return port;
            }
        }
    }

    fn connection_budget_left(&self) -> bool {
        self.conns.len() + self.pending_hosts.len() < MAX_CONNECTIONS
    }

    /// Sends the transport-reset event if one is pending and the guest gave a buffer.
    fn process_event_queue(&mut self) {
        if !self.reset_event_pending {
            return;
        }
        let Some(mem) = self.common.mem.clone() else {
            return;
        };
        let Some(chain) = self.common.pop_chain(EVENT_QUEUE, &mem) else {
            return;
        };
        let head = chain.head_index();
        let used = match Writer::new(&mem, chain) {
            Ok(mut w) => match w.write_obj(EVENT_TRANSPORT_RESET.to_le()) {
                Ok(()) => 4,
                Err(_) => 0,
            },
            Err(_) => 0,
        };
        if self.common.queues[EVENT_QUEUE]
            .add_used(&mem, head, used)
            .is_ok()
        {
            self.reset_event_pending = false;
            self.reset_hold
                .delivered(self.common.avail_idx(EVENT_QUEUE).unwrap_or(0));
            // The guest re-posting a buffer after handling the event ends
            // the hold on host connections: ask it to say so.
            self.common.notify_on_next_buffer(EVENT_QUEUE);
            self.common.signal_used_queue(EVENT_QUEUE);
        }
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }
    fn common(&self) -> &DeviceCommon {
        &self.common
    }
    fn common_mut(&mut self) -> &mut DeviceCommon {
        &mut self.common
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_vsock_config { le64 guest_cid; }
        read_config_bytes(&self.cid.to_le_bytes(), offset, data);
    }
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), ActivateError> {
        self.common.activate(mem, interrupt)?;
        self.kick();
        Ok(())
    }
    fn reset(&mut self) {
        self.common.reset();
        for c in self.conns.values_mut() {
            c.dead = true;
        }
        // Host connections not handed to the guest yet keep waiting (within
        // their deadline): a driver resets the device before starting it.
        self.rx_control.clear();
        self.reset_event_pending = false;
        self.reset_event_owed = false;
        self.reset_hold.release();
        self.kick();
    }
}

impl MutEventSubscriber for Vsock {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        let evts = &self.common.queue_evts;
        if fd == evts[RX_QUEUE].as_raw_fd() {
            let _ = evts[RX_QUEUE].read();
        } else if fd == evts[TX_QUEUE].as_raw_fd() {
            let _ = evts[TX_QUEUE].read();
            self.process_tx();
        } else if fd == evts[EVENT_QUEUE].as_raw_fd() {
            let _ = evts[EVENT_QUEUE].read();
            let avail = self.common.avail_idx(EVENT_QUEUE).unwrap_or(0);
            // Ending the hold admits waiting host connections below.
            self.reset_hold.guest_notified(avail);
        } else if fd == self.reset_hold.timer.as_raw_fd() {
            self.reset_hold.timed_out();
        } else if fd == self.deadlines.timer.as_raw_fd() {
            self.expire_handshakes();
        } else if fd == self.kick_evt.as_raw_fd() {
            // Activation or reset: host connections waiting for the device
            // are admitted below.
            let _ = self.kick_evt.read();
        } else if fd == self.listener.as_raw_fd() {
            self.accept_host_connections(ops);
        } else if self.pending_hosts.contains_key(&fd) {
            self.read_connect_line(fd);
        } else {
            self.on_connection_event(fd, events.event_set());
        }
        self.admit_waiting_hosts(ops);
        self.process_event_queue();
        self.watch_new_connections(ops);
        self.process_rx();
        self.reap(ops);
    }

    fn init(&mut self, ops: &mut EventOps) {
        self.common.watch_queues(ops, "virtio-vsock");
        let mut add = |events: Events, what: &str| {
            if let Err(e) = ops.add(events) {
                tracing::error!(error = ?e, "cannot watch the vsock {what}");
            }
        };
        add(Events::new(&self.kick_evt, EventSet::IN), "kick eventfd");
        add(
            Events::new(&self.reset_hold.timer, EventSet::IN),
            "reset hold timer",
        );
        add(
            Events::new(&self.deadlines.timer, EventSet::IN),
            "handshake deadline timer",
        );
        add(
            Events::new(&self.listener, EventSet::IN | EventSet::EDGE_TRIGGERED),
            "host socket",
        );
    }
}

#[cfg(test)]
mod tests;
