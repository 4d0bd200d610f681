//! A `nats-server -js` on a loopback port with its own store directory,
//! started by a test: killed (and startable again on the same port and
//! store) to play an outage, SIGKILLed when dropped.
//!
//! Debian's `nats-server` package provides the binary (`scripts/test`
//! installs it); [`NatsServer::available`] says whether this machine has it.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::process::command;

/// Where Debian puts the server, and the name looked up in `PATH` otherwise.
const DEBIAN_PATH: &str = "/usr/sbin/nats-server";

/// A JetStream-enabled NATS server owned by a test.
pub struct NatsServer {
    /// Its store and log directory.
    pub dir: tempfile::TempDir,
    /// Its client port on 127.0.0.1.
    pub port: u16,
    child: Option<Child>,
    starts: u32,
    extra: Vec<String>,
}

impl NatsServer {
    /// The server binary, when this machine has one.
    pub fn binary() -> Option<PathBuf> {
        if Path::new(DEBIAN_PATH).exists() {
            return Some(DEBIAN_PATH.into());
        }
        std::env::var_os("PATH").and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("nats-server"))
                .find(|c| c.exists())
        })
    }

    /// Whether a test can start one; prints why not when it cannot.
    pub fn available() -> bool {
        let found = Self::binary().is_some();
        if !found {
            eprintln!(
                "SKIP: no nats-server on this machine (Debian package nats-server; scripts/test installs it)"
            );
        }
        found
    }

    /// Starts a server on a free loopback port and waits until it accepts
    /// connections.
    pub fn start() -> NatsServer {
        Self::start_with(&[])
    }

    /// As [`NatsServer::start`], with more server flags (`--auth TOKEN`).
    pub fn start_with(extra: &[&str]) -> NatsServer {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").expect("binding a free port");
            l.local_addr().expect("local addr").port()
        };
        let mut s = NatsServer {
            dir: tempfile::tempdir().expect("tempdir"),
            port,
            child: None,
            starts: 0,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        s.resume();
        s
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the server again (after [`NatsServer::kill`]) on the same port
    /// and store, so its streams and buckets are as it left them.
    pub fn resume(&mut self) {
        assert!(self.child.is_none(), "nats-server is already running");
        self.starts += 1;
        let bin = Self::binary().expect("nats-server (check NatsServer::available first)");
        let log = std::fs::File::create(self.dir.path().join(format!("nats-{}.log", self.starts)))
            .expect("creating the nats-server log");
        let child = command(bin)
            .args(["-js", "-a", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .arg("-sd")
            .arg(self.dir.path().join("store"))
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawning nats-server");
        self.child = Some(child);
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let start = Instant::now();
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "nats-server did not listen on {addr} within 20 s: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs the server (an outage; [`NatsServer::resume`] ends it).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The log of the server's latest start.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("nats-{}.log", self.starts)))
            .unwrap_or_default()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}
