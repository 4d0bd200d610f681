//! A blocking guest channel for tools and tests: the vsock `CONNECT`
//! handshake of `vmm_api::vsock`, then length-prefixed protobuf frames
//! (`proto::framing`), opened by the Hello exchange of `proto::hello`.
//! host-agent's session channel is the async, multiplexed user of the same
//! three pieces.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use proto::framing::{self, FrameDecoder, DEFAULT_MAX_FRAME};
use proto::guest::{GuestMessage, Hello, HostMessage};
use proto::hello::HelloError;
use vmm_api::ControlError;

/// Errors on the guest channel.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// Connecting failed, or the vmm refused the CONNECT (nobody listens on
    /// that guest port yet).
    #[error(transparent)]
    Connect(#[from] ControlError),
    /// Talking on the open channel failed.
    #[error("vsock socket {path}: {source}")]
    Io {
        /// The Unix socket.
        path: String,
        /// The OS error.
        source: std::io::Error,
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
    /// The guest's first message did not open the channel.
    #[error(transparent)]
    Hello(#[from] HelloError),
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
        Self::connect_checked(uds, port, None, timeout)
    }

    /// [`GuestChannel::connect`], requiring `uds` to be served by `peer`.
    pub fn connect_checked(
        uds: &Path,
        port: u32,
        peer: Option<u32>,
        timeout: Duration,
    ) -> Result<Self, ChannelError> {
        let stream = vmm_api::vsock::connect(uds, port, peer, timeout)?;
        Ok(Self {
            stream,
            decoder: FrameDecoder::new(DEFAULT_MAX_FRAME),
            path: uds.display().to_string(),
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
        self.send(&proto::hello::host_hello(software))?;
        let first: GuestMessage = self.recv(timeout)?;
        Ok(proto::hello::accept_guest_hello(first)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::guest::{guest_message, host_message, PROTOCOL_VERSION};
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
        assert!(
            matches!(
                e,
                ChannelError::Connect(ControlError::ConnectRefused { port: 7, .. })
            ),
            "{e}"
        );
        t.join().unwrap();
    }
}
