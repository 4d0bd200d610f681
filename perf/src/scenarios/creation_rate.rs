//! creation-rate: how many restores per second the host sustains with N
//! restores in flight at once.
//!
//! Each round starts `concurrency` workers that restore the same snapshot
//! (128 MiB or the smallest `--mem-sizes`) back to back until the round's
//! quota is done; one restore cycle is spawn -> first guest output ->
//! SIGKILL -> reaped. Rate = restores in the round / round wall time (from
//! starting the workers to the last one finishing). The latency of each
//! restore under this load is recorded too.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use crate::error::{PerfError, Result};
use crate::results::{Metric, ScenarioResult};
use crate::runner::{ms, Context};

use super::prepare::counter_snapshot;

/// Scenario name.
pub const NAME: &str = "creation-rate";
/// Restores each worker does per round.
pub const PER_WORKER: u64 = 5;

fn rounds(ctx: &Context) -> u32 {
    ctx.runs(5, 2)
}

/// Progress steps.
pub fn plan(ctx: &Context) -> u64 {
    ctx.backends.len() as u64 * u64::from(ctx.warmup() + rounds(ctx))
}

/// Runs the scenario.
pub fn run(ctx: &Context) -> ScenarioResult {
    if let Some(reason) = ctx.backends.iter().find_map(|b| b.restore_unsupported()) {
        return ScenarioResult::skipped(NAME, reason);
    }
    super::guarded(NAME, |result| measure(ctx, result))
}

fn measure(ctx: &Context, result: &mut ScenarioResult) -> Result<()> {
    let concurrency = ctx.settings.concurrency.max(1);
    let mem_mib = ctx
        .settings
        .mem_sizes_mib
        .iter()
        .copied()
        .min()
        .unwrap_or(128);
    let cores = crate::machine::cores();
    result.notes.push(format!(
        "{concurrency} concurrent restores of a {mem_mib} MiB counter guest, {PER_WORKER} per \
         worker per round, on {cores} cores"
    ));
    for backend in &ctx.backends {
        let subject = backend.subject();
        ctx.status(format!("{NAME} ({subject}): taking the snapshot"));
        let snapshot = counter_snapshot(ctx, backend.as_ref(), mem_mib)?;
        ctx.status(format!("{NAME} ({subject}, {concurrency} at once)"));
        let params = |m: Metric| {
            m.param("mem_mib", mem_mib)
                .param("concurrency", concurrency as u64)
        };
        let mut rate = params(
            Metric::new(
                "creation-rate.rate",
                format!("creation rate: restores per second, {concurrency} at once"),
                "restores/s",
                subject,
            )
            .higher_is_better(),
        );
        let mut per_core = params(
            Metric::new(
                "creation-rate.rate-per-core",
                "creation rate: restores per second per host core",
                "restores/s",
                subject,
            )
            .higher_is_better(),
        );
        let mut latency = params(Metric::new(
            "creation-rate.latency",
            format!("creation rate: spawn -> first guest output under load, {concurrency} at once"),
            "ms",
            subject,
        ));
        ctx.repeat(rounds(ctx), |warmup| {
            let quota = AtomicU64::new(concurrency as u64 * PER_WORKER);
            let latencies = Mutex::new(Vec::new());
            let start = Instant::now();
            let outcomes: Vec<Result<()>> = std::thread::scope(|s| {
                let workers: Vec<_> = (0..concurrency)
                    .map(|_| {
                        std::thread::Builder::new().spawn_scoped(s, || -> Result<()> {
                            while quota
                                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| {
                                    q.checked_sub(1)
                                })
                                .is_ok()
                            {
                                let dir = ctx.scratch()?;
                                let mut vm = backend.restore(
                                    &snapshot.path,
                                    dir.path(),
                                    false,
                                    ctx.timeout(),
                                )?;
                                let (seen, _) = vm.process.wait_for("", 0, ctx.timeout())?;
                                let took = ms(seen - vm.process.started());
                                vm.process.kill();
                                latencies
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .push(took);
                            }
                            Ok(())
                        })
                    })
                    .collect();
                workers
                    .into_iter()
                    .map(|w| match w {
                        Ok(handle) => handle.join().unwrap_or_else(|_| {
                            Err(PerfError::Guest(
                                "a creation-rate worker thread panicked".into(),
                            ))
                        }),
                        Err(source) => Err(PerfError::Io {
                            action: "cannot start a creation-rate worker thread for",
                            path: snapshot.path.clone(),
                            source,
                        }),
                    })
                    .collect()
            });
            let elapsed = start.elapsed().as_secs_f64();
            outcomes.into_iter().collect::<Result<Vec<()>>>()?;
            let done = concurrency as f64 * PER_WORKER as f64;
            rate.push(done / elapsed, warmup);
            per_core.push(done / elapsed / cores as f64, warmup);
            for l in latencies.into_inner().unwrap_or_else(|p| p.into_inner()) {
                latency.push(l, warmup);
            }
            Ok(())
        })?;
        result.metrics.push(rate.finish());
        result.metrics.push(per_core.finish());
        result.metrics.push(latency.finish());
    }
    Ok(())
}
