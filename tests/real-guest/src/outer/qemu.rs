//! The outer VM (L1): QEMU in software emulation (TCG) with an emulated AMD
//! CPU that has SVM and nested paging, so Debian's kernel in it gets a
//! `/dev/kvm` that behaves like hardware.
//!
//! Its output comes on two channels, read line by line, so that nothing a
//! scenario relays (an inner guest's console, a vmm's stderr) is ever taken
//! for the outer kernel's own words: the first serial port (`ttyS0`, QEMU's
//! stdout) carries the outer kernel's console and L1's init (heartbeats,
//! `L1: ready`, `L1-DONE`); the second (`ttyS1`, written to a file the
//! harness follows) carries the scenario runner and everything it starts.
//! QEMU's human monitor listens on a socket, so the harness can record the
//! outer VM's CPU state when it gives up on it.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// How the outer VM is started.
#[derive(Debug, Clone)]
pub struct L1Options {
    /// QEMU binary.
    pub qemu: PathBuf,
    /// vCPUs.
    pub smp: u32,
    /// Memory, MiB.
    pub mem_mib: u32,
    /// TCG thread mode: `multi` (a host thread per vCPU) or `single`.
    pub tcg_thread: String,
    /// CPU model (`max`, or e.g. `EPYC` with SVM).
    pub cpu: String,
}

/// Which channel a line of the outer VM's output came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The outer kernel's console and L1's init (`ttyS0`).
    Kernel,
    /// The scenario runner and its children (`ttyS1`).
    Runner,
    /// QEMU's own stderr.
    Qemu,
}

/// One line of the outer VM's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsoleLine {
    /// Where it came from.
    pub source: Source,
    /// The line, without its line ending.
    pub text: String,
}

impl ConsoleLine {
    /// A line from `source`.
    pub fn new(source: Source, text: impl Into<String>) -> ConsoleLine {
        ConsoleLine {
            source,
            text: text.into(),
        }
    }
}

/// Where one outer VM writes what the harness keeps of it.
pub struct L1Files<'a> {
    /// The outer kernel's console (a copy of `ttyS0`).
    pub console_log: &'a Path,
    /// The runner's output (`ttyS1`), written by QEMU and followed.
    pub runner_log: &'a Path,
    /// QEMU's human-monitor socket (a short path: `sun_path` holds 108 bytes).
    pub monitor: &'a Path,
}

/// A running outer VM.
pub struct L1 {
    child: Child,
    /// Output lines of every channel, as they arrive; closed once QEMU has
    /// exited and everything it wrote has been read.
    pub lines: mpsc::Receiver<ConsoleLine>,
    monitor: PathBuf,
}

impl L1 {
    /// Starts QEMU with `kernel`, `initrd`, the host's / shared read-only
    /// and `work` shared read-write; L1's init runs `script` (a path under
    /// `work`) with its output on the second serial port. L1 puts its own
    /// memory-backed /tmp, /run and /var/tmp over the host's; the host
    /// directories in `keep` (the checkout, the cache) stay visible wherever
    /// they are. `files` says where its output and monitor go.
    pub fn start(
        opts: &L1Options,
        kernel: &Path,
        initrd: &Path,
        work: &Path,
        keep: &[PathBuf],
        script: &Path,
        files: &L1Files<'_>,
    ) -> std::io::Result<L1> {
        let paths = [work, script, files.runner_log, files.monitor];
        for p in keep.iter().map(|p| p.as_path()).chain(paths) {
            if p.to_str()
                .is_none_or(|s| s.contains(char::is_whitespace) || s.contains(','))
            {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "{}: the outer VM gets host paths on its kernel command line, \
                         so they must be UTF-8 without spaces or commas",
                        p.display()
                    ),
                ));
            }
        }
        let keep: Vec<String> = keep.iter().map(|p| p.display().to_string()).collect();
        let append = format!(
            "console=ttyS0 loglevel=4 mitigations=off l1.work={} l1.keep={} l1.cmd={}",
            work.display(),
            keep.join(","),
            script.display()
        );
        let mut cmd = Command::new(&opts.qemu);
        cmd.args([
            "-accel",
            &format!("tcg,thread={},tb-size=512", opts.tcg_thread),
            "-cpu",
            &opts.cpu,
            "-smp",
            &opts.smp.to_string(),
            "-m",
            &opts.mem_mib.to_string(),
            "-M",
            "q35",
            "-nographic",
            "-no-reboot",
            "-monitor",
            &format!("unix:{},server=on,wait=off", files.monitor.display()),
            "-serial",
            "stdio",
            "-serial",
            &format!("file:{}", files.runner_log.display()),
            "-kernel",
        ])
        .arg(kernel)
        .arg("-initrd")
        .arg(initrd)
        .arg("-append")
        .arg(append)
        .arg("-virtfs")
        .arg("local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap")
        .arg("-virtfs")
        .arg(format!(
            "local,path={},mount_tag=work,security_model=none",
            work.display()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        // SAFETY: prctl(PR_SET_PDEATHSIG) in the forked child only sets a
        // process attribute; it allocates nothing and touches no locks.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let _ = std::fs::remove_file(files.monitor);
        // QEMU truncates it; made first so that following it can start at once.
        std::fs::File::create(files.runner_log)?;
        let mut child = cmd.spawn()?;
        let (tx, rx) = mpsc::channel();
        let mut file = std::fs::File::create(files.console_log)?;
        let exited = Arc::new(AtomicBool::new(false));
        let runner_log = files.runner_log.to_path_buf();
        let (tx3, gone) = (tx.clone(), exited.clone());
        std::thread::spawn(move || follow(&runner_log, &gone, &tx3));
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let tx2 = tx.clone();
        if let Some(err) = stderr {
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    if tx2.send(ConsoleLine::new(Source::Qemu, line)).is_err() {
                        break;
                    }
                }
            });
        }
        if let Some(out) = stdout {
            std::thread::spawn(move || {
                let mut reader = BufReader::new(out);
                let mut buf = Vec::new();
                loop {
                    buf.clear();
                    match reader.read_until(b'\n', &mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {
                            let _ = file.write_all(&buf);
                            let line = String::from_utf8_lossy(&buf)
                                .trim_end_matches(['\r', '\n'])
                                .to_string();
                            if tx.send(ConsoleLine::new(Source::Kernel, line)).is_err() {
                                break;
                            }
                        }
                    }
                }
                let _ = file.flush();
                // QEMU's stdout ends when it exits: the runner's file is
                // complete, and its follower may stop at its end.
                exited.store(true, Ordering::SeqCst);
            });
        }
        Ok(L1 {
            child,
            lines: rx,
            monitor: files.monitor.to_path_buf(),
        })
    }

    /// Runs `command` on QEMU's human monitor and returns what it printed,
    /// within `timeout`.
    pub fn monitor(&self, command: &str, timeout: Duration) -> std::io::Result<String> {
        query_monitor(&self.monitor, command, timeout)
    }
}

/// Runs `command` on the QEMU human monitor listening at `socket` and
/// returns what it printed, within `timeout`.
pub fn query_monitor(socket: &Path, command: &str, timeout: Duration) -> std::io::Result<String> {
    {
        let mut s = UnixStream::connect(socket)?;
        s.set_read_timeout(Some(Duration::from_millis(200)))?;
        let deadline = Instant::now() + timeout;
        let mut got = Vec::new();
        // The banner ends with the first prompt.
        read_to_prompt(&mut s, &mut got, deadline)?;
        got.clear();
        s.write_all(format!("{command}\n").as_bytes())?;
        read_to_prompt(&mut s, &mut got, deadline)?;
        Ok(monitor_text(&got, command))
    }
}

impl L1 {
    /// QEMU's exit status, once it has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Kills QEMU and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The monitor's prompt.
const PROMPT: &[u8] = b"(qemu) ";

/// Reads from the monitor into `got` until it ends with the prompt.
fn read_to_prompt(s: &mut UnixStream, got: &mut Vec<u8>, deadline: Instant) -> std::io::Result<()> {
    let mut buf = [0u8; 4096];
    while !got.ends_with(PROMPT) {
        if Instant::now() > deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "QEMU's monitor did not answer in time",
            ));
        }
        match s.read(&mut buf) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "QEMU's monitor closed",
                ))
            }
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The monitor's answer to `command` as text: its terminal escapes, the
/// echoed command and the closing prompt taken out.
fn monitor_text(raw: &[u8], command: &str) -> String {
    let text = String::from_utf8_lossy(raw);
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // CSI: ESC [ parameters final-letter.
            if chars.peek() == Some(&'[') {
                chars.next();
                for n in chars.by_ref() {
                    if n.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        if c != '\r' {
            out.push(c);
        }
    }
    let out = out.strip_suffix("(qemu) ").unwrap_or(&out);
    out.lines()
        .filter(|l| l.trim() != command)
        .collect::<Vec<_>>()
        .join("\n")
}

/// Follows the runner's output file, sending each complete line; ends once
/// `exited` is set and the file is read to its end.
fn follow(path: &Path, exited: &AtomicBool, tx: &mpsc::Sender<ConsoleLine>) {
    let Ok(mut file) = std::fs::File::open(path) else {
        return;
    };
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        // Read the flag before the file: what QEMU wrote before it exited
        // is then in this round's reads.
        let done = exited.load(Ordering::SeqCst);
        loop {
            match file.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => pending.extend_from_slice(&buf[..n]),
            }
        }
        while let Some(at) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=at).collect();
            let text = String::from_utf8_lossy(&line)
                .trim_end_matches(['\r', '\n'])
                .to_string();
            if tx.send(ConsoleLine::new(Source::Runner, text)).is_err() {
                return;
            }
        }
        if done {
            if !pending.is_empty() {
                let text = String::from_utf8_lossy(&pending).trim_end().to_string();
                let _ = tx.send(ConsoleLine::new(Source::Runner, text));
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Drop for L1 {
    fn drop(&mut self) {
        if self.exited().is_none() {
            self.kill();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_monitor_s_answer_loses_its_echo_escapes_and_prompt() {
        let raw =
            b"info registers -a\r\n\x1b[K\x1b[DCPU#0\r\nRAX=0000000000000001 RBX=0\r\n(qemu) ";
        assert_eq!(
            monitor_text(raw, "info registers -a"),
            "CPU#0\nRAX=0000000000000001 RBX=0"
        );
    }

    #[test]
    fn a_real_qemu_s_monitor_gives_its_vcpus_registers() {
        let Some(qemu) = crate::which("qemu-system-x86_64") else {
            println!(
                "skipped: no qemu-system-x86_64 on this host (tests/real-guest/run installs it)"
            );
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("m.sock");
        // Stopped before its first instruction (-S): two vCPUs, no devices.
        let mut child = Command::new(qemu)
            .args([
                "-M",
                "q35",
                "-smp",
                "2",
                "-S",
                "-nodefaults",
                "-display",
                "none",
            ])
            .arg("-monitor")
            .arg(format!("unix:{},server=on,wait=off", sock.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let answer = loop {
            match query_monitor(&sock, "info registers -a", Duration::from_secs(10)) {
                Ok(a) => break a,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("{e}"),
            }
        };
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            answer.contains("CPU#0") && answer.contains("CPU#1"),
            "{answer}"
        );
        assert!(
            answer.contains("EIP=") || answer.contains("RIP="),
            "{answer}"
        );
        assert!(!answer.contains("(qemu)"), "{answer}");
    }

    #[test]
    fn the_runner_s_file_is_followed_to_its_end_once_qemu_exited() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("runner.log");
        std::fs::write(&path, "RGH START a\r\nhalf").unwrap();
        let exited = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let (p, gone) = (path.clone(), exited.clone());
        let t = std::thread::spawn(move || follow(&p, &gone, &tx));
        let first = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(first, ConsoleLine::new(Source::Runner, "RGH START a"));
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b" a line\nlast, unended").unwrap();
        exited.store(true, Ordering::SeqCst);
        t.join().unwrap();
        let rest: Vec<String> = rx.iter().map(|l| l.text).collect();
        assert_eq!(rest, vec!["half a line", "last, unended"]);
    }
}
