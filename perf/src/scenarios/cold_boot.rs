//! cold-boot: spawn the VMM with a guest, wait for the guest's output and
//! for the VMM to exit cleanly after the guest resets.
//!
//! Clocks: wall starts immediately before `fork` and stops when `wait4`
//! reaps the exited VMM; CPU is the child's user + system time from `wait4`'s
//! rusage (every thread of the VMM); first-output stops when the pipe read
//! that completes the guest's line returns. With several VMMs, each run
//! boots each of them in turn.
//!
//! Breakdown (our vmm only): the vmm times two setup steps itself and logs
//! them (JSON on stderr, only these two events at info): building and
//! writing the ACPI tables (`cold-boot.acpi-tables`) and the MP table
//! (`cold-boot.mp-table`), in microseconds, from `Instant` before the first
//! table is built to after the last byte is in guest memory. After the timed
//! runs, separate boots with the vmm's start-up phase marks logged give
//! `cold-boot.phase.STEP`: µs from one mark to the next, through the guest's
//! first output, the vmm's `vm-ended` mark (vCPU threads joined) and
//! `reaped` (wait4 returned: the process's exit and the kernel's teardown).

use crate::backend::vmm::{logged_build_us, ACPI_TIMING_TARGET, MPTABLE_TIMING_TARGET};
use crate::backend::{BootSpec, Subject};
use crate::error::Result;
use crate::guests;
use crate::phases::{FIRST_OUTPUT, REAPED};
use crate::results::{Metric, ScenarioResult};
use crate::runner::{ms, Context};

/// Scenario name.
pub const NAME: &str = "cold-boot";
/// Kernel command line for `--kernel` when `--cmdline` is not given: with no
/// root filesystem the kernel panics and `panic=-1 reboot=k` resets at
/// once, so the run ends with the VMM's clean exit.
pub const KERNEL_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 pci=off";

fn runs(ctx: &Context) -> u32 {
    ctx.runs(20, 5)
}

/// Progress steps: one per run of every VMM.
pub fn plan(ctx: &Context) -> u64 {
    u64::from(2 * ctx.warmup() + runs(ctx) + super::breakdown::runs(ctx))
}

/// Runs the scenario.
pub fn run(ctx: &Context) -> ScenarioResult {
    if ctx.settings.kernel.is_some() && !ctx.hardware_virtualization {
        return ScenarioResult::skipped(
            NAME,
            "skipped: --kernel needs hardware KVM (no vmx or svm flag in /proc/cpuinfo); this \
             host's KVM emulates guest kernel code, so a Linux kernel does not boot here",
        );
    }
    super::guarded(NAME, |result| measure(ctx, result))
}

fn measure(ctx: &Context, result: &mut ScenarioResult) -> Result<()> {
    let (spec, marker, guest) = match &ctx.settings.kernel {
        Some(kernel) => (
            BootSpec {
                kernel: kernel.into(),
                cmdline: ctx.cmdline.clone().unwrap_or_else(|| KERNEL_CMDLINE.into()),
                mem_mib: ctx.settings.mem_sizes_mib.first().copied().unwrap_or(128),
                control: false,
                setup_timings: true,
                net: None,
            },
            "",
            "kernel",
        ),
        None => (
            BootSpec {
                kernel: guests::path(guests::HELLO)?,
                cmdline: ctx.cmdline.clone().unwrap_or_default(),
                mem_mib: 128,
                control: false,
                setup_timings: true,
                net: None,
            },
            guests::HELLO_LINE,
            "hello guest",
        ),
    };
    result.notes.push(format!(
        "guest: {}, {} MiB, 1 vCPU",
        spec.kernel.display(),
        spec.mem_mib
    ));
    // One set of metrics per VMM; each run boots every VMM in turn, so a
    // change in the machine's load hits all of them alike.
    let mut sets: Vec<[Metric; 3]> = ctx
        .backends
        .iter()
        .map(|backend| {
            let subject = backend.subject();
            let param = |m: Metric| m.param("guest", guest).param("mem_mib", spec.mem_mib);
            [
                param(Metric::new(
                    "cold-boot.wall",
                    "cold boot: spawn -> guest output -> clean exit (wall)",
                    "ms",
                    subject,
                )),
                param(Metric::new(
                    "cold-boot.cpu",
                    "cold boot: VMM CPU time, user + system",
                    "ms",
                    subject,
                )),
                param(Metric::new(
                    "cold-boot.first-output",
                    "cold boot: spawn -> first guest output",
                    "ms",
                    subject,
                )),
            ]
        })
        .collect();
    // The vmm's own timings of its setup steps: (log target, metric).
    let param = |m: Metric| m.param("guest", guest).param("mem_mib", spec.mem_mib);
    let mut breakdown = [
        (
            ACPI_TIMING_TARGET,
            param(Metric::new(
                "cold-boot.acpi-tables",
                "cold boot: ACPI tables built and written (timed inside the vmm)",
                "us",
                Subject::Vmm,
            )),
        ),
        (
            MPTABLE_TIMING_TARGET,
            param(Metric::new(
                "cold-boot.mp-table",
                "cold boot: MP table built and written (timed inside the vmm)",
                "us",
                Subject::Vmm,
            )),
        ),
    ];
    ctx.repeat(runs(ctx), |warmup| {
        for (backend, [wall, cpu, first]) in ctx.backends.iter().zip(sets.iter_mut()) {
            let dir = ctx.scratch()?;
            let mut vm = backend.boot(&spec, dir.path(), ctx.timeout())?;
            let (seen, _) = vm.process.wait_for(marker, 0, ctx.timeout())?;
            let exit = vm.process.wait_exit(ctx.timeout())?;
            vm.process.check_success(&exit)?;
            let started = vm.process.started();
            wall.push(ms(exit.at - started), warmup);
            cpu.push(ms(exit.cpu), warmup);
            first.push(ms(seen - started), warmup);
            if backend.subject() == Subject::Vmm {
                let stderr = vm.process.stderr_text();
                for (target, metric) in breakdown.iter_mut() {
                    if let Some(us) = logged_build_us(&stderr, target) {
                        metric.push(us, warmup);
                    }
                }
            }
        }
        Ok(())
    })?;
    for set in sets {
        result.metrics.extend(set.into_iter().map(Metric::finish));
    }
    for backend in &ctx.backends {
        result
            .metrics
            .extend(phases(ctx, backend.as_ref(), &spec, marker, guest)?);
    }
    // A vmm that does not log a step (an older one, or ACPI off) has no
    // sample for it, and the metric is left out.
    result.metrics.extend(
        breakdown
            .into_iter()
            .filter(|(_, m)| !m.samples.is_empty())
            .map(|(_, m)| m.finish()),
    );
    Ok(())
}

/// The breakdown runs of `backend` (none for a VMM without phase marks).
fn phases(
    ctx: &Context,
    backend: &dyn crate::backend::Backend,
    spec: &BootSpec,
    marker: &str,
    guest: &str,
) -> Result<Vec<Metric>> {
    let mut steps = super::breakdown::Breakdown::new(
        "cold-boot.phase",
        "",
        "cold boot breakdown, µs to the end of",
    )
    .param("guest", guest)
    .param("mem_mib", spec.mem_mib);
    let mut supported = true;
    ctx.status(format!("{NAME}: breakdown runs"));
    ctx.repeat(super::breakdown::runs(ctx), |warmup| {
        if !supported {
            return Ok(());
        }
        let dir = ctx.scratch()?;
        let Some(mut vm) = backend.boot_with_phases(spec, dir.path(), ctx.timeout())? else {
            supported = false;
            return Ok(());
        };
        let (seen, _) = vm.process.wait_for(marker, 0, ctx.timeout())?;
        let exit = vm.process.wait_exit(ctx.timeout())?;
        vm.process.check_success(&exit)?;
        let stderr = super::breakdown::stderr_with_mark(
            &vm.process,
            "vm-ended",
            std::time::Duration::from_secs(1),
        );
        let events = [
            (FIRST_OUTPUT, vm.process.monotonic_ns(seen)),
            (REAPED, vm.process.monotonic_ns(exit.at)),
        ];
        steps.push(
            &crate::phases::steps(&stderr, vm.process.started_ns(), &events),
            warmup,
        );
        Ok(())
    })?;
    Ok(steps.finish())
}
