//! One outer-VM session of a group: QEMU started, its two channels read
//! (see `qemu`), the outer VM watched for health, results filed as the
//! runner reports them, and the outer VM's state recorded when the harness
//! gives up on it.
//!
//! The outer VM prints a heartbeat every 10 s from its own init, whatever
//! the scenarios do; a scenario whose guest hangs is failed by the runner's
//! own watchdog while the heartbeats go on. So: no heartbeat for
//! [`HEARTBEAT_LIMIT`] means L1 froze (infrastructure, but nothing in that
//! names the outer machine: a product can wedge it too); a group that runs
//! past its limit with heartbeats flowing is a scenario failure. Only the
//! outer kernel's own console is read for its panic: a scenario's FAIL line
//! that relays an inner guest's panic is that scenario's failure.

use std::path::Path;
use std::time::{Duration, Instant};

use super::evidence::{self, Heartbeat, Infra};
use super::qemu::{ConsoleLine, L1Files, Source, L1};
use super::{End, Filed, RunOptions};
use crate::catalogue::Group;
use crate::report::{self, Filing, Line, Outcome};

/// The outer VM must reach its `ready` line within this.
const BOOT_LIMIT: Duration = Duration::from_secs(300);
/// Silence after which the outer VM is taken as frozen.
const HEARTBEAT_LIMIT: Duration = Duration::from_secs(150);
/// How long the monitor may take to give the outer VM's registers.
const MONITOR_TIMEOUT: Duration = Duration::from_secs(20);

/// What the watcher asks of the session after a line or a tick.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Action {
    /// A scenario's result, to file.
    File(Outcome),
    /// The session is over.
    End(End),
}

/// The health of one outer VM and where its group stands, from its lines
/// alone (no QEMU), so its rules can be tested on recorded lines.
pub(super) struct Watch {
    limit: Duration,
    started: Instant,
    ready: Option<Instant>,
    last_beat: Instant,
    /// The latest heartbeat's figures.
    pub heartbeat: Option<Heartbeat>,
    /// The scenario running now.
    pub current: Option<String>,
    /// L1's init said the runner ended.
    pub done: bool,
}

impl Watch {
    /// Watches a session of a group with time limit `limit`, started `now`.
    pub fn new(limit: Duration, now: Instant) -> Watch {
        Watch {
            limit,
            started: now,
            ready: None,
            last_beat: now,
            heartbeat: None,
            current: None,
            done: false,
        }
    }

    /// Takes one line that came at `now`.
    pub fn line(&mut self, line: &ConsoleLine, now: Instant) -> Option<Action> {
        match line.source {
            Source::Kernel => self.kernel_line(&line.text, now),
            Source::Runner => self.runner_line(&line.text),
            Source::Qemu => {
                println!("   qemu: {}", line.text);
                None
            }
        }
    }

    /// The outer kernel's console and L1's init: heartbeats, readiness, the
    /// runner's end, and the outer kernel's own panic.
    fn kernel_line(&mut self, text: &str, now: Instant) -> Option<Action> {
        if let Some(hb) = evidence::heartbeat(text) {
            self.last_beat = now;
            self.heartbeat = Some(hb);
            return None;
        }
        if text.contains("L1: ready") && self.ready.is_none() {
            self.ready = Some(now);
            self.last_beat = now;
            println!(
                "   outer VM ready in {:.0} s{}",
                now.duration_since(self.started).as_secs_f64(),
                if text.contains("kvm=no") {
                    " (but it has no /dev/kvm)"
                } else {
                    ""
                }
            );
        }
        if text.contains("L1-DONE") {
            self.done = true;
        }
        if let Some(sign) = evidence::kernel_sign(text) {
            return Some(Action::End(End::Infrastructure(Infra::from_kernel(sign))));
        }
        if text.contains("BUG: ") || text.contains("watchdog: BUG") {
            println!("   outer VM kernel: {text}");
        }
        None
    }

    /// The runner's output: its `RGH` lines; anything else it or its
    /// children print is only kept in the log.
    fn runner_line(&mut self, text: &str) -> Option<Action> {
        match report::parse(text)? {
            Line::Start(name) => {
                println!(".. {name}");
                self.current = Some(name);
                None
            }
            Line::Info(name, text) => {
                println!("   {name}: {text}");
                None
            }
            Line::Abandon(why) => Some(Action::End(End::Infrastructure(Infra::named(
                format!("the runner gave up on it: {why}"),
                why,
            )))),
            Line::Result(o) => {
                println!("{o}");
                self.current = None;
                Some(Action::File(o))
            }
        }
    }

    /// Checks the time limits at `now`.
    pub fn tick(&self, now: Instant) -> Option<End> {
        let elapsed = now.duration_since(self.started);
        if self.ready.is_none() && elapsed > BOOT_LIMIT {
            return Some(End::Infrastructure(Infra::unattributed(format!(
                "the outer VM did not boot within {} s",
                BOOT_LIMIT.as_secs()
            ))));
        }
        if self.ready.is_some() && now.duration_since(self.last_beat) > HEARTBEAT_LIMIT {
            return Some(End::Infrastructure(Infra::unattributed(format!(
                "the outer VM froze: no heartbeat for {} s{}",
                HEARTBEAT_LIMIT.as_secs(),
                self.current
                    .as_ref()
                    .map(|c| format!(" (during {c})"))
                    .unwrap_or_default()
            ))));
        }
        if elapsed > self.limit {
            return Some(End::Overran(format!(
                "the group ran past its limit of {} min while the outer VM stayed responsive",
                self.limit.as_secs() / 60
            )));
        }
        None
    }

    /// How the session ended once QEMU's output ended (`status`: its exit).
    pub fn qemu_ended(&self, status: Option<std::process::ExitStatus>) -> End {
        if self.done {
            End::Finished
        } else {
            End::Infrastructure(Infra::unattributed(format!(
                "QEMU ended ({}) before the scenarios finished",
                status.map_or("no status".into(), |s| s.to_string())
            )))
        }
    }
}

/// Runs one outer-VM session of `group`, filing results as they come.
/// Returns how it ended and the scenario running at the end.
pub(super) fn run(
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
    let stem = format!("l1-{}-{attempt}", group.name);
    let console_log = logs.join(format!("{stem}.log"));
    let runner_log = logs.join(format!("{stem}.runner.log"));
    let state_file = logs.join(format!("{stem}.state"));
    let monitor = std::env::temp_dir().join(format!("rgh-{}-{stem}.mon", std::process::id()));
    println!("   outer VM console: {}", console_log.display());
    println!("   runner's output: {}", runner_log.display());
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
        &L1Files {
            console_log: &console_log,
            runner_log: &runner_log,
            monitor: &monitor,
        },
    )?;
    let mut watch = Watch::new(group.limit, Instant::now());
    let end = loop {
        let action = match l1.lines.recv_timeout(Duration::from_millis(500)) {
            Ok(line) => watch.line(&line, Instant::now()),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                // QEMU exited and all it wrote has been read.
                Some(Action::End(watch.qemu_ended(l1.exited())))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
        };
        match action.or_else(|| watch.tick(Instant::now()).map(Action::End)) {
            Some(Action::End(end)) => break end,
            Some(Action::File(o)) => {
                let name = o.name.clone();
                if filed.file(o) == Filing::Stalled {
                    let state = record_state(&l1, &state_file, watch.heartbeat.as_ref());
                    filed.stall_state(&name, state);
                }
            }
            None => {}
        }
    };
    let end = match end {
        End::Infrastructure(mut infra) => {
            infra.state = record_state(&l1, &state_file, watch.heartbeat.as_ref());
            End::Infrastructure(infra)
        }
        other => other,
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
    let _ = std::fs::remove_file(&monitor);
    Ok((end, watch.current))
}

/// Records the outer VM's memory (its latest heartbeat) and CPU state (every
/// vCPU's registers, from QEMU's monitor), appending them to `path`;
/// returns a summary when both were had.
fn record_state(l1: &L1, path: &Path, heartbeat: Option<&Heartbeat>) -> Option<String> {
    use std::io::Write;
    let registers = l1.monitor("info registers -a", MONITOR_TIMEOUT);
    let memory = heartbeat.filter(|h| h.mem_avail_kib.is_some());
    let mut text = String::from("== the outer VM's state\n");
    match memory {
        Some(h) => text.push_str(&format!("latest heartbeat: {h}\n")),
        None => text.push_str("no heartbeat with its memory figures\n"),
    }
    match &registers {
        Ok(r) => text.push_str(&format!("info registers -a:\n{r}\n")),
        Err(e) => text.push_str(&format!("registers not read from QEMU's monitor: {e}\n")),
    }
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()));
    if let Err(e) = written {
        println!(
            "   cannot record the outer VM's state in {}: {e}",
            path.display()
        );
        return None;
    }
    match (memory, registers) {
        (Some(h), Ok(_)) => Some(format!("{h}; registers in {}", path.display())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Status;

    fn kernel(t: &str) -> ConsoleLine {
        ConsoleLine::new(Source::Kernel, t)
    }

    fn runner(t: &str) -> ConsoleLine {
        ConsoleLine::new(Source::Runner, t)
    }

    /// Feeds `lines` to a fresh watcher; the actions they asked for.
    fn feed(lines: &[ConsoleLine]) -> (Watch, Vec<Action>) {
        let t0 = Instant::now();
        let mut w = Watch::new(Duration::from_secs(3600), t0);
        let actions = lines
            .iter()
            .filter_map(|l| w.line(l, t0 + Duration::from_secs(1)))
            .collect();
        (w, actions)
    }

    #[test]
    fn an_inner_guest_s_panic_relayed_in_a_fail_line_is_that_scenario_s_failure() {
        // What a scenario's FAIL line carries when the vmm's bug panics the
        // inner guest (inner guests boot with panic=1).
        let fail = "RGH RESULT restore-uffd FAIL 41.2 the guest's console ended before \"RG-DONE\"; \
                    last console lines: [    2.104] Kernel panic - not syncing: Attempted to kill init! \
                    exitcode=0x0000000b | [    2.105] Rebooting in 1 seconds..";
        let (_, actions) = feed(&[
            kernel("L1: ready, uptime 40.1s, kvm=yes"),
            runner("RGH START restore-uffd"),
            // What the runner's children print lands on its channel too.
            runner("[    2.104] Kernel panic - not syncing: Attempted to kill init!"),
            runner(fail),
        ]);
        assert_eq!(actions.len(), 1, "{actions:?}");
        let Action::File(o) = &actions[0] else {
            panic!("{actions:?}");
        };
        assert_eq!((o.name.as_str(), o.status), ("restore-uffd", Status::Fail));
    }

    #[test]
    fn the_outer_kernel_s_own_panic_is_infrastructure_that_names_it() {
        let (w, actions) = feed(&[
            kernel("L1: ready, uptime 40.1s, kvm=yes"),
            kernel("L1-HEARTBEAT 50.0 mem_avail_kib=2097152 load=2.00,1.50,1.00"),
            runner("RGH START virtio-net"),
            kernel("[  812.100231] Kernel panic - not syncing: Fatal exception in interrupt"),
        ]);
        let [Action::End(End::Infrastructure(infra))] = actions.as_slice() else {
            panic!("{actions:?}");
        };
        assert!(infra.signature.is_some(), "{infra:?}");
        assert!(infra.why.contains("Fatal exception"), "{infra:?}");
        assert_eq!(w.current.as_deref(), Some("virtio-net"));
        assert_eq!(
            w.heartbeat.as_ref().and_then(|h| h.mem_avail_kib),
            Some(2_097_152)
        );
        // Out of memory is the outer kernel's too, but the product may have
        // caused it: nothing names the outer machine.
        let (_, actions) = feed(&[kernel(
            "[ 99.0] Kernel panic - not syncing: System is deadlocked on memory",
        )]);
        let [Action::End(End::Infrastructure(infra))] = actions.as_slice() else {
            panic!("{actions:?}");
        };
        assert_eq!(infra.signature, None);
    }

    #[test]
    fn runner_lines_on_the_kernel_s_console_are_not_results() {
        // Only the runner's channel files results: a line on L1's console
        // that looks like one (a guest's output printed there) is not.
        let (_, actions) = feed(&[kernel("RGH RESULT boot-1-vcpu PASS 3.0 fine")]);
        assert!(actions.is_empty(), "{actions:?}");
        let (_, actions) = feed(&[runner("RGH ABANDON the 9p share stopped answering")]);
        let [Action::End(End::Infrastructure(infra))] = actions.as_slice() else {
            panic!("{actions:?}");
        };
        assert!(infra.signature.is_some());
    }

    #[test]
    fn silence_and_slowness_end_a_session_without_naming_the_outer_machine() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut w = Watch::new(Duration::from_secs(1800), t0);
        assert_eq!(w.tick(at(299)), None);
        let Some(End::Infrastructure(boot)) = w.tick(at(301)) else {
            panic!("a boot over 300 s ends the session");
        };
        assert_eq!(boot.signature, None);
        w.line(&kernel("L1: ready, uptime 40.1s, kvm=yes"), at(100));
        w.line(
            &kernel("L1-HEARTBEAT 50.0 mem_avail_kib=1 load=0,0,0"),
            at(200),
        );
        assert_eq!(w.tick(at(349)), None);
        let Some(End::Infrastructure(freeze)) = w.tick(at(351)) else {
            panic!("no heartbeat for 150 s ends the session");
        };
        assert_eq!(freeze.signature, None);
        let quit = w.qemu_ended(None);
        assert!(matches!(quit, End::Infrastructure(ref i) if i.signature.is_none()));
        w.line(&kernel("L1-DONE rc=0"), at(210));
        assert_eq!(w.qemu_ended(None), End::Finished);
        // Heartbeats flowing past the group's limit: the scenario's failure.
        w.line(&kernel("L1-HEARTBEAT 1800.0"), at(1800));
        assert!(matches!(w.tick(at(1801)), Some(End::Overran(_))));
    }
}
