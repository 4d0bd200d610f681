//! Protobuf messages over a connection, in [`proto::framing`] frames.

use proto::framing::{decode_payload, encode_frame, FrameDecoder, FrameError};
use proto::guest::{GuestMessage, HostMessage};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const READ_CHUNK: usize = 64 * 1024;

/// Reads host messages.
pub struct FrameReader<R> {
    inner: R,
    decoder: FrameDecoder,
    buf: Vec<u8>,
}

/// One read result: a message, or a frame that was refused.
pub type Incoming = Result<HostMessage, FrameError>;

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// Reads frames of at most `max_frame` bytes from `inner`.
    pub fn new(inner: R, max_frame: usize) -> Self {
        Self {
            inner,
            decoder: FrameDecoder::new(max_frame),
            buf: vec![0; READ_CHUNK],
        }
    }

    /// The next message or refused frame; `Ok(None)` at end of stream.
    pub async fn next(&mut self) -> std::io::Result<Option<Incoming>> {
        loop {
            match self.decoder.next_frame() {
                Ok(Some(payload)) => return Ok(Some(decode_payload::<HostMessage>(&payload))),
                Ok(None) => {}
                Err(e) => return Ok(Some(Err(e))),
            }
            let n = self.inner.read(&mut self.buf).await?;
            if n == 0 {
                return Ok(None);
            }
            self.decoder.push(&self.buf[..n]);
        }
    }
}

/// Writes guest messages.
pub struct FrameWriter<W> {
    inner: W,
    max_frame: usize,
}

/// Failure to send a message.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The message does not fit in a frame.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The connection failed.
    #[error("writing to the host failed: {0}")]
    Io(#[from] std::io::Error),
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    /// Writes frames of at most `max_frame` bytes to `inner`.
    pub fn new(inner: W, max_frame: usize) -> Self {
        Self { inner, max_frame }
    }

    /// Sends one message.
    pub async fn send(&mut self, msg: &GuestMessage) -> Result<(), SendError> {
        let frame = encode_frame(msg, self.max_frame)?;
        self.inner.write_all(&frame).await?;
        self.inner.flush().await?;
        Ok(())
    }
}
