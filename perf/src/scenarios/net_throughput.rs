//! net-throughput: frames per second and MiB per second the VMM's
//! virtio-net device carries between the guest and a tap, each way, at
//! full-size (1514-byte) and small (64-byte) Ethernet frames.
//!
//! The guest is net_perf; the host side is a raw packet socket on the tap,
//! in a network namespace private to the run ([`crate::netns`]). Each run
//! boots a fresh guest for one direction and size (outside the clock):
//!
//! * tx (guest -> host): the guest waits for a go frame, then keeps its
//!   transmit ring full until it has sent N frames. The clock starts right
//!   before perf sends the go frame and stops when the `recv` returning the
//!   N-th frame returns.
//! * rx (host -> guest): perf sends N frames, at most 320 ahead of the
//!   guest's acknowledgements (one per 64 frames received). The clock
//!   starts right before the first frame is sent and stops when the `recv`
//!   returning the acknowledgement of the N-th frame returns.
//!
//! Bytes count whole Ethernet frames (header included, no FCS, no
//! virtio-net header). With several VMMs, each run measures each of them in
//! turn.

use crate::netns::{self, FrameSocket, Tap};
use crate::results::{Metric, ScenarioResult};
use crate::runner::Context;

use super::net_guest::{guest_to_host, host_to_guest, NetGuest, SIZES, TAP};

/// Scenario name.
pub const NAME: &str = "net-throughput";
/// Frames per run by default.
pub const DEFAULT_FRAMES: u64 = 20_000;
/// Frames per run with `--quick`.
pub const QUICK_FRAMES: u64 = 2_000;

/// Which way frames go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Guest -> host.
    Tx,
    /// Host -> guest.
    Rx,
}

impl Direction {
    fn id(self) -> &'static str {
        match self {
            Direction::Tx => "tx",
            Direction::Rx => "rx",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Direction::Tx => "guest -> host",
            Direction::Rx => "host -> guest",
        }
    }
}

const DIRECTIONS: [Direction; 2] = [Direction::Tx, Direction::Rx];

fn runs(ctx: &Context) -> u32 {
    ctx.runs(10, 3)
}

/// Frames per run: `--net-frames`, else the default for the run's length.
pub fn frames(ctx: &Context) -> u64 {
    ctx.settings
        .net_frames
        .unwrap_or(if ctx.settings.quick {
            QUICK_FRAMES
        } else {
            DEFAULT_FRAMES
        })
        .max(1)
}

/// Progress steps: one per run of every VMM, per direction and size.
pub fn plan(ctx: &Context) -> u64 {
    (DIRECTIONS.len() * SIZES.len()) as u64 * u64::from(ctx.warmup() + runs(ctx))
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
    let count = frames(ctx);
    result.notes.push(format!(
        "net_perf guest, 1 vCPU, {count} frames per run; tap in a private network namespace, \
         read and written through a raw packet socket"
    ));
    let tap = Tap::create(TAP)?;
    let sock = FrameSocket::bind(&tap)?;
    for direction in DIRECTIONS {
        for size in SIZES {
            let param = |m: Metric| {
                m.param("direction", direction.id())
                    .param("frame_bytes", size as u64)
                    .param("frames", count)
                    .higher_is_better()
            };
            let mut sets: Vec<[Metric; 2]> = ctx
                .backends
                .iter()
                .map(|backend| {
                    let subject = backend.subject();
                    let id = format!("{NAME}.{}.{size}b", direction.id());
                    [
                        param(Metric::new(
                            format!("{id}.frames"),
                            format!("net throughput: {}, {size}-byte frames", direction.label()),
                            "frames/s",
                            subject,
                        )),
                        param(Metric::new(
                            format!("{id}.mib"),
                            format!("net throughput: {}, {size}-byte frames", direction.label()),
                            "MiB/s",
                            subject,
                        )),
                    ]
                })
                .collect();
            ctx.status(format!("{NAME} ({}, {size} bytes)", direction.id()));
            ctx.repeat(runs(ctx), |warmup| {
                for (backend, [per_frame, per_byte]) in ctx.backends.iter().zip(sets.iter_mut()) {
                    let (mode, moved) = match direction {
                        Direction::Tx => ("tx", guest_to_host as MoveFn),
                        Direction::Rx => ("rx", host_to_guest as MoveFn),
                    };
                    let cmdline = format!("mode={mode} count={count} size={size}");
                    let mut guest = NetGuest::boot(ctx, backend.as_ref(), &tap, cmdline)?;
                    let transfer = moved(&guest, &sock, count, size, ctx.timeout())?;
                    guest.vm.process.kill();
                    per_frame.push(transfer.frames_per_s(), warmup);
                    per_byte.push(transfer.mib_per_s(), warmup);
                }
                Ok(())
            })?;
            for set in sets {
                result.metrics.extend(set.into_iter().map(Metric::finish));
            }
        }
    }
    Ok(())
}

type MoveFn = fn(
    &NetGuest,
    &FrameSocket,
    u64,
    usize,
    std::time::Duration,
) -> crate::error::Result<super::net_guest::Transfer>;
