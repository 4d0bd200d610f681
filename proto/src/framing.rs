//! Length-prefixed frames: a 4-byte big-endian payload length, then the
//! payload (one encoded protobuf message).
//!
//! [`FrameDecoder`] is sans-IO: feed it bytes as they arrive and take whole
//! frames out. It never panics on hostile input, holds at most one frame plus
//! whatever was pushed beyond it, and rejects a frame whose declared length
//! exceeds the maximum *before* allocating for it. After an oversize error it
//! discards that frame's payload as it arrives, so the stream stays in sync.

use prost::Message;

/// Size of the length prefix in bytes.
pub const HEADER_LEN: usize = 4;

/// Default maximum payload size of one frame: 4 MiB.
pub const DEFAULT_MAX_FRAME: usize = 4 * 1024 * 1024;

/// Errors from framing and decoding.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    /// A frame declared (or a message needs) more than the maximum size.
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    Oversize {
        /// Declared or needed payload length.
        len: u64,
        /// The maximum in force.
        max: usize,
    },
    /// A payload that does not decode as the expected message.
    #[error("malformed message: {0}")]
    Malformed(String),
}

/// Encodes `msg` as one frame (header + payload).
pub fn encode_frame<M: Message>(msg: &M, max: usize) -> Result<Vec<u8>, FrameError> {
    let len = msg.encoded_len();
    if len > max || u32::try_from(len).is_err() {
        return Err(FrameError::Oversize {
            len: len as u64,
            max,
        });
    }
    let mut out = Vec::with_capacity(HEADER_LEN + len);
    // Checked above: len fits in u32.
    out.extend_from_slice(&(len as u32).to_be_bytes());
    msg.encode(&mut out)
        .map_err(|e| FrameError::Malformed(e.to_string()))?;
    Ok(out)
}

/// Decodes one frame's payload as `M`.
pub fn decode_payload<M: Message + Default>(payload: &[u8]) -> Result<M, FrameError> {
    M::decode(payload).map_err(|e| FrameError::Malformed(e.to_string()))
}

/// Incremental frame decoder; see the module documentation.
#[derive(Debug)]
pub struct FrameDecoder {
    max: usize,
    buf: Vec<u8>,
    /// Payload bytes of a rejected oversize frame still to be discarded.
    skip: u64,
}

impl FrameDecoder {
    /// A decoder accepting payloads of at most `max` bytes.
    pub fn new(max: usize) -> Self {
        Self {
            max,
            buf: Vec::new(),
            skip: 0,
        }
    }

    /// The maximum payload size in force.
    pub fn max_frame(&self) -> usize {
        self.max
    }

    /// Number of bytes buffered and not yet returned as a frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// True while the decoder is discarding a rejected frame's payload.
    pub fn is_skipping(&self) -> bool {
        self.skip > 0
    }

    /// Appends received bytes. Bytes belonging to a rejected oversize frame
    /// are dropped here without being stored.
    pub fn push(&mut self, mut data: &[u8]) {
        if self.skip > 0 {
            let n = usize::try_from(self.skip)
                .unwrap_or(usize::MAX)
                .min(data.len());
            data = &data[n..];
            self.skip -= n as u64;
        }
        self.buf.extend_from_slice(data);
    }

    /// Takes the next whole frame's payload, if one is buffered.
    ///
    /// On [`FrameError::Oversize`] the frame is dropped (its payload is
    /// discarded as it arrives) and later frames decode normally.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        if self.skip > 0 || self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let mut header = [0u8; HEADER_LEN];
        header.copy_from_slice(&self.buf[..HEADER_LEN]);
        let len = u32::from_be_bytes(header) as usize;
        if len > self.max {
            let available = self.buf.len() - HEADER_LEN;
            let discard_now = available.min(len);
            self.buf.drain(..HEADER_LEN + discard_now);
            self.skip = (len - discard_now) as u64;
            return Err(FrameError::Oversize {
                len: len as u64,
                max: self.max,
            });
        }
        if self.buf.len() < HEADER_LEN + len {
            return Ok(None);
        }
        let payload = self.buf[HEADER_LEN..HEADER_LEN + len].to_vec();
        self.buf.drain(..HEADER_LEN + len);
        Ok(Some(payload))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest::{host_message, Exec, HostMessage};

    fn exec_msg(id: &str) -> HostMessage {
        HostMessage {
            kind: Some(host_message::Kind::Exec(Exec {
                exec_id: id.into(),
                argv: vec!["echo".into(), "hi".into()],
                ..Default::default()
            })),
        }
    }

    #[test]
    fn round_trip_byte_by_byte() {
        let mut wire = encode_frame(&exec_msg("a"), DEFAULT_MAX_FRAME).unwrap();
        wire.extend(encode_frame(&exec_msg("b"), DEFAULT_MAX_FRAME).unwrap());
        let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME);
        let mut got = Vec::new();
        for b in &wire {
            dec.push(std::slice::from_ref(b));
            while let Some(p) = dec.next_frame().unwrap() {
                got.push(decode_payload::<HostMessage>(&p).unwrap());
            }
        }
        assert_eq!(got, vec![exec_msg("a"), exec_msg("b")]);
        assert_eq!(dec.buffered(), 0);
    }

    #[test]
    fn oversize_is_rejected_before_allocation_and_stream_resyncs() {
        let mut dec = FrameDecoder::new(16);
        // Declares 4 GiB - 1: must not allocate or wait for it.
        dec.push(&u32::MAX.to_be_bytes());
        assert_eq!(
            dec.next_frame(),
            Err(FrameError::Oversize {
                len: u64::from(u32::MAX),
                max: 16
            })
        );
        assert!(dec.is_skipping());
        assert_eq!(dec.buffered(), 0);

        let mut dec = FrameDecoder::new(4);
        let mut wire = 10u32.to_be_bytes().to_vec();
        wire.extend_from_slice(&[7u8; 10]);
        wire.extend_from_slice(&2u32.to_be_bytes());
        wire.extend_from_slice(&[1, 2]);
        dec.push(&wire[..6]);
        assert!(matches!(
            dec.next_frame(),
            Err(FrameError::Oversize { len: 10, .. })
        ));
        dec.push(&wire[6..]);
        assert_eq!(dec.next_frame(), Ok(Some(vec![1, 2])));
    }

    #[test]
    fn encode_refuses_oversize() {
        let big = HostMessage {
            kind: Some(host_message::Kind::Exec(Exec {
                stdin: vec![0; 100],
                ..Default::default()
            })),
        };
        assert!(matches!(
            encode_frame(&big, 50),
            Err(FrameError::Oversize { .. })
        ));
    }

    #[test]
    fn garbage_never_panics() {
        // xorshift, so the test is deterministic without a rand dependency.
        let mut s: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut frames = 0;
        let mut errors = 0;
        for _ in 0..2000 {
            let mut dec = FrameDecoder::new(64);
            let len = (next() % 200) as usize;
            let bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            dec.push(&bytes);
            for _ in 0..64 {
                match dec.next_frame() {
                    Ok(Some(p)) => {
                        frames += 1;
                        if decode_payload::<HostMessage>(&p).is_err() {
                            errors += 1;
                        }
                    }
                    Ok(None) => break,
                    Err(_) => errors += 1,
                }
            }
            assert!(dec.buffered() <= bytes.len());
        }
        assert!(
            frames + errors > 0,
            "random input produced neither frames nor errors"
        );
    }

    #[test]
    fn malformed_payload_is_an_error() {
        // Field 4 (exec), wire type 2, declared length 100 but 1 byte present.
        let err = decode_payload::<HostMessage>(&[0x22, 100, 1]).unwrap_err();
        assert!(matches!(err, FrameError::Malformed(_)));
    }
}
