//! One vsock stream connection between a guest port and a host Unix socket,
//! with its credit accounting (virtio spec 5.10.6.3).

use std::collections::VecDeque;
use std::io::{self, Write};
use std::num::Wrapping;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use super::packet::PacketHeader;

/// Receive buffer the device advertises to the guest for each connection:
/// guest data waiting for a slow host reader never exceeds this.
pub const TX_BUF_ALLOC: u32 = 256 * 1024;
/// Forwarded bytes after which the guest is told about the freed space.
const CREDIT_UPDATE_THRESHOLD: u32 = TX_BUF_ALLOC / 4;

/// Where a connection stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnState {
    /// A host process asked to connect; the guest has not answered.
    AwaitingResponse,
    /// Data flows.
    Established,
}

/// One connection.
#[derive(Debug)]
pub struct Conn {
    /// The host side.
    pub stream: UnixStream,
    /// Handshake state.
    pub state: ConnState,
    /// While awaiting the guest's RESPONSE: when the host socket is closed
    /// if none came (see `handshake`).
    pub deadline: Option<Instant>,
    /// The guest's receive buffer size.
    pub peer_buf_alloc: u32,
    /// Bytes the guest has consumed of what we sent.
    pub peer_fwd_cnt: Wrapping<u32>,
    /// Bytes sent to the guest.
    pub rx_cnt: Wrapping<u32>,
    /// Bytes of guest data written to the host socket.
    pub fwd_cnt: Wrapping<u32>,
    /// `fwd_cnt` as last told to the guest.
    pub last_fwd_cnt_sent: Wrapping<u32>,
    /// Guest data not yet written to the host socket (at most `TX_BUF_ALLOC`).
    pub tx_buf: VecDeque<u8>,
    /// The host socket may have data to read.
    pub readable: bool,
    /// The host socket reached end of file (the guest was told).
    pub host_eof: bool,
    /// The guest will send no more.
    pub peer_shut_send: bool,
    /// The guest will receive no more.
    pub peer_shut_rcv: bool,
    /// The guest asked for a credit update.
    pub credit_update_needed: bool,
    /// Ended; to be unregistered and closed by the event loop.
    pub dead: bool,
}

impl Conn {
    /// A connection on `stream` (non-blocking).
    pub fn new(stream: UnixStream, state: ConnState) -> Conn {
        Conn {
            stream,
            state,
            deadline: None,
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            rx_cnt: Wrapping(0),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            tx_buf: VecDeque::new(),
            readable: true,
            host_eof: false,
            peer_shut_send: false,
            peer_shut_rcv: false,
            credit_update_needed: false,
            dead: false,
        }
    }

    /// Records the credit the guest advertised in `hdr`.
    pub fn update_peer_credit(&mut self, hdr: &PacketHeader) {
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
    }

    /// Bytes the guest can still take: its buffer minus what is in flight.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Whether host data may be read and sent to the guest now.
    pub fn can_send_to_guest(&self) -> bool {
        !self.dead
            && self.state == ConnState::Established
            && self.readable
            && !self.host_eof
            && !self.peer_shut_rcv
            && self.peer_credit() > 0
    }

    /// Whether `len` more guest bytes fit in what we advertised.
    pub fn accept_tx(&self, len: usize) -> bool {
        self.tx_buf.len().saturating_add(len) <= TX_BUF_ALLOC as usize
    }

    /// Whether the guest should be told about freed buffer space.
    pub fn wants_credit_update(&self) -> bool {
        self.credit_update_needed
            || (self.fwd_cnt - self.last_fwd_cnt_sent).0 >= CREDIT_UPDATE_THRESHOLD
    }

    /// `fwd_cnt` for a packet to the guest, remembered as announced.
    pub fn announce_fwd_cnt(&mut self) -> u32 {
        self.last_fwd_cnt_sent = self.fwd_cnt;
        self.fwd_cnt.0
    }

    /// Writes buffered guest data to the host socket until it would block.
    pub fn flush_tx(&mut self) -> io::Result<()> {
        while !self.tx_buf.is_empty() {
            let (front, _) = self.tx_buf.as_slices();
            match (&self.stream).write(front) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.tx_buf.drain(..n);
                    self.fwd_cnt += Wrapping(n as u32);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        if self.peer_shut_send {
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
        }
        Ok(())
    }
}
