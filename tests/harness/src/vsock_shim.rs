//! The host side of a vmm's vsock device, played by a test: a Unix socket
//! where a client writes `CONNECT <port>\n`, is answered `OK <host port>\n`,
//! and then has a byte stream to the guest port (Firecracker's convention,
//! the one `vmm_api::vsock::connect` and host-agent speak). Stand-in guests
//! serve it with [`read_connect`] and [`answer_ok`]; [`relay`] puts a guest
//! program listening on a plain Unix socket (guest-init run on the host)
//! behind one.

use std::io;
use std::path::{Path, PathBuf};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinHandle;

/// Longest `CONNECT` line read before giving up on it.
const MAX_LINE: usize = 64;

/// Reads the client's `CONNECT <port>\n` from `conn`, byte by byte so that
/// nothing after it is taken from the stream; `None` for any other line.
pub async fn read_connect(conn: &mut UnixStream) -> io::Result<Option<u32>> {
    let mut line = Vec::new();
    loop {
        let b = conn.read_u8().await?;
        if b == b'\n' {
            break;
        }
        if line.len() == MAX_LINE {
            return Ok(None);
        }
        line.push(b);
    }
    Ok(std::str::from_utf8(&line)
        .ok()
        .and_then(|l| l.strip_prefix("CONNECT "))
        .and_then(|p| p.parse().ok()))
}

/// Accepts the connection: `OK <hostport>\n`.
pub async fn answer_ok(conn: &mut UnixStream, hostport: u32) -> io::Result<()> {
    conn.write_all(format!("OK {hostport}\n").as_bytes()).await
}

/// Refuses the connection (nothing listens on the port).
pub async fn refuse(conn: &mut UnixStream) -> io::Result<()> {
    conn.write_all(b"ERR unknown port\n").await
}

/// Listens on `path` (the vsock socket a host program is given) and relays
/// every connection to guest `port` to the Unix socket `upstream`, after
/// the handshake; connections to other ports, or when `upstream` does not
/// answer, are refused. Host ports are numbered from 50001. Runs until the
/// returned task is aborted or the runtime ends.
pub fn relay(path: &Path, port: u32, upstream: PathBuf) -> io::Result<JoinHandle<()>> {
    let listener = UnixListener::bind(path)?;
    Ok(tokio::spawn(async move {
        let mut hostport = 50_000u32;
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            hostport += 1;
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(Some(asked)) = read_connect(&mut conn).await else {
                    let _ = refuse(&mut conn).await;
                    return;
                };
                let guest = if asked == port {
                    UnixStream::connect(&upstream).await.ok()
                } else {
                    None
                };
                let Some(mut guest) = guest else {
                    let _ = refuse(&mut conn).await;
                    return;
                };
                if answer_ok(&mut conn, hostport).await.is_ok() {
                    let _ = tokio::io::copy_bidirectional(&mut conn, &mut guest).await;
                }
            });
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::Duration;

    /// A guest program on a Unix socket that answers each connection with
    /// what it read, upper-cased.
    async fn upper_guest(path: &Path) {
        let l = UnixListener::bind(path).unwrap();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n @ 1..) = c.read(&mut buf).await {
                        let up = buf[..n].to_ascii_uppercase();
                        if c.write_all(&up).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_relay_speaks_the_handshake_vmm_api_speaks() {
        let dir = tempfile::tempdir().unwrap();
        let (vsock, guest) = (dir.path().join("v.sock"), dir.path().join("g.sock"));
        upper_guest(&guest).await;
        let _relay = relay(&vsock, 1024, guest).unwrap();
        let talk = tokio::task::spawn_blocking(move || {
            let t = Duration::from_secs(10);
            let mut s = vmm_api::vsock::connect(&vsock, 1024, None, t).unwrap();
            s.write_all(b"hello").unwrap();
            let mut got = [0u8; 5];
            s.read_exact(&mut got).unwrap();
            let refused = vmm_api::vsock::connect(&vsock, 7, None, t).unwrap_err();
            (got, refused)
        });
        let (got, refused) = talk.await.unwrap();
        assert_eq!(&got, b"HELLO");
        assert!(
            matches!(
                refused,
                vmm_api::ControlError::ConnectRefused { port: 7, .. }
            ),
            "{refused}"
        );
    }

    #[tokio::test]
    async fn only_a_connect_line_is_a_port() {
        for (line, port) in [
            (&b"CONNECT 1024\nrest"[..], Some(1024)),
            (b"CONNECT x\n", None),
            (b"HELLO\n", None),
            (&[b'C'; 100], None),
        ] {
            let (mut a, mut b) = UnixStream::pair().unwrap();
            a.write_all(line).await.unwrap();
            assert_eq!(read_connect(&mut b).await.unwrap(), port, "{line:?}");
            if port.is_some() {
                let mut rest = [0u8; 4];
                b.read_exact(&mut rest).await.unwrap();
                assert_eq!(&rest, b"rest", "nothing after the line is taken");
            }
        }
    }
}
