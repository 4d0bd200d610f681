//! The host side: runs each scenario group in a fresh outer VM, watches it
//! (`session`), tells an infrastructure failure (the outer VM panicked,
//! froze or QEMU died) from a scenario failure in a healthy outer VM,
//! retries only the first, and prints the summary.
//!
//! Retrying must not hide a product failure (`evidence`): scenarios that no
//! healthy outer VM got to run fail unless every infrastructure failure of
//! their group names the outer machine. A scenario the runner reports as
//! `INFRA` (a recognised emulation stall of the outer VM under a guest) is
//! retried in the next attempt's fresh outer VM too. So, once, is a scenario
//! whose guest crashed at the CPU level (triple fault, KVM internal error:
//! `report::guest_cpu_crash`) unless the vmm's report shows state it wrote;
//! every crash is kept in the summary, a second one is the scenario's
//! failure, and so is a crash seen in another recent run (`crashes`).

pub mod crashes;
pub mod evidence;
pub mod qemu;
mod session;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Instant;

use crate::catalogue::Group;
use crate::report::{self, Filing, Outcome, Status};
use evidence::Infra;
use qemu::L1Options;

/// What ended one outer-VM session.
#[derive(Debug, Clone, PartialEq)]
enum End {
    /// The runner finished (results are complete or the runner itself failed).
    Finished,
    /// The outer VM failed: retry the group.
    Infrastructure(Infra),
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
    /// Where guest CPU crashes are recorded across runs (`crashes`);
    /// `None`: not recorded, and no crash is compared with earlier runs.
    pub crash_history: Option<PathBuf>,
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
    /// Each guest CPU crash: its scenario and what became of it.
    pub crashes: Vec<(String, String)>,
    /// Wall time.
    pub secs: f64,
}

/// Runs `groups` and returns what happened (printing progress as it goes).
pub fn run(opts: &RunOptions, groups: &[&Group]) -> Summary {
    let t0 = Instant::now();
    let mut summary = Summary::default();
    for group in groups {
        run_group(
            opts.attempts,
            group,
            &mut summary,
            &mut |group, attempt, filed| {
                session::run(opts, group, attempt, filed).unwrap_or_else(|e| {
                    (
                        End::Infrastructure(Infra::named(
                            format!("cannot start QEMU: {e}"),
                            "QEMU did not start, before anything of the product ran",
                        )),
                        None,
                    )
                })
            },
        );
    }
    if let Some(path) = &opts.crash_history {
        compare_crashes(path, &mut summary);
    }
    summary.secs = t0.elapsed().as_secs_f64();
    summary
}

/// Records this run's guest CPU crashes in the history at `path`, and fails
/// each scenario that crashed in this run and in another recent one.
fn compare_crashes(path: &std::path::Path, summary: &mut Summary) {
    let mut history = match crashes::History::load(path) {
        Ok(h) => h,
        Err(e) => {
            // Not overwritten: a history that cannot be read is kept for a
            // person to look at.
            println!("CRASH HISTORY not compared: {e}");
            return;
        }
    };
    let run = crashes::RunRecord {
        ended_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        ran: summary.outcomes.iter().map(|o| o.name.clone()).collect(),
        crashed: summary
            .crashes
            .iter()
            .map(|(s, _)| s.clone())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect(),
    };
    for (name, runs) in history.repeated(&run) {
        let why = format!(
            "its guest crashed at the CPU level in {runs} of the last {} runs recorded in {} \
             (this one included): a crash that comes back is the product's until shown \
             otherwise",
            crashes::WINDOW,
            path.display()
        );
        println!("REPEATED CRASH {name}: {why}");
        if let Some(o) = summary.outcomes.iter_mut().find(|o| o.name == name) {
            o.detail = if o.status == Status::Pass {
                format!("{why}; this run's rerun passed: {}", o.detail)
            } else {
                format!("{}; {why}", o.detail)
            };
            o.status = Status::Fail;
        }
    }
    history.push(run);
    if let Err(e) = history.save(path) {
        println!("CRASH HISTORY not saved: {e}");
    }
}

/// One outer-VM session of a group's attempt: how it ended and the
/// scenario running then (`session::run`, or a recorded stand-in in tests).
type SessionFn<'s> = dyn FnMut(&Group, u32, &mut Filed<'_>) -> (End, Option<String>) + 's;

/// Runs `group` in up to `attempts` outer-VM sessions through `session`,
/// adding its outcomes and what could not run to `summary`.
fn run_group(attempts: u32, group: &Group, summary: &mut Summary, session: &mut SessionFn<'_>) {
    let mut results: BTreeMap<String, Outcome> = BTreeMap::new();
    // Every infrastructure failure of this group, with its evidence.
    let mut failures: Vec<Infra> = Vec::new();
    // Scenarios reported INFRA in the latest attempt.
    let mut stalled: BTreeMap<String, (Outcome, Option<String>)> = BTreeMap::new();
    // Scenarios whose guest crashed once (in any attempt), with that failure.
    let mut crashed: BTreeMap<String, Outcome> = BTreeMap::new();
    for attempt in 1..=attempts {
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
            "== group {} (attempt {attempt}/{attempts}): {}",
            group.name, group.about
        );
        stalled.clear();
        let crashed_before: Vec<String> = crashed.keys().cloned().collect();
        let mut filed = Filed {
            results: &mut results,
            stalled: &mut stalled,
            crashed: &mut crashed,
        };
        let (end, current) = session(group, attempt, &mut filed);
        // Scenarios whose guest crashed for the first time in this attempt.
        let crashed_now: Vec<String> = crashed
            .keys()
            .filter(|k| !crashed_before.contains(k))
            .cloned()
            .collect();
        let rerun = !crashed_now.is_empty() && attempt < attempts;
        let last = attempt == attempts;
        let note = |name: &str, detail: &str, then: &str| {
            format!(
                "group {} attempt {attempt}: {name}: {detail}; {then}",
                group.name
            )
        };
        for o in crashed_now.iter().map(|name| &crashed[name]) {
            let then = if last {
                "the guest crashed and no attempt is left to rerun it"
            } else {
                "the guest crashed: rerunning it once in a fresh outer VM"
            };
            summary
                .crashes
                .push((o.name.clone(), note(&o.name, &o.detail, then)));
        }
        for (o, state) in stalled.values() {
            let then = if last {
                "no attempts left"
            } else {
                "retrying in a fresh outer VM"
            };
            let infra = Infra {
                why: note(&o.name, &o.detail, then),
                // The runner marks only a stall it recognised as the outer
                // VM's emulation.
                signature: Some(o.detail.clone()),
                state: state.clone(),
            };
            summary.infrastructure.push(infra.describe());
            failures.push(infra);
        }
        match end {
            End::Finished if !stalled.is_empty() && attempt < attempts => {
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
                            detail: "the runner ended without reporting it (see the runner's log)"
                                .into(),
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
            End::Infrastructure(mut infra) => {
                infra.why = format!(
                    "group {} attempt {attempt}: {}{}",
                    group.name,
                    infra.why,
                    if attempt < attempts {
                        "; retrying in a fresh outer VM"
                    } else {
                        "; no attempts left"
                    }
                );
                println!("INFRASTRUCTURE {}", infra.describe());
                summary.infrastructure.push(infra.describe());
                failures.push(infra);
            }
        }
    }
    for s in group.scenarios {
        if let Some(o) = results.get(*s) {
            if o.status == Status::Fail && report::guest_cpu_crash(&o.detail) {
                // A crash filed as the verdict (a second one, or on state the
                // vmm wrote) is in the summary's crash list too.
                if !summary
                    .crashes
                    .iter()
                    .any(|(n, d)| n == s && d.contains(&o.detail))
                {
                    summary.crashes.push((
                        s.to_string(),
                        format!("group {}: {s}: {}", group.name, o.detail),
                    ));
                }
            }
        }
        // A crash whose rerun never ran (the outer VM kept failing) stands.
        match results.remove(*s).or_else(|| crashed.remove(*s)) {
            Some(o) => summary.outcomes.push(o),
            None if summary.not_run.iter().any(|(n, _)| n == s) => {}
            None => match evidence::unrun_verdict(&failures) {
                Ok(()) => summary.not_run.push((
                    s.to_string(),
                    format!(
                        "it could not run in {attempts} outer VM(s), each failure naming the \
                         outer machine; last: {}",
                        failures.last().map_or("", |f| f.why.as_str())
                    ),
                )),
                Err(unnamed) => {
                    let o = Outcome {
                        name: s.to_string(),
                        status: Status::Fail,
                        secs: 0.0,
                        detail: format!(
                            "it could not run in {attempts} outer VM(s), and nothing names the \
                             outer machine as the cause of: {}",
                            unnamed
                                .iter()
                                .map(|f| f.describe())
                                .collect::<Vec<_>>()
                                .join("; ")
                        ),
                    };
                    println!("{o}");
                    summary.outcomes.push(o);
                }
            },
        }
    }
}

/// Where one group's results are filed as the runner reports them.
struct Filed<'a> {
    /// Final verdicts.
    results: &'a mut BTreeMap<String, Outcome>,
    /// Scenarios the outer VM stalled under in this attempt, with the outer
    /// VM's state recorded then.
    stalled: &'a mut BTreeMap<String, (Outcome, Option<String>)>,
    /// Scenarios whose guest crashed once, in any attempt.
    crashed: &'a mut BTreeMap<String, Outcome>,
}

impl Filed<'_> {
    /// Files one result (see `report::filing`); says where it went.
    fn file(&mut self, o: Outcome) -> Filing {
        let first = self.crashed.get(&o.name).cloned();
        let filing = report::filing(&o, first.is_some());
        match filing {
            Filing::Stalled => {
                self.stalled.insert(o.name.clone(), (o, None));
            }
            Filing::CrashRerun => {
                self.crashed.insert(o.name.clone(), o);
            }
            Filing::Final => {
                let mut o = o;
                if let Some(first) = first {
                    o.detail = match o.status {
                        Status::Fail => {
                            format!("{} (its first run crashed too: {})", o.detail, first.detail)
                        }
                        _ => format!(
                            "{} (passed on its rerun; its first run's guest crashed: {})",
                            o.detail, first.detail
                        ),
                    };
                }
                self.results.insert(o.name.clone(), o);
            }
        }
        filing
    }

    /// Records the outer VM's `state` when scenario `name` stalled.
    fn stall_state(&mut self, name: &str, state: Option<String>) {
        if let Some(entry) = self.stalled.get_mut(name) {
            entry.1 = state;
        }
    }
}

/// Prints the summary; returns the process exit code: 0 all passed, 1 a
/// scenario failed, 3 some scenarios could not run because the outer
/// machine failed (each failure's evidence naming it) and none failed. Its
/// last line counts those as skipped.
pub fn print_summary(s: &Summary) -> i32 {
    println!();
    println!("== real-guest summary ({:.0} s)", s.secs);
    for o in &s.outcomes {
        println!("{o}");
    }
    for (name, why) in &s.not_run {
        println!("NOT RUN {name}: {why}");
    }
    println!("infrastructure failures: {}", s.infrastructure.len());
    for i in &s.infrastructure {
        println!("  {i}");
    }
    println!("guest CPU crashes: {}", s.crashes.len());
    for (name, what) in &s.crashes {
        println!("  {name}: {what}");
    }
    let passed = s
        .outcomes
        .iter()
        .filter(|o| o.status == Status::Pass)
        .count();
    let failed = s.outcomes.len() - passed;
    if !s.not_run.is_empty() {
        println!(
            "WARNING: {} scenario(s) could not run because the outer VM kept failing, \
             each failure's evidence naming the outer machine: {}",
            s.not_run.len(),
            s.not_run
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    println!("{}", closing_line(passed, failed, s.not_run.len()));
    if failed > 0 {
        1
    } else if !s.not_run.is_empty() {
        3
    } else {
        0
    }
}

/// The summary's last line: `N passed, N failed`, and `, N skipped` for
/// scenarios that did not run.
fn closing_line(passed: usize, failed: usize, not_run: usize) -> String {
    if not_run > 0 {
        format!("{passed} passed, {failed} failed, {not_run} skipped")
    } else {
        format!("{passed} passed, {failed} failed")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const GROUP: Group = Group {
        name: "g",
        about: "a recorded group",
        scenarios: &["a", "b"],
        limit: Duration::from_secs(60),
        node_image: false,
    };

    fn outcome(name: &str, status: Status, detail: &str) -> Outcome {
        Outcome {
            name: name.into(),
            status,
            secs: 1.0,
            detail: detail.into(),
        }
    }

    /// Runs [`GROUP`] in 3 attempts, each session's results and end from
    /// `attempt(n)`.
    fn run_recorded(attempt: impl Fn(u32) -> (Vec<Outcome>, End)) -> (Summary, i32) {
        let mut summary = Summary::default();
        run_group(3, &GROUP, &mut summary, &mut |_, n, filed| {
            let (results, end) = attempt(n);
            for o in results {
                filed.file(o);
            }
            (end, None)
        });
        let code = print_summary(&summary);
        (summary, code)
    }

    fn freeze() -> End {
        let mut i = Infra::unattributed("the outer VM froze: no heartbeat for 150 s");
        i.state = Some("L1 up 900 s, 3 MiB available".into());
        End::Infrastructure(i)
    }

    fn outer_panic() -> End {
        let mut i = Infra::named("its kernel panicked", "Kernel panic - not syncing: x");
        i.state = Some("L1 up 900 s, 900 MiB available; registers in l1-g-1.state".into());
        End::Infrastructure(i)
    }

    #[test]
    fn a_group_that_is_infrastructure_three_times_fails_unless_the_evidence_names_the_outer_machine(
    ) {
        let (s, code) = run_recorded(|_| (vec![], freeze()));
        assert_eq!(code, 1);
        assert_eq!(s.outcomes.len(), 2);
        assert!(s
            .outcomes
            .iter()
            .all(|o| o.status == Status::Fail
                && o.detail.contains("nothing names the outer machine")));
        assert_eq!(s.infrastructure.len(), 3);
        // One unnamed failure among named ones is enough to fail.
        let (s, code) = run_recorded(|n| (vec![], if n == 2 { freeze() } else { outer_panic() }));
        assert_eq!((code, s.outcomes.len()), (1, 2));
        // Named every time: not run, and counted in the last line.
        let (s, code) = run_recorded(|_| (vec![], outer_panic()));
        assert_eq!(code, 3);
        assert!(s.outcomes.is_empty());
        assert_eq!(s.not_run.len(), 2);
        assert_eq!(
            closing_line(0, 0, s.not_run.len()),
            "0 passed, 0 failed, 2 skipped"
        );
        // A panic whose state could not be recorded does not name it.
        let (_, code) = run_recorded(|_| {
            (
                vec![],
                End::Infrastructure(Infra::named("its kernel panicked", "Kernel panic")),
            )
        });
        assert_eq!(code, 1);
    }

    #[test]
    fn a_failure_that_retrying_fixes_is_kept_in_the_summary() {
        // Attempt 1: "a" stalls (a recognised emulation stall), then the outer
        // VM panics; attempt 2 runs both.
        let (s, code) = run_recorded(|n| match n {
            1 => (
                vec![outcome("a", Status::Infra, "[outer-VM emulation] stalled")],
                outer_panic(),
            ),
            _ => (
                vec![
                    outcome("a", Status::Pass, ""),
                    outcome("b", Status::Pass, ""),
                ],
                End::Finished,
            ),
        });
        assert_eq!(code, 0);
        assert_eq!(s.infrastructure.len(), 2, "{:?}", s.infrastructure);
        assert!(s.not_run.is_empty());
    }

    #[test]
    fn a_guest_crash_is_reported_even_when_its_rerun_passes() {
        let crash = "vmm stderr: vmm: VM failed: vCPU 1 triple-faulted";
        let (s, code) = run_recorded(|n| match n {
            1 => (
                vec![
                    outcome("a", Status::Fail, crash),
                    outcome("b", Status::Pass, ""),
                ],
                End::Finished,
            ),
            _ => (vec![outcome("a", Status::Pass, "fine")], End::Finished),
        });
        assert_eq!(code, 0);
        assert_eq!(s.crashes.len(), 1);
        assert_eq!(s.crashes[0].0, "a");
        let a = s.outcomes.iter().find(|o| o.name == "a").unwrap();
        assert!(
            a.detail.contains("passed on its rerun") && a.detail.contains(crash),
            "{a:?}"
        );
        // A crash on state the vmm wrote is not rerun.
        let wrote = format!("{crash} | {}", report::VMM_WROTE_STATE);
        let (s, code) = run_recorded(|_| {
            (
                vec![
                    outcome("a", Status::Fail, &wrote),
                    outcome("b", Status::Pass, ""),
                ],
                End::Finished,
            )
        });
        assert_eq!(code, 1);
        assert_eq!(s.crashes.len(), 1);
    }

    #[test]
    fn a_crash_seen_in_a_recent_run_fails_even_after_a_passing_rerun() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("crash-history.json");
        let crashed_then_passed = || {
            let mut s = Summary::default();
            s.outcomes.push(outcome("a", Status::Pass, "fine"));
            s.outcomes.push(outcome("b", Status::Pass, "fine"));
            s.crashes.push(("a".into(), "vCPU 0 triple-faulted".into()));
            s
        };
        let mut first = crashed_then_passed();
        compare_crashes(&path, &mut first);
        assert!(first.outcomes.iter().all(|o| o.status == Status::Pass));
        let mut second = crashed_then_passed();
        compare_crashes(&path, &mut second);
        let a = &second.outcomes[0];
        assert_eq!(a.status, Status::Fail);
        assert!(a.detail.contains("2 of the last 5 runs"), "{a:?}");
        assert_eq!(second.outcomes[1].status, Status::Pass);
        assert_eq!(crashes::History::load(&path).unwrap().runs.len(), 2);
    }
}
