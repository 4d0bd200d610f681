//! Setting up what several scenarios need: a snapshot of a running counter
//! guest, and reading the guest's count from its output.

use std::path::{Path, PathBuf};

use crate::backend::{Backend, BootSpec, SnapshotKind, Vm};
use crate::error::{PerfError, Result};
use crate::guests;
use crate::process::VmProcess;
use crate::runner::{Context, ScratchDir};

/// A snapshot of a counter guest, kept on disk until dropped.
pub struct CounterSnapshot {
    _dir: ScratchDir,
    /// The snapshot folder.
    pub path: PathBuf,
    /// Guest memory size, MiB.
    pub mem_mib: u64,
    /// The last complete `count=N` the guest printed before the snapshot.
    pub last_count: u64,
}

/// Boots the counter guest (`cmdline`, `mem_mib`, with its control socket)
/// and pauses it once it has printed a complete `count=` line; returns the
/// VM and the folder its sockets live in (keep both alive together).
pub fn boot_counter_paused(
    ctx: &Context,
    backend: &dyn Backend,
    cmdline: &str,
    mem_mib: u64,
) -> Result<(ScratchDir, Vm)> {
    let vm_dir = ctx.scratch()?;
    let spec = BootSpec {
        kernel: guests::path(guests::COUNTER)?,
        cmdline: cmdline.into(),
        mem_mib,
        control: true,
        setup_timings: false,
        net: None,
    };
    let mut vm = backend.boot(&spec, vm_dir.path(), ctx.timeout())?;
    let (_, end) = vm.process.wait_for("count=", 0, ctx.timeout())?;
    vm.process.wait_for("\n", end, ctx.timeout())?;
    backend.pause(&mut vm)?;
    Ok((vm_dir, vm))
}

/// Boots the counter guest with `mem_mib`, waits until it counts, pauses it,
/// writes a full snapshot and kills it.
pub fn counter_snapshot(
    ctx: &Context,
    backend: &dyn Backend,
    mem_mib: u64,
) -> Result<CounterSnapshot> {
    let (_vm_dir, mut vm) = boot_counter_paused(ctx, backend, guests::COUNTER_CMDLINE, mem_mib)?;
    let dir = ctx.scratch()?;
    let path = dir.path().join("snapshot");
    backend.snapshot(&mut vm, &path, SnapshotKind::Full)?;
    vm.process.kill();
    let last_count = last_count(&vm.process.output()).ok_or_else(|| {
        PerfError::Guest(format!(
            "the counter guest printed no complete count= line before the snapshot; output: {:?}",
            vm.process.output_tail()
        ))
    })?;
    Ok(CounterSnapshot {
        _dir: dir,
        path,
        mem_mib,
        last_count,
    })
}

/// The value of the last complete `count=N\n` line in `output`.
pub fn last_count(output: &[u8]) -> Option<u64> {
    let text = String::from_utf8_lossy(output);
    let complete = &text[..text.rfind('\n')? + 1];
    complete
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("count=")?.parse().ok())
}

/// After the clock has stopped: waits for the first complete `count=M`
/// line from a restored counter guest and checks that it continues from
/// `last_count` (M > last_count) rather than starting again.
pub fn check_continues(
    process: &mut VmProcess,
    last_count: u64,
    timeout: std::time::Duration,
) -> Result<()> {
    let (_, start) = process.wait_for("count=", 0, timeout)?;
    let (_, end) = process.wait_for("\n", start, timeout)?;
    let output = process.output();
    let text = String::from_utf8_lossy(&output[start..end]);
    let value: u64 = text.trim().parse().map_err(|_| {
        PerfError::Guest(format!(
            "restored counter guest printed count={:?}",
            text.trim()
        ))
    })?;
    if value <= last_count {
        return Err(PerfError::Guest(format!(
            "the restored counter guest printed count={value}, but it had printed count={last_count} \
             before the snapshot: the restore started the guest over instead of resuming it"
        )));
    }
    Ok(())
}

/// Bytes a folder's files take on disk (allocated blocks, so sparse files
/// count only what they store), in MiB.
pub fn disk_usage_mib(dir: &Path) -> f64 {
    fn walk(dir: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        let Ok(entries) = std::fs::read_dir(dir) else {
            return 0;
        };
        entries
            .flatten()
            .map(|e| match e.metadata() {
                Ok(m) if m.is_dir() => walk(&e.path()),
                Ok(m) => m.blocks() * 512,
                Err(_) => 0,
            })
            .sum()
    }
    walk(dir) as f64 / (1u64 << 20) as f64
}

#[cfg(test)]
mod tests {
    #[test]
    fn last_count_ignores_a_partial_line() {
        assert_eq!(
            super::last_count(b"counter: start\ncount=1\ncount=2\ncount=3"),
            Some(2)
        );
        assert_eq!(super::last_count(b"count=7\n"), Some(7));
        assert_eq!(super::last_count(b"counter: start\n"), None);
    }
}
