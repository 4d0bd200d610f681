//! The host side: runs each scenario group in a fresh outer VM, watches it,
//! tells an infrastructure failure (the outer VM panicked, froze or QEMU
//! died) from a scenario failure in a healthy outer VM, retries only the
//! first, and prints the summary.
//!
//! The outer VM prints a heartbeat every 10 s from its own init, whatever
//! the scenarios do; a scenario whose guest hangs is failed by the runner's
//! own watchdog while the heartbeats go on. So: no heartbeat for
//! [`HEARTBEAT_LIMIT`] means L1 froze (infrastructure); a group that runs
//! past its limit with heartbeats flowing is a scenario failure. A scenario
//! the runner reports as `INFRA` (a recognised emulation stall of the outer
//! VM under a guest) is retried in the next attempt's fresh outer VM too.
//! So, once, is a scenario whose guest crashed at the CPU level (triple
//! fault, KVM internal error: `report::guest_cpu_crash`); the first crash is
//! kept in the summary, and a second one is the scenario's failure.

pub mod qemu;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::catalogue::Group;
use crate::report::{self, Filing, Line, Outcome, Status};
use qemu::{L1Options, L1};

/// The outer VM must reach its `ready` line within this.
const BOOT_LIMIT: Duration = Duration::from_secs(300);
/// Silence after which the outer VM is taken as frozen.
const HEARTBEAT_LIMIT: Duration = Duration::from_secs(150);

/// What ended one outer-VM session.
#[derive(Debug, Clone, PartialEq)]
enum End {
    /// The runner finished (results are complete or the runner itself failed).
    Finished,
    /// The outer VM failed: retry the group.
    Infrastructure(String),
    /// The group ran past its limit while the outer VM stayed responsive.
    Overran(String),
}

/// Options for a run.
pub struct RunOptions {
    /// The outer VM.
    pub l1: L1Options,
    /// Outer-VM sessions to try per group.
    pub attempts: u32,
    /// The outer VM's kernel and initramfs.
    pub kernel: PathBuf,
    /// See `kernel`.
    pub initrd: PathBuf,
    /// Scratch directory shared with the outer VM (holds `env.json`).
    pub work: PathBuf,
    /// Host directories the runner in the outer VM reads (the checkout with
    /// its binaries, the cache), kept visible there even under /tmp or /run.
    pub keep: Vec<PathBuf>,
    /// The runner binary (run inside the outer VM, from the host's tree).
    pub runner: PathBuf,
}

/// Everything a run found.
#[derive(Default)]
pub struct Summary {
    /// Final result per scenario, in catalogue order.
    pub outcomes: Vec<Outcome>,
    /// Scenarios no healthy outer VM got to run, with why.
    pub not_run: Vec<(String, String)>,
    /// Each infrastructure failure that was retried or gave up.
    pub infrastructure: Vec<String>,
    /// Each guest crash that was rerun (its first failure).
    pub crash_reruns: Vec<String>,
    /// Wall time.
    pub secs: f64,
}

/// Runs `groups` and returns what happened (printing progress as it goes).
pub fn run(opts: &RunOptions, groups: &[&Group]) -> Summary {
    let t0 = Instant::now();
    let mut summary = Summary::default();
    for group in groups {
        run_group(opts, group, &mut summary);
    }
    summary.secs = t0.elapsed().as_secs_f64();
    summary
}

fn run_group(opts: &RunOptions, group: &Group, summary: &mut Summary) {
    let mut results: BTreeMap<String, Outcome> = BTreeMap::new();
    let mut last_infra = String::new();
    // Scenarios reported INFRA in the latest attempt.
    let mut stalled: BTreeMap<String, Outcome> = BTreeMap::new();
    // Scenarios whose guest crashed once (in any attempt), with that failure.
    let mut crashed: BTreeMap<String, Outcome> = BTreeMap::new();
    for attempt in 1..=opts.attempts {
        let pending: Vec<&str> = group
            .scenarios
            .iter()
            .copied()
            .filter(|s| !results.contains_key(*s))
            .collect();
        if pending.is_empty() {
            break;
        }
        println!(
            "== group {} (attempt {attempt}/{}): {}",
            group.name, opts.attempts, group.about
        );
        stalled.clear();
        let crashed_before: Vec<String> = crashed.keys().cloned().collect();
        let mut filed = Filed {
            results: &mut results,
            stalled: &mut stalled,
            crashed: &mut crashed,
        };
        let (end, current) = match session(opts, group, attempt, &mut filed) {
            Ok(x) => x,
            Err(e) => (End::Infrastructure(format!("cannot start QEMU: {e}")), None),
        };
        // Scenarios whose guest crashed for the first time in this attempt.
        let crashed_now: Vec<String> = crashed
            .keys()
            .filter(|k| !crashed_before.contains(k))
            .cloned()
            .collect();
        let rerun = !crashed_now.is_empty() && attempt < opts.attempts;
        let last = attempt == opts.attempts;
        let note = |o: &Outcome, then: &str| {
            format!(
                "group {} attempt {attempt}: {}: {}; {then}",
                group.name, o.name, o.detail
            )
        };
        for o in crashed_now.iter().map(|name| &crashed[name]) {
            summary.crash_reruns.push(note(
                o,
                if last {
                    "the guest crashed and no attempt is left to rerun it"
                } else {
                    "the guest crashed: rerunning it once in a fresh outer VM"
                },
            ));
        }
        for o in stalled.values() {
            let then = if last {
                "no attempts left"
            } else {
                "retrying in a fresh outer VM"
            };
            summary.infrastructure.push(note(o, then));
            last_infra = o.detail.clone();
        }
        match end {
            End::Finished if !stalled.is_empty() && attempt < opts.attempts => {
                println!(
                    "INFRASTRUCTURE group {} attempt {attempt}: the outer VM stalled under {}; \
                     retrying them in a fresh outer VM",
                    group.name,
                    stalled.keys().cloned().collect::<Vec<_>>().join(", ")
                );
            }
            End::Finished if rerun => {
                println!(
                    "GUEST CRASH group {} attempt {attempt}: rerunning {} once in a fresh outer VM",
                    group.name,
                    crashed_now.join(", ")
                );
            }
            End::Finished => {
                // A runner that ended without reporting a scenario failed it
                // (one that stalled on the last attempt could not run; one
                // whose guest crashed with no attempt left failed with that).
                for s in group.scenarios {
                    if let Some(o) = crashed.get(*s).filter(|_| !results.contains_key(*s)) {
                        results.insert(s.to_string(), o.clone());
                    }
                    if !results.contains_key(*s) && !stalled.contains_key(*s) {
                        let o = Outcome {
                            name: s.to_string(),
                            status: Status::Fail,
                            secs: 0.0,
                            detail: "the runner ended without reporting it (see the L1 log)".into(),
                        };
                        println!("{o}");
                        results.insert(s.to_string(), o);
                    }
                }
                break;
            }
            End::Overran(why) => {
                let name = current.unwrap_or_else(|| pending[0].to_string());
                let o = Outcome {
                    name: name.clone(),
                    status: Status::Fail,
                    secs: 0.0,
                    detail: why,
                };
                println!("{o}");
                results.insert(name, o);
                for s in group.scenarios {
                    if !results.contains_key(*s) && !crashed.contains_key(*s) {
                        summary.not_run.push((
                            s.to_string(),
                            format!("group {} overran its time limit first", group.name),
                        ));
                    }
                }
                break;
            }
            End::Infrastructure(why) => {
                let retry = attempt < opts.attempts;
                let msg = format!(
                    "group {} attempt {attempt}: {why}{}",
                    group.name,
                    if retry {
                        "; retrying in a fresh outer VM"
                    } else {
                        "; no attempts left"
                    }
                );
                println!("INFRASTRUCTURE {msg}");
                summary.infrastructure.push(msg);
                last_infra = why;
            }
        }
    }
    for s in group.scenarios {
        // A crash whose rerun never ran (the outer VM kept failing) stands.
        match results.remove(*s).or_else(|| crashed.remove(*s)) {
            Some(o) => summary.outcomes.push(o),
            None => {
                if !summary.not_run.iter().any(|(n, _)| n == s) {
                    summary.not_run.push((
                        s.to_string(),
                        format!(
                            "it could not run in {} outer VM(s); last: {last_infra}",
                            opts.attempts
                        ),
                    ));
                }
            }
        }
    }
}

/// Where one group's results are filed as the runner reports them.
struct Filed<'a> {
    /// Final verdicts.
    results: &'a mut BTreeMap<String, Outcome>,
    /// Scenarios the outer VM stalled under in this attempt.
    stalled: &'a mut BTreeMap<String, Outcome>,
    /// Scenarios whose guest crashed once, in any attempt.
    crashed: &'a mut BTreeMap<String, Outcome>,
}

impl Filed<'_> {
    /// Files one result (see `report::filing`).
    fn file(&mut self, o: Outcome) {
        let first = self.crashed.get(&o.name).cloned();
        match report::filing(&o, first.is_some()) {
            Filing::Stalled => {
                self.stalled.insert(o.name.clone(), o);
            }
            Filing::CrashRerun => {
                self.crashed.insert(o.name.clone(), o);
            }
            Filing::Final => {
                let mut o = o;
                if let (Some(first), Status::Fail) = (first, o.status) {
                    o.detail =
                        format!("{} (its first run crashed too: {})", o.detail, first.detail);
                }
                self.results.insert(o.name.clone(), o);
            }
        }
    }
}

/// Runs one outer-VM session of `group`, recording results as they come.
/// Returns how it ended and the scenario running at the end.
fn session(
    opts: &RunOptions,
    group: &Group,
    attempt: u32,
    filed: &mut Filed<'_>,
) -> std::io::Result<(End, Option<String>)> {
    let logs = opts.work.join("logs");
    std::fs::create_dir_all(&logs)?;
    let script = opts.work.join(format!("l1-{}-{attempt}.sh", group.name));
    // Everything of the group in the catalogue but what is still to run here
    // (`group` may be a `--scenario` selection of it).
    let full = crate::catalogue::group(group.name).map_or(group.scenarios, |g| g.scenarios);
    let skip: Vec<&str> = full
        .iter()
        .copied()
        .filter(|s| filed.results.contains_key(*s) || !group.scenarios.contains(s))
        .collect();
    // The runner runs from the outer VM's memory (its /run is a tmpfs), not
    // from the host's tree over 9p: its watchdog must still run, paging in
    // code it has not run yet, when the 9p share stops answering.
    std::fs::write(
        &script,
        format!(
            "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root\n\
             cp {} /run/rg-runner || exit 1\n\
             exec /run/rg-runner inner --env {} --group {} --skip '{}' --attempt {attempt}\n",
            opts.runner.display(),
            opts.work.join("env.json").display(),
            group.name,
            skip.join(",")
        ),
    )?;
    let log = logs.join(format!("l1-{}-{attempt}.log", group.name));
    println!("   outer VM console: {}", log.display());
    println!(
        "   guests' logs: {}",
        logs.join(crate::inner::logs_dir(group.name, attempt))
            .display()
    );
    let mut l1 = L1::start(
        &opts.l1,
        &opts.kernel,
        &opts.initrd,
        &opts.work,
        &opts.keep,
        &script,
        &log,
    )?;
    let started = Instant::now();
    let mut ready: Option<Instant> = None;
    let mut last_beat = Instant::now();
    let mut current: Option<String> = None;
    let mut done = false;
    let end = loop {
        match l1.lines.recv_timeout(Duration::from_millis(500)) {
            Ok(line) => {
                if line.contains("L1-HEARTBEAT") {
                    last_beat = Instant::now();
                    continue;
                }
                if line.contains("L1: ready") && ready.is_none() {
                    ready = Some(Instant::now());
                    last_beat = Instant::now();
                    println!(
                        "   outer VM ready in {:.0} s{}",
                        started.elapsed().as_secs_f64(),
                        if line.contains("kvm=no") {
                            " (but it has no /dev/kvm)"
                        } else {
                            ""
                        }
                    );
                }
                if line.contains("L1-DONE") {
                    done = true;
                }
                if line.contains("Kernel panic - not syncing") {
                    break End::Infrastructure(format!("its kernel panicked: {line}"));
                }
                if line.contains("BUG: ") || line.contains("watchdog: BUG") {
                    println!("   outer VM kernel: {line}");
                }
                match report::parse(&line) {
                    Some(Line::Start(name)) => {
                        println!(".. {name}");
                        current = Some(name);
                    }
                    Some(Line::Info(name, text)) => println!("   {name}: {text}"),
                    Some(Line::Abandon(why)) => {
                        break End::Infrastructure(format!("the runner gave up on it: {why}"));
                    }
                    Some(Line::Result(o)) => {
                        println!("{o}");
                        current = None;
                        filed.file(o);
                    }
                    None => {}
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                // QEMU's output ended: it exited.
                let status = l1.exited();
                if done {
                    break End::Finished;
                }
                break End::Infrastructure(format!(
                    "QEMU ended ({}) before the scenarios finished",
                    status.map_or("no status".into(), |s| s.to_string())
                ));
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if ready.is_none() && started.elapsed() > BOOT_LIMIT {
            break End::Infrastructure(format!(
                "the outer VM did not boot within {} s",
                BOOT_LIMIT.as_secs()
            ));
        }
        if ready.is_some() && last_beat.elapsed() > HEARTBEAT_LIMIT {
            break End::Infrastructure(format!(
                "the outer VM froze: no heartbeat for {} s{}",
                HEARTBEAT_LIMIT.as_secs(),
                current
                    .as_ref()
                    .map(|c| format!(" (during {c})"))
                    .unwrap_or_default()
            ));
        }
        if started.elapsed() > group.limit {
            break End::Overran(format!(
                "the group ran past its limit of {} min while the outer VM stayed responsive",
                group.limit.as_secs() / 60
            ));
        }
    };
    if !matches!(end, End::Finished) {
        l1.kill();
    } else {
        // It powers itself off after L1-DONE.
        let deadline = Instant::now() + Duration::from_secs(60);
        while l1.exited().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok((end, current))
}

/// Prints the summary; returns the process exit code: 0 all passed, 1 a
/// scenario failed, 3 some scenarios could not run (infrastructure) and
/// none failed.
pub fn print_summary(s: &Summary) -> i32 {
    println!();
    println!("== real-guest summary ({:.0} s)", s.secs);
    for o in &s.outcomes {
        println!("{o}");
    }
    for (name, why) in &s.not_run {
        println!("NOT RUN {name}: {why}");
    }
    println!("infrastructure retries: {}", s.infrastructure.len());
    for i in &s.infrastructure {
        println!("  {i}");
    }
    println!("guest crashes rerun: {}", s.crash_reruns.len());
    for c in &s.crash_reruns {
        println!("  {c}");
    }
    let passed = s
        .outcomes
        .iter()
        .filter(|o| o.status == Status::Pass)
        .count();
    let failed = s.outcomes.len() - passed;
    if !s.not_run.is_empty() {
        println!(
            "WARNING: {} scenario(s) could not run because the outer VM kept failing \
             (infrastructure, not a product failure): {}",
            s.not_run.len(),
            s.not_run
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        1
    } else if !s.not_run.is_empty() {
        3
    } else {
        0
    }
}
