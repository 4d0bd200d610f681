//! Snapshots and ACPI under real KVM: every restore of one snapshot writes a
//! new VM generation ID (different from the snapshot's and from every other
//! restore's) and raises the GED event the guest reads, when the restored VM
//! first runs; a VM restored paused keeps the snapshot's memory until then.
//! Format 1.0 and 1.1 snapshots (no ACPI) still restore exactly as before.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::counter::{
    assert_continues, boot_counter_with, boot_guest, checksum, counts, restore, snapshot, stop,
    wait_for_counts, Vm,
};
use vmm::snapshot::format::encode_minor;
use vmm::snapshot::manifest::Manifest;
use vmm::snapshot::state::MachineState;

const VMGENID_ADDR: u64 = 0xe0040;

/// Waits for a line of the serial log that starts with `prefix`, after
/// `skip` such lines; returns it without the prefix.
fn wait_for_line(log: &Path, prefix: &str, skip: usize) -> String {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text
            .split_inclusive('\n')
            .filter_map(|l| l.strip_suffix('\n'))
            .filter_map(|l| l.strip_prefix(prefix))
            .collect();
        if let Some(line) = lines.get(skip) {
            return line.to_string();
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no line {prefix:?} (after {skip}) in {}:\n{text}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Guest memory of a snapshot, as (gpa, bytes) per region.
fn memory(snap: &Path) -> Vec<(u64, Vec<u8>)> {
    let manifest = Manifest::load(snap).unwrap();
    let file = std::fs::read(snap.join("memory")).unwrap();
    manifest
        .regions
        .iter()
        .map(|r| {
            let start = r.file_offset as usize;
            (r.gpa, file[start..start + r.size as usize].to_vec())
        })
        .collect()
}

/// The 16-byte generation ID in a snapshot's memory, as hex.
fn vmgenid_in(snap: &Path) -> String {
    let (_, low) = &memory(snap)[0];
    let at = VMGENID_ADDR as usize;
    low[at..at + 16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Guest-physical ranges where two snapshots' memory differs.
fn differences(a: &Path, b: &Path) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for ((gpa, x), (_, y)) in memory(a).iter().zip(memory(b)) {
        for (i, (p, q)) in x.iter().zip(&y).enumerate() {
            if p != q {
                let addr = gpa + i as u64;
                match out.last_mut() {
                    Some((_, end)) if *end == addr => *end = addr + 1,
                    _ => out.push((addr, addr + 1)),
                }
            }
        }
    }
    out
}

fn boot_watcher(dir: &Path) -> Vm {
    boot_guest(dir, "origin", "acpi", "action=3", &[])
}

fn pause_and_snapshot(vm: &mut Vm, snap: &Path) {
    assert_eq!(vm.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    snapshot(&mut vm.ctl, snap, "full");
}

#[test]
fn every_restore_writes_a_new_generation_id_and_raises_the_ged_event() {
    let t = tempfile::tempdir().unwrap();
    let mut origin = boot_watcher(t.path());
    wait_for_line(&origin.log, "acpi: watching", 0);
    let booted_id = wait_for_line(&origin.log, "vmgenid=", 0);
    let snap = t.path().join("snap");
    pause_and_snapshot(&mut origin, &snap);
    let at_snapshot = checksum(&mut origin.ctl);
    stop(origin.ctl, origin.child);
    assert_eq!(
        vmgenid_in(&snap),
        booted_id,
        "the snapshot holds the boot ID"
    );
    let saved = MachineState::load(&snap).unwrap().acpi.expect("ACPI state");
    assert_eq!(
        (saved.vmgenid_addr, saved.ged_gsi, saved.ged_pending),
        (VMGENID_ADDR, 3, 0)
    );

    // Restore 1, paused: its memory is the snapshot's (a paused copy taken
    // now is identical), until it first runs.
    let mut first = restore(t.path(), "first", &snap, "file", true);
    assert_eq!(checksum(&mut first.ctl), at_snapshot);
    let paused_snap = t.path().join("paused-snap");
    snapshot(&mut first.ctl, &paused_snap, "full");
    assert_eq!(differences(&snap, &paused_snap), vec![]);
    assert_eq!(
        MachineState::load(&paused_snap)
            .unwrap()
            .acpi
            .unwrap()
            .ged_pending,
        0
    );
    // Resumed, the guest sees a new ID at once, and the GED's VMGenID event.
    assert_eq!(first.ctl.send_raw(r#"{"op":"resume"}"#)["ok"], true);
    let (first_id, ged) = new_id_seen(&first.log);
    assert_eq!(ged, "1");
    assert_ne!(first_id, booted_id);
    let first_snap = t.path().join("first-snap");
    pause_and_snapshot(&mut first, &first_snap);
    stop(first.ctl, first.child);
    assert_eq!(vmgenid_in(&first_snap), first_id);
    let read = MachineState::load(&first_snap).unwrap().acpi.unwrap();
    assert_eq!(read.ged_pending, 0, "the guest's read cleared the event");

    // Restore 2, running (uffd backend): a third ID.
    let mut second = restore(t.path(), "second", &snap, "uffd", false);
    let (second_id, ged) = new_id_seen(&second.log);
    assert_eq!(ged, "1");
    assert_ne!(second_id, booted_id);
    assert_ne!(second_id, first_id);
    let second_snap = t.path().join("second-snap");
    pause_and_snapshot(&mut second, &second_snap);
    stop(second.ctl, second.child);
    assert_eq!(vmgenid_in(&second_snap), second_id);
}

/// The first `vmgenid=ID ged=N` line the watching guest printed after a
/// restore: (ID, N).
fn new_id_seen(log: &Path) -> (String, String) {
    let seen = wait_for_line(log, "vmgenid=", 0);
    let (id, ged) = seen.split_once(" ged=").expect("vmgenid=ID ged=N");
    (id.to_string(), ged.to_string())
}

/// Rewrites a snapshot directory as a vmm writing format 1.`minor` (0: no
/// i8042 state yet, 1: no ACPI state yet) would have written it: postcard
/// encodes a struct as its fields in order, so the older payload is a tuple
/// of the fields that version had.
fn as_older_format(snap: &Path, out: &Path, minor: u16) -> PathBuf {
    std::fs::create_dir(out).unwrap();
    std::fs::copy(snap.join("memory"), out.join("memory")).unwrap();
    let state = MachineState::load(snap).unwrap();
    assert!(state.acpi.is_none(), "booted with --acpi off");
    let payload = match minor {
        0 => postcard::to_stdvec(&(
            state.mem_mib,
            &state.vm,
            &state.vcpus,
            &state.serial,
            &state.virtio,
        )),
        _ => postcard::to_stdvec(&(
            state.mem_mib,
            &state.vm,
            &state.vcpus,
            &state.serial,
            &state.virtio,
            &state.i8042,
        )),
    }
    .unwrap();
    std::fs::write(out.join("state"), encode_minor(&payload, minor)).unwrap();
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(snap.join("manifest")).unwrap()).unwrap();
    manifest["format_version"] = serde_json::json!([1, minor]);
    std::fs::write(out.join("manifest"), manifest.to_string()).unwrap();
    out.to_path_buf()
}

#[test]
fn format_1_0_and_1_1_snapshots_without_acpi_restore_as_before() {
    let t = tempfile::tempdir().unwrap();
    let mut vm = boot_counter_with(t.path(), "origin", &["--acpi", "off"]);
    wait_for_counts(&vm.log, 3);
    assert_eq!(vm.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    let snap = t.path().join("full");
    snapshot(&mut vm.ctl, &snap, "full");
    let expected = checksum(&mut vm.ctl);
    let last = *counts(&vm.log).last().unwrap();
    stop(vm.ctl, vm.child);

    let v1_0 = as_older_format(&snap, &t.path().join("v1.0"), 0);
    let v1_1 = as_older_format(&snap, &t.path().join("v1.1"), 1);
    for (minor, dir) in [(0u8, &v1_0), (1, &v1_1)] {
        let header = std::fs::read(dir.join("state")).unwrap();
        assert_eq!(&header[8..12], &[1, 0, minor, 0], "format 1.{minor}");
    }
    for (name, dir) in [("current", &snap), ("v1.0", &v1_0), ("v1.1", &v1_1)] {
        let mut r = restore(t.path(), name, dir, "file", true);
        // No ACPI: nothing in guest memory changes on restore.
        assert_eq!(checksum(&mut r.ctl), expected, "{name}");
        assert_eq!(r.ctl.send_raw(r#"{"op":"resume"}"#)["ok"], true);
        let after = wait_for_counts(&r.log, 1);
        assert_continues(after[0], last);
        stop(r.ctl, r.child);
    }
}
