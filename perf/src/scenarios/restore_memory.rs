//! restore-memory: what a restore costs when the snapshot holds memory, for
//! each way of backing and filling guest memory: private (anonymous) or
//! shared (a memfd, as vhost-user backends such as virtiofsd need), filled
//! from the memory file (`--memory-backend file`: a private mapping, or for
//! shared memory a copy into the new memfd) or through userfaultfd (`uffd`:
//! on first touch, and for shared memory also in the background).
//!
//! The dirtier guest writes half its RAM pages (of the first GiB) on every
//! pass; it is snapshotted after two passes. Two clocks per restore, both
//! from immediately before `fork` of the restoring vmm:
//! * ready: until its control socket accepts a connection, which the vmm
//!   binds once the restore is done and the vCPUs are about to run;
//! * re-dirtied: until the guest prints its next `pass=` line, i.e. it has
//!   touched every page it dirtied again (the whole restored working set).

use std::time::Instant;

use crate::backend::vmm::VmmBackend;
use crate::backend::{Backend, BootSpec, SnapshotKind, Subject};
use crate::error::Result;
use crate::guests;
use crate::results::{Metric, ScenarioResult};
use crate::runner::{ms, Context};

/// Scenario name.
pub const NAME: &str = "restore-memory";

/// Thousandths of the guest's pages the dirtier writes.
const PERMILLE: u64 = 500;

/// The (memory, backend) pairs measured.
const MODES: [(&str, &str); 4] = [
    ("private", "file"),
    ("private", "uffd"),
    ("shared", "file"),
    ("shared", "uffd"),
];

fn runs(ctx: &Context) -> u32 {
    ctx.runs(10, 3)
}

/// Progress steps: one per run of every mode, per memory size.
pub fn plan(ctx: &Context) -> u64 {
    (ctx.settings.mem_sizes_mib.len() * MODES.len()) as u64 * u64::from(ctx.warmup() + runs(ctx))
}

/// Runs the scenario (the vmm only: Firecracker has no shared-memory mode).
pub fn run(ctx: &Context) -> ScenarioResult {
    if let Some(reason) = ctx.backends.iter().find_map(|b| b.restore_unsupported()) {
        return ScenarioResult::skipped(NAME, reason);
    }
    super::guarded(NAME, |result| measure(ctx, result))
}

fn measure(ctx: &Context, result: &mut ScenarioResult) -> Result<()> {
    result.notes.push(format!(
        "dirtier guest, permille={PERMILLE} (of the first GiB of RAM), snapshotted after two passes"
    ));
    for &mem_mib in &ctx.settings.mem_sizes_mib {
        for (memory, fill) in MODES {
            let backend =
                VmmBackend::with_memory(ctx.vmm.clone(), Some(fill.into()), Some(memory.into()));
            ctx.status(format!(
                "{NAME} ({memory}/{fill}, {mem_mib} MiB): taking the snapshot"
            ));
            let snapshot_dir = ctx.scratch()?;
            let snapshot = snapshot_dir.path().join("snapshot");
            let vm_dir = ctx.scratch()?;
            let spec = BootSpec {
                kernel: guests::path(guests::DIRTIER)?,
                cmdline: format!("console=ttyS0 permille={PERMILLE}"),
                mem_mib,
                control: true,
                setup_timings: false,
                net: None,
            };
            let mut vm = backend.boot(&spec, vm_dir.path(), ctx.timeout())?;
            vm.process.wait_for("pass=2", 0, ctx.timeout())?;
            backend.pause(&mut vm)?;
            backend.snapshot(&mut vm, &snapshot, SnapshotKind::Full)?;
            vm.process.kill();

            let id = |what: &str| {
                format!(
                    "restore_memory.{what}.{memory}_{fill}.{}",
                    super::mem_id(mem_mib)
                )
            };
            let metric = |what: &str, label: &str| {
                Metric::new(
                    id(what),
                    format!("restore {memory}/{fill}, {mem_mib} MiB: {label}"),
                    "ms",
                    Subject::Vmm,
                )
                .param("mem_mib", mem_mib)
                .param("memory", memory)
                .param("memory_backend", fill)
            };
            let mut ready = metric("ready", "spawn -> ready to run");
            let mut redirtied = metric("redirtied", "spawn -> working set touched again");
            ctx.status(format!("{NAME} ({memory}/{fill}, {mem_mib} MiB)"));
            ctx.repeat(runs(ctx), |warmup| {
                let dir = ctx.scratch()?;
                let mut vm = backend.restore(&snapshot, dir.path(), true, ctx.timeout())?;
                let connected = Instant::now();
                ready.push(ms(connected - vm.process.started()), warmup);
                let (seen, _) = vm.process.wait_for("pass=", 0, ctx.timeout())?;
                redirtied.push(ms(seen - vm.process.started()), warmup);
                vm.process.kill();
                Ok(())
            })?;
            result.metrics.push(ready.finish());
            result.metrics.push(redirtied.finish());
        }
    }
    Ok(())
}
