//! density: how many idle sessions restored from one snapshot fit in this
//! host's memory.
//!
//! One full snapshot of an idle counter guest of [`MEM_MIB`] MiB is taken
//! per VMM (the guest counts a few more times after the snapshot and then
//! halts for good: `halt_after`); then, per count N, N VMM processes
//! restore it at once, and once every guest has printed (it runs) and gone
//! idle (`counter: idle`, its vCPU in HLT), and after a settle time, the
//! `Rss` and `Pss` of every VMM process are read from
//! /proc/PID/smaps_rollup. Pss divides each page by the number of
//! processes mapping it, so the snapshot's page-cache pages that every
//! restored VM maps count once across the N: the Pss sum is what the N
//! sessions cost the host, and MemTotal over the Pss per session is how
//! many would fit.

use std::time::{Duration, Instant};

use crate::backend::{Backend, SnapshotKind, Subject, Vm};
use crate::error::{PerfError, Result};
use crate::results::{Metric, ScenarioResult};
use crate::runner::{ms, Context, ScratchDir};
use crate::smaps;

/// Scenario name.
pub const NAME: &str = "density";
/// Guest memory of the snapshot every session is restored from, MiB.
pub const MEM_MIB: u64 = 512;
/// Wait after every guest is idle before reading memory; the VMMs' CPU time
/// is measured over it.
pub const SETTLE: Duration = Duration::from_millis(500);
/// The line the counter guest prints when it stops in its HLT loop.
pub const IDLE_LINE: &str = "counter: idle";
/// Counts the guest prints before it idles (`halt_after`): the snapshot is
/// taken after the first, so a restored guest prints the second (or the
/// rest of it) and its idle line, then halts.
const HALT_AFTER: u64 = 2;
/// The guest's `interval=`s tried in turn, shortest first, until the VMM is
/// paused before the guest reaches its idle loop: the shortest that works
/// keeps what each restored guest counts before it idles short (an
/// increment takes about a nanosecond on hardware KVM, microseconds on an
/// emulating one, so one host needs a longer interval than another).
const INTERVALS: &[u64] = &[
    1 << 10,
    1 << 13,
    1 << 16,
    1 << 19,
    1 << 22,
    1 << 25,
    1 << 28,
];
/// How long a paused VMM's last serial bytes may take to reach perf.
const OUTPUT_DRAIN: Duration = Duration::from_millis(50);

fn runs(ctx: &Context) -> u32 {
    ctx.runs(3, 1)
}

/// Progress steps: one per round of every VMM and count.
pub fn plan(ctx: &Context) -> u64 {
    ctx.backends.len() as u64 * ctx.settings.density_counts.len() as u64 * u64::from(runs(ctx))
}

/// Runs the scenario.
pub fn run(ctx: &Context) -> ScenarioResult {
    if let Some(reason) = ctx.backends.iter().find_map(|b| b.restore_unsupported()) {
        return ScenarioResult::skipped(NAME, reason);
    }
    super::guarded(NAME, |result| measure(ctx, result))
}

/// A snapshot of the idle guest, kept on disk until dropped.
struct IdleSnapshot {
    _dir: ScratchDir,
    path: std::path::PathBuf,
    cmdline: String,
}

/// What one round of N restores measured.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Reading {
    rss_kib: u64,
    pss_kib: u64,
    /// CPU time of all N VMM processes over [`SETTLE`], in % of one core.
    cpu_percent: f64,
}

/// The metrics of one VMM and count.
struct Count {
    rss: Metric,
    pss: Metric,
    per_session: Metric,
    fit: Metric,
    cpu: Metric,
}

impl Count {
    fn new(subject: Subject, n: u64) -> Self {
        let metric = |what: &str, label: &str, unit: &str| {
            Metric::new(
                format!("{NAME}.{what}.n{n}"),
                format!("{label}, {n} idle VMs restored from one {MEM_MIB} MiB snapshot"),
                unit,
                subject,
            )
            .param("sessions", n)
            .param("mem_mib", MEM_MIB)
        };
        Count {
            rss: metric("rss-sum", "sum of Rss", "MiB"),
            pss: metric("pss-sum", "sum of Pss", "MiB"),
            per_session: metric("pss-per-session", "Pss per VM", "MiB"),
            fit: metric("fit-in-host", "MemTotal / Pss per VM", "sessions").higher_is_better(),
            cpu: metric("cpu", "CPU of all VMMs while idle, % of one core", "%"),
        }
    }

    fn push(&mut self, r: Reading, n: u64, mem_total_kib: u64) {
        let per_session_kib = r.pss_kib as f64 / n as f64;
        self.rss.push(kib_to_mib(r.rss_kib as f64), false);
        self.pss.push(kib_to_mib(r.pss_kib as f64), false);
        self.per_session.push(kib_to_mib(per_session_kib), false);
        self.fit
            .push(fit_in_host(mem_total_kib, per_session_kib), false);
        self.cpu.push(r.cpu_percent, false);
    }

    fn finish(self) -> [Metric; 5] {
        [
            self.rss.finish(),
            self.pss.finish(),
            self.per_session.finish(),
            self.fit.finish(),
            self.cpu.finish(),
        ]
    }
}

fn kib_to_mib(kib: f64) -> f64 {
    kib / 1024.0
}

/// Whole sessions of `per_session_kib` that fit in `mem_total_kib`.
fn fit_in_host(mem_total_kib: u64, per_session_kib: f64) -> f64 {
    if per_session_kib <= 0.0 {
        return 0.0;
    }
    (mem_total_kib as f64 / per_session_kib).floor()
}

fn measure(ctx: &Context, result: &mut ScenarioResult) -> Result<()> {
    let mem_total_kib = mem_total_kib()?;
    let mut snapshots = Vec::new();
    for backend in &ctx.backends {
        ctx.status(format!(
            "{NAME} ({}): snapshot of the idle guest",
            backend.subject()
        ));
        snapshots.push(idle_snapshot(ctx, backend.as_ref())?);
    }
    let guests: Vec<String> = ctx
        .backends
        .iter()
        .zip(&snapshots)
        .map(|(b, s)| format!("{}: {}", b.subject(), s.cmdline))
        .collect();
    result.notes.push(format!(
        "counter guest ({}), {MEM_MIB} MiB, 1 vCPU, one full snapshot per VMM; per round N VMMs \
         restore it at once; Rss and Pss from /proc/PID/smaps_rollup of each VMM process and its children (the vmm's keeper) {} ms after every guest \
         printed {IDLE_LINE:?} (its vCPU halted); fit-in-host = MemTotal ({} MiB) / Pss per VM; \
         guest memory in the kernel (KVM's page tables) is not in smaps",
        guests.join("; "),
        SETTLE.as_millis(),
        mem_total_kib / 1024
    ));
    for &n in &ctx.settings.density_counts {
        for (backend, snapshot) in ctx.backends.iter().zip(&snapshots) {
            let subject = backend.subject();
            let mut m = Count::new(subject, n);
            for _ in 0..runs(ctx) {
                ctx.status(format!("{NAME} ({subject}, {n} VMs)"));
                let r = round(ctx, backend.as_ref(), snapshot, n)?;
                m.push(r, n, mem_total_kib);
                ctx.progress.inc(1);
            }
            result.metrics.extend(m.finish());
        }
    }
    Ok(())
}

/// This host's MemTotal, KiB.
fn mem_total_kib() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")
        .map_err(PerfError::io("cannot read", "/proc/meminfo"))?;
    text.lines()
        .find_map(|l| {
            l.strip_prefix("MemTotal:")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .ok_or_else(|| PerfError::Guest("/proc/meminfo has no MemTotal line".into()))
}

/// A full snapshot of the counter guest still counting toward its idle
/// loop: tries each of [`INTERVALS`] until the VMM is paused before the
/// guest got there.
fn idle_snapshot(ctx: &Context, backend: &dyn Backend) -> Result<IdleSnapshot> {
    for &interval in INTERVALS {
        let cmdline = format!("interval={interval} halt_after={HALT_AFTER}");
        if let Some(s) = try_idle_snapshot(ctx, backend, &cmdline)? {
            return Ok(s);
        }
    }
    Err(PerfError::Guest(format!(
        "the counter guest went idle before {} could pause it, even with interval={}",
        backend.subject(),
        INTERVALS.last().copied().unwrap_or_default()
    )))
}

/// Boots the guest with `cmdline`, pauses it after its first count and
/// snapshots it; `None` when it had gone idle by then.
fn try_idle_snapshot(
    ctx: &Context,
    backend: &dyn Backend,
    cmdline: &str,
) -> Result<Option<IdleSnapshot>> {
    let (_vm_dir, mut vm) = super::prepare::boot_counter_paused(ctx, backend, cmdline, MEM_MIB)?;
    std::thread::sleep(OUTPUT_DRAIN);
    if String::from_utf8_lossy(&vm.process.output()).contains(IDLE_LINE) {
        vm.process.kill();
        return Ok(None);
    }
    let dir = ctx.scratch()?;
    let path = dir.path().join("snapshot");
    backend.snapshot(&mut vm, &path, SnapshotKind::Full)?;
    vm.process.kill();
    Ok(Some(IdleSnapshot {
        _dir: dir,
        path,
        cmdline: cmdline.into(),
    }))
}

/// Restores `n` VMs from `snapshot` at once, waits until each has printed
/// and gone idle, lets them settle and reads their memory; every VMM is
/// killed and reaped when this returns, also on an error (dropping a
/// [`Vm`] kills its process).
fn round(ctx: &Context, backend: &dyn Backend, snapshot: &IdleSnapshot, n: u64) -> Result<Reading> {
    let mut dirs = Vec::new();
    let mut vms: Vec<Vm> = Vec::new();
    for _ in 0..n {
        let dir = ctx.scratch()?;
        vms.push(backend.restore(&snapshot.path, dir.path(), false, ctx.timeout())?);
        dirs.push(dir);
    }
    for vm in &mut vms {
        // Runs again: its first byte since the restore.
        vm.process.wait_for("", 0, ctx.timeout())?;
    }
    for vm in &mut vms {
        vm.process.wait_for(IDLE_LINE, 0, ctx.timeout())?;
    }
    // Each VMM process with its children: our vmm's keeper (which holds
    // the VM fd for the teardown) is part of what a VM costs.
    let pids: Vec<u32> = vms
        .iter()
        .flat_map(|vm| with_children(vm.process.pid()))
        .collect();
    let cpu_before = cpu_time(&pids)?;
    let t = Instant::now();
    std::thread::sleep(SETTLE);
    let cpu = cpu_time(&pids)?.saturating_sub(cpu_before);
    let window = t.elapsed();
    let mut reading = Reading {
        rss_kib: 0,
        pss_kib: 0,
        cpu_percent: 100.0 * ms(cpu) / ms(window),
    };
    for &pid in &pids {
        let r = smaps::rollup(pid)?;
        reading.rss_kib += r.rss_kib;
        reading.pss_kib += r.pss_kib;
    }
    for vm in &mut vms {
        vm.process.kill();
    }
    Ok(reading)
}

/// `pid` and its children (of any of its threads).
fn with_children(pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten();
    for task in tasks {
        let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        out.extend(
            children
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok()),
        );
    }
    out
}

/// User + system CPU time of the processes `pids`, all their threads.
fn cpu_time(pids: &[u32]) -> Result<Duration> {
    // SAFETY: sysconf has no preconditions.
    let ticks_per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let mut ticks = 0;
    for &pid in pids {
        let path = format!("/proc/{pid}/stat");
        let text = std::fs::read_to_string(&path).map_err(PerfError::io("cannot read", &path))?;
        ticks += stat_cpu_ticks(&text)
            .ok_or_else(|| PerfError::Guest(format!("{path} does not parse: {text:?}")))?;
    }
    Ok(Duration::from_secs_f64(ticks as f64 / ticks_per_s as f64))
}

/// utime + stime (clock ticks) from the text of /proc/PID/stat.
fn stat_cpu_ticks(text: &str) -> Option<u64> {
    // The command name is in parentheses and may hold spaces: fields are
    // counted after its closing one, from field 3 (the state).
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_counted_with_its_children() {
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(sh.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let child: u32 = line.trim().parse().unwrap();
        let family = with_children(sh.id());
        let _ = std::process::Command::new("kill")
            .arg(child.to_string())
            .status();
        let _ = sh.kill();
        let _ = sh.wait();
        assert_eq!(family, vec![sh.id(), child]);
    }

    #[test]
    fn cpu_ticks_are_read_after_the_command_name() {
        let stat = "1234 (vmm (x) y) S 1 1234 1234 0 -1 4194560 500 0 0 0 17 5 0 0 20 0 3 0 \
                    100 1000 200";
        assert_eq!(stat_cpu_ticks(stat), Some(22));
        assert_eq!(stat_cpu_ticks("1234 (vmm) S 1"), None);
    }

    #[test]
    fn sessions_that_fit_are_whole() {
        assert_eq!(fit_in_host(1024 * 1024, 1000.0), 1048.0);
        assert_eq!(fit_in_host(1024, 0.0), 0.0);
    }

    #[test]
    fn a_round_gives_sums_and_per_session_figures() {
        let mut c = Count::new(Subject::Vmm, 4);
        let r = Reading {
            rss_kib: 40 * 1024,
            pss_kib: 8 * 1024,
            cpu_percent: 0.5,
        };
        c.push(r, 4, 16 * 1024 * 1024);
        let [rss, pss, per, fit, cpu] = c.finish();
        assert_eq!(rss.id, "density.rss-sum.n4");
        assert_eq!(rss.samples, [40.0]);
        assert_eq!(pss.samples, [8.0]);
        assert_eq!(per.samples, [2.0]);
        assert_eq!(fit.samples, [8192.0]);
        assert!(!fit.lower_is_better);
        assert_eq!(cpu.samples, [0.5]);
    }
}
