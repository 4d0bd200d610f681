//! Clones share their random state unless something fresh reaches each:
//! the low-level counterpart of guest-init's CRNG reseed
//! (`guest-init/src/clone_safety.rs`), which mixes the host's fresh bytes
//! into a restored Linux guest's pool before its first command, and of
//! Linux's own vmgenid driver.
//!
//! The `clone_rng` test guest seeds a generator at boot and keeps its state
//! only in guest memory, as a kernel keeps its CRNG's. It is snapshotted,
//! and the snapshot restored twice (once per memory back end). Each restore
//! prints the generator's next outputs from its memory state alone, and
//! the same state with the VM generation ID mixed in, which the vmm writes
//! anew when a restored VM first runs (README, *ACPI*). The first are the
//! same in both restores: a restored generator repeats its clone's
//! "random" numbers. The second differ: the generation ID is the fresh
//! input per restore.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::counter::{boot_guest, restore, snapshot, stop, Vm};

/// What a restore printed once it saw its new generation ID.
#[derive(Debug)]
struct Draws {
    vmgenid: String,
    memory_only: String,
    reseeded: String,
}

/// The first `key=` line of `text`, without the key.
fn value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.split_inclusive('\n')
        .filter_map(|l| l.strip_suffix('\n'))
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
}

/// Waits (30 s at most) until the guest's serial log holds a complete
/// line that `ready` finds; returns the log.
fn wait_for(log: &Path, what: &str, ready: impl Fn(&str) -> bool) -> String {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if ready(&text) {
            return text;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no {what} in {}:\n{text}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The draws a restored VM printed at its first run; stops it.
fn draws_of(vm: Vm) -> Draws {
    let text = wait_for(&vm.log, "reseeded= line", |t| {
        value(t, "reseeded").is_some()
    });
    stop(vm.ctl, vm.child);
    let get = |key: &str| value(&text, key).unwrap_or_else(|| panic!("no {key}=: {text}"));
    Draws {
        vmgenid: get("vmgenid").to_string(),
        memory_only: get("memory_only").to_string(),
        reseeded: get("reseeded").to_string(),
    }
}

#[test]
fn two_restores_repeat_memory_only_random_numbers_and_differ_once_reseeded_per_restore() {
    let t = tempfile::tempdir().unwrap();
    let mut origin = boot_guest(t.path(), "origin", "clone_rng", "clone_rng=1", &[]);
    wait_for(&origin.log, "`clone_rng: waiting`", |t| {
        t.contains("clone_rng: waiting\n")
    });
    assert_eq!(origin.ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    let snap = t.path().join("snap");
    snapshot(&mut origin.ctl, &snap, "full");
    stop(origin.ctl, origin.child);

    let first = draws_of(restore(t.path(), "first", &snap, "file", false));
    let second = draws_of(restore(t.path(), "second", &snap, "uffd", false));

    println!("first restore: {first:?}\nsecond restore: {second:?}");
    assert_ne!(first.vmgenid, second.vmgenid, "each restore has its own ID");
    assert_eq!(
        first.memory_only, second.memory_only,
        "a generator kept in memory repeats itself in every restore"
    );
    assert_ne!(
        first.reseeded, second.reseeded,
        "the generation ID mixed in sets the restores apart"
    );
    for d in [&first, &second] {
        assert_eq!(d.memory_only.split(',').count(), 4, "{d:?}");
        assert_ne!(d.memory_only, d.reseeded, "{d:?}");
    }
}
