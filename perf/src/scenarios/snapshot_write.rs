//! snapshot-write: time to write a full snapshot, and a diff snapshot with
//! 1 % and 10 % of guest pages dirty, across guest memory sizes.
//!
//! The dirtier guest writes one byte into `permille` thousandths of its
//! pages per pass and prints `pass=K` after each. For a diff, the harness
//! waits for a complete pass after the previous snapshot, so exactly that
//! set of pages (plus the guest's stack) is dirty. Clock: from writing the
//! snapshot request on the control (or API) socket to reading its answer,
//! with the VM paused; pausing and resuming are outside it. Each VMM's
//! guest is booted at once and the VMMs take turns, snapshot by snapshot
//! (which goes first alternates), each guest resumed only for its own run;
//! all the diffs are timed before the full snapshots.

use crate::backend::{Backend, BootSpec, SnapshotKind, Vm};
use crate::error::{PerfError, Result};
use crate::guests;
use crate::results::{Metric, ScenarioResult};
use crate::runner::{ms, Context, ScratchDir};

use super::prepare::disk_usage_mib;

/// Scenario name.
pub const NAME: &str = "snapshot-write";
/// Dirty fractions measured, in thousandths of guest pages.
pub const DIRTY_PERMILLE: &[u64] = &[10, 100];

fn runs(ctx: &Context) -> u32 {
    ctx.runs(10, 3)
}

/// Progress steps: one per run of every VMM together (the full snapshots
/// are one more series of runs per memory size).
pub fn plan(ctx: &Context) -> u64 {
    ctx.settings.mem_sizes_mib.len() as u64
        * (DIRTY_PERMILLE.len() as u64 + 1)
        * u64::from(ctx.warmup() + runs(ctx))
}

/// Runs the scenario.
pub fn run(ctx: &Context) -> ScenarioResult {
    if let Some(reason) = ctx.backends.iter().find_map(|b| b.restore_unsupported()) {
        return ScenarioResult::skipped(NAME, reason);
    }
    super::guarded(NAME, |result| measure(ctx, result))
}

/// Waits for the next complete `pass=K` line printed after this call.
fn wait_pass(ctx: &Context, vm: &mut Vm) -> Result<()> {
    let from = vm.process.output_len();
    let (_, end) = vm.process.wait_for("pass=", from, ctx.timeout())?;
    vm.process.wait_for("\n", end, ctx.timeout())?;
    Ok(())
}

/// Lets the paused `vm` finish a pass, pauses it and writes a snapshot of
/// `kind` into a new scratch folder; returns the folder and the time the
/// write took. The VM is left paused, so that only the VMM being measured
/// has a guest running.
fn snapshot_after_pass(
    ctx: &Context,
    backend: &dyn Backend,
    vm: &mut Vm,
    kind: SnapshotKind,
) -> Result<(ScratchDir, f64)> {
    backend.resume(vm)?;
    wait_pass(ctx, vm)?;
    backend.pause(vm)?;
    let dir = ctx.scratch()?;
    let took = backend.snapshot(vm, &dir.path().join("snapshot"), kind)?;
    Ok((dir, ms(took)))
}

/// One VMM's dirtier guest and its metrics at one size and dirty fraction.
struct DirtierVm {
    vm: Vm,
    _vm_dir: ScratchDir,
    /// The newest snapshot: the next diff's parent.
    parent: ScratchDir,
    full: Metric,
    full_disk: Metric,
    diff: Metric,
    diff_disk: Metric,
}

impl DirtierVm {
    /// Boots `backend`'s dirtier guest and takes the untimed full snapshot
    /// every later diff descends from.
    fn start(ctx: &Context, backend: &dyn Backend, mem_mib: u64, permille: u64) -> Result<Self> {
        let subject = backend.subject();
        let mem = super::mem_id(mem_mib);
        let pct = permille as f64 / 10.0;
        let spec = BootSpec {
            kernel: guests::path(guests::DIRTIER)?,
            cmdline: format!("permille={permille}"),
            mem_mib,
            control: true,
            setup_timings: false,
            net: None,
        };
        let vm_dir = ctx.scratch()?;
        let mut vm = backend.boot(&spec, vm_dir.path(), ctx.timeout())?;
        wait_pass(ctx, &mut vm)?;
        backend.pause(&mut vm)?;
        let parent = ctx.scratch()?;
        backend.snapshot(&mut vm, &parent.path().join("snapshot"), SnapshotKind::Full)?;
        let metric = |id: String, label: String, unit: &str| {
            Metric::new(id, label, unit, subject).param("mem_mib", mem_mib)
        };
        Ok(DirtierVm {
            vm,
            _vm_dir: vm_dir,
            parent,
            full: metric(
                format!("snapshot-write.full.{mem}"),
                format!("snapshot write: full, {mem_mib} MiB"),
                "ms",
            ),
            full_disk: metric(
                format!("snapshot-write.full-disk.{mem}"),
                format!("snapshot size on disk: full, {mem_mib} MiB"),
                "MiB",
            ),
            diff: metric(
                format!("snapshot-write.diff-{permille}permille.{mem}"),
                format!("snapshot write: diff, {pct} % of pages dirty, {mem_mib} MiB"),
                "ms",
            )
            .param("dirty_permille", permille),
            diff_disk: metric(
                format!("snapshot-write.diff-{permille}permille-disk.{mem}"),
                format!("snapshot size on disk: diff, {pct} % dirty, {mem_mib} MiB"),
                "MiB",
            )
            .param("dirty_permille", permille),
        })
    }

    /// One run: a snapshot of `kind` after a complete pass, timed.
    fn run(
        &mut self,
        ctx: &Context,
        backend: &dyn Backend,
        kind: SnapshotKind,
        warmup: bool,
    ) -> Result<()> {
        let (dir, took) = snapshot_after_pass(ctx, backend, &mut self.vm, kind)?;
        let (time, disk) = match kind {
            SnapshotKind::Full => (&mut self.full, &mut self.full_disk),
            SnapshotKind::Diff => (&mut self.diff, &mut self.diff_disk),
        };
        time.push(took, warmup);
        disk.push(disk_usage_mib(dir.path()), warmup);
        // Keep only the newest snapshot (the next diff's parent) on disk,
        // and let the filesystem finish freeing the one before, so that the
        // next timed write (of this VMM or the next) does not wait for it.
        self.parent = dir;
        sync_filesystem(self.parent.path())
    }
}

/// Writes back and commits everything pending on the filesystem that holds
/// `dir` (syncfs), outside the timed part of a run.
fn sync_filesystem(dir: &std::path::Path) -> Result<()> {
    let folder = std::fs::File::open(dir).map_err(PerfError::io("cannot open", dir))?;
    // SAFETY: syncfs takes a descriptor, which `folder` keeps open.
    if unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&folder)) } != 0 {
        return Err(PerfError::io("cannot sync the filesystem of", dir)(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

fn measure(ctx: &Context, result: &mut ScenarioResult) -> Result<()> {
    result.notes.push(
        "dirtier guest; full snapshots taken in the 1 % guest, after its diffs; each diff \
         follows one complete dirtying pass after the previous snapshot; the VMMs' guests \
         booted at once and snapshotted in turns (which first alternates), only the measured \
         guest running; the filesystem synced after each snapshot, outside the clock"
            .into(),
    );
    for &mem_mib in &ctx.settings.mem_sizes_mib {
        for &permille in DIRTY_PERMILLE {
            let pct = permille as f64 / 10.0;
            ctx.status(format!("{NAME} ({mem_mib} MiB, {pct} % dirty)"));
            // Runs alternate between the VMMs, so the disk's drift (its rate
            // moves by a tenth within minutes here) falls on all of them alike.
            // Only the measured guest runs: the others wait paused.
            let mut subjects = Vec::with_capacity(ctx.backends.len());
            for backend in &ctx.backends {
                subjects.push(DirtierVm::start(ctx, backend.as_ref(), mem_mib, permille)?);
            }
            // The diffs first, then (in the 1 % guests) the full snapshots:
            // a full snapshot of the whole memory leaves the disk busy well
            // after its fsync (Firecracker writes every page), which would
            // slow the diffs timed after it.
            let with_full = permille == DIRTY_PERMILLE[0];
            let kinds: &[SnapshotKind] = if with_full {
                &[SnapshotKind::Diff, SnapshotKind::Full]
            } else {
                &[SnapshotKind::Diff]
            };
            for &kind in kinds {
                let mut round = 0usize;
                ctx.repeat(runs(ctx), |warmup| {
                    // The VMMs take turns, and which goes first alternates, so
                    // the disk's drift and what one write leaves the next fall
                    // on each alike.
                    let mut order: Vec<usize> = (0..subjects.len()).collect();
                    if round % 2 == 1 {
                        order.reverse();
                    }
                    round += 1;
                    for i in order {
                        subjects[i].run(ctx, ctx.backends[i].as_ref(), kind, warmup)?;
                    }
                    Ok(())
                })?;
            }
            for mut subject in subjects {
                subject.vm.process.kill();
                if with_full {
                    result.metrics.push(subject.full.finish());
                    result.metrics.push(subject.full_disk.finish());
                }
                result.metrics.push(subject.diff.finish());
                result.metrics.push(subject.diff_disk.finish());
            }
        }
    }
    Ok(())
}
