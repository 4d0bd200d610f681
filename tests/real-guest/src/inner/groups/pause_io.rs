//! Scenario `pause-after-io` (group `snapshot`): a vCPU paused right after a
//! port write does not write it again when its snapshot is restored.
//!
//! On KVM with hardware virtualization (this outer VM's), an OUT exits to
//! the vmm before RIP moves past it; KVM moves it only when KVM_RUN is
//! entered again. A vmm that parks a vCPU straight after handling the exit
//! saves a state in which the OUT has not happened, and every restore
//! replays it. The host's own KVM may finish the OUT before exiting, so the
//! vmm's test of the same thing (`vmm/tests/pause_io.rs`) cannot fail
//! there: this one can. The guest is the vmm's `sequence` test guest, which
//! writes a..z and a newline forever, one OUT per byte.

use std::path::Path;
use std::time::{Duration, Instant};

use vmm_api::{RestoreSpec, RunSpec, Serial, SnapshotKind};

use crate::inner::vm::{Guest, Launch};
use crate::inner::{Check, Ctx};

/// Snapshot and restore rounds; nearly every pause lands right after an OUT.
const ROUNDS: usize = 6;
const LIMIT: Duration = Duration::from_secs(120);

/// The byte the guest writes after `b`.
fn after(b: u8) -> u8 {
    match b {
        b'z' => b'\n',
        b'\n' => b'a',
        other => other + 1,
    }
}

/// Where `bytes` breaks the guest's sequence, if it does.
fn first_break(bytes: &[u8]) -> Option<usize> {
    bytes
        .windows(2)
        .position(|w| w[1] != after(w[0]))
        .map(|i| i + 1)
}

fn wait_for_bytes(path: &Path, at_least: usize) -> Result<(), String> {
    let deadline = Instant::now() + LIMIT;
    loop {
        let n = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        if n >= at_least as u64 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{}: {n} bytes after {} s",
                path.display(),
                LIMIT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Runs the vmm `launch` describes with `--serial file:<log>` until
/// `at_least` bytes are out, then pauses it, snapshots it into `snap` (if
/// given) and stops it.
fn run_until(
    ctx: &Ctx,
    name: &str,
    mut launch: Launch,
    at_least: usize,
    snap: Option<&Path>,
) -> Result<Vec<u8>, String> {
    let log = ctx.scratch.join(format!("{name}.serial"));
    let _ = std::fs::remove_file(&log);
    launch.devices_mut().serial = Serial::File(log.clone());
    let mut g = Guest::start(ctx, name, launch)?;
    wait_for_bytes(&log, at_least).map_err(|e| format!("{e}; {}", g.stderr_tail()))?;
    g.pause()?;
    if let Some(dir) = snap {
        g.snapshot(dir, SnapshotKind::Full)?;
    }
    g.stop()?;
    g.expect_clean_exit(LIMIT)?;
    read(&log)
}

/// `pause-after-io`.
pub fn pause_after_io(ctx: &mut Ctx, _name: &str) -> Check {
    let guest = test_guests::path("sequence").ok_or("the vmm's test guests lack `sequence`")?;
    for round in 0..ROUNDS {
        let snap = ctx.scratch.join(format!("seq-snap{round}"));
        let _ = std::fs::remove_dir_all(&snap);
        let mut run = RunSpec::new(&guest);
        run.mem_mib = 32;
        let before = run_until(ctx, &format!("seq{round}"), run.into(), 2048, Some(&snap))?;
        if let Some(at) = first_break(&before) {
            return Err(format!(
                "round {round}: the origin's output breaks at byte {at}"
            ));
        }
        let last = *before.last().ok_or("the origin wrote nothing")?;
        let restore = RestoreSpec::new(&snap).into();
        let after_restore = run_until(ctx, &format!("seq{round}-restored"), restore, 64, None)?;
        let first = *after_restore
            .first()
            .ok_or("the restored VM wrote nothing")?;
        if first != after(last) {
            return Err(format!(
                "round {round}: the restored VM wrote {:?} first, after the origin's last {:?}{}",
                first as char,
                last as char,
                if first == last {
                    " (the port write the vCPU was paused after, written again)"
                } else {
                    ""
                }
            ));
        }
        if let Some(at) = first_break(&after_restore) {
            return Err(format!(
                "round {round}: the restored VM's output breaks at byte {at}"
            ));
        }
        let _ = std::fs::remove_dir_all(&snap);
    }
    Ok(format!(
        "{ROUNDS} pauses of a guest writing a port, snapshotted and restored: no write replayed or lost"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_check_finds_a_repeated_or_missing_byte() {
        assert_eq!(first_break(b"xyz\nabc"), None);
        assert_eq!(first_break(b"abcc"), Some(3));
        assert_eq!(first_break(b"ac"), Some(1));
        assert_eq!(after(b'z'), b'\n');
        assert_eq!(after(b'\n'), b'a');
    }
}
