//! The vmm integration tests' own helpers: running the vmm binary Cargo
//! built for them, and talking raw lines to its control socket. Locating
//! test guests, deadlines, waiting for sockets and the jail check come from
//! the shared harness (`tests/harness`) and are re-exported here.

// Each test file uses a part of this module.
#![allow(dead_code, unused_imports)]

pub mod counter;
pub mod tap;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

pub use test_harness::guests::path as guest;
pub use test_harness::host::jail_supported;
pub use test_harness::process::{stderr, stdout, wait_for_path, wait_with_deadline};

/// The vmm binary under test: Cargo's own build of it for these tests, or
/// the one `AGENTVM_TEST_VMM` names (`scripts/test-release-vmm` runs the
/// tests against the node's release build, linked with another libc). It is
/// killed when the test thread that started it ends, so a failing assertion
/// never leaves a VM running.
pub fn vmm() -> Command {
    match std::env::var_os("AGENTVM_TEST_VMM") {
        Some(path) => test_harness::process::command(path),
        None => test_harness::process::command(env!("CARGO_BIN_EXE_vmm")),
    }
}

/// Starts the vmm with `args`, capturing its stdout and stderr.
pub fn spawn_vmm(args: &[&str]) -> Child {
    vmm()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn vmm")
}

/// Runs the vmm with `args` and returns its output (20 s deadline).
pub fn run_vmm(args: &[&str]) -> Output {
    wait_with_deadline(spawn_vmm(args), Duration::from_secs(20))
}

/// A connected control-socket client.
pub struct Control {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Control {
    /// Connects to the control socket at `path`, waiting for it to appear.
    pub fn connect(path: &Path) -> Control {
        wait_for_path(path, Duration::from_secs(10));
        let stream = UnixStream::connect(path).expect("connect control socket");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        Control {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
        }
    }

    /// Sends one raw line and returns the parsed response.
    pub fn send_raw(&mut self, line: &str) -> serde_json::Value {
        self.writer.write_all(line.as_bytes()).expect("write");
        self.writer.write_all(b"\n").expect("write");
        let mut resp = String::new();
        self.reader.read_line(&mut resp).expect("read response");
        serde_json::from_str(&resp).unwrap_or_else(|e| panic!("bad response {resp:?}: {e}"))
    }
}

/// Reads `key=value` lines from guest output into pairs (repeated keys kept in order).
pub fn kv_lines(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The value of the first `key=` line.
pub fn kv<'a>(pairs: &'a [(String, String)], key: &str) -> &'a str {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("guest did not report {key}"))
}

/// Waits (up to 20 s) until process `pid`'s main thread is in seccomp filter
/// mode and returns its /proc status. The vmm's main thread installs its
/// filter just after the control socket appears, so a client can get an
/// answer before that.
pub fn wait_main_thread_filtered(pid: &str) -> String {
    let start = std::time::Instant::now();
    loop {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        if status.contains("Seccomp:\t2") {
            return status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the main thread of {pid} is not filtered after 20 s: {status}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
