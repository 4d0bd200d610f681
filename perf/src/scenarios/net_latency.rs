//! net-latency: round trip of one frame host -> guest -> host through the
//! VMM's virtio-net device, at 64-byte and 1514-byte frames.
//!
//! The guest is net_perf in echo mode: it sends every frame it receives
//! back from the buffer it arrived in. The host side is a raw packet socket
//! on the tap, in a network namespace private to the run
//! ([`crate::netns`]). One frame is in flight at a time; each sample is one
//! round trip, from right before perf's `send` of the ping to the return of
//! the `recv` that brings the same ping (size and sequence number) back.
//!
//! Each round boots one echo guest per VMM in turn (boot outside the
//! clock) and sends it `--net-pings` pings of each size; warm-up rounds
//! are recorded but left out of the statistics.

use crate::netns::{self, FrameSocket, Tap};
use crate::results::{Metric, ScenarioResult};
use crate::runner::Context;

use super::net_guest::{round_trip, NetGuest, SIZES, TAP};

/// Scenario name.
pub const NAME: &str = "net-latency";
/// Pings per frame size per round by default.
pub const DEFAULT_PINGS: u64 = 200;
/// Pings per frame size per round with `--quick`.
pub const QUICK_PINGS: u64 = 50;

fn rounds(ctx: &Context) -> u32 {
    ctx.runs(10, 3)
}

/// Pings per frame size per round: `--net-pings`, else the default.
pub fn pings(ctx: &Context) -> u64 {
    ctx.settings
        .net_pings
        .unwrap_or(if ctx.settings.quick {
            QUICK_PINGS
        } else {
            DEFAULT_PINGS
        })
        .max(1)
}

/// Progress steps: one per round.
pub fn plan(ctx: &Context) -> u64 {
    u64::from(ctx.warmup() + rounds(ctx))
}

/// Runs the scenario.
pub fn run(ctx: &Context) -> ScenarioResult {
    if let Some(reason) = netns::unavailable() {
        return ScenarioResult::skipped(NAME, reason);
    }
    super::guarded(NAME, |result| {
        netns::in_private_netns(|| measure(ctx, result))
    })
}

fn measure(ctx: &Context, result: &mut ScenarioResult) -> crate::error::Result<()> {
    let pings = pings(ctx);
    result.notes.push(format!(
        "net_perf echo guest, 1 vCPU, {pings} round trips per frame size per round, one in \
         flight; tap in a private network namespace, raw packet socket"
    ));
    let tap = Tap::create(TAP)?;
    let sock = FrameSocket::bind(&tap)?;
    let mut sets: Vec<Vec<Metric>> = ctx
        .backends
        .iter()
        .map(|backend| {
            SIZES
                .iter()
                .map(|&size| {
                    Metric::new(
                        format!("{NAME}.rtt.{size}b"),
                        format!("net latency: host -> guest -> host, {size}-byte frame"),
                        "us",
                        backend.subject(),
                    )
                    .param("frame_bytes", size as u64)
                    .param("pings_per_round", pings)
                })
                .collect()
        })
        .collect();
    let mut seq = 0u64;
    ctx.repeat(rounds(ctx), |warmup| {
        for (backend, metrics) in ctx.backends.iter().zip(sets.iter_mut()) {
            let mut guest = NetGuest::boot(ctx, backend.as_ref(), &tap, "mode=echo".into())?;
            sock.drain()?;
            for (&size, metric) in SIZES.iter().zip(metrics.iter_mut()) {
                for _ in 0..pings {
                    seq += 1;
                    let took = round_trip(&guest, &sock, seq, size, ctx.timeout())?;
                    metric.push(took.as_secs_f64() * 1e6, warmup);
                }
            }
            guest.vm.process.kill();
        }
        Ok(())
    })?;
    for set in sets {
        result.metrics.extend(set.into_iter().map(Metric::finish));
    }
    Ok(())
}
