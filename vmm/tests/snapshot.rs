//! Snapshots under real KVM with the counting guest: continuity across a
//! restore, concurrent restores, a full + 3 diff chain restored to identical
//! memory with both memory backends, and hostile snapshot files.

mod common;

use std::path::Path;

use common::counter::*;
use common::*;
use serde_json::{json, Value};
use vmm::snapshot::format::FORMAT_MINOR;
use vmm::snapshot::state::MachineState;

fn continuity(backend: &str) {
    let t = tempfile::tempdir().unwrap();
    let (snap, last) = counter_snapshot(t.path());
    assert!(last >= 3 * INTERVAL);
    let vm = restore(t.path(), "restored", &snap, backend, false);
    let after = wait_for_counts(&vm.log, 2);
    assert_continues(after[0], last);
    assert_eq!(after[1], after[0] + INTERVAL);
    stop(vm.ctl, vm.child);
}

#[test]
fn count_continues_after_restore_file_backend() {
    continuity("file");
}

#[test]
fn count_continues_after_restore_uffd_backend() {
    continuity("uffd");
}

#[test]
fn ten_concurrent_restores_of_one_snapshot_all_continue() {
    let t = tempfile::tempdir().unwrap();
    let (snap, last) = counter_snapshot(t.path());
    let vms: Vec<Vm> = (0..10)
        .map(|i| {
            let backend = if i % 2 == 0 { "file" } else { "uffd" };
            restore(t.path(), &format!("r{i}"), &snap, backend, false)
        })
        .collect();
    for vm in vms {
        let after = wait_for_counts(&vm.log, 1);
        assert_continues(after[0], last);
        stop(vm.ctl, vm.child);
    }
}

/// Restores each layer `(snapshot dir, memory checksum taken when it was
/// written)` paused, with both memory backends, and checks its memory.
fn assert_every_layer_restores_to(dir: &Path, layers: &[(std::path::PathBuf, String)]) {
    for backend in ["file", "uffd"] {
        for (i, (snap, expected)) in layers.iter().enumerate() {
            let mut r = restore(dir, &format!("{backend}{i}"), snap, backend, true);
            assert_eq!(
                &checksum(&mut r.ctl),
                expected,
                "layer {i} restored with {backend} differs"
            );
            stop(r.ctl, r.child);
        }
    }
}

fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn full_plus_three_diffs_restore_to_identical_memory_on_both_backends() {
    let t = tempfile::tempdir().unwrap();
    let mut vm = boot_counter(t.path(), "origin");
    wait_for_counts(&vm.log, 1);
    let mut layers = Vec::new();
    for (i, kind) in ["full", "diff", "diff", "diff"].iter().enumerate() {
        if i > 0 {
            assert_eq!(vm.ctl.send_raw(r#"{"op":"resume"}"#)["ok"], true);
            let seen = counts(&vm.log).len();
            wait_for_counts(&vm.log, seen + 1);
        }
        assert_eq!(vm.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
        let dir = t.path().join(format!("layer{i}"));
        let resp = snapshot(&mut vm.ctl, &dir, kind);
        layers.push((dir, checksum(&mut vm.ctl), resp));
    }
    stop(vm.ctl, vm.child);

    for (dir, _, resp) in &layers[1..] {
        // A diff holds only the pages the counter dirtied: a handful, not 64 MiB.
        let pages = resp["pages_written"].as_u64().unwrap();
        assert!((1..64).contains(&pages), "diff wrote {pages} pages");
        let manifest: Value =
            serde_json::from_slice(&std::fs::read(dir.join("manifest")).unwrap()).unwrap();
        let listed: u64 = manifest["extents"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["len"].as_u64().unwrap())
            .sum();
        assert_eq!(listed, pages * 4096);
        assert!(manifest["parent"].is_string());
        let on_disk = allocated_bytes(&dir.join("memory"));
        assert!(
            on_disk <= listed + 64 * 1024,
            "diff memory file allocates {on_disk} bytes for {listed} bytes of pages"
        );
        assert_eq!(
            std::fs::metadata(dir.join("memory")).unwrap().len(),
            64 << 20,
            "memory file spans the whole layout (sparse)"
        );
    }
    let full_alloc = allocated_bytes(&layers[0].0.join("memory"));
    assert!(
        full_alloc < 8 << 20,
        "full snapshot of a mostly empty guest is sparse"
    );

    let chain: Vec<_> = layers
        .iter()
        .map(|(d, c, _)| (d.clone(), c.clone()))
        .collect();
    assert_every_layer_restores_to(t.path(), &chain);

    // The top of the chain also runs on from where it was.
    let top = &layers[3].0;
    let vm = restore(t.path(), "top", top, "file", false);
    wait_for_counts(&vm.log, 1);
    stop(vm.ctl, vm.child);
}

/// A full snapshot reads only the pages that may be non-zero (written since
/// boot, or held by the restored chain): a full snapshot of a VM restored from
/// a full + diff chain, taken after it ran on, must still hold every page.
#[test]
fn a_full_snapshot_of_a_restored_vm_holds_every_page_of_its_chain() {
    let t = tempfile::tempdir().unwrap();
    let mut vm = boot_counter(t.path(), "origin");
    wait_for_counts(&vm.log, 1);
    assert_eq!(vm.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    snapshot(&mut vm.ctl, &t.path().join("base"), "full");
    assert_eq!(vm.ctl.send_raw(r#"{"op":"resume"}"#)["ok"], true);
    let seen = counts(&vm.log).len();
    wait_for_counts(&vm.log, seen + 1);
    assert_eq!(vm.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    let diff = t.path().join("diff");
    snapshot(&mut vm.ctl, &diff, "diff");
    stop(vm.ctl, vm.child);

    for backend in ["file", "uffd"] {
        let mut r = restore(t.path(), &format!("{backend}-run"), &diff, backend, false);
        wait_for_counts(&r.log, 1);
        assert_eq!(r.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
        let expected = checksum(&mut r.ctl);
        let again = t.path().join(format!("{backend}-full"));
        snapshot(&mut r.ctl, &again, "full");
        // A second full after more running: the first one's zero pages that the
        // guest wrote since must be in it too.
        assert_eq!(r.ctl.send_raw(r#"{"op":"resume"}"#)["ok"], true);
        let seen = counts(&r.log).len();
        wait_for_counts(&r.log, seen + 1);
        assert_eq!(r.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
        let expected_second = checksum(&mut r.ctl);
        let second = t.path().join(format!("{backend}-full2"));
        snapshot(&mut r.ctl, &second, "full");
        stop(r.ctl, r.child);

        for (dir, want) in [(&again, &expected), (&second, &expected_second)] {
            let mut back = restore(t.path(), &format!("{backend}-check"), dir, "file", true);
            assert_eq!(
                &checksum(&mut back.ctl),
                want,
                "full snapshot {} of a {backend}-restored VM lost pages",
                dir.display()
            );
            stop(back.ctl, back.child);
        }
    }
}

#[test]
fn snapshot_requests_that_cannot_succeed_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let mut vm = boot_counter(t.path(), "origin");
    let running = t.path().join("while-running");
    let resp = vm
        .ctl
        .send_raw(&json!({"op": "snapshot", "dir": running}).to_string());
    assert_eq!(
        resp,
        json!({"ok": false, "error": "cannot snapshot: a snapshot needs a paused VM: send {\"op\":\"pause\"} first"})
    );
    assert!(!running.exists());
    assert_eq!(vm.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    let diff = vm.ctl.send_raw(
        &json!({"op": "snapshot", "dir": t.path().join("d"), "kind": "diff"}).to_string(),
    );
    assert!(diff["error"]
        .as_str()
        .unwrap()
        .contains("take a full snapshot first"));
    let nowhere = vm
        .ctl
        .send_raw(&json!({"op": "snapshot", "dir": "/nonexistent/dir/snap"}).to_string());
    assert!(nowhere["error"]
        .as_str()
        .unwrap()
        .contains("parent directory does not exist"));
    let snap = t.path().join("full");
    snapshot(&mut vm.ctl, &snap, "full");
    let again = vm
        .ctl
        .send_raw(&json!({"op": "snapshot", "dir": snap}).to_string());
    assert!(again["error"].as_str().unwrap().contains("already exists"));
    stop(vm.ctl, vm.child);
    // Only the complete snapshot and the VM's own files: no temporary directories.
    let mut names: Vec<String> = std::fs::read_dir(t.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["full", "origin.log"]);
}

/// Copies a snapshot directory so a test can damage the copy.
fn copy_snapshot(src: &Path, dst: &Path) {
    std::fs::create_dir(dst).unwrap();
    for f in ["state", "memory", "manifest"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
}

fn assert_restore_refused(snap: &Path, expect: &str) {
    let out = run_vmm(&[
        "restore",
        "--snapshot",
        snap.to_str().unwrap(),
        "--serial",
        "none",
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{}: {err}", snap.display());
    assert!(err.contains(expect), "expected {expect:?} in {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn damaged_snapshots_are_refused_with_clear_errors() {
    let t = tempfile::tempdir().unwrap();
    let (snap, _) = counter_snapshot(t.path());
    let damaged = |name: &str| {
        let d = t.path().join(name);
        copy_snapshot(&snap, &d);
        d
    };

    let d = damaged("truncated");
    let state = std::fs::read(d.join("state")).unwrap();
    std::fs::write(d.join("state"), &state[..state.len() / 2]).unwrap();
    assert_restore_refused(&d, "snapshot state length mismatch");

    let d = damaged("tiny");
    std::fs::write(d.join("state"), b"AGVM").unwrap();
    assert_restore_refused(&d, "snapshot state is truncated");

    let d = damaged("bitflip");
    let mut state = std::fs::read(d.join("state")).unwrap();
    let mid = state.len() / 2;
    state[mid] ^= 0x10;
    std::fs::write(d.join("state"), &state).unwrap();
    assert_restore_refused(&d, "checksum mismatch");

    let d = damaged("magic");
    let mut state = std::fs::read(d.join("state")).unwrap();
    state[0] = b'X';
    std::fs::write(d.join("state"), &state).unwrap();
    assert_restore_refused(&d, "not a snapshot state file (bad magic)");

    let d = damaged("newer-state");
    let mut state = std::fs::read(d.join("state")).unwrap();
    state[8] = 9;
    std::fs::write(d.join("state"), &state).unwrap();
    assert_restore_refused(
        &d,
        &format!("snapshot format version 9.{FORMAT_MINOR} is newer than this vmm supports (1.{FORMAT_MINOR})"),
    );

    let d = damaged("newer-manifest");
    let manifest = std::fs::read_to_string(d.join("manifest")).unwrap();
    let mut m: Value = serde_json::from_str(&manifest).unwrap();
    m["format_version"] = json!([7, 1]);
    std::fs::write(d.join("manifest"), m.to_string()).unwrap();
    assert_restore_refused(
        &d,
        &format!("format version 7.1, newer than this vmm supports (1.{FORMAT_MINOR})"),
    );

    let d = damaged("short-memory");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("memory"))
        .unwrap();
    f.set_len(1 << 20).unwrap();
    assert_restore_refused(&d, "holds 1048576 bytes, the manifest describes 67108864");

    let d = damaged("no-manifest");
    std::fs::remove_file(d.join("manifest")).unwrap();
    assert_restore_refused(&d, "cannot read snapshot manifest");

    let d = damaged("bad-json");
    std::fs::write(d.join("manifest"), "{not json").unwrap();
    assert_restore_refused(&d, "invalid snapshot manifest");

    // Diff chains: a missing parent, and two diffs naming each other.
    let a = damaged("loop-a");
    let b = damaged("loop-b");
    for (dir, parent) in [(&a, &b), (&b, &a)] {
        let mut m: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("manifest")).unwrap()).unwrap();
        m["kind"] = json!("diff");
        m["parent"] = json!(parent);
        std::fs::write(dir.join("manifest"), m.to_string()).unwrap();
    }
    assert_restore_refused(&a, "snapshot chain loops");
    let orphan = damaged("orphan");
    let mut m: Value =
        serde_json::from_str(&std::fs::read_to_string(orphan.join("manifest")).unwrap()).unwrap();
    m["kind"] = json!("diff");
    m["parent"] = json!(t.path().join("gone"));
    std::fs::write(orphan.join("manifest"), m.to_string()).unwrap();
    assert_restore_refused(&orphan, "which does not exist");

    assert_restore_refused(
        &t.path().join("nothing-here"),
        "cannot read snapshot manifest",
    );
}

#[test]
fn virtio_devices_are_saved_and_come_back_with_new_back_ends() {
    let t = tempfile::tempdir().unwrap();
    let disk = t.path().join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let vsock = format!("3:{}", t.path().join("origin.vsock").display());
    let vm = boot_counter_with(
        t.path(),
        "origin",
        &["--disk", disk.to_str().unwrap(), "--rng", "--vsock", &vsock],
    );
    let (child, mut ctl, log) = (vm.child, vm.ctl, vm.log);
    wait_for_counts(&log, 2);
    assert_eq!(ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    let snap = t.path().join("snap");
    snapshot(&mut ctl, &snap, "full");
    let last = *counts(&log).last().unwrap();
    stop(ctl, child);

    // Without the devices the restore is refused, naming what to pass.
    let out = run_vmm(&[
        "restore",
        "--snapshot",
        snap.to_str().unwrap(),
        "--serial",
        "none",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the snapshot has 3 virtio devices, the restore was given 0"),
        "{}",
        stderr(&out)
    );

    // A per-session copy of the disk and a new vsock socket path.
    let copy = t.path().join("session-disk.img");
    std::fs::copy(&disk, &copy).unwrap();
    let new_vsock = t.path().join("session.vsock");
    let log2 = t.path().join("restored.log");
    let sock2 = t.path().join("restored.sock");
    let child = spawn_vmm(&[
        "restore",
        "--snapshot",
        snap.to_str().unwrap(),
        "--serial",
        &format!("file:{}", log2.display()),
        "--control-socket",
        sock2.to_str().unwrap(),
        "--disk",
        copy.to_str().unwrap(),
        "--rng",
        "--vsock",
        &format!("3:{}", new_vsock.display()),
    ]);
    let mut ctl = Control::connect(&sock2);
    let after = wait_for_counts(&log2, 1);
    assert_continues(after[0], last);
    assert!(
        new_vsock.exists(),
        "the vsock host socket listens after restore"
    );
    assert_eq!(ctl.send_raw(r#"{"op":"status"}"#)["state"], "running");
    stop(ctl, child);
}

/// Waits until `log` holds `needle`.
fn wait_for_text(log: &Path, needle: &str) {
    let start = std::time::Instant::now();
    while !std::fs::read_to_string(log)
        .unwrap_or_default()
        .contains(needle)
    {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "no {needle:?} in {}",
            log.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A restored vsock device owes the guest a transport-reset event; it is
/// delivered once the VM runs, never while a `--paused` restore waits, so
/// the paused VM's memory is the snapshot's byte for byte (with a real
/// guest the event's used-ring entry made every restore's checksum differ).
#[test]
fn a_restored_vsock_device_writes_nothing_until_the_vm_runs() {
    let t = tempfile::tempdir().unwrap();
    let origin = format!("3:{}", t.path().join("origin.vsock").display());
    let mut vm = boot_guest(
        t.path(),
        "origin",
        "virtio_vsock",
        "vsock_idle=1",
        &["--vsock", &origin],
    );
    wait_for_text(&vm.log, "vsock: idle");
    let (snap, before) = paused_snapshot(t.path(), &mut vm);
    stop(vm.ctl, vm.child);

    for backend in ["file", "uffd"] {
        let vsock = format!("3:{}", t.path().join(format!("{backend}.vsock")).display());
        let mut vm = restore_with(
            t.path(),
            backend,
            &snap,
            backend,
            true,
            &["--vsock", &vsock],
        );
        assert_eq!(checksum(&mut vm.ctl), before, "{backend}: paused restore");
        // Give the device's event thread every chance to write anyway.
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(checksum(&mut vm.ctl), before, "{backend}: still paused");
        assert_eq!(vm.ctl.send_raw(r#"{"op":"resume"}"#)["ok"], true);
        wait_for_text(&vm.log, "vsock: transport reset event");
        assert!(std::fs::read_to_string(&vm.log)
            .unwrap()
            .contains("vsock.event=0"));
        stop(vm.ctl, vm.child);
    }
}

/// Pauses `vm` and takes a full snapshot into `<dir>/snap`; returns it with
/// the paused memory's checksum.
fn paused_snapshot(dir: &Path, vm: &mut Vm) -> (std::path::PathBuf, String) {
    assert_eq!(vm.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    let before = checksum(&mut vm.ctl);
    let snap = dir.join("snap");
    snapshot(&mut vm.ctl, &snap, "full");
    (snap, before)
}

/// A frame that reaches a `--paused` restore's tap waits there until the VM
/// runs: the device thread serves no backend before the first resume, so the
/// paused VM's memory is the snapshot's byte for byte (a real guest's restore
/// once failed that check when the host sent its tap a frame), and the guest
/// receives the frame once resumed.
#[test]
fn a_frame_sent_to_a_paused_restore_arrives_only_when_it_runs() {
    let name = format!("vmms{}", std::process::id() % 100_000);
    let tap = match common::tap::HostTap::create(&name) {
        Ok(tap) => tap,
        Err(why) => {
            println!("SKIPPED paused-restore net test: cannot create a tap ({why})");
            return;
        }
    };
    let sock = common::tap::PacketSocket::bind(&tap.0);
    let net = format!("{},mac=02:11:22:33:44:55", tap.0);
    let t = tempfile::tempdir().unwrap();
    // Waits (all but) forever for the host's frame, its rx buffer posted.
    let mut vm = boot_guest(
        t.path(),
        "origin",
        "virtio_net",
        "rx_spins=1000000000000000",
        &["--net", &net],
    );
    wait_for_text(&vm.log, "net: sent");
    let (snap, before) = paused_snapshot(t.path(), &mut vm);
    stop(vm.ctl, vm.child);

    let mut frame = vec![
        0x02, 0x11, 0x22, 0x33, 0x44, 0x55, 0x02, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0x88, 0xb5,
    ];
    frame.extend_from_slice(b"hello from the host");
    frame.resize(64, 0);
    for backend in ["file", "uffd"] {
        let mut vm = restore_with(t.path(), backend, &snap, backend, true, &["--net", &net]);
        // Restored (the checksum answers after the restore), so the tap is open.
        assert_eq!(checksum(&mut vm.ctl), before, "{backend}: paused restore");
        sock.send(&frame);
        // Every chance for the device to write it into the posted buffer.
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert_eq!(
            checksum(&mut vm.ctl),
            before,
            "{backend}: a frame on the tap changed the paused VM's memory"
        );
        assert_eq!(vm.ctl.send_raw(r#"{"op":"resume"}"#)["ok"], true);
        wait_for_text(&vm.log, "net.rx_payload=hello from the host");
        let out = wait_with_deadline(vm.child, std::time::Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(0), "{backend}: {}", stderr(&out));
    }
}

/// Whether the snapshot in `dir` has a PIT, and whether its saved state is
/// a live PIT's (KVM resets channel 0 with its gate up) or the zeros of none.
fn saved_pit(dir: &Path) -> (bool, bool) {
    let state = MachineState::load(dir).unwrap();
    (state.pit, state.vm.pit.channels[0].gate != 0)
}

/// There is an in-kernel PIT unless asked not to (`--pit off`); a VM keeps
/// what it has in its snapshots, and a restore gets it back, also on a
/// standby vmm whose vCPUs exist before it learns of the PIT.
#[test]
fn a_pit_is_made_unless_asked_not_to_and_kept_across_restores() {
    let t = tempfile::tempdir().unwrap();
    for (pit, extra) in [(false, &["--pit", "off"][..]), (true, &[][..])] {
        let mut vm = boot_counter_with(t.path(), &format!("boot-{pit}"), extra);
        wait_for_counts(&vm.log, 1);
        assert_eq!(vm.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
        let booted = t.path().join(format!("booted-{pit}"));
        snapshot(&mut vm.ctl, &booted, "full");
        stop(vm.ctl, vm.child);
        assert_eq!(saved_pit(&booted), (pit, pit), "booted with {extra:?}");

        let mut r = restore(t.path(), &format!("restored-{pit}"), &booted, "file", false);
        let seen = counts(&r.log).len();
        wait_for_counts(&r.log, seen + 1);
        assert_eq!(r.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
        let again = t.path().join(format!("again-{pit}"));
        snapshot(&mut r.ctl, &again, "full");
        stop(r.ctl, r.child);
        assert_eq!(saved_pit(&again), (pit, pit), "restored from {extra:?}");

        let (child, mut ctl, log, _) = spawn_logged(
            t.path(),
            &format!("standby-{pit}"),
            &["restore", "--standby"],
            &["--mem-mib", "64"],
        );
        let request = json!({"op": "restore", "snapshot": &again, "paused": false});
        let resp = ctl.send_raw(&request.to_string());
        assert_eq!(resp["ok"], true, "{resp}");
        wait_for_counts(&log, counts(&log).len() + 1);
        assert_eq!(ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
        let third = t.path().join(format!("standby-{pit}-snap"));
        snapshot(&mut ctl, &third, "full");
        stop(ctl, child);
        assert_eq!(
            saved_pit(&third),
            (pit, pit),
            "standby restore of {extra:?}"
        );
    }
}

/// Complete `pass=N` lines the dirtier guest has printed.
fn passes(log: &Path) -> usize {
    let text = std::fs::read(log).unwrap_or_default();
    text.split(|b| *b == b'\n')
        .rev()
        .skip(1) // the part after the last newline is not a complete line
        .filter(|l| l.starts_with(b"pass="))
        .count()
}

fn wait_for_passes(log: &Path, at_least: usize) {
    let start = std::time::Instant::now();
    while passes(log) < at_least {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "the dirtier guest completed only {} passes into {}",
            passes(log),
            log.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Diffs holding megabytes of contiguous dirty pages (the runs that go to
/// the memory file with O_DIRECT where the filesystem takes it) restore to
/// the same memory as the VM had, with both memory backends.
#[test]
fn diffs_of_long_dirty_runs_restore_to_identical_memory() {
    let t = tempfile::tempdir().unwrap();
    // 10 % of the RAM of 64 MiB: about 1630 contiguous pages from 4 MiB,
    // rewritten every pass.
    let mut vm = boot_guest(t.path(), "origin", "dirtier", "permille=100", &[]);
    wait_for_passes(&vm.log, 1);
    let mut layers = Vec::new();
    for (i, kind) in ["full", "diff", "diff"].iter().enumerate() {
        if i > 0 {
            assert_eq!(vm.ctl.send_raw(r#"{"op":"resume"}"#)["ok"], true);
            // Two more complete passes: at least one whole pass since the resume.
            wait_for_passes(&vm.log, passes(&vm.log) + 2);
        }
        assert_eq!(vm.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
        let dir = t.path().join(format!("layer{i}"));
        let resp = snapshot(&mut vm.ctl, &dir, kind);
        if i > 0 {
            let pages = resp["pages_written"].as_u64().unwrap();
            assert!(pages >= 1500, "diff {i} wrote only {pages} pages");
        }
        layers.push((dir, checksum(&mut vm.ctl)));
    }
    stop(vm.ctl, vm.child);
    assert_every_layer_restores_to(t.path(), &layers);
}
