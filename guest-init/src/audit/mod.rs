//! The audit log: one JSON line per action, hash-chained.
//!
//! Each line is `{v, seq, at, session_id, turn_id, actor, action, resource,
//! decision, result, prev_hash, hash}` in that order. The *canonical event*
//! is the compact JSON of the first ten fields (everything but `prev_hash`
//! and `hash`) in that order; `hash = hex(sha256(prev_hash || canonical))`,
//! where `prev_hash` is the previous line's hash as 64 hex characters (64
//! zeros for the first line) and `seq` counts from 1. So an edited, removed
//! or reordered line breaks the chain; [`verify()`] finds the first break.

pub mod time;
pub mod verify;

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use verify::{verify, VerifyOutcome};

use crate::policy::secrets::Redactor;

/// Format version written in `v`.
pub const VERSION: u32 = 1;

/// `prev_hash` of the first line.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// The hashed part of an audit line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Event {
    /// Format version.
    pub v: u32,
    /// 1-based position in the log.
    pub seq: u64,
    /// RFC 3339 UTC time with milliseconds.
    pub at: String,
    /// Session the action belongs to.
    pub session_id: String,
    /// Turn, or empty for session-level actions.
    pub turn_id: String,
    /// Who acted: `agent`, `host` or `guest-init`.
    pub actor: String,
    /// What happened, e.g. `exec.decided`.
    pub action: String,
    /// What it happened to: a command, a secret name, a destination.
    pub resource: String,
    /// `allow`, `ask`, `deny`, `once`, `always`, `reject`, or empty.
    pub decision: String,
    /// Outcome, e.g. `exit 0`, `signal 9`, `killed 3`.
    pub result: String,
}

/// One line as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Line {
    /// The event, flattened.
    #[serde(flatten)]
    pub event: Event,
    /// Hash of the previous line.
    pub prev_hash: String,
    /// This line's hash.
    pub hash: String,
}

/// The fields a caller supplies; the log fills in the rest.
#[derive(Debug, Clone, Default)]
pub struct Entry<'a> {
    /// Turn, or empty.
    pub turn_id: &'a str,
    /// Who acted.
    pub actor: &'a str,
    /// What happened.
    pub action: &'a str,
    /// What it happened to.
    pub resource: &'a str,
    /// Decision, or empty.
    pub decision: &'a str,
    /// Outcome, or empty.
    pub result: &'a str,
}

/// Failure to write the log.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// The log file could not be opened or written.
    #[error("audit log {path}: {source}")]
    Io {
        /// Log path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Serialising an event failed (an invariant violation).
    #[error("audit event could not be serialised: {0}")]
    Json(#[from] serde_json::Error),
}

/// The hash of `event` chained after `prev_hash`.
pub fn chain_hash(prev_hash: &str, event: &Event) -> Result<String, serde_json::Error> {
    let canonical = serde_json::to_vec(event)?;
    let mut h = Sha256::new();
    h.update(prev_hash.as_bytes());
    h.update(&canonical);
    Ok(hex::encode(h.finalize()))
}

/// An append-only, hash-chained audit log for one session.
pub struct AuditLog {
    file: Option<(File, String)>,
    session_id: String,
    seq: u64,
    prev_hash: String,
    redactor: Redactor,
}

impl AuditLog {
    /// A log writing to `path` (created with mode 0600, truncated), or only
    /// in memory when `path` is None.
    pub fn open(
        path: Option<&Path>,
        session_id: &str,
        redactor: Redactor,
    ) -> Result<Self, AuditError> {
        let file = match path {
            Some(p) => {
                let f = OpenOptions::new()
                    .create(true)
                    .write(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(p)
                    .map_err(|source| AuditError::Io {
                        path: p.display().to_string(),
                        source,
                    })?;
                Some((f, p.display().to_string()))
            }
            None => None,
        };
        Ok(Self {
            file,
            session_id: session_id.to_string(),
            seq: 0,
            prev_hash: GENESIS.to_string(),
            redactor,
        })
    }

    /// Appends one event; returns its sequence number and JSON line (without
    /// the newline). Secret values in any field are redacted first.
    pub fn append(&mut self, e: Entry<'_>) -> Result<(u64, String), AuditError> {
        let r = &self.redactor;
        let event = Event {
            v: VERSION,
            seq: self.seq + 1,
            at: time::now_rfc3339(),
            session_id: r.redact(&self.session_id),
            turn_id: r.redact(e.turn_id),
            actor: r.redact(e.actor),
            action: r.redact(e.action),
            resource: r.redact(e.resource),
            decision: r.redact(e.decision),
            result: r.redact(e.result),
        };
        let hash = chain_hash(&self.prev_hash, &event)?;
        let line = Line {
            event,
            prev_hash: self.prev_hash.clone(),
            hash: hash.clone(),
        };
        let text = serde_json::to_string(&line)?;
        if let Some((f, path)) = &mut self.file {
            let mut buf = text.clone().into_bytes();
            buf.push(b'\n');
            f.write_all(&buf).map_err(|source| AuditError::Io {
                path: path.clone(),
                source,
            })?;
        }
        self.seq += 1;
        self.prev_hash = hash;
        Ok((self.seq, text))
    }
}

impl AuditLog {
    /// The sequence number of the last event appended (0: none yet).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The hash of the last event appended ([`GENESIS`] when none was): what
    /// the next one chains after.
    pub fn last_hash(&self) -> &str {
        &self.prev_hash
    }

    /// Continues numbering after `seq` (when it is ahead): a guest restored from
    /// an older snapshot must not reuse numbers the host already holds for
    /// events of the future it was rolled back from. The hash chain goes on
    /// from this log's own last line.
    pub fn skip_to(&mut self, seq: u64) {
        self.seq = self.seq.max(seq);
    }

    /// Every line of the log file, oldest first, with its seq and hash (a log
    /// kept only in memory has none): what a resume compares with the host's
    /// last event and sends again.
    pub fn lines(&self) -> Result<Vec<Logged>, AuditError> {
        let Some((_, path)) = &self.file else {
            return Ok(Vec::new());
        };
        let text = std::fs::read_to_string(path).map_err(|source| AuditError::Io {
            path: path.clone(),
            source,
        })?;
        text.lines()
            .map(|l| {
                let line: Line = serde_json::from_str(l)?;
                Ok(Logged {
                    seq: line.event.seq,
                    hash: line.hash,
                    json: l.to_string(),
                })
            })
            .collect()
    }
}

/// One line read back from an audit log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Logged {
    /// Its sequence number.
    pub seq: u64,
    /// Its chain hash.
    pub hash: String,
    /// The line itself, as sent to the host.
    pub json: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_chain_and_redact() {
        let values = [("T".to_string(), "topsecret".to_string())].into();
        let mut log = AuditLog::open(None, "s1", Redactor::new(&values)).unwrap();
        let (s1, l1) = log
            .append(Entry {
                actor: "agent",
                action: "exec.decided",
                resource: "echo topsecret",
                decision: "allow",
                ..Default::default()
            })
            .unwrap();
        let (s2, l2) = log
            .append(Entry {
                actor: "guest-init",
                action: "session.end",
                ..Default::default()
            })
            .unwrap();
        assert_eq!((s1, s2), (1, 2));
        assert!(!l1.contains("topsecret") && l1.contains("[REDACTED:T]"));
        let a: Line = serde_json::from_str(&l1).unwrap();
        let b: Line = serde_json::from_str(&l2).unwrap();
        assert_eq!(a.prev_hash, GENESIS);
        assert_eq!(b.prev_hash, a.hash);
        assert_eq!(chain_hash(&a.prev_hash, &a.event).unwrap(), a.hash);
        assert!(l1.starts_with("{\"v\":1,\"seq\":1,\"at\":"));
    }

    #[test]
    fn lines_come_back_from_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let mut log = AuditLog::open(Some(&path), "s1", Redactor::default()).unwrap();
        let mut sent = Vec::new();
        for action in ["a", "b", "c"] {
            sent.push(
                log.append(Entry {
                    action,
                    ..Default::default()
                })
                .unwrap(),
            );
        }
        let lines = log.lines().unwrap();
        let back: Vec<(u64, String)> = lines.iter().map(|l| (l.seq, l.json.clone())).collect();
        assert_eq!(back, sent);
        let second: Line = serde_json::from_str(&sent[1].1).unwrap();
        assert_eq!(lines[1].hash, second.hash);
        let memory = AuditLog::open(None, "s1", Redactor::default()).unwrap();
        assert!(memory.lines().unwrap().is_empty());
        assert_eq!(memory.last_hash(), GENESIS);
        assert_eq!(log.last_hash(), lines[2].hash);

        // Rolled back behind the host: numbering continues after the host's.
        log.skip_to(10);
        log.skip_to(5);
        let (seq, line) = log
            .append(Entry {
                action: "d",
                ..Default::default()
            })
            .unwrap();
        assert_eq!(seq, 11);
        let prev: Line = serde_json::from_str(&sent[2].1).unwrap();
        let next: Line = serde_json::from_str(&line).unwrap();
        assert_eq!(
            next.prev_hash, prev.hash,
            "the chain goes on from the last line"
        );
    }
}
