//! restore: latency from starting a VMM that restores a snapshot to the
//! restored guest's first output, across guest memory sizes.
//!
//! Clock: starts immediately before `fork` of the restoring VMM (for
//! Firecracker the API calls that load the snapshot are inside the window)
//! and stops when the pipe read returning the guest's first serial byte
//! returns. The counter guest prints on every increment, so its first byte
//! comes as soon as it runs again. After the clock stops, the count printed
//! is checked to continue from the snapshot. With several VMMs, each run
//! restores each of them in turn.
//!
//! Restore onto a standby vmm (`restore.prestarted.memN`): each run also
//! starts every VMM ahead of its snapshot and, once it is ready, clocks from
//! the load request (`{"op":"restore"}` / `PUT /snapshot/load`) to the
//! guest's first output: what a session waits for when its node keeps VMM
//! processes started ahead. Not like for like: our vmm `restore --standby`
//! has made its KVM VM, vCPUs and memory reservation before the clock,
//! Firecracker started ahead is only a process with its API socket, and
//! makes its VM inside the clock. So the metric says so
//! ([`STANDBY_NOT_LIKE_FOR_LIKE`]) and the report shows both medians without
//! a ratio.
//!
//! Breakdown (our vmm only): after the timed runs, separate restores with
//! the vmm's start-up phase marks logged give `restore.phase.STEP.memN`, the
//! µs from one mark to the next (see [`crate::phases`]).

use std::time::Instant;

use crate::backend::{Backend, Subject};
use crate::error::Result;
use crate::phases::FIRST_OUTPUT;
use crate::results::{Metric, ScenarioResult};
use crate::runner::{ms, Context};

use super::breakdown::{self, Breakdown};
use super::prepare::{check_continues, counter_snapshot, CounterSnapshot};

/// Scenario name.
pub const NAME: &str = "restore";

/// What the restore onto a standby vmm is called in the reports.
pub const STANDBY_LABEL: &str = "restore onto a standby vmm (not like for like)";

/// Why the restore onto a standby vmm has no vmm/Firecracker ratio.
pub const STANDBY_NOT_LIKE_FOR_LIKE: &str = "vmm: VM, vCPUs and memory made before the clock; \
     Firecracker: process and API socket only, its VM made inside the clock";

/// The metric of a restore onto a VMM started ahead, `mem_mib` of guest
/// memory, for `subject`: named and marked as not like for like.
pub fn standby_metric(mem_mib: u64, subject: Subject) -> Metric {
    Metric::new(
        format!("restore.prestarted.{}", super::mem_id(mem_mib)),
        format!("{STANDBY_LABEL}: load request -> first guest output, {mem_mib} MiB"),
        "ms",
        subject,
    )
    .not_like_for_like(STANDBY_NOT_LIKE_FOR_LIKE)
}

fn runs(ctx: &Context) -> u32 {
    ctx.runs(30, 5)
}

/// Progress steps: one per run of every VMM, per memory size.
pub fn plan(ctx: &Context) -> u64 {
    ctx.settings.mem_sizes_mib.len() as u64
        * u64::from(2 * ctx.warmup() + runs(ctx) + breakdown::runs(ctx))
}

/// Runs the scenario.
pub fn run(ctx: &Context) -> ScenarioResult {
    if let Some(reason) = ctx.backends.iter().find_map(|b| b.restore_unsupported()) {
        return ScenarioResult::skipped(NAME, reason);
    }
    super::guarded(NAME, |result| measure(ctx, result))
}

fn measure(ctx: &Context, result: &mut ScenarioResult) -> Result<()> {
    if let Some(backend) = &ctx.settings.memory_backend {
        result
            .notes
            .push(format!("vmm restore --memory-backend {backend}"));
    }
    if let Some(memory) = &ctx.settings.memory {
        result
            .notes
            .push(format!("vmm run|restore --memory {memory}"));
    }
    for &mem_mib in &ctx.settings.mem_sizes_mib {
        // Snapshots first, then runs that restore every VMM in turn, so a
        // change in the machine's load hits all of them alike.
        let mut sets = Vec::new();
        for backend in &ctx.backends {
            let subject = backend.subject();
            ctx.status(format!(
                "{NAME} ({subject}, {mem_mib} MiB): taking the snapshot"
            ));
            let snapshot = counter_snapshot(ctx, backend.as_ref(), mem_mib)?;
            let with_params = |metric: Metric| {
                metric
                    .param("mem_mib", mem_mib)
                    .param(
                        "memory_backend",
                        ctx.settings.memory_backend.as_deref().unwrap_or("default"),
                    )
                    .param(
                        "memory",
                        ctx.settings.memory.as_deref().unwrap_or("private"),
                    )
            };
            let latency = with_params(Metric::new(
                format!("restore.latency.{}", super::mem_id(mem_mib)),
                format!("restore: spawn -> first guest output, {mem_mib} MiB"),
                "ms",
                subject,
            ));
            let prestarted = with_params(standby_metric(mem_mib, subject));
            sets.push((snapshot, latency, Some(prestarted)));
        }
        ctx.status(format!("{NAME} ({mem_mib} MiB)"));
        ctx.repeat(runs(ctx), |warmup| {
            for (backend, (snapshot, latency, prestarted)) in
                ctx.backends.iter().zip(sets.iter_mut())
            {
                let dir = ctx.scratch()?;
                let mut vm = backend.restore(&snapshot.path, dir.path(), false, ctx.timeout())?;
                let (seen, _) = vm.process.wait_for("", 0, ctx.timeout())?;
                latency.push(ms(seen - vm.process.started()), warmup);
                check_continues(&mut vm.process, snapshot.last_count, ctx.timeout())?;
                vm.process.kill();
                if prestarted.is_some() {
                    let dir = ctx.scratch()?;
                    match backend.prestart(dir.path(), mem_mib, ctx.timeout())? {
                        Some(mut vm) => {
                            // Ready (VM prepared, socket answering): the clock
                            // covers the load request and the restore only.
                            let asked = Instant::now();
                            backend.load_prestarted(&mut vm, &snapshot.path)?;
                            let (seen, _) = vm.process.wait_for("", 0, ctx.timeout())?;
                            if let Some(m) = prestarted.as_mut() {
                                m.push(ms(seen.saturating_duration_since(asked)), warmup);
                            }
                            check_continues(&mut vm.process, snapshot.last_count, ctx.timeout())?;
                            vm.process.kill();
                        }
                        None => *prestarted = None,
                    }
                }
            }
            Ok(())
        })?;
        for (backend, (snapshot, _, _)) in ctx.backends.iter().zip(&sets) {
            result
                .metrics
                .extend(phases(ctx, backend.as_ref(), snapshot, mem_mib)?);
        }
        // The standby metric only where every VMM could be started ahead, so
        // each has its counterpart.
        let all_prestarted = sets.iter().all(|(_, _, p)| p.is_some());
        if !all_prestarted {
            result.notes.push(
                "restore.prestarted: skipped, a VMM under test cannot be started ahead \
                 (vmm without restore --standby), so no restore onto a standby vmm"
                    .into(),
            );
        }
        for (_, latency, prestarted) in sets {
            result.metrics.push(latency.finish());
            if let Some(p) = prestarted.filter(|_| all_prestarted) {
                result.metrics.push(p.finish());
            }
        }
    }
    Ok(())
}

/// The breakdown runs of `backend` (none for a VMM without phase marks).
fn phases(
    ctx: &Context,
    backend: &dyn Backend,
    snapshot: &CounterSnapshot,
    mem_mib: u64,
) -> Result<Vec<Metric>> {
    let mut steps = Breakdown::new(
        "restore.phase",
        &format!(".{}", super::mem_id(mem_mib)),
        &format!("restore breakdown, {mem_mib} MiB, µs to the end of"),
    )
    .param("mem_mib", mem_mib);
    let mut supported = true;
    ctx.status(format!("{NAME} ({mem_mib} MiB): breakdown runs"));
    ctx.repeat(breakdown::runs(ctx), |warmup| {
        if !supported {
            return Ok(());
        }
        let dir = ctx.scratch()?;
        let Some(mut vm) =
            backend.restore_with_phases(&snapshot.path, dir.path(), ctx.timeout())?
        else {
            supported = false;
            return Ok(());
        };
        let (seen, _) = vm.process.wait_for("", 0, ctx.timeout())?;
        let seen_ns = vm.process.monotonic_ns(seen);
        let stderr = breakdown::stderr_with_mark(
            &vm.process,
            "first-run",
            std::time::Duration::from_secs(1),
        );
        check_continues(&mut vm.process, snapshot.last_count, ctx.timeout())?;
        vm.process.kill();
        let run =
            crate::phases::steps(&stderr, vm.process.started_ns(), &[(FIRST_OUTPUT, seen_ns)]);
        steps.push(&run, warmup);
        Ok(())
    })?;
    Ok(steps.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_standby_restore_is_named_for_what_each_vmm_did_ahead() {
        for subject in [Subject::Vmm, Subject::Firecracker] {
            let m = standby_metric(2048, subject);
            assert_eq!(m.id, "restore.prestarted.mem2048");
            assert_eq!(
                m.label,
                "restore onto a standby vmm (not like for like): load request -> first \
                 guest output, 2048 MiB"
            );
            let why = m.not_like_for_like.as_deref().unwrap_or_default();
            assert!(
                why.contains("vmm: VM, vCPUs and memory made before the clock"),
                "{why}"
            );
            assert!(
                why.contains("Firecracker: process and API socket only"),
                "{why}"
            );
        }
    }
}
