//! The host side of the guest channel through the vmm's vsock device: a
//! Unix socket where the host writes `CONNECT <port>\n`, reads
//! `OK <host port>\n`, and then speaks length-prefixed protobuf frames
//! (`proto::guest`), starting with the Hello exchange.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use proto::framing::{self, FrameDecoder, DEFAULT_MAX_FRAME};
use proto::guest::{
    guest_message, host_message, GuestMessage, Hello, HostMessage, PROTOCOL_VERSION,
};

/// Errors on the guest channel.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// Connecting or talking to the socket failed.
    #[error("vsock socket {path}: {source}")]
    Io {
        /// The Unix socket.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The vmm refused the CONNECT (nobody listens on that guest port yet).
    #[error("vsock CONNECT {port} refused: {reply}")]
    Refused {
        /// Guest port.
        port: u32,
        /// What came back instead of `OK`.
        reply: String,
    },
    /// A frame could not be encoded or decoded.
    #[error("guest channel: {0}")]
    Frame(#[from] framing::FrameError),
    /// The guest closed the channel.
    #[error("the guest closed the channel")]
    Closed,
    /// Nothing arrived in time.
    #[error("no message from the guest within {0:?}")]
    Timeout(Duration),
    /// The guest answered something other than what the protocol expects.
    #[error("unexpected guest message: {0}")]
    Unexpected(String),
}

/// An open channel to guest-init.
pub struct GuestChannel {
    stream: UnixStream,
    decoder: FrameDecoder,
    path: String,
}

impl GuestChannel {
    /// Connects to `uds` and asks the vmm for guest `port`.
    pub fn connect(uds: &Path, port: u32, timeout: Duration) -> Result<Self, ChannelError> {
        let path = uds.display().to_string();
        let io = |source| ChannelError::Io {
            path: path.clone(),
            source,
        };
        let mut stream = UnixStream::connect(uds).map_err(io)?;
        stream.set_read_timeout(Some(timeout)).map_err(io)?;
        stream
            .write_all(format!("CONNECT {port}\n").as_bytes())
            .map_err(io)?;
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while line.len() < 64 {
            match stream.read(&mut byte) {
                Ok(0) => break,
                Ok(_) if byte[0] == b'\n' => break,
                Ok(_) => line.push(byte[0]),
                Err(e) => return Err(io(e)),
            }
        }
        let reply = String::from_utf8_lossy(&line).into_owned();
        if !reply.starts_with("OK ") {
            return Err(ChannelError::Refused { port, reply });
        }
        Ok(Self {
            stream,
            decoder: FrameDecoder::new(DEFAULT_MAX_FRAME),
            path,
        })
    }

    /// Sends one message.
    pub fn send(&mut self, msg: &HostMessage) -> Result<(), ChannelError> {
        let frame = framing::encode_frame(msg, DEFAULT_MAX_FRAME)?;
        self.stream
            .write_all(&frame)
            .map_err(|source| ChannelError::Io {
                path: self.path.clone(),
                source,
            })
    }

    /// Receives the next message, waiting at most `timeout`.
    pub fn recv(&mut self, timeout: Duration) -> Result<GuestMessage, ChannelError> {
        let deadline = Instant::now() + timeout;
        let mut buf = [0u8; 64 * 1024];
        loop {
            if let Some(payload) = self.decoder.next_frame()? {
                return Ok(framing::decode_payload(&payload)?);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ChannelError::Timeout(timeout));
            }
            let io = |source| ChannelError::Io {
                path: self.path.clone(),
                source,
            };
            self.stream.set_read_timeout(Some(left)).map_err(io)?;
            match self.stream.read(&mut buf) {
                Ok(0) => return Err(ChannelError::Closed),
                Ok(n) => self.decoder.push(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(ChannelError::Timeout(timeout))
                }
                Err(e) => return Err(io(e)),
            }
        }
    }

    /// The Hello exchange: sends ours, returns guest-init's.
    pub fn hello(&mut self, software: &str, timeout: Duration) -> Result<Hello, ChannelError> {
        self.send(&HostMessage {
            kind: Some(host_message::Kind::Hello(Hello {
                protocol_version: PROTOCOL_VERSION,
                software: software.to_string(),
            })),
        })?;
        match self.recv(timeout)?.kind {
            Some(guest_message::Kind::Hello(h)) if h.protocol_version == PROTOCOL_VERSION => Ok(h),
            Some(guest_message::Kind::Hello(h)) => Err(ChannelError::Unexpected(format!(
                "guest speaks protocol {}, we speak {PROTOCOL_VERSION}",
                h.protocol_version
            ))),
            other => Err(ChannelError::Unexpected(format!(
                "{other:?} instead of Hello"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A fake vmm vsock socket: accepts, answers the CONNECT line, then
    /// plays guest-init's side of the Hello exchange.
    fn fake_guest(listener: UnixListener, accept_port: u32) {
        let (mut s, _) = listener.accept().unwrap();
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while s.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
            line.push(b[0]);
        }
        if line != format!("CONNECT {accept_port}").into_bytes() {
            return; // dropping the stream closes it: a refusal
        }
        s.write_all(b"OK 1073741824\n").unwrap();
        let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME);
        let mut buf = [0u8; 256];
        let payload = loop {
            if let Some(p) = dec.next_frame().unwrap() {
                break p;
            }
            let n = s.read(&mut buf).unwrap();
            dec.push(&buf[..n]);
        };
        let m: HostMessage = framing::decode_payload(&payload).unwrap();
        assert!(matches!(m.kind, Some(host_message::Kind::Hello(_))));
        let reply = GuestMessage {
            kind: Some(guest_message::Kind::Hello(Hello {
                protocol_version: PROTOCOL_VERSION,
                software: "fake guest-init".into(),
            })),
        };
        s.write_all(&framing::encode_frame(&reply, DEFAULT_MAX_FRAME).unwrap())
            .unwrap();
    }

    #[test]
    fn connects_and_exchanges_hello() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("v.sock");
        let l = UnixListener::bind(&sock).unwrap();
        let t = std::thread::spawn(move || fake_guest(l, 1024));
        let mut c = GuestChannel::connect(&sock, 1024, Duration::from_secs(5)).unwrap();
        let h = c.hello("test", Duration::from_secs(5)).unwrap();
        assert_eq!(h.software, "fake guest-init");
        t.join().unwrap();
    }

    #[test]
    fn a_refused_port_is_reported() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("v.sock");
        let l = UnixListener::bind(&sock).unwrap();
        let t = std::thread::spawn(move || fake_guest(l, 1024));
        let e = GuestChannel::connect(&sock, 7, Duration::from_secs(5))
            .err()
            .unwrap();
        assert!(matches!(e, ChannelError::Refused { port: 7, .. }), "{e}");
        t.join().unwrap();
    }
}
