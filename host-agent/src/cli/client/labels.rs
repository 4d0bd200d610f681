//! `--label KEY=VALUE` (of `sessions create`, `sessions list` and `events
//! watch`) and `--state` (of `sessions list`). Lengths and counts are
//! checked by host-agent.

use std::collections::HashMap;

use proto::hostagent as pb;

/// Labels on the command line.
#[derive(clap::Args, Debug, Default)]
pub struct LabelArgs {
    /// A label, KEY=VALUE (repeatable; the value may be empty). For a
    /// filter, sessions must have every label given, value for value.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
    label: Vec<(String, String)>,
}

impl LabelArgs {
    /// The request's label map; a key given twice is an error.
    pub fn map(self) -> Result<HashMap<String, String>, String> {
        let mut out = HashMap::new();
        for (k, v) in self.label {
            if out.contains_key(&k) {
                return Err(format!("--label: the key {k:?} is given twice"));
            }
            out.insert(k, v);
        }
        Ok(out)
    }
}

/// One `--label KEY=VALUE`: split at the first `=`; the key is not empty.
fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!(
            "expected KEY=VALUE with a key before '=' (the value may be empty), got {s:?}"
        )),
    }
}

/// A session state for `--state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StateArg {
    Pending,
    Restoring,
    Ready,
    Running,
    Paused,
    Stopping,
    Stopped,
    Failed,
}

impl StateArg {
    /// The API's value.
    pub fn to_pb(self) -> i32 {
        let s = match self {
            StateArg::Pending => pb::SessionState::Pending,
            StateArg::Restoring => pb::SessionState::Restoring,
            StateArg::Ready => pb::SessionState::Ready,
            StateArg::Running => pb::SessionState::Running,
            StateArg::Paused => pb::SessionState::Paused,
            StateArg::Stopping => pb::SessionState::Stopping,
            StateArg::Stopped => pb::SessionState::Stopped,
            StateArg::Failed => pb::SessionState::Failed,
        };
        s as i32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        labels: LabelArgs,
    }

    fn labels(args: &[&str]) -> Result<HashMap<String, String>, String> {
        let cli = Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        cli.labels.map()
    }

    #[test]
    fn labels_split_at_the_first_equals_sign() {
        let l = labels(&[
            "--label", "team=x", "--label", "tier=", "--label", "url=a=b",
        ])
        .unwrap();
        assert_eq!(l.len(), 3);
        assert_eq!(l["team"], "x");
        assert_eq!(l["tier"], "");
        assert_eq!(l["url"], "a=b");
        assert!(labels(&[]).unwrap().is_empty());
    }

    #[test]
    fn bad_labels_are_refused_with_what_was_expected() {
        for bad in ["team", "=x", ""] {
            let e = labels(&["--label", bad]).unwrap_err();
            assert!(
                e.contains("--label") && e.contains("KEY=VALUE"),
                "{bad}: {e}"
            );
        }
        let e = labels(&["--label", "a=1", "--label", "a=2"]).unwrap_err();
        assert!(e.contains("\"a\" is given twice"), "{e}");
    }
}
