//! The runner's watchdog. A scenario bounds its own waits, but the runner
//! can still be stuck where no timeout reaches (a system call that never
//! returns); the outer half then sees only that the group overran. So a
//! thread watches the running scenario: past [`REPORT_AFTER`] it prints
//! what the runner and its children (the vmm) are doing, again every
//! [`REPORT_EVERY`], and shortly before the group's limit it fails the
//! scenario itself, with that report, and ends the runner.
//!
//! One such stall is the outer VM's: its 9p share (the host's tree, where
//! the vmm and every image are read from) stops answering, and whatever
//! reads through it (a page of the vmm's code included) waits for good,
//! while the outer VM itself stays idle and alive. A thread of the runner's
//! process tree seen in the 9p client's request wait at every look for
//! [`NINEP_STUCK`], never on a CPU meanwhile, is that: the watchdog reports
//! the scenario INFRA and abandons the outer VM (`RGH ABANDON`), and the
//! harness retries the group in a fresh one. The runner itself runs from the
//! outer VM's memory so that this still works.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::collections::HashMap;

use super::{hang, INFRA_MARK};
use crate::catalogue::Group;
use crate::report::{self, Outcome, Status};

/// A scenario running this long gets its first status report.
const REPORT_AFTER: Duration = Duration::from_secs(8 * 60);
/// And another after each further stretch.
const REPORT_EVERY: Duration = Duration::from_secs(5 * 60);
/// How long before the group's limit the runner gives up on a scenario:
/// the outer VM's boot and the runner's own start come out of the limit
/// too, and its result must reach the outer half before the limit.
const LIMIT_MARGIN: Duration = Duration::from_secs(3 * 60);
/// How often the watchdog looks.
const TICK: Duration = Duration::from_secs(15);
/// How long a thread may wait on 9p, without running, before the share is
/// taken for stuck (a read of the host's tree answers in well under a
/// second even under the outer VM's emulation).
const NINEP_STUCK: Duration = Duration::from_secs(120);

/// Threads seen waiting on 9p, and since when without running.
#[derive(Default)]
struct NinePTracker {
    /// tid -> (first seen waiting at this CPU time, that CPU time, who).
    seen: HashMap<u32, (Instant, u64, String)>,
}

impl NinePTracker {
    /// Takes one look (`waits` at `now`); returns why the share is taken
    /// for stuck, once a thread has waited [`NINEP_STUCK`] without running.
    fn observe(&mut self, now: Instant, waits: &[hang::NinePWait]) -> Option<String> {
        self.seen
            .retain(|tid, _| waits.iter().any(|w| w.tid == *tid));
        for w in waits {
            let e = self
                .seen
                .entry(w.tid)
                .or_insert_with(|| (now, w.ran_ns, w.who.clone()));
            if e.1 != w.ran_ns {
                *e = (now, w.ran_ns, w.who.clone());
            }
        }
        self.seen
            .iter()
            .filter(|(_, (since, _, _))| now.duration_since(*since) >= NINEP_STUCK)
            .map(|(tid, (since, _, who))| {
                format!(
                    "{INFRA_MARK}the outer VM's 9p share stopped answering: thread {tid} \
                     ({who}) has waited in the 9p client for {} s without running",
                    now.duration_since(*since).as_secs()
                )
            })
            .next()
    }
}

/// The scenario running now, as the watchdog sees it.
#[derive(Clone, Default)]
pub struct Running(Arc<Mutex<Option<(&'static str, Instant)>>>);

impl Running {
    /// Records that `name` started now (`None`: between scenarios).
    pub fn set(&self, name: Option<&'static str>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = name.map(|n| (n, Instant::now()));
    }

    fn get(&self) -> Option<(&'static str, Instant)> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Starts watching `group`'s scenarios; the runner reports each one's start
/// and end through the returned handle.
pub fn start(group: &Group) -> Running {
    let running = Running::default();
    let watched = running.clone();
    let deadline = Instant::now() + group.limit.saturating_sub(LIMIT_MARGIN);
    let spawned = std::thread::Builder::new()
        .name("rg-watchdog".into())
        .spawn(move || watch(&watched, deadline));
    if let Err(e) = spawned {
        println!(
            "{}",
            report::info_line("runner", &format!("no watchdog thread: {e}"))
        );
    }
    running
}

/// Prints the runner's process tree under `name`.
fn print_tree(name: &str) {
    for l in hang::process_tree(std::process::id()).lines() {
        println!("{}", report::info_line(name, l));
    }
}

/// Ends scenario `name` (running since `since`) with `status` and `why`,
/// after its process tree, and ends the runner: the scenario's thread may be
/// stuck for good. An `INFRA` end abandons the outer VM too.
fn give_up(name: &str, since: Instant, status: Status, why: &str) -> ! {
    print_tree(name);
    let outcome = Outcome {
        name: name.to_string(),
        status,
        secs: since.elapsed().as_secs_f64(),
        detail: why.to_string(),
    };
    println!("{}", outcome.line());
    if status == Status::Infra {
        println!("{}", report::abandon_line(why));
    }
    std::process::exit(1);
}

fn watch(running: &Running, deadline: Instant) {
    let mut reported: Option<(&'static str, Instant)> = None;
    let mut nine_p = NinePTracker::default();
    loop {
        std::thread::sleep(TICK);
        let Some((name, since)) = running.get() else {
            nine_p = NinePTracker::default();
            continue;
        };
        let now = Instant::now();
        if let Some(why) = nine_p.observe(now, &hang::waiting_on_9p(std::process::id())) {
            give_up(name, since, Status::Infra, &why);
        }
        if now >= deadline {
            let why = format!(
                "the runner's watchdog: still running after {} s, {} s before the group's \
                 limit, where none of its own timeouts ended it; what the runner and its \
                 children were doing is in the lines above",
                since.elapsed().as_secs(),
                LIMIT_MARGIN.as_secs()
            );
            give_up(name, since, Status::Fail, &why);
        }
        let due = match reported {
            Some((n, at)) if n == name && at >= since => now - at >= REPORT_EVERY,
            _ => now - since >= REPORT_AFTER,
        };
        if due {
            println!(
                "{}",
                report::info_line(
                    name,
                    &format!(
                        "running for {} s; the runner's processes:",
                        since.elapsed().as_secs()
                    )
                )
            );
            print_tree(name);
            reported = Some((name, now));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait(tid: u32, ran_ns: u64) -> hang::NinePWait {
        hang::NinePWait {
            tid,
            who: format!("1/t{tid}"),
            ran_ns,
        }
    }

    #[test]
    fn a_thread_waiting_on_9p_without_running_is_a_stuck_share() {
        let t0 = Instant::now();
        let mut t = NinePTracker::default();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(t.observe(at(0), &[wait(7, 100)]), None);
        assert_eq!(t.observe(at(60), &[wait(7, 100)]), None);
        let why = t.observe(at(120), &[wait(7, 100)]).expect("stuck");
        assert!(why.starts_with(INFRA_MARK), "{why}");
        assert!(
            why.contains("thread 7 (1/t7)") && why.contains("120 s"),
            "{why}"
        );
    }

    #[test]
    fn a_thread_that_runs_or_leaves_the_wait_is_not_stuck() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        // Reading a large file: in the 9p wait at every look, but running.
        let mut t = NinePTracker::default();
        for (i, s) in (0..=300).step_by(15).enumerate() {
            assert_eq!(t.observe(at(s), &[wait(7, 100 + i as u64)]), None);
        }
        // In and out of the wait: each stretch starts over.
        let mut t = NinePTracker::default();
        assert_eq!(t.observe(at(0), &[wait(7, 100)]), None);
        assert_eq!(t.observe(at(100), &[]), None);
        assert_eq!(t.observe(at(110), &[wait(7, 100)]), None);
        assert_eq!(t.observe(at(200), &[wait(7, 100)]), None);
        assert!(t.observe(at(230), &[wait(7, 100)]).is_some());
    }
}
