//! The host side of a guest's vsock device, with the vmm's conventions
//! (Firecracker's): the host connects to guest port P by sending
//! `CONNECT P\n` on the device's Unix socket and reading `OK <port>\n`; a
//! guest connecting to host port P reaches a listener at `<socket>_P`.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Duration;

use sha2::{Digest, Sha256};

/// Hex SHA-256 of `data`.
pub fn sha256(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// What a host listener received.
#[derive(Debug)]
pub struct Received {
    /// Bytes.
    pub len: usize,
    /// Their SHA-256.
    pub sha256: String,
}

/// Listens on `<uds>_<port>` for one guest connection, reads to its end,
/// answers `ok <sha256>` and closes. Gives up after `timeout`.
pub fn receive_one(
    uds: &Path,
    port: u32,
    timeout: Duration,
) -> Result<JoinHandle<Result<Received, String>>, String> {
    let path = PathBuf::from(format!("{}_{port}", uds.display()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + timeout;
        let mut stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if std::time::Instant::now() >= deadline {
                        return Err(format!(
                            "no guest connection to port {port} within {} s",
                            timeout.as_secs()
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(format!("accept on {}: {e}", path.display())),
            }
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(120)));
        let mut data = Vec::new();
        stream
            .read_to_end(&mut data)
            .map_err(|e| format!("reading the guest's data: {e} (after {} bytes)", data.len()))?;
        let sha = sha256(&data);
        stream
            .write_all(format!("ok {sha}\n").as_bytes())
            .map_err(|e| format!("answering the guest: {e}"))?;
        Ok(Received {
            len: data.len(),
            sha256: sha,
        })
    }))
}

/// Connects to guest port `port` through the device socket `uds`
/// ([`vmm_api::vsock::connect`]); `timeout` bounds the handshake and each
/// later read.
pub fn connect(uds: &Path, port: u32, timeout: Duration) -> Result<UnixStream, String> {
    vmm_api::vsock::connect(uds, port, None, timeout).map_err(|e| e.to_string())
}

/// Sends `data` to guest port `port`, then ends the write side; returns
/// what the guest sent back before closing.
pub fn send_all(uds: &Path, port: u32, data: &[u8], timeout: Duration) -> Result<Vec<u8>, String> {
    let mut s = connect(uds, port, timeout)?;
    s.write_all(data)
        .map_err(|e| format!("sending {} bytes to port {port}: {e}", data.len()))?;
    s.shutdown(std::net::Shutdown::Write)
        .map_err(|e| format!("ending the write side: {e}"))?;
    let mut back = Vec::new();
    s.read_to_end(&mut back)
        .map_err(|e| format!("reading the guest's answer: {e}"))?;
    Ok(back)
}

/// `n` random bytes.
pub fn random_bytes(n: usize) -> Result<Vec<u8>, String> {
    let mut v = vec![0u8; n];
    getrandom::fill(&mut v).map_err(|e| format!("no randomness: {e}"))?;
    Ok(v)
}
