//! A guest that floods the serial console while nobody reads the vmm's
//! stdout: host memory stays bounded and the VM still pauses and stops.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::*;

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn a_flooding_guest_with_an_unread_console_stays_bounded_and_controllable() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    let g = guest("flood");
    // stdout is a pipe this test never reads: it fills after 64 KiB.
    let child = vmm()
        .args(["run", "--kernel", g.to_str().unwrap(), "--mem-mib", "64"])
        .args(["--control-socket", sock.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ctl = Control::connect(&sock);
    std::thread::sleep(Duration::from_millis(500));
    let early = rss_kib(child.id());
    std::thread::sleep(Duration::from_secs(2));
    let late = rss_kib(child.id());
    assert!(
        late < early + 8 * 1024,
        "vmm resident memory grew from {early} KiB to {late} KiB while the guest flooded"
    );
    // The vCPU is not stuck in a blocking write: it parks and resumes.
    assert_eq!(ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    assert_eq!(ctl.send_raw(r#"{"op":"resume"}"#)["ok"], true);
    assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["ok"], true);
    let out = wait_with_deadline(child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}
