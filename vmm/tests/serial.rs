//! The serial console under real KVM. Its receive FIFO: input the host sent
//! before the guest reset its FIFO (through FCR) is gone, in the FIFO and
//! held back by the vmm alike; input sent after it arrives whole. Its
//! transmit: through KVM's coalesced ring while the UART's THR side effects
//! are off, exiting for each byte (so interrupts come at once) after.

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

/// The serial device's log: its JSON lines (`--log-format json`).
const SERIAL_LOG: &[&str] = &[
    "--log-format",
    "json",
    "--log-level",
    "warn,vmm::devices::legacy::serial=debug",
];

/// The vmm's end-of-run transmit summary in `stderr`: bytes that went
/// through KVM's coalesced ring, and whether the data port was still in it;
/// `None` where KVM has no coalesced port I/O (said in the debug log).
fn transmit_summary(stderr: &str) -> Option<(u64, bool)> {
    let events: Vec<serde_json::Value> = stderr
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if events.iter().any(|e| {
        e["fields"]["message"]
            == "KVM has no coalesced port I/O: serial transmit exits for each byte"
    }) {
        return None;
    }
    let summary = events
        .iter()
        .find(|e| e["fields"]["message"] == "serial transmit summary")
        .unwrap_or_else(|| panic!("no transmit summary in {stderr}"));
    Some((
        summary["fields"]["coalesced_bytes"].as_u64().unwrap(),
        summary["fields"]["coalescing"].as_bool().unwrap(),
    ))
}

/// Boots test guest `name` with the serial device's log on and checks
/// that the VM ended cleanly.
fn run_logged(name: &str) -> std::process::Output {
    let g = guest(name);
    let mut args = SERIAL_LOG.to_vec();
    args.extend(["run", "--kernel", g.to_str().unwrap()]);
    let out = run_vmm(&args);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    out
}

#[test]
fn console_output_with_the_uarts_interrupts_off_goes_through_kvms_coalesced_ring() {
    let out = run_logged("hello");
    assert_eq!(stdout(&out), "Hello from the hello test guest!\n");
    match transmit_summary(&stderr(&out)) {
        // Every byte of the line, and the port stays in the ring.
        Some(summary) => assert_eq!(summary, (33, true), "{}", stderr(&out)),
        None => eprintln!("skipped the ring check: KVM here has no KVM_CAP_COALESCED_PIO"),
    }
}

#[test]
fn the_thr_empty_interrupt_arrives_without_waiting_for_another_exit() {
    let out = run_logged("serial_irq");
    let text = stdout(&out);
    assert!(text.starts_with("serial_irq: polled line\n"), "{text}");
    // One interrupt when the guest enabled it (THR is empty), one for its
    // write; a write held in the ring would have raised none before the
    // guest gave up waiting.
    assert!(
        text.contains("serial_irq: on_enable=1 after_write=2\n"),
        "{text}"
    );
    match transmit_summary(&stderr(&out)) {
        // The first line went through the ring; from the interrupt's
        // enabling on every write exited, even after the guest cleared IER.
        Some(summary) => assert_eq!(
            summary,
            ("serial_irq: polled line\n".len() as u64, false),
            "{}",
            stderr(&out)
        ),
        None => eprintln!("skipped the ring check: KVM here has no KVM_CAP_COALESCED_PIO"),
    }
}
