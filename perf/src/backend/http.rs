//! A minimal HTTP/1.1 client over a Unix socket, enough for Firecracker's API
//! (JSON bodies, `Content-Length` framing, one request per connection).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::error::{PerfError, Result};

/// Sends `method path` with a JSON `body` to the API socket at `sock`;
/// succeeds on a 2xx status.
pub fn request(sock: &Path, method: &'static str, path: &str, body: &str) -> Result<()> {
    let sock_err = |action: &str| {
        let sock = sock.to_path_buf();
        let action = format!("{action} ({method} {path})");
        move |source| PerfError::Socket {
            path: sock,
            action,
            source,
        }
    };
    let mut stream = UnixStream::connect(sock).map_err(sock_err("cannot connect"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(600)))
        .map_err(sock_err("cannot set a read timeout"))?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream
        .write_all(format!("{head}{body}").as_bytes())
        .map_err(sock_err("cannot send"))?;
    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    reader
        .read_line(&mut status_line)
        .map_err(sock_err("cannot read the status line"))?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut content_length = 0usize;
    loop {
        let mut header = String::new();
        let n = reader
            .read_line(&mut header)
            .map_err(sock_err("cannot read headers"))?;
        let header = header.trim_end();
        if n == 0 || header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                content_length = value.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body_bytes = vec![0u8; content_length.min(1 << 20)];
    reader
        .read_exact(&mut body_bytes)
        .map_err(sock_err("cannot read the body"))?;
    if (200..300).contains(&status) {
        Ok(())
    } else {
        Err(PerfError::FirecrackerApi {
            method,
            path: path.into(),
            status,
            body: if status == 0 {
                format!("unparsable status line {:?}", status_line.trim())
            } else {
                String::from_utf8_lossy(&body_bytes).into_owned()
            },
        })
    }
}
