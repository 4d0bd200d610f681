//! Drives a running VM through its control socket: status, pause (the guest
//! stops counting), resume (it counts again), bad requests, stop.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

fn last_count(log: &Path) -> u64 {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    // Only whole lines: the last one may still be being written.
    text.split_inclusive('\n')
        .rev()
        .filter_map(|l| l.strip_suffix('\n'))
        .filter_map(|l| l.strip_prefix("count="))
        .find_map(|n| n.parse().ok())
        .unwrap_or(0)
}

fn wait_for_count_above(log: &Path, floor: u64) -> u64 {
    let start = Instant::now();
    loop {
        let c = last_count(log);
        if c > floor {
            return c;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "guest stopped counting at {c}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn status_pause_resume_stop() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    let log = dir.path().join("serial.log");
    let g = guest("counter");
    let child = vmm()
        .args([
            "run",
            "--kernel",
            g.to_str().unwrap(),
            "--vcpus",
            "2",
            "--cmdline",
            "interval=20000",
            "--serial",
            &format!("file:{}", log.display()),
            "--control-socket",
            sock.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ctl = Control::connect(&sock);

    assert_eq!(
        ctl.send_raw(r#"{"op":"status"}"#),
        json!({"ok": true, "state": "running", "vcpus": 2})
    );
    let before = wait_for_count_above(&log, 0);

    assert_eq!(
        ctl.send_raw(r#"{"op":"pause"}"#),
        json!({"ok": true, "state": "paused", "vcpus": 2})
    );
    let paused_at = last_count(&log);
    assert!(paused_at >= before);
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(last_count(&log), paused_at, "guest ran while paused");
    assert_eq!(ctl.send_raw(r#"{"op":"status"}"#)["state"], "paused");
    let again = ctl.send_raw(r#"{"op":"pause"}"#);
    assert_eq!(again["ok"], false);
    assert_eq!(again["error"], "cannot pause: the VM is already paused");

    assert_eq!(ctl.send_raw(r#"{"op":"resume"}"#)["state"], "running");
    wait_for_count_above(&log, paused_at);

    // Bad requests are answered and the connection stays usable.
    let not_json = ctl.send_raw("pause please");
    assert_eq!(not_json["ok"], false);
    assert!(not_json["error"]
        .as_str()
        .unwrap()
        .starts_with("request is not valid JSON"));
    let unknown = ctl.send_raw(r#"{"op":"reboot"}"#);
    assert_eq!(
        unknown,
        json!({"ok": false, "error": "unknown op \"reboot\"; known ops: status, pause, resume, stop, snapshot, memory_checksum, restore"})
    );
    let no_op = ctl.send_raw(r#"{"state":"paused"}"#);
    assert_eq!(no_op["error"], "request has no \"op\" field");

    // A second client works alongside the first.
    let mut other = Control::connect(&sock);
    assert_eq!(other.send_raw(r#"{"op":"status"}"#)["vcpus"], 2);

    assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["state"], "stopping");
    let out = wait_with_deadline(child, Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    assert!(!sock.exists(), "control socket left behind");
}

#[test]
fn a_paused_vm_can_be_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    let g = guest("counter");
    let child = vmm()
        .args([
            "run",
            "--kernel",
            g.to_str().unwrap(),
            "--serial",
            "none",
            "--control-socket",
            sock.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ctl = Control::connect(&sock);
    assert_eq!(ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["ok"], true);
    let out = wait_with_deadline(child, Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
}

#[test]
fn a_socket_path_in_use_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let g = guest("counter");
    let out = run_vmm(&[
        "run",
        "--kernel",
        g.to_str().unwrap(),
        "--serial",
        "none",
        "--control-socket",
        sock.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("is in use by another process"),
        "{}",
        stderr(&out)
    );
}
