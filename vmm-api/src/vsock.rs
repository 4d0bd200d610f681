//! The host side of the vmm's vsock device: a Unix socket where the host
//! writes `CONNECT <port>\n` and reads `OK <host port>\n` (Firecracker's
//! convention); after that the stream is a byte pipe to the guest port.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::error::ControlError;

const WHAT: &str = "vsock socket";
/// Longest reply line to `CONNECT` read before giving up on it.
const MAX_REPLY: usize = 64;

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> ControlError + '_ {
    move |source| ControlError::Io {
        what: WHAT,
        path: path.to_path_buf(),
        source,
    }
}

fn check_reply(port: u32, reply: Vec<u8>) -> Result<(), ControlError> {
    let reply = String::from_utf8_lossy(&reply).into_owned();
    if reply.starts_with("OK ") {
        Ok(())
    } else {
        Err(ControlError::ConnectRefused { port, reply })
    }
}

/// Connects to guest `port` through the vsock socket `uds`; `timeout` bounds
/// the handshake and is left as the stream's read timeout. With `peer`, the
/// socket must be served by that process.
pub fn connect(
    uds: &Path,
    port: u32,
    peer: Option<u32>,
    timeout: Duration,
) -> Result<UnixStream, ControlError> {
    let io = io_err(uds);
    let mut stream = UnixStream::connect(uds).map_err(&io)?;
    crate::peer::check(&stream, peer, WHAT, uds)?;
    stream.set_read_timeout(Some(timeout)).map_err(&io)?;
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .map_err(&io)?;
    // Byte by byte, so no stream data after the line is buffered away.
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < MAX_REPLY {
        match stream.read(&mut byte).map_err(&io)? {
            0 => break,
            _ if byte[0] == b'\n' => break,
            _ => line.push(byte[0]),
        }
    }
    check_reply(port, line)?;
    Ok(stream)
}

/// The async [`connect`] (no read timeout is set; bound the call instead).
#[cfg(feature = "tokio")]
pub async fn connect_async(
    uds: &Path,
    port: u32,
    peer: Option<u32>,
) -> Result<tokio::net::UnixStream, ControlError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let io = io_err(uds);
    let mut stream = tokio::net::UnixStream::connect(uds).await.map_err(&io)?;
    crate::peer::check(&stream, peer, WHAT, uds)?;
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .await
        .map_err(&io)?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < MAX_REPLY {
        match stream.read(&mut byte).await.map_err(&io)? {
            0 => break,
            _ if byte[0] == b'\n' => break,
            _ => line.push(byte[0]),
        }
    }
    check_reply(port, line)?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::os::unix::net::UnixListener;

    /// A stand-in vmm answering one CONNECT with `reply` then sending `data`.
    fn vmm(
        reply: &'static [u8],
        data: &'static [u8],
    ) -> (
        tempfile::TempDir,
        std::path::PathBuf,
        std::thread::JoinHandle<String>,
    ) {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("v.sock");
        let l = UnixListener::bind(&sock).unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut line = String::new();
            std::io::BufReader::new(s.try_clone().unwrap())
                .read_line(&mut line)
                .unwrap();
            let mut w = s;
            w.write_all(reply).unwrap();
            w.write_all(data).unwrap();
            line
        });
        (d, sock, t)
    }

    #[test]
    fn the_handshake_leaves_the_stream_at_the_guest_data() {
        let (_d, sock, t) = vmm(b"OK 1073741824\n", b"hello");
        let mut s = connect(&sock, 700, Some(std::process::id()), Duration::from_secs(5)).unwrap();
        assert_eq!(t.join().unwrap(), "CONNECT 700\n");
        let mut data = [0u8; 5];
        s.read_exact(&mut data).unwrap();
        assert_eq!(&data, b"hello");
    }

    #[test]
    fn refusals_and_endless_replies_are_errors() {
        let (_d, sock, t) = vmm(b"", b"");
        let e = connect(&sock, 9, None, Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(e, ControlError::ConnectRefused { port: 9, .. }),
            "{e}"
        );
        t.join().unwrap();
        let (_d, sock, t) = vmm(&[b'A'; 200], b"");
        let e = connect(&sock, 9, None, Duration::from_secs(5)).unwrap_err();
        match e {
            ControlError::ConnectRefused { reply, .. } => assert_eq!(reply.len(), MAX_REPLY),
            other => panic!("{other}"),
        }
        t.join().unwrap();
    }

    #[cfg(feature = "tokio")]
    #[tokio::test]
    async fn the_async_handshake_matches() {
        let (_d, sock, t) = vmm(b"OK 5\n", b"x");
        let mut s = connect_async(&sock, 700, None).await.unwrap();
        use tokio::io::AsyncReadExt;
        assert_eq!(s.read_u8().await.unwrap(), b'x');
        t.join().unwrap();
        let (_d, sock, t) = vmm(b"NO\n", b"");
        let e = connect_async(&sock, 700, None).await.unwrap_err();
        assert!(e.to_string().contains("refused"), "{e}");
        t.join().unwrap();
    }
}
