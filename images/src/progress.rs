//! Runs the external programs of a recipe and shows progress on stderr.
//!
//! Every line a program prints is counted; in [`Echo::Lines`] mode it is also
//! shown, prefixed with the step and the elapsed time. When a program is quiet
//! for a while (unpacking, compressing) a heartbeat line says it is still
//! running. The last lines are kept for the error if the program fails, and a
//! failure that mentions "No space left on device" becomes
//! [`Error::DiskFull`].

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Lines kept for an error report.
const TAIL_LINES: usize = 25;
/// Quiet time after which a heartbeat is printed.
const HEARTBEAT: Duration = Duration::from_secs(15);

/// How much of a program's output to show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Echo {
    /// Every line.
    Lines,
    /// One line per `n` lines, plus heartbeats (e.g. a kernel build).
    Every(u64),
    /// Nothing but heartbeats.
    Quiet,
}

/// Prints a progress message for `step`.
pub fn note(step: &str, message: &str) {
    eprintln!("[images {step}] {message}");
}

/// Runs `cmd` to completion, showing progress; returns its stdout.
///
/// `disk_path` names the file system the step writes to, for the
/// full-disk error.
pub fn run(step: &str, cmd: &mut Command, echo: Echo, disk_path: &Path) -> Result<String> {
    let command = describe(cmd);
    let program = cmd.get_program().to_string_lossy().into_owned();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                Error::MissingTools {
                    step: step.to_string(),
                    missing: vec![crate::tools::missing_program(&program)],
                }
            } else {
                Error::Spawn {
                    step: step.to_string(),
                    program: program.clone(),
                    source,
                }
            }
        })?;
    let (tx, rx) = mpsc::channel::<(bool, String)>();
    let mut readers = Vec::new();
    if let Some(out) = child.stdout.take() {
        readers.push(spawn_reader(out, true, tx.clone()));
    }
    if let Some(err) = child.stderr.take() {
        readers.push(spawn_reader(err, false, tx.clone()));
    }
    drop(tx);

    let start = Instant::now();
    let mut stdout = String::new();
    let mut tail: VecDeque<String> = VecDeque::with_capacity(TAIL_LINES);
    let mut lines = 0u64;
    let mut last_print = Instant::now();
    loop {
        match rx.recv_timeout(HEARTBEAT) {
            Ok((is_stdout, line)) => {
                lines += 1;
                let show = match echo {
                    Echo::Lines => true,
                    Echo::Every(n) => n > 0 && lines % n == 0,
                    Echo::Quiet => false,
                };
                if show {
                    eprintln!("[images {step} {:>4}s] {line}", start.elapsed().as_secs());
                    last_print = Instant::now();
                } else if last_print.elapsed() >= HEARTBEAT {
                    heartbeat(step, start, lines);
                    last_print = Instant::now();
                }
                if is_stdout {
                    stdout.push_str(&line);
                    stdout.push('\n');
                }
                if tail.len() == TAIL_LINES {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                heartbeat(step, start, lines);
                last_print = Instant::now();
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    for r in readers {
        // A reader thread only ends by EOF or a read error; nothing to report.
        let _ = r.join();
    }
    let status = child.wait().map_err(|source| Error::Spawn {
        step: step.to_string(),
        program,
        source,
    })?;
    if status.success() {
        return Ok(stdout);
    }
    let tail: Vec<String> = tail.into_iter().collect();
    if tail
        .iter()
        .any(|l| l.contains("No space left on device") || l.contains("Could not allocate block"))
    {
        return Err(Error::DiskFull {
            path: disk_path.to_path_buf(),
            step: step.to_string(),
        });
    }
    Err(Error::CommandFailed {
        step: step.to_string(),
        command,
        status: status.to_string(),
        tail: tail.join("\n"),
    })
}

fn heartbeat(step: &str, start: Instant, lines: u64) {
    eprintln!(
        "[images {step} {:>4}s] still running ({lines} lines of output so far)",
        start.elapsed().as_secs()
    );
}

fn spawn_reader<R: Read + Send + 'static>(
    r: R,
    is_stdout: bool,
    tx: mpsc::Sender<(bool, String)>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(r);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match r.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let line = String::from_utf8_lossy(&buf)
                        .trim_end_matches(['\n', '\r'])
                        .to_string();
                    if tx.send((is_stdout, line)).is_err() {
                        break;
                    }
                }
            }
        }
    })
}

/// The command line as a shell would show it.
pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_stdout_and_reports_failures_with_their_output() {
        let out = run(
            "test",
            Command::new("sh").args(["-c", "echo one; echo two >&2; echo three"]),
            Echo::Quiet,
            Path::new("/tmp"),
        )
        .unwrap();
        assert_eq!(out, "one\nthree\n");
        let e = run(
            "test",
            Command::new("sh").args(["-c", "echo boom >&2; exit 3"]),
            Echo::Lines,
            Path::new("/tmp"),
        )
        .unwrap_err();
        let s = e.to_string();
        assert!(s.contains("exit status: 3") && s.contains("boom"), "{s}");
    }

    #[test]
    fn a_full_disk_is_named_as_such() {
        let e = run(
            "test",
            Command::new("sh").args(["-c", "echo 'write: No space left on device' >&2; exit 1"]),
            Echo::Quiet,
            Path::new("/tmp"),
        )
        .unwrap_err();
        assert!(matches!(e, Error::DiskFull { .. }), "{e}");
    }

    #[test]
    fn a_missing_program_names_its_package() {
        let e = run(
            "test",
            &mut Command::new("definitely-not-a-program-xyz"),
            Echo::Quiet,
            Path::new("/tmp"),
        )
        .unwrap_err();
        assert!(matches!(e, Error::MissingTools { .. }), "{e}");
    }
}
