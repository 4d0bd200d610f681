//! memory-overhead: the VMM's resident memory that is not guest memory, per
//! VMM process, for an idle booted guest and for a freshly restored one.
//!
//! Measured from /proc/PID/smaps once the guest has printed (booted) or
//! printed its first byte after restore, plus a settle time: the sum of every
//! mapping's Rss minus the Rss of the guest memory mappings (see
//! [`crate::smaps`]), i.e. minus guest memory touched.

use std::time::Duration;

use crate::backend::BootSpec;
use crate::error::Result;
use crate::guests;
use crate::results::{Metric, ScenarioResult};
use crate::runner::Context;
use crate::smaps;

use super::prepare::counter_snapshot;

/// Scenario name.
pub const NAME: &str = "memory-overhead";
/// Wait after the guest is up before reading smaps, so start-up allocations are done.
pub const SETTLE: Duration = Duration::from_millis(200);

fn runs(ctx: &Context) -> u32 {
    ctx.runs(5, 2)
}

fn restores(ctx: &Context) -> bool {
    ctx.backends
        .iter()
        .all(|b| b.restore_unsupported().is_none())
}

/// Progress steps.
pub fn plan(ctx: &Context) -> u64 {
    let per_size = u64::from(ctx.warmup() + runs(ctx)) * if restores(ctx) { 2 } else { 1 };
    ctx.backends.len() as u64 * ctx.settings.mem_sizes_mib.len() as u64 * per_size
}

/// Runs the scenario.
pub fn run(ctx: &Context) -> ScenarioResult {
    super::guarded(NAME, |result| measure(ctx, result))
}

fn kib_to_mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn measure(ctx: &Context, result: &mut ScenarioResult) -> Result<()> {
    let restore_skip = ctx.backends.iter().find_map(|b| b.restore_unsupported());
    if let Some(reason) = &restore_skip {
        result.notes.push(format!("after restore: {reason}"));
    }
    result.notes.push(format!(
        "overhead = Rss of the VMM process - Rss of its guest memory mappings, read {} ms after \
         the guest's first output",
        SETTLE.as_millis()
    ));
    for backend in &ctx.backends {
        let subject = backend.subject();
        for &mem_mib in &ctx.settings.mem_sizes_mib {
            ctx.status(format!("{NAME} ({subject}, {mem_mib} MiB, idle)"));
            let mem = super::mem_id(mem_mib);
            let mut idle = Metric::new(
                format!("memory-overhead.idle.{mem}"),
                format!("memory overhead: booted idle guest, {mem_mib} MiB"),
                "MiB",
                subject,
            )
            .param("mem_mib", mem_mib);
            let mut idle_guest = Metric::new(
                format!("memory-overhead.idle-guest-touched.{mem}"),
                format!("guest memory touched: booted idle guest, {mem_mib} MiB"),
                "MiB",
                subject,
            )
            .param("mem_mib", mem_mib);
            let spec = BootSpec {
                kernel: guests::path(guests::COUNTER)?,
                cmdline: guests::COUNTER_CMDLINE.into(),
                mem_mib,
                control: false,
                setup_timings: false,
                net: None,
            };
            ctx.repeat(runs(ctx), |warmup| {
                let dir = ctx.scratch()?;
                let mut vm = backend.boot(&spec, dir.path(), ctx.timeout())?;
                vm.process.wait_for("count=", 0, ctx.timeout())?;
                std::thread::sleep(SETTLE);
                let r = smaps::read(vm.process.pid(), None)?;
                idle.push(kib_to_mib(r.overhead_kib()), warmup);
                idle_guest.push(kib_to_mib(r.guest_kib), warmup);
                vm.process.kill();
                Ok(())
            })?;
            result.metrics.push(idle.finish());
            result.metrics.push(idle_guest.finish());
            if restore_skip.is_some() {
                continue;
            }
            ctx.status(format!("{NAME} ({subject}, {mem_mib} MiB, restored)"));
            let snapshot = counter_snapshot(ctx, backend.as_ref(), mem_mib)?;
            let mut restored = Metric::new(
                format!("memory-overhead.restored.{mem}"),
                format!("memory overhead: restored guest, {mem_mib} MiB"),
                "MiB",
                subject,
            )
            .param("mem_mib", mem_mib);
            let mut restored_guest = Metric::new(
                format!("memory-overhead.restored-guest-touched.{mem}"),
                format!("guest memory touched: restored guest, {mem_mib} MiB"),
                "MiB",
                subject,
            )
            .param("mem_mib", mem_mib);
            ctx.repeat(runs(ctx), |warmup| {
                let dir = ctx.scratch()?;
                let mut vm = backend.restore(&snapshot.path, dir.path(), false, ctx.timeout())?;
                vm.process.wait_for("", 0, ctx.timeout())?;
                std::thread::sleep(SETTLE);
                let r = smaps::read(vm.process.pid(), Some(&snapshot.path))?;
                restored.push(kib_to_mib(r.overhead_kib()), warmup);
                restored_guest.push(kib_to_mib(r.guest_kib), warmup);
                vm.process.kill();
                Ok(())
            })?;
            result.metrics.push(restored.finish());
            result.metrics.push(restored_guest.finish());
        }
    }
    Ok(())
}
