//! The virtio-vsock packet header and protocol constants (virtio spec 5.10).

use vm_memory::ByteValued;

/// The host's context ID.
pub const HOST_CID: u64 = 2;
/// Stream sockets, the only type offered.
pub const TYPE_STREAM: u16 = 1;

/// Connection request.
pub const OP_REQUEST: u16 = 1;
/// Connection accepted.
pub const OP_RESPONSE: u16 = 2;
/// Connection refused or ended.
pub const OP_RST: u16 = 3;
/// No more data in one or both directions.
pub const OP_SHUTDOWN: u16 = 4;
/// Data.
pub const OP_RW: u16 = 5;
/// Tells the peer how much buffer space is free.
pub const OP_CREDIT_UPDATE: u16 = 6;
/// Asks the peer for a credit update.
pub const OP_CREDIT_REQUEST: u16 = 7;

/// SHUTDOWN flag: the sender will receive no more data.
pub const SHUTDOWN_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more data.
pub const SHUTDOWN_SEND: u32 = 2;

/// Event queue: the transport was reset; the driver drops its connections.
pub const EVENT_TRANSPORT_RESET: u32 = 0;

/// `struct virtio_vsock_hdr`, little endian (x86 hosts only, like the rest of the VMM).
#[repr(C, packed)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PacketHeader {
    /// Source context ID.
    pub src_cid: u64,
    /// Destination context ID.
    pub dst_cid: u64,
    /// Source port.
    pub src_port: u32,
    /// Destination port.
    pub dst_port: u32,
    /// Payload length.
    pub len: u32,
    /// Socket type.
    pub type_: u16,
    /// Operation.
    pub op: u16,
    /// Operation flags (SHUTDOWN).
    pub flags: u32,
    /// Receive buffer space of the sender.
    pub buf_alloc: u32,
    /// Bytes the sender has consumed from its receive buffer.
    pub fwd_cnt: u32,
}

/// Size of the header on the wire.
pub const HEADER_LEN: usize = std::mem::size_of::<PacketHeader>();

// SAFETY: PacketHeader is repr(C, packed) plain integers (44 bytes, no padding); any byte
// pattern is a valid value.
unsafe impl ByteValued for PacketHeader {}

#[cfg(test)]
mod tests {
    #[test]
    fn header_is_44_bytes() {
        assert_eq!(super::HEADER_LEN, 44);
    }
}
