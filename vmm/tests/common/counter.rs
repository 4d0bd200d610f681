//! The counting guest: booting it with a serial log and control socket,
//! reading its counts, snapshotting it and checking that a restore continues.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::*;

pub const INTERVAL: u64 = 20_000;

/// Complete `count=N` lines of a serial log, in order.
pub fn counts(log: &Path) -> Vec<u64> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.split_inclusive('\n')
        .filter_map(|l| l.strip_suffix('\n'))
        .filter_map(|l| l.strip_prefix("count="))
        .filter_map(|n| n.parse().ok())
        .collect()
}

pub fn wait_for_counts(log: &Path, at_least: usize) -> Vec<u64> {
    let start = Instant::now();
    loop {
        let c = counts(log);
        if c.len() >= at_least {
            return c;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "guest printed only {c:?} into {}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn stop(mut ctl: Control, child: Child) {
    assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["ok"], true);
    let out = wait_with_deadline(child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
}

pub fn snapshot(ctl: &mut Control, dir: &Path, kind: &str) -> Value {
    let req = json!({"op": "snapshot", "dir": dir, "kind": kind}).to_string();
    let resp = ctl.send_raw(&req);
    assert_eq!(
        resp["ok"],
        true,
        "snapshot {kind} into {}: {resp}",
        dir.display()
    );
    resp
}

pub fn checksum(ctl: &mut Control) -> String {
    let resp = ctl.send_raw(r#"{"op":"memory_checksum"}"#);
    assert_eq!(resp["ok"], true, "{resp}");
    resp["crc64"].as_str().unwrap().to_string()
}

/// A counting VM with its serial log and control socket.
pub struct Vm {
    pub child: Child,
    pub ctl: Control,
    pub log: PathBuf,
}

pub fn boot_counter(dir: &Path, name: &str) -> Vm {
    boot_counter_with(dir, name, &[])
}

/// Boots the counting guest with `extra` vmm flags (devices).
pub fn boot_counter_with(dir: &Path, name: &str, extra: &[&str]) -> Vm {
    boot_guest(dir, name, "counter", &format!("interval={INTERVAL}"), extra)
}

/// Boots test guest `guest` (64 MiB, `cmdline`, `extra` vmm flags) with its
/// serial log at `<dir>/<name>.log` and control socket `<dir>/<name>.sock`.
pub fn boot_guest(dir: &Path, name: &str, guest_name: &str, cmdline: &str, extra: &[&str]) -> Vm {
    let g = guest(guest_name);
    let args = [
        "run",
        "--kernel",
        g.to_str().unwrap(),
        "--mem-mib",
        "64",
        "--cmdline",
        cmdline,
    ];
    let (child, ctl, log, _) = spawn_logged(dir, name, &args, extra);
    Vm { child, ctl, log }
}

/// Spawns the vmm with `args`, its serial console in `<dir>/<name>.log` and
/// its control socket at `<dir>/<name>.sock`, then `extra`; returns it with
/// the socket connected, the log's path and the socket's path.
pub fn spawn_logged(
    dir: &Path,
    name: &str,
    args: &[&str],
    extra: &[&str],
) -> (Child, Control, PathBuf, PathBuf) {
    let log = dir.join(format!("{name}.log"));
    let sock = dir.join(format!("{name}.sock"));
    let serial = format!("file:{}", log.display());
    let mut all = args.to_vec();
    all.extend([
        "--serial",
        &serial,
        "--control-socket",
        sock.to_str().unwrap(),
    ]);
    all.extend_from_slice(extra);
    let child = spawn_vmm(&all);
    let ctl = Control::connect(&sock);
    (child, ctl, log, sock)
}

pub fn restore(dir: &Path, name: &str, snap: &Path, backend: &str, paused: bool) -> Vm {
    restore_with(dir, name, snap, backend, paused, &[])
}

/// Restores `snap` on `backend` (`--paused` or not) with the `devices` the
/// snapshotted VM had, its log and socket named after `name` in `dir`.
pub fn restore_with(
    dir: &Path,
    name: &str,
    snap: &Path,
    backend: &str,
    paused: bool,
    devices: &[&str],
) -> Vm {
    let args = [
        "restore",
        "--snapshot",
        snap.to_str().unwrap(),
        "--memory-backend",
        backend,
    ];
    let mut extra: Vec<&str> = if paused { vec!["--paused"] } else { vec![] };
    extra.extend_from_slice(devices);
    let (child, ctl, log, _) = spawn_logged(dir, name, &args, &extra);
    Vm { child, ctl, log }
}

/// Boots, lets it count, pauses, takes a full snapshot, stops.
/// Returns the snapshot and the last count printed before it.
pub fn counter_snapshot(dir: &Path) -> (PathBuf, u64) {
    let mut vm = boot_counter(dir, "origin");
    wait_for_counts(&vm.log, 3);
    assert_eq!(vm.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    let snap = dir.join("full");
    snapshot(&mut vm.ctl, &snap, "full");
    let last = *counts(&vm.log).last().unwrap();
    stop(vm.ctl, vm.child);
    (snap, last)
}

/// The first count after a restore continues from the snapshot's: the next
/// multiple of the interval, or the one after if a line was cut by the pause.
pub fn assert_continues(first: u64, last_before: u64) {
    assert!(
        first == last_before + INTERVAL || first == last_before + 2 * INTERVAL,
        "count restarted or jumped: last before snapshot {last_before}, first after restore {first}"
    );
}
