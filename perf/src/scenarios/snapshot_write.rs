//! snapshot-write: time to write a full snapshot, and a diff snapshot with
//! 1 % and 10 % of guest pages dirty, across guest memory sizes.
//!
//! The dirtier guest writes one byte into `permille` thousandths of its
//! pages per pass and prints `pass=K` after each. For a diff, the harness
//! waits for a complete pass after the previous snapshot, so exactly that
//! set of pages (plus the guest's stack) is dirty. Clock: from writing the
//! snapshot request on the control (or API) socket to reading its answer,
//! with the VM paused; pausing and resuming are outside it.

use crate::backend::{Backend, BootSpec, SnapshotKind, Vm};
use crate::error::Result;
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

/// Progress steps.
pub fn plan(ctx: &Context) -> u64 {
    ctx.backends.len() as u64
        * ctx.settings.mem_sizes_mib.len() as u64
        * DIRTY_PERMILLE.len() as u64
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

/// Pauses after a complete pass, writes a snapshot of `kind` into a new
/// scratch folder, resumes; returns the folder and the time the write took.
fn snapshot_after_pass(
    ctx: &Context,
    backend: &dyn Backend,
    vm: &mut Vm,
    kind: SnapshotKind,
) -> Result<(ScratchDir, f64)> {
    wait_pass(ctx, vm)?;
    backend.pause(vm)?;
    let dir = ctx.scratch()?;
    let took = backend.snapshot(vm, &dir.path().join("snapshot"), kind)?;
    backend.resume(vm)?;
    Ok((dir, ms(took)))
}

fn measure(ctx: &Context, result: &mut ScenarioResult) -> Result<()> {
    result.notes.push(
        "dirtier guest; full snapshots taken in the 1 % guest; each diff follows one complete \
         dirtying pass after the previous snapshot"
            .into(),
    );
    for backend in &ctx.backends {
        let subject = backend.subject();
        for &mem_mib in &ctx.settings.mem_sizes_mib {
            let mem = super::mem_id(mem_mib);
            for &permille in DIRTY_PERMILLE {
                let pct = permille as f64 / 10.0;
                ctx.status(format!("{NAME} ({subject}, {mem_mib} MiB, {pct} % dirty)"));
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
                let with_full = permille == DIRTY_PERMILLE[0];
                let mut full = Metric::new(
                    format!("snapshot-write.full.{mem}"),
                    format!("snapshot write: full, {mem_mib} MiB"),
                    "ms",
                    subject,
                )
                .param("mem_mib", mem_mib);
                let mut full_disk = Metric::new(
                    format!("snapshot-write.full-disk.{mem}"),
                    format!("snapshot size on disk: full, {mem_mib} MiB"),
                    "MiB",
                    subject,
                )
                .param("mem_mib", mem_mib);
                let mut diff = Metric::new(
                    format!("snapshot-write.diff-{permille}permille.{mem}"),
                    format!("snapshot write: diff, {pct} % of pages dirty, {mem_mib} MiB"),
                    "ms",
                    subject,
                )
                .param("mem_mib", mem_mib)
                .param("dirty_permille", permille);
                let mut diff_disk = Metric::new(
                    format!("snapshot-write.diff-{permille}permille-disk.{mem}"),
                    format!("snapshot size on disk: diff, {pct} % dirty, {mem_mib} MiB"),
                    "MiB",
                    subject,
                )
                .param("mem_mib", mem_mib)
                .param("dirty_permille", permille);
                // The base every later diff descends from; untimed.
                let (mut parent, _) =
                    snapshot_after_pass(ctx, backend.as_ref(), &mut vm, SnapshotKind::Full)?;
                ctx.repeat(runs(ctx), |warmup| {
                    if with_full {
                        let (dir, took) = snapshot_after_pass(
                            ctx,
                            backend.as_ref(),
                            &mut vm,
                            SnapshotKind::Full,
                        )?;
                        full.push(took, warmup);
                        full_disk.push(disk_usage_mib(dir.path()), warmup);
                        parent = dir;
                    }
                    let (dir, took) =
                        snapshot_after_pass(ctx, backend.as_ref(), &mut vm, SnapshotKind::Diff)?;
                    diff.push(took, warmup);
                    diff_disk.push(disk_usage_mib(dir.path()), warmup);
                    // Keep only the newest snapshot (the next diff's parent) on disk.
                    parent = dir;
                    Ok(())
                })?;
                drop(parent);
                vm.process.kill();
                if with_full {
                    result.metrics.push(full.finish());
                    result.metrics.push(full_disk.finish());
                }
                result.metrics.push(diff.finish());
                result.metrics.push(diff_disk.finish());
            }
        }
    }
    Ok(())
}
