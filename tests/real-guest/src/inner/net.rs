//! The outer VM's side of a guest's network: a tap with an address, and a
//! TCP server on it that answers every line with `ack <line>`.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The L1 end of the guest's link.
pub const HOST_IP: &str = "172.16.0.1";
/// The guest's address on the link (given on its command line).
pub const GUEST_CIDR: &str = "172.16.0.2/30";
/// Port of [`AckServer`].
pub const TCP_PORT: u16 = 7000;

/// Runs `ip args...`; its error names the command and what `ip` said.
pub(crate) fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A persistent tap with [`HOST_IP`]/30, removed on drop.
pub struct Tap {
    /// Its name (give it to `vmm --net`).
    pub name: String,
}

impl Tap {
    /// Creates (or re-creates) the tap.
    pub fn create(name: &str) -> Result<Tap, String> {
        let _ = ip(&["link", "del", name]);
        ip(&["tuntap", "add", "dev", name, "mode", "tap"])?;
        // No IPv6 chatter (router and neighbour solicitations) from the
        // outer VM's side: nothing should reach a paused guest unasked.
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1");
        ip(&["addr", "add", &format!("{HOST_IP}/30"), "dev", name])?;
        ip(&["link", "set", name, "up"])?;
        Ok(Tap {
            name: name.to_string(),
        })
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.name]);
    }
}

/// A TCP server on [`HOST_IP`]:[`TCP_PORT`] answering each line with
/// `ack <line>`; counts the connections it served.
pub struct AckServer {
    /// Connections answered so far.
    pub served: Arc<AtomicUsize>,
}

impl AckServer {
    /// Binds and serves in a thread for the life of the process.
    pub fn start() -> Result<AckServer, String> {
        let listener = TcpListener::bind((HOST_IP, TCP_PORT))
            .map_err(|e| format!("binding {HOST_IP}:{TCP_PORT}: {e}"))?;
        let served = Arc::new(AtomicUsize::new(0));
        let count = served.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let count = count.clone();
                std::thread::spawn(move || {
                    let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(30)));
                    let mut w = match stream.try_clone() {
                        Ok(w) => w,
                        Err(_) => return,
                    };
                    let mut line = String::new();
                    if BufReader::new(stream).read_line(&mut line).is_ok() {
                        let _ = writeln!(w, "ack {}", line.trim());
                        count.fetch_add(1, Ordering::SeqCst);
                    }
                });
            }
        });
        Ok(AckServer { served })
    }

    /// Connections answered so far.
    pub fn count(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }
}
