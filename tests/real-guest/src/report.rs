//! The lines the scenario runner (in the outer VM) prints and the harness
//! (on the host) parses, and the summary at the end of a run.
//!
//! Runner lines start with `RGH ` so kernel messages on the same console are
//! never taken for them:
//!
//! ```text
//! RGH START <scenario>
//! RGH RESULT <scenario> PASS|FAIL|INFRA <seconds> <detail or reason>
//! RGH INFO <scenario> <text>
//! RGH ABANDON <reason>
//! ```
//!
//! `ABANDON` is the runner's watchdog giving up on the outer VM (see
//! `inner::watchdog`): the runner may not be able to exit, so the harness
//! ends the outer VM at once and retries the group in a fresh one.

use std::fmt;

/// Prefix of every runner line.
pub const PREFIX: &str = "RGH ";

/// How a scenario ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Everything it checks held.
    Pass,
    /// Something it checks did not hold (in a healthy outer VM).
    Fail,
    /// The outer VM's emulation failed under it in a way the runner
    /// recognises (see `inner::hang::emulation_stall`): retried like an
    /// outer VM that froze.
    Infra,
}

/// One scenario's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Scenario name.
    pub name: String,
    /// Pass or fail.
    pub status: Status,
    /// Seconds it took.
    pub secs: f64,
    /// What it showed (pass) or what went wrong (fail).
    pub detail: String,
}

/// Whether a failure's reason says the guest died at the CPU level: the
/// vmm's own words for a triple fault or a KVM internal error. Under the
/// outer VM's software emulation such a crash is sometimes the emulation's
/// (see the README's "The outer VM's QEMU"), so the harness reruns the
/// scenario once in a fresh outer VM; a crash that comes back fails.
pub fn guest_cpu_crash(detail: &str) -> bool {
    detail.contains("triple-faulted") || detail.contains("KVM internal error on vCPU")
}

/// What the vmm's crash report says when a vCPU faulted on its first entry
/// after the vmm wrote its state (at boot or at a restore): the state that
/// faulted is the vmm's, not anything the guest did since.
pub const VMM_WROTE_STATE: &str = "on the first entry after the vmm wrote its state";

/// Whether a guest CPU crash's report shows state the vmm wrote: such a
/// crash is the product's, and is not rerun.
pub fn crash_on_state_the_vmm_wrote(detail: &str) -> bool {
    guest_cpu_crash(detail) && detail.contains(VMM_WROTE_STATE)
}

/// Where the harness files a scenario's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filing {
    /// The scenario's verdict.
    Final,
    /// The outer VM stalled under it: run it in the next outer VM.
    Stalled,
    /// Its guest crashed for the first time: run it once more in the next
    /// outer VM.
    CrashRerun,
}

/// Files `o`; `crashed_before` says whether this scenario's guest already
/// crashed in an earlier outer VM (a second crash is the verdict).
pub fn filing(o: &Outcome, crashed_before: bool) -> Filing {
    match o.status {
        Status::Infra => Filing::Stalled,
        Status::Fail
            if guest_cpu_crash(&o.detail)
                && !crash_on_state_the_vmm_wrote(&o.detail)
                && !crashed_before =>
        {
            Filing::CrashRerun
        }
        Status::Fail | Status::Pass => Filing::Final,
    }
}

/// A parsed runner line.
#[derive(Debug, Clone, PartialEq)]
pub enum Line {
    /// A scenario started.
    Start(String),
    /// A scenario ended.
    Result(Outcome),
    /// A note from a scenario.
    Info(String, String),
    /// The runner gave up on the outer VM, for this reason.
    Abandon(String),
}

/// The `RGH ABANDON` line.
pub fn abandon_line(reason: &str) -> String {
    format!("{PREFIX}ABANDON {}", one_line(reason))
}

/// The `RGH START` line for `name`.
pub fn start_line(name: &str) -> String {
    format!("{PREFIX}START {name}")
}

/// The `RGH INFO` line.
pub fn info_line(name: &str, text: &str) -> String {
    format!("{PREFIX}INFO {name} {}", one_line(text))
}

/// Newlines would split a record: runner lines are single lines.
pub fn one_line(text: &str) -> String {
    text.replace(['\r', '\n'], " | ")
}

impl Outcome {
    /// The `RGH RESULT` line.
    pub fn line(&self) -> String {
        let status = match self.status {
            Status::Pass => "PASS",
            Status::Fail => "FAIL",
            Status::Infra => "INFRA",
        };
        format!(
            "{PREFIX}RESULT {} {status} {:.1} {}",
            self.name,
            self.secs,
            one_line(&self.detail)
        )
    }
}

/// The human summary line: `PASS name (N s)` or `FAIL name: reason`.
impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.status {
            Status::Pass => write!(f, "PASS {} ({:.0} s)", self.name, self.secs)?,
            Status::Fail => write!(f, "FAIL {}: {}", self.name, self.detail)?,
            Status::Infra => write!(f, "INFRA {}: {}", self.name, self.detail)?,
        }
        if self.status == Status::Pass && !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        Ok(())
    }
}

/// Parses a console line; anything that is not a well-formed runner line
/// (kernel output, a line cut by a crash) is `None`.
pub fn parse(line: &str) -> Option<Line> {
    let at = line.find(PREFIX)?;
    let rest = line[at + PREFIX.len()..].trim_end_matches(['\r', '\n']);
    let (kind, rest) = rest.split_once(' ')?;
    match kind {
        "START" => Some(Line::Start(rest.trim().to_string())),
        "ABANDON" => Some(Line::Abandon(rest.trim().to_string())),
        "INFO" => {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            Some(Line::Info(name.to_string(), text.to_string()))
        }
        "RESULT" => {
            let mut parts = rest.splitn(4, ' ');
            let name = parts.next()?.to_string();
            let status = match parts.next()? {
                "PASS" => Status::Pass,
                "FAIL" => Status::Fail,
                "INFRA" => Status::Infra,
                _ => return None,
            };
            let secs = parts.next()?.parse().ok()?;
            let detail = parts.next().unwrap_or("").to_string();
            Some(Line::Result(Outcome {
                name,
                status,
                secs,
                detail,
            }))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_lines_round_trip() {
        let o = Outcome {
            name: "boot-1-vcpu".into(),
            status: Status::Fail,
            secs: 12.34,
            detail: "no marker\nin 300 s".into(),
        };
        let line = o.line();
        assert_eq!(
            line,
            "RGH RESULT boot-1-vcpu FAIL 12.3 no marker | in 300 s"
        );
        let Some(Line::Result(back)) = parse(&format!("[  3.1] junk{line}\r\n")) else {
            panic!("not parsed: {line}");
        };
        assert_eq!(back.name, "boot-1-vcpu");
        assert_eq!(back.status, Status::Fail);
        assert_eq!(back.detail, "no marker | in 300 s");
        assert_eq!(back.to_string(), "FAIL boot-1-vcpu: no marker | in 300 s");
    }

    #[test]
    fn a_guest_crash_is_rerun_once_and_nothing_else_is() {
        let with = |status, detail: &str| Outcome {
            name: "boot-bzimage".into(),
            status,
            secs: 9.0,
            detail: detail.into(),
        };
        let triple = with(
            Status::Fail,
            "the guest's console ended (vmm exit status: 1) before \"RG-DONE\"; \
             vmm stderr: vmm: VM failed: vCPU 0 triple-faulted",
        );
        assert_eq!(filing(&triple, false), Filing::CrashRerun);
        assert_eq!(filing(&triple, true), Filing::Final, "a second crash fails");
        let internal = with(
            Status::Fail,
            "vmm: VM failed: KVM internal error on vCPU 1: suberror 1 (emulation)",
        );
        assert_eq!(filing(&internal, false), Filing::CrashRerun);
        // Any other failure is the verdict at once, a pass is a pass, and a
        // stall goes to the next outer VM whatever came before.
        let wrong = with(Status::Fail, "the guest sees \"1\" CPUs, not 2");
        assert_eq!(filing(&wrong, false), Filing::Final);
        assert_eq!(filing(&with(Status::Pass, "1 CPU"), false), Filing::Final);
        let stall = with(Status::Infra, "stalled");
        assert_eq!(filing(&stall, true), Filing::Stalled);
        // A crash on state the vmm wrote is the product's: no rerun.
        let vmm_state = with(
            Status::Fail,
            &format!(
                "vmm stderr: vmm: VM failed: vCPU 1 triple-faulted | vCPU 1 at the failure: \
                 rip=0x... exits since the vmm set this vCPU's state: 0 ({VMM_WROTE_STATE})"
            ),
        );
        assert_eq!(filing(&vmm_state, false), Filing::Final);
    }

    #[test]
    fn other_lines_are_ignored() {
        assert_eq!(parse("L1-HEARTBEAT 12.0"), None);
        assert_eq!(parse("RGH RESULT x MAYBE 1.0 y"), None);
        assert_eq!(parse("RGH RESULT x PASS notanumber"), None);
        assert_eq!(parse("RGH START a"), Some(Line::Start("a".into())));
        assert_eq!(
            parse(&abandon_line("9p\nstuck")),
            Some(Line::Abandon("9p | stuck".into()))
        );
        let Some(Line::Result(o)) = parse("RGH RESULT virtio-net INFRA 61.0 stalled") else {
            panic!("an INFRA result is a result");
        };
        assert_eq!(o.status, Status::Infra);
        assert_eq!(o.to_string(), "INFRA virtio-net: stalled");
    }
}
