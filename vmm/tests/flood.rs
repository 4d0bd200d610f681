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

#[test]
fn a_flooding_guest_cannot_grow_its_serial_file_past_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    let log = dir.path().join("serial.log");
    let previous = dir.path().join("serial.log.1");
    let bound = 64 * 1024;
    let g = guest("flood");
    let serial = format!("file:{}", log.display());
    let child = vmm()
        .args(["--log-max-bytes", "64K"])
        .args(["run", "--kernel", g.to_str().unwrap(), "--mem-mib", "64"])
        .args(["--serial", &serial])
        .args(["--control-socket", sock.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ctl = Control::connect(&sock);
    // Wait for three rotations (the current file is replaced each time),
    // checking both files against the bound at every look.
    let size = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let inode = |p: &std::path::Path| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(p).map(|m| m.ino()).ok()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let (now, old) = (size(&log), size(&previous));
        assert!(
            now <= bound,
            "serial.log holds {now} bytes, over the {bound}-byte bound"
        );
        assert!(
            old <= bound,
            "serial.log.1 holds {old} bytes, over the {bound}-byte bound"
        );
        if let Some(ino) = inode(&previous) {
            if seen.last() != Some(&ino) {
                seen.push(ino);
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the serial file was rotated {} times in 30 s (serial.log {now} bytes)",
            seen.len()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["ok"], true);
    let out = wait_with_deadline(child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(size(&log) <= bound && size(&previous) == bound);
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("serial"))
        .collect();
    assert_eq!(names.len(), 2, "one previous file is kept: {names:?}");
}
