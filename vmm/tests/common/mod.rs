//! Helpers shared by the vmm integration tests: running the vmm binary with
//! a deadline, talking to its control socket, and locating test guests.

#![allow(dead_code)]

pub mod counter;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The vmm binary under test. It is killed when the test thread that started it
/// ends, so a failing assertion never leaves a VM running.
pub fn vmm() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vmm"));
    cmd.stdin(Stdio::null());
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets a flag on the child between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// Path of a test guest.
pub fn guest(name: &str) -> PathBuf {
    test_guests::path(name).expect("known test guest")
}

/// Waits for `child` to exit within `limit`, killing it and panicking otherwise.
pub fn wait_with_deadline(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            return child.wait_with_output().expect("collect output");
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect output");
            panic!(
                "vmm did not exit within {limit:?}\nstdout: {}\nstderr: {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
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

/// Stdout as text.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Stderr as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Waits until `path` exists (a socket the vmm creates).
pub fn wait_for_path(path: &Path, limit: Duration) {
    let start = Instant::now();
    while !path.exists() {
        assert!(start.elapsed() < limit, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(5));
    }
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
