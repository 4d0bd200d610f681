//! Seccomp: every vmm thread runs filtered, a forbidden call from any thread
//! kind ends the VM with a clear message, and --no-seccomp says it is off.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::*;

#[test]
fn every_thread_of_a_running_vm_is_filtered() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    let g = guest("counter");
    let child = vmm()
        .args([
            "run",
            "--kernel",
            g.to_str().unwrap(),
            "--vcpus",
            "2",
            "--serial",
            "none",
        ])
        .args(["--control-socket", sock.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ctl = Control::connect(&sock);
    assert_eq!(ctl.send_raw(r#"{"op":"status"}"#)["ok"], true);
    // The main thread installs its filter just after the control socket starts.
    let main_status = format!("/proc/{}/status", child.id());
    let start = std::time::Instant::now();
    while !std::fs::read_to_string(&main_status)
        .unwrap()
        .contains("Seccomp:\t2")
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "main thread never filtered"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut seen = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{}/task", child.id())).unwrap() {
        let task = task.unwrap().path();
        let name = std::fs::read_to_string(task.join("comm"))
            .unwrap()
            .trim()
            .to_string();
        let status = std::fs::read_to_string(task.join("status")).unwrap();
        let mode = status
            .lines()
            .find_map(|l| l.strip_prefix("Seccomp:"))
            .unwrap()
            .trim()
            .to_string();
        assert_eq!(mode, "2", "thread {name} is not in seccomp filter mode");
        seen.push(name);
    }
    for expected in ["vcpu0", "vcpu1", "control", "control-client", "signals"] {
        assert!(
            seen.iter().any(|n| n == expected),
            "no {expected} thread in {seen:?}"
        );
    }
    assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["ok"], true);
    let out = wait_with_deadline(child, Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn a_forbidden_call_from_any_thread_kind_is_fatal() {
    let g = guest("counter");
    for (kind, name) in [
        ("vcpu", "vCPU"),
        ("main", "main"),
        ("control", "control"),
        ("device", "device"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("vm.sock");
        let child = vmm()
            .args([
                "--seccomp-selftest",
                kind,
                "run",
                "--kernel",
                g.to_str().unwrap(),
            ])
            .args([
                "--serial",
                "none",
                "--control-socket",
                sock.to_str().unwrap(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The control thread only starts its filter once the socket exists.
        let out = wait_with_deadline(child, Duration::from_secs(20));
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{kind}: {err}");
        assert!(
            err.contains(&format!(
                "vmm: seccomp: a {name} thread made forbidden system call {}",
                libc::SYS_getppid
            )),
            "{kind}: {err}"
        );
    }
}

#[test]
fn no_seccomp_runs_and_warns() {
    let g = guest("hello");
    let out = run_vmm(&["--no-seccomp", "run", "--kernel", g.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(stdout(&out), "Hello from the hello test guest!\n");
    assert!(stderr(&out).contains("seccomp filters are disabled (--no-seccomp)"));
}
