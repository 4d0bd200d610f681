//! `vmm restore --standby` under real KVM with the counting guest: a vmm
//! started ahead of its session (VM and vCPUs created) waits on its control
//! socket, answers `status` with `standby`, refuses what needs a VM, keeps
//! waiting after a restore it cannot do, and restores the snapshot it is
//! sent, with either memory backend, into a VM that runs on from the
//! snapshot and is served on the same socket afterwards.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use common::counter::*;
use common::*;
use serde_json::{json, Value};

/// A vmm on standby with its serial log and control socket.
struct Standby {
    child: Child,
    ctl: Control,
    log: PathBuf,
    sock: PathBuf,
}

fn standby(dir: &Path, name: &str, extra: &[&str]) -> Standby {
    let (child, ctl, log, sock) = spawn_logged(dir, name, &["restore", "--standby"], extra);
    Standby {
        child,
        ctl,
        log,
        sock,
    }
}

fn restore_request(snapshot: &Path, paused: bool) -> String {
    json!({"op": "restore", "snapshot": snapshot, "paused": paused}).to_string()
}

fn assert_standby(ctl: &mut Control, vcpus: u64) {
    let status = ctl.send_raw(r#"{"op":"status"}"#);
    assert_eq!(status["ok"], true, "{status}");
    assert_eq!(status["state"], "standby", "{status}");
    assert_eq!(status["vcpus"], vcpus, "{status}");
}

fn error_of(resp: &Value) -> String {
    assert_eq!(resp["ok"], false, "expected a refusal: {resp}");
    resp["error"].as_str().unwrap().to_string()
}

fn continues_after_standby_restore(backend: &str, extra: &[&str]) {
    let t = tempfile::tempdir().unwrap();
    let (snap, last) = counter_snapshot(t.path());
    let mut args = vec!["--memory-backend", backend];
    args.extend_from_slice(extra);
    let mut vm = standby(t.path(), "standby", &args);
    assert_standby(&mut vm.ctl, 1);
    // Nothing runs before the request: no guest output at all.
    assert!(counts(&vm.log).is_empty());

    let resp = vm.ctl.send_raw(&restore_request(&snap, false));
    assert_eq!(resp["ok"], true, "{resp}");
    assert_eq!(resp["state"], "running", "{resp}");
    let after = wait_for_counts(&vm.log, 2);
    assert_continues(after[0], last);
    assert_eq!(after[1], after[0] + INTERVAL);

    // The restored VM is served on the same socket, to the client that asked
    // and to new ones; it is filtered like any restored vmm's.
    let pid = vm.child.id().to_string();
    wait_main_thread_filtered(&pid);
    let mut other = Control::connect(&vm.sock);
    assert_eq!(other.send_raw(r#"{"op":"pause"}"#)["state"], "paused");
    let again = vm.ctl.send_raw(&restore_request(&snap, false));
    assert!(error_of(&again).contains("already holds a VM"), "{again}");
    assert_eq!(vm.ctl.send_raw(r#"{"op":"resume"}"#)["state"], "running");
    stop(vm.ctl, vm.child);
}

#[test]
fn a_standby_vmm_restores_what_it_is_sent_file_backend() {
    continues_after_standby_restore("file", &[]);
}

#[test]
fn a_standby_vmm_restores_what_it_is_sent_uffd_backend() {
    continues_after_standby_restore("uffd", &[]);
}

#[test]
fn a_standby_vmm_with_memory_reserved_restores_what_it_is_sent() {
    // Slots, irqchip, PIT and vCPUs ahead; the memory file mapped over the
    // reservation at the request.
    continues_after_standby_restore("file", &["--mem-mib", "64"]);
}

/// Memory mapped over a standby vmm's reservation is the snapshot's, byte
/// for byte, and KVM tracks the guest's writes into it: a diff taken after
/// it ran restores (the usual way) to the same memory.
#[test]
fn memory_mapped_over_a_reservation_is_the_snapshots_and_diffs_follow_it() {
    let t = tempfile::tempdir().unwrap();
    let mut origin = boot_counter(t.path(), "origin");
    wait_for_counts(&origin.log, 2);
    assert_eq!(origin.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    let full = t.path().join("full");
    snapshot(&mut origin.ctl, &full, "full");
    let at_snapshot = checksum(&mut origin.ctl);
    stop(origin.ctl, origin.child);

    let mut vm = standby(t.path(), "reserved", &["--mem-mib", "64"]);
    assert_eq!(
        vm.ctl.send_raw(&restore_request(&full, true))["state"],
        "paused"
    );
    assert_eq!(checksum(&mut vm.ctl), at_snapshot);
    assert_eq!(vm.ctl.send_raw(r#"{"op":"resume"}"#)["state"], "running");
    let seen = counts(&vm.log).len();
    wait_for_counts(&vm.log, seen + 2);
    assert_eq!(vm.ctl.send_raw(r#"{"op":"pause"}"#)["state"], "paused");
    let ran_on = checksum(&mut vm.ctl);
    assert_ne!(ran_on, at_snapshot, "the guest wrote nothing");
    let diff = t.path().join("diff");
    let resp = snapshot(&mut vm.ctl, &diff, "diff");
    let pages = resp["pages_written"].as_u64().unwrap();
    assert!((1..64).contains(&pages), "diff wrote {pages} pages");
    stop(vm.ctl, vm.child);

    let mut back = restore(t.path(), "back", &diff, "file", true);
    assert_eq!(checksum(&mut back.ctl), ran_on);
    stop(back.ctl, back.child);
}

#[test]
fn a_standby_vmm_stays_on_standby_after_a_restore_it_cannot_do() {
    let t = tempfile::tempdir().unwrap();
    let (snap, last) = counter_snapshot(t.path());
    let mut vm = standby(t.path(), "standby", &["--vcpus", "2"]);
    assert_standby(&mut vm.ctl, 2);

    for op in ["pause", "resume", "memory_checksum"] {
        let resp = vm.ctl.send_raw(&json!({ "op": op }).to_string());
        let message = error_of(&resp);
        assert!(
            message.contains("on standby") && message.contains("restore"),
            "{op}: {message}"
        );
    }
    let missing = vm
        .ctl
        .send_raw(&restore_request(&t.path().join("missing"), false));
    assert!(error_of(&missing).contains("missing"), "{missing}");
    // A snapshot of one vCPU does not fit a standby vmm made for two: the
    // error says how to start one that fits.
    let other = vm.ctl.send_raw(&restore_request(&snap, false));
    assert!(error_of(&other).contains("--vcpus 1"), "{other}");
    assert!(vm.ctl.send_raw("not json")["error"]
        .as_str()
        .unwrap()
        .contains("JSON"));
    assert_standby(&mut vm.ctl, 2);

    // A new client finds it still waiting, and a stop ends it without a VM.
    drop(vm.ctl);
    let mut ctl = Control::connect(&vm.sock);
    assert_standby(&mut ctl, 2);
    assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["state"], "stopping");
    let out = wait_with_deadline(vm.child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    assert!(!vm.sock.exists(), "the socket outlived the standby vmm");

    // Memory reserved for another size: refused, naming the size to reserve.
    let mut vm = standby(t.path(), "bigger", &["--mem-mib", "128"]);
    let other = vm.ctl.send_raw(&restore_request(&snap, false));
    assert!(error_of(&other).contains("--mem-mib 64"), "{other}");
    assert_standby(&mut vm.ctl, 1);
    assert_eq!(vm.ctl.send_raw(r#"{"op":"stop"}"#)["state"], "stopping");
    let out = wait_with_deadline(vm.child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));

    // And a standby vmm of the right size restores it, paused as asked.
    let mut vm = standby(t.path(), "fits", &["--vcpus", "1"]);
    let resp = vm.ctl.send_raw(&restore_request(&snap, true));
    assert_eq!(resp["state"], "paused", "{resp}");
    std::thread::sleep(Duration::from_millis(200));
    assert!(counts(&vm.log).is_empty(), "a paused restore ran the guest");
    assert_eq!(vm.ctl.send_raw(r#"{"op":"resume"}"#)["state"], "running");
    assert_continues(wait_for_counts(&vm.log, 1)[0], last);
    stop(vm.ctl, vm.child);
}

#[test]
fn lines_sent_after_the_restore_request_are_answered_by_the_restored_vm() {
    let t = tempfile::tempdir().unwrap();
    let (snap, _) = counter_snapshot(t.path());
    let vm = standby(t.path(), "pipelined", &[]);
    drop(vm.ctl);
    let stream = UnixStream::connect(&vm.sock).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut writer = stream.try_clone().unwrap();
    // Both lines in one write: the second is already buffered when the
    // standby vmm reads the first.
    let lines = format!("{}\n{{\"op\":\"status\"}}\n", restore_request(&snap, true));
    writer.write_all(lines.as_bytes()).unwrap();
    let mut reader = BufReader::new(stream);
    let mut answers = Vec::new();
    for _ in 0..2 {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        answers.push(serde_json::from_str::<Value>(&line).unwrap());
    }
    assert_eq!(answers[0]["state"], "paused", "{answers:?}");
    assert_eq!(answers[1]["state"], "paused", "{answers:?}");
    writer.write_all(b"{\"op\":\"stop\"}\n").unwrap();
    let out = wait_with_deadline(vm.child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
}

#[test]
fn a_standby_vmm_ends_on_sigterm() {
    let t = tempfile::tempdir().unwrap();
    let mut vm = standby(t.path(), "term", &[]);
    assert_standby(&mut vm.ctl, 1);
    // SAFETY: sends SIGTERM to the child this test started.
    assert_eq!(
        unsafe { libc::kill(vm.child.id() as libc::pid_t, libc::SIGTERM) },
        0
    );
    // Nothing to save on standby: the signal's default action ends it.
    let out = wait_with_deadline(vm.child, Duration::from_secs(20));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(libc::SIGTERM), "{:?}", out.status);
}

/// The blocked-signal mask (`SigBlk`) of `pid`'s thread named `name`.
fn thread_blocked_signals(pid: u32, name: &str) -> u64 {
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = task.unwrap().path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).unwrap();
        let hex = status
            .lines()
            .find_map(|l| l.strip_prefix("SigBlk:"))
            .unwrap_or_else(|| panic!("no SigBlk in {status}"));
        return u64::from_str_radix(hex.trim(), 16).unwrap();
    }
    panic!("vmm {pid} has no thread named {name}");
}

#[test]
fn a_vm_restored_on_standby_stops_cleanly_on_sigterm() {
    // The vCPU threads were started on standby, before the main thread
    // blocked the termination signals: they must block them themselves, or
    // a SIGTERM arriving while the main thread is not in its sigwait would
    // reach one of them and kill the process instead of stopping the VM.
    let t = tempfile::tempdir().unwrap();
    let (snap, _) = counter_snapshot(t.path());
    let mut vm = standby(t.path(), "term-restored", &[]);
    assert_standby(&mut vm.ctl, 1);
    let resp = vm.ctl.send_raw(&restore_request(&snap, false));
    assert_eq!(resp["ok"], true, "{resp}");
    wait_for_counts(&vm.log, 1);
    // The vCPU thread blocks SIGHUP, SIGINT, SIGTERM and the exit wake-up
    // (SIGUSR2), as every thread but the main one, whose sigwait takes them.
    let blocked = thread_blocked_signals(vm.child.id(), "vcpu0");
    let wanted = (1 << (libc::SIGHUP - 1))
        | (1 << (libc::SIGINT - 1))
        | (1 << (libc::SIGTERM - 1))
        | (1 << (libc::SIGUSR2 - 1));
    assert_eq!(blocked & wanted, wanted, "vcpu0 blocks {blocked:#x}");
    // SAFETY: sends SIGTERM to the child this test started.
    assert_eq!(
        unsafe { libc::kill(vm.child.id() as libc::pid_t, libc::SIGTERM) },
        0
    );
    let out = wait_with_deadline(vm.child, Duration::from_secs(20));
    // Exit 0: a requested stop, not death by the signal.
    assert_eq!(
        out.status.code(),
        Some(0),
        "{:?}, stderr: {}",
        out.status,
        stderr(&out)
    );
}

#[test]
fn standby_options_are_checked() {
    let t = tempfile::tempdir().unwrap();
    let sock = t.path().join("s.sock");
    let sock = sock.to_str().unwrap();
    for (args, says) in [
        (vec!["restore", "--standby"], "--control-socket"),
        (vec!["restore"], "--snapshot"),
        (
            vec!["restore", "--snapshot", "/s", "--vcpus", "2"],
            "--standby",
        ),
        (
            vec!["restore", "--standby", "--control-socket", sock, "--paused"],
            "--paused",
        ),
        (
            vec![
                "restore",
                "--standby",
                "--control-socket",
                sock,
                "--snapshot",
                "/s",
            ],
            "--snapshot",
        ),
        (
            vec![
                "restore",
                "--standby",
                "--control-socket",
                sock,
                "--vcpus",
                "0",
            ],
            "--vcpus",
        ),
        (
            vec!["restore", "--snapshot", "/s", "--mem-mib", "64"],
            "--standby",
        ),
        (
            vec![
                "restore",
                "--standby",
                "--control-socket",
                sock,
                "--mem-mib",
                "64",
                "--memory-backend",
                "uffd",
            ],
            "--mem-mib on standby",
        ),
    ] {
        let out = run_vmm(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }
}
