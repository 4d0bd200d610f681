//! Guest CPU crashes across runs. A scenario whose guest crashed at the CPU
//! level (triple fault, KVM internal error) is rerun once in a fresh outer
//! VM, since the outer machine's emulation does fault now and then; but a
//! pass on the rerun could hide an intermittent vmm state bug. So every run
//! records which scenarios crashed in a history kept in the harness's cache,
//! and a scenario that crashed in this run and in another of the last
//! [`WINDOW`] runs fails, whatever its rerun did.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// How many runs, this one included, a repeated crash is looked for in.
pub const WINDOW: usize = 5;
/// How many runs the history keeps.
const KEEP: usize = 20;

/// One run's crashes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRecord {
    /// When it ended (seconds since the epoch).
    pub ended_unix: u64,
    /// The scenarios it ran.
    pub ran: Vec<String>,
    /// The scenarios whose guest crashed at the CPU level in it.
    pub crashed: Vec<String>,
}

/// The runs recorded, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct History {
    /// Oldest first.
    pub runs: Vec<RunRecord>,
}

/// Why the history could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The history file.
        path: String,
        /// What failed.
        source: std::io::Error,
    },
    /// The file is not a history.
    #[error("{path}: not a crash history ({source}); remove it to start a new one")]
    Parse {
        /// The history file.
        path: String,
        /// What failed.
        source: serde_json::Error,
    },
}

impl History {
    /// Reads the history at `path`; an absent file is an empty history.
    pub fn load(path: &Path) -> Result<History, HistoryError> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|source| HistoryError::Parse {
                path: path.display().to_string(),
                source,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(History::default()),
            Err(source) => Err(HistoryError::Io {
                path: path.display().to_string(),
                source,
            }),
        }
    }

    /// Writes the history to `path` (through a temporary file, renamed).
    pub fn save(&self, path: &Path) -> Result<(), HistoryError> {
        let io = |source| HistoryError::Io {
            path: path.display().to_string(),
            source,
        };
        let tmp = path.with_extension("tmp");
        // Serializing plain strings and numbers cannot fail.
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| io(std::io::Error::other(e)))?;
        std::fs::write(&tmp, bytes).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// The scenarios of `run` whose guest crashed in it and in at least one
    /// other of the last [`WINDOW`] runs that ran them, with how many of
    /// those runs (this one included) saw it crash.
    pub fn repeated(&self, run: &RunRecord) -> Vec<(String, usize)> {
        run.crashed
            .iter()
            .filter_map(|s| {
                let earlier = self
                    .runs
                    .iter()
                    .rev()
                    .filter(|r| r.ran.contains(s))
                    .take(WINDOW - 1)
                    .filter(|r| r.crashed.contains(s))
                    .count();
                (earlier > 0).then(|| (s.clone(), earlier + 1))
            })
            .collect()
    }

    /// Appends `run`, keeping the newest [`KEEP`] runs.
    pub fn push(&mut self, run: RunRecord) {
        self.runs.push(run);
        let extra = self.runs.len().saturating_sub(KEEP);
        self.runs.drain(..extra);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(ran: &[&str], crashed: &[&str]) -> RunRecord {
        RunRecord {
            ended_unix: 1,
            ran: ran.iter().map(|s| s.to_string()).collect(),
            crashed: crashed.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn a_crash_seen_in_an_earlier_recent_run_is_repeated() {
        let mut h = History::default();
        h.push(run(&["a", "b"], &["a"]));
        for _ in 0..3 {
            h.push(run(&["a", "b"], &[]));
        }
        // The crash of "a" four runs back is in the window (this run + 4).
        assert_eq!(
            h.repeated(&run(&["a", "b"], &["a", "b"])),
            vec![("a".to_string(), 2)]
        );
        // One more quiet run pushes it out.
        h.push(run(&["a", "b"], &[]));
        assert!(h.repeated(&run(&["a"], &["a"])).is_empty());
    }

    #[test]
    fn runs_that_did_not_run_the_scenario_do_not_count() {
        let mut h = History::default();
        h.push(run(&["a"], &["a"]));
        // Five runs of other groups only.
        for _ in 0..5 {
            h.push(run(&["z"], &[]));
        }
        assert_eq!(h.repeated(&run(&["a"], &["a"])), vec![("a".to_string(), 2)]);
    }

    #[test]
    fn the_history_round_trips_and_keeps_its_newest_runs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("crash-history.json");
        assert_eq!(History::load(&path).unwrap(), History::default());
        let mut h = History::default();
        for i in 0..(KEEP + 3) {
            h.push(run(&["a"], if i == KEEP + 2 { &["a"] } else { &[] }));
        }
        assert_eq!(h.runs.len(), KEEP);
        h.save(&path).unwrap();
        assert_eq!(History::load(&path).unwrap(), h);
        std::fs::write(&path, "not json").unwrap();
        let e = History::load(&path).unwrap_err().to_string();
        assert!(e.contains("remove it"), "{e}");
    }
}
