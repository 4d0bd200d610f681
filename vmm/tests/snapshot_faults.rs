//! Faults while snapshotting: the vmm killed mid-write, and a full disk.
//! The previous snapshot stays valid and no half-written snapshot looks valid.

mod common;

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use common::*;
use serde_json::json;

fn boot_counter(dir: &Path, mem_mib: &str) -> (Child, PathBuf) {
    let sock = dir.join("vm.sock");
    let g = guest("counter");
    let child = spawn_vmm(&[
        "run",
        "--kernel",
        g.to_str().unwrap(),
        "--mem-mib",
        mem_mib,
        "--serial",
        "none",
        "--control-socket",
        sock.to_str().unwrap(),
    ]);
    (child, sock)
}

fn restores(snap: &Path) -> bool {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("r.sock");
    let child = spawn_vmm(&[
        "restore",
        "--snapshot",
        snap.to_str().unwrap(),
        "--serial",
        "none",
        "--paused",
        "--control-socket",
        sock.to_str().unwrap(),
    ]);
    // A refused snapshot makes the vmm exit at once; a good one serves the socket.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut child = child;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert_eq!(
                status.code(),
                Some(2),
                "restore of {} failed oddly",
                snap.display()
            );
            return false;
        }
        if sock.exists() {
            let mut ctl = Control::connect(&sock);
            assert_eq!(ctl.send_raw(r#"{"op":"status"}"#)["state"], "paused");
            assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["ok"], true);
            let out = wait_with_deadline(child, Duration::from_secs(20));
            assert_eq!(out.status.code(), Some(0));
            return true;
        }
        assert!(std::time::Instant::now() < deadline, "restore hung");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn temp_dirs(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect()
}

#[test]
fn vmm_killed_mid_snapshot_leaves_the_previous_one_valid() {
    let t = tempfile::tempdir().unwrap();
    let (child, sock) = boot_counter(t.path(), "1024");
    let mut ctl = Control::connect(&sock);
    assert_eq!(ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    let first = t.path().join("first");
    let resp = ctl.send_raw(&json!({"op": "snapshot", "dir": first}).to_string());
    assert_eq!(resp["ok"], true, "{resp}");

    // Start a second full snapshot and kill the vmm while it writes.
    let second = t.path().join("second");
    let mut writer = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    use std::io::Write;
    writeln!(writer, "{}", json!({"op": "snapshot", "dir": second})).unwrap();
    std::thread::sleep(Duration::from_millis(40));
    let mut child = child;
    child.kill().unwrap();
    child.wait().unwrap();

    assert!(restores(&first), "the previous snapshot must still restore");
    // The interrupted one is either absent or, if the write won the race, complete.
    if second.exists() {
        assert!(
            restores(&second),
            "a snapshot at its final path must be complete"
        );
    }
    for tmp in temp_dirs(t.path()) {
        assert!(!restores(&tmp), "half-written {} restored", tmp.display());
    }
}

#[test]
fn a_full_disk_surfaces_as_an_error_and_leaves_nothing_behind() {
    let t = tempfile::tempdir().unwrap();
    let small = t.path().join("small");
    std::fs::create_dir(&small).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=16k", "tmpfs"])
        .arg(&small)
        .status();
    if !matches!(mounted, Ok(s) if s.success()) {
        println!("skipped: cannot mount a small tmpfs here (needs root) to simulate a full disk");
        return;
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(small.clone());

    let (child, sock) = boot_counter(t.path(), "64");
    let mut ctl = Control::connect(&sock);
    assert_eq!(ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    let target = small.join("snap");
    let resp = ctl.send_raw(&json!({"op": "snapshot", "dir": target}).to_string());
    assert_eq!(resp["ok"], false, "{resp}");
    let err = resp["error"].as_str().unwrap();
    assert!(err.contains("No space left on device"), "{err}");
    assert!(!target.exists());
    assert!(
        temp_dirs(&small).is_empty(),
        "temporary directory left on the full disk"
    );

    // The VM is unharmed: it resumes, and a snapshot elsewhere works.
    let elsewhere = t.path().join("ok");
    let resp = ctl.send_raw(&json!({"op": "snapshot", "dir": elsewhere}).to_string());
    assert_eq!(resp["ok"], true, "{resp}");
    assert_eq!(ctl.send_raw(r#"{"op":"resume"}"#)["ok"], true);
    assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["ok"], true);
    let out = wait_with_deadline(child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(0));
    assert!(restores(&elsewhere));
}
