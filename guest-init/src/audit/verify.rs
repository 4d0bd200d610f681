//! `guest-init audit verify FILE`: checks the hash chain line by line.

use std::io::BufRead;

use super::{chain_hash, Line, GENESIS};

/// What verification found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerifyOutcome {
    /// Every line links to the one before it.
    Holds {
        /// Number of lines.
        lines: u64,
        /// Hash of the last line (compare with the host's copy to detect a
        /// truncated tail).
        last_hash: String,
    },
    /// The first broken or missing link.
    Broken {
        /// 1-based line number in the file.
        line: u64,
        /// What is wrong.
        reason: String,
    },
}

impl std::fmt::Display for VerifyOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Holds { lines, last_hash } => {
                write!(f, "chain holds: {lines} lines, last hash {last_hash}")
            }
            Self::Broken { line, reason } => write!(f, "chain broken at line {line}: {reason}"),
        }
    }
}

/// Verifies a log read from `reader`.
pub fn verify(reader: impl BufRead) -> std::io::Result<VerifyOutcome> {
    let mut prev = GENESIS.to_string();
    let mut n = 0u64;
    for text in reader.lines() {
        let text = text?;
        n += 1;
        let broken = |reason: String| Ok(VerifyOutcome::Broken { line: n, reason });
        let line: Line = match serde_json::from_str(&text) {
            Ok(l) => l,
            Err(e) => return broken(format!("not an audit line: {e}")),
        };
        if line.event.seq != n {
            return broken(format!(
                "seq is {} but line {n} should hold seq {n}: a line was removed, inserted or reordered",
                line.event.seq
            ));
        }
        if line.prev_hash != prev {
            return broken(format!(
                "prev_hash {} does not match the previous line's hash {prev}",
                line.prev_hash
            ));
        }
        let want = match chain_hash(&prev, &line.event) {
            Ok(h) => h,
            Err(e) => return broken(format!("cannot canonicalise event: {e}")),
        };
        if line.hash != want {
            return broken(format!(
                "hash {} does not match the event (expected {want}): the line was edited",
                line.hash
            ));
        }
        prev = line.hash;
    }
    Ok(VerifyOutcome::Holds {
        lines: n,
        last_hash: prev,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::{AuditLog, Entry};
    use crate::policy::secrets::Redactor;

    fn log_lines(n: usize) -> Vec<String> {
        let mut log = AuditLog::open(None, "s", Redactor::default()).unwrap();
        (0..n)
            .map(|i| {
                log.append(Entry {
                    actor: "agent",
                    action: "exec.started",
                    resource: &format!("cmd {i}"),
                    ..Default::default()
                })
                .unwrap()
                .1
            })
            .collect()
    }

    fn run(lines: &[String]) -> VerifyOutcome {
        verify(lines.join("\n").as_bytes()).unwrap()
    }

    #[test]
    fn intact_chain_holds() {
        let lines = log_lines(4);
        assert!(matches!(run(&lines), VerifyOutcome::Holds { lines: 4, .. }));
    }

    #[test]
    fn edited_line_is_found() {
        let mut lines = log_lines(4);
        lines[2] = lines[2].replace("cmd 2", "cmd X");
        match run(&lines) {
            VerifyOutcome::Broken { line, reason } => {
                assert_eq!(line, 3);
                assert!(reason.contains("edited"), "{reason}");
            }
            o => panic!("{o}"),
        }
    }

    #[test]
    fn removed_and_reordered_lines_are_found() {
        let mut lines = log_lines(4);
        lines.remove(1);
        assert!(matches!(run(&lines), VerifyOutcome::Broken { line: 2, .. }));
        let mut lines = log_lines(4);
        lines.swap(1, 2);
        assert!(matches!(run(&lines), VerifyOutcome::Broken { line: 2, .. }));
        let mut lines = log_lines(2);
        lines[1].push_str("garbage");
        assert!(matches!(run(&lines), VerifyOutcome::Broken { line: 2, .. }));
    }
}
