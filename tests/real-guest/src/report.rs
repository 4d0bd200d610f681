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
//! ```

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

/// A parsed runner line.
#[derive(Debug, Clone, PartialEq)]
pub enum Line {
    /// A scenario started.
    Start(String),
    /// A scenario ended.
    Result(Outcome),
    /// A note from a scenario.
    Info(String, String),
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
    fn other_lines_are_ignored() {
        assert_eq!(parse("L1-HEARTBEAT 12.0"), None);
        assert_eq!(parse("RGH RESULT x MAYBE 1.0 y"), None);
        assert_eq!(parse("RGH RESULT x PASS notanumber"), None);
        assert_eq!(parse("RGH START a"), Some(Line::Start("a".into())));
        let Some(Line::Result(o)) = parse("RGH RESULT virtio-net INFRA 61.0 stalled") else {
            panic!("an INFRA result is a result");
        };
        assert_eq!(o.status, Status::Infra);
        assert_eq!(o.to_string(), "INFRA virtio-net: stalled");
    }
}
