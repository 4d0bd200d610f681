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
    // A thread has its name from the moment it is spawned (until then it
    // shows the process's "vmm") and installs its filter first thing in its
    // body, before any work; the main thread installs its filter just after
    // the control socket starts. So a thread can be seen named but not yet
    // filtered (under load a vCPU thread was): wait, with a deadline, until
    // every expected thread is there and filtered; a thread that never
    // installs its filter fails at the deadline. Then no thread of the
    // process may be unfiltered.
    let expected = ["vmm", "vcpu0", "vcpu1", "control", "control-client"];
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let threads = loop {
        let threads = thread_modes(child.id());
        let started = expected
            .iter()
            .all(|name| threads.iter().any(|(n, mode)| n == name && mode == "2"))
            && threads.iter().filter(|(n, _)| n == "vmm").count() == 1;
        if started {
            break threads;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the VM's threads were not all started and filtered within 20 s (want {expected:?} in mode 2, have {threads:?})"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    for (name, mode) in &threads {
        assert_eq!(
            mode, "2",
            "thread {name} is not in seccomp filter mode: {threads:?}"
        );
    }
    assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["ok"], true);
    let out = wait_with_deadline(child, Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(0));
}

/// (name, seccomp mode) of every thread of `pid`, from /proc.
fn thread_modes(pid: u32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        // A thread that exits between the listing and the reads is skipped.
        let (Ok(name), Ok(status)) = (
            std::fs::read_to_string(task.join("comm")),
            std::fs::read_to_string(task.join("status")),
        ) else {
            continue;
        };
        let mode = status
            .lines()
            .find_map(|l| l.strip_prefix("Seccomp:"))
            .unwrap_or("?")
            .trim()
            .to_string();
        out.push((name.trim().to_string(), mode));
    }
    out
}

#[test]
fn a_forbidden_call_from_any_thread_kind_is_fatal() {
    for (kind, name) in [
        ("vcpu", "vCPU"),
        ("main", "main"),
        ("control", "control"),
        ("device", "device"),
    ] {
        // The control thread only starts its filter once the socket exists.
        let (code, err) = selftest(kind);
        assert_eq!(code, Some(1), "{kind}: {err}");
        assert!(
            err.contains(&format!(
                "vmm: seccomp: a {name} thread made forbidden system call {}",
                libc::SYS_getppid
            )),
            "{kind}: {err}"
        );
    }
}

/// Starts the counter guest with `--seccomp-selftest SELFTEST` and returns
/// (exit code, stderr): 1 where the handler ended it, 3 where the call was
/// let through (the hook then exits by itself).
fn selftest(selftest: &str) -> (Option<i32>, String) {
    let g = guest("counter");
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    // The console's output thread is the device thread every such VM has
    // (termination signals are taken by the main thread, not a thread of their own).
    let serial = if selftest.starts_with("device") {
        "stdout"
    } else {
        "none"
    };
    let child = vmm()
        .args([
            "--seccomp-selftest",
            selftest,
            "run",
            "--kernel",
            g.to_str().unwrap(),
        ])
        .args([
            "--serial",
            serial,
            "--control-socket",
            sock.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_with_deadline(child, Duration::from_secs(20));
    (out.status.code(), stderr(&out))
}

#[test]
fn the_guest_runs_only_once_the_main_thread_is_filtered() {
    // The main thread installs its filter before it hands the vCPUs out, so
    // that it is asleep, not competing for a CPU, when the guest starts: its
    // `main-filtered` mark comes before vCPU 0's `first-run` (handed out
    // first, the vCPU usually marked its first run while the main thread was
    // still installing its filter).
    let g = guest("hello");
    let out = run_vmm(&[
        "--log-format",
        "json",
        "--log-level",
        "warn,vmm::timing=info",
        "run",
        "--kernel",
        g.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let at = |phase: &str| -> u64 {
        stderr(&out)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["fields"]["phase"] == phase)
            .and_then(|v| v["fields"]["at_ns"].as_u64())
            .unwrap_or_else(|| panic!("no {phase} mark in {}", stderr(&out)))
    };
    assert!(
        at("main-filtered") < at("first-run"),
        "the guest ran before the main thread was filtered: {}",
        stderr(&out)
    );
}

#[test]
fn a_forbidden_argument_from_any_thread_kind_is_fatal() {
    // Each call is allowed to some thread kinds with other arguments (socket for
    // Unix sockets, clone for threads, prctl for naming threads, ioctl for the
    // KVM requests in use, mprotect without PROT_EXEC); with these arguments it
    // is refused to every kind.
    let calls = [
        ("socket-inet", libc::SYS_socket),
        ("clone-process", libc::SYS_clone),
        ("prctl", libc::SYS_prctl),
        ("ioctl", libc::SYS_ioctl),
        ("mprotect-exec", libc::SYS_mprotect),
    ];
    let mut failures = Vec::new();
    for (kind, name) in [
        ("vcpu", "vCPU"),
        ("main", "main"),
        ("control", "control"),
        ("device", "device"),
    ] {
        for (call, nr) in calls {
            let (code, err) = selftest(&format!("{kind}:{call}"));
            let expected =
                format!("vmm: seccomp: a {name} thread made forbidden system call {nr} ");
            if code != Some(1) || !err.contains(&expected) {
                failures.push(format!("{kind}:{call}: exit {code:?}, stderr {err:?}"));
            }
        }
    }
    assert!(failures.is_empty(), "let through:\n{}", failures.join("\n"));
}

#[test]
fn no_seccomp_runs_and_warns() {
    let g = guest("hello");
    let out = run_vmm(&["--no-seccomp", "run", "--kernel", g.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(stdout(&out), "Hello from the hello test guest!\n");
    assert!(stderr(&out).contains("seccomp filters are disabled (--no-seccomp)"));
    // The log goes to a pipe here (a file under host-agent, whose last
    // lines go into error messages): no colour codes.
    assert!(!stderr(&out).contains('\x1b'), "{:?}", stderr(&out));
}
