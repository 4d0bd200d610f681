//! The control socket listener: one thread accepts, one thread per client
//! reads request lines (bounded in length and in number of clients).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::protocol::{self, ControlTarget, MAX_REQUEST_LEN};

/// Most clients served at once; more are answered with an error and closed.
pub const MAX_CLIENTS: usize = 16;

/// Errors starting the control socket.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Another process is serving this path.
    #[error("control socket {0} is in use by another process")]
    InUse(PathBuf),
    /// Binding failed.
    #[error("cannot create control socket {path}: {source}")]
    Bind {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// A running control socket; the file is removed when this is dropped.
pub struct ControlServer {
    path: PathBuf,
}

impl ControlServer {
    /// Binds `path` (replacing a stale socket nobody listens on) and serves it.
    pub fn start(path: &Path, target: Arc<dyn ControlTarget>) -> Result<Self, ControlError> {
        let listener = bind(path)?;
        Self::serve_on(path, listener, target, None)
    }

    /// Serves `listener`, already bound at `path` (see [`bind`]), and the
    /// client `first` already connected to it (a standby vmm's client that
    /// asked for the restore: lines it sent after that request are in the
    /// reader's buffer).
    pub fn serve_on(
        path: &Path,
        listener: UnixListener,
        target: Arc<dyn ControlTarget>,
        first: Option<BufReader<UnixStream>>,
    ) -> Result<Self, ControlError> {
        let clients = Arc::new(AtomicUsize::new(0));
        let server = ControlServer { path: path.into() };
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || accept_loop(listener, target, clients, first))
            .map_err(|source| ControlError::Bind {
                path: path.into(),
                source,
            })?;
        Ok(server)
    }
}

/// Binds a listening control socket at `path`, replacing a stale socket
/// nobody listens on; refuses a path another process serves.
pub fn bind(path: &Path) -> Result<UnixListener, ControlError> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(ControlError::InUse(path.into()));
        }
        let _ = std::fs::remove_file(path);
    }
    bind_listening(path).map_err(|source| ControlError::Bind {
        path: path.into(),
        source,
    })
}

/// Binds a listening socket that appears at `path` only once it listens: it
/// is bound under a temporary name beside `path` and renamed into place, so
/// a client that sees the file never meets a socket that refuses it.
fn bind_listening(path: &Path) -> std::io::Result<UnixListener> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let staging = path.with_file_name(format!(".{name}.{}", std::process::id()));
    let _ = std::fs::remove_file(&staging);
    let listener = match UnixListener::bind(&staging) {
        Ok(l) => l,
        // A staging name past the socket path limit: bind in place.
        Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => return UnixListener::bind(path),
        Err(e) => return Err(e),
    };
    if let Err(e) = std::fs::rename(&staging, path) {
        let _ = std::fs::remove_file(&staging);
        return Err(e);
    }
    Ok(listener)
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn accept_loop(
    listener: UnixListener,
    target: Arc<dyn ControlTarget>,
    clients: Arc<AtomicUsize>,
    first: Option<BufReader<UnixStream>>,
) {
    // Client threads inherit this filter.
    crate::seccomp::apply_or_die(crate::seccomp::ThreadKind::Control);
    if let Some(reader) = first {
        spawn_client(reader, &target, &clients);
    }
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        if clients.load(Ordering::SeqCst) >= MAX_CLIENTS {
            let _ = write_response(&mut stream, &protocol::error("too many control clients"));
            continue;
        }
        spawn_client(BufReader::new(stream), &target, &clients);
    }
}

/// Serves one client on a thread of its own, counted in `clients`.
fn spawn_client(
    reader: BufReader<UnixStream>,
    target: &Arc<dyn ControlTarget>,
    clients: &Arc<AtomicUsize>,
) {
    clients.fetch_add(1, Ordering::SeqCst);
    let target = target.clone();
    let clients_done = clients.clone();
    let spawned = std::thread::Builder::new()
        .name("control-client".into())
        .spawn(move || {
            serve_client(reader, target.as_ref());
            clients_done.fetch_sub(1, Ordering::SeqCst);
        });
    if spawned.is_err() {
        clients.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Writes `value` as one answer line.
pub(super) fn write_response(
    stream: &mut UnixStream,
    value: &serde_json::Value,
) -> std::io::Result<()> {
    let mut line = value.to_string();
    line.push('\n');
    stream.write_all(line.as_bytes())?;
    stream.flush()
}

/// Reads one line of at most MAX_REQUEST_LEN bytes. `Ok(None)` at end of stream.
pub(super) fn read_line(
    reader: &mut impl BufRead,
) -> std::io::Result<Option<Result<String, String>>> {
    let mut buf = Vec::new();
    let n = reader
        .by_ref()
        .take(MAX_REQUEST_LEN as u64 + 1)
        .read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') && buf.len() > MAX_REQUEST_LEN {
        return Ok(Some(Err(format!(
            "request line longer than {MAX_REQUEST_LEN} bytes"
        ))));
    }
    Ok(Some(
        String::from_utf8(buf).map_err(|_| "request is not valid UTF-8".to_string()),
    ))
}

fn serve_client(mut reader: BufReader<UnixStream>, target: &dyn ControlTarget) {
    let Ok(mut writer) = reader.get_ref().try_clone() else {
        return;
    };
    loop {
        let line = match read_line(&mut reader) {
            Ok(Some(line)) => line,
            Ok(None) | Err(_) => return,
        };
        let (response, request, fatal) = match line {
            Err(message) => (protocol::error(message), None, true),
            Ok(text) if text.trim().is_empty() => continue,
            Ok(text) => match protocol::parse_request(&text) {
                Ok(req) => (protocol::handle(&req, target), Some(req), false),
                Err(message) => (protocol::error(message), None, false),
            },
        };
        if write_response(&mut writer, &response).is_err() {
            return;
        }
        if let Some(req) = request {
            protocol::after_response(&req, target);
        }
        if fatal {
            // The rest of an over-long line cannot be resynchronised.
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlong_lines_are_refused_without_buffering_them_all() {
        let data = vec![b'x'; MAX_REQUEST_LEN * 3];
        let mut reader = BufReader::new(&data[..]);
        let line = read_line(&mut reader).unwrap().unwrap();
        assert!(line.unwrap_err().contains("longer than"));
    }

    #[test]
    fn lines_are_split_and_eof_is_none() {
        let data = b"{\"op\":\"status\"}\n\xff\n";
        let mut reader = BufReader::new(&data[..]);
        assert_eq!(
            read_line(&mut reader).unwrap().unwrap().unwrap(),
            "{\"op\":\"status\"}\n"
        );
        assert!(read_line(&mut reader).unwrap().unwrap().is_err());
        assert!(read_line(&mut reader).unwrap().is_none());
    }
}
