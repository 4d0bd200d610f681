//! The serial console's receive FIFO under real KVM: input the host sent
//! before the guest reset its FIFO (through FCR) is gone, in the FIFO and
//! held back by the vmm alike; input sent after it arrives whole.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

use common::*;

/// Waits for the next guest line starting with `prefix` and returns it; every
/// line read is kept in `seen`.
fn wait_line(lines: &mpsc::Receiver<String>, prefix: &str, seen: &mut Vec<String>) -> String {
    loop {
        match lines.recv_timeout(Duration::from_secs(20)) {
            Ok(line) => {
                seen.push(line.clone());
                if line.starts_with(prefix) {
                    return line;
                }
            }
            Err(e) => panic!("no {prefix:?} line from the guest ({e}); saw {seen:?}"),
        }
    }
}

#[test]
fn input_before_the_guests_fifo_reset_is_dropped_and_input_after_it_arrives_whole() {
    let g = guest("serial_fifo");
    let mut child = vmm()
        .args(["run", "--kernel", g.to_str().unwrap()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn vmm");
    let mut stdin = child.stdin.take().expect("stdin");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut seen = Vec::new();
    wait_line(&lines, "fifo: waiting", &mut seen);
    // One write below PIPE_BUF arrives in one read: 64 bytes fill the guest's
    // FIFO and the vmm holds the rest back until there is room.
    stdin.write_all(&[b'x'; 200]).unwrap();
    stdin.flush().unwrap();
    let after = wait_line(&lines, "fifo: data_ready_after_reset=", &mut seen);
    assert_eq!(after, "fifo: data_ready_after_reset=0", "{seen:?}");
    wait_line(&lines, "fifo: reset done", &mut seen);
    stdin.write_all(b"fresh-line\n").unwrap();
    stdin.flush().unwrap();
    let got = wait_line(&lines, "fifo: got=", &mut seen);
    assert_eq!(got, "fifo: got=fresh-line", "{seen:?}");
    drop(stdin);
    let out = wait_with_deadline(child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
}
