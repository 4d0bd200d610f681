//! The commands of a session, as host-agent keeps them: each with a record
//! ([`record`]) holding its state and the newest output ([`ring`]), fed by
//! a pump task from the guest channel ([`pump`]) and read by any number of
//! attached streams ([`attach`]).
//!
//! A command outlives its streams: when the Exec stream that started it
//! drops, it keeps running and its output keeps going into its buffer, to
//! be replayed by Attach. Memory is bounded per session: at most
//! [`MAX_RUNNING_PER_SESSION`] commands not yet ended (more are refused with
//! RESOURCE_EXHAUSTED), each with at most [`ring::OUTPUT_BUFFER_BYTES`] of
//! output; of the ended ones the newest [`MAX_ENDED_WITH_OUTPUT`] keep their
//! output and the newest [`MAX_ENDED_KEPT`] stay listable.

pub mod attach;
mod pump;
pub mod record;
pub mod ring;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use proto::hostagent as pb;

use crate::error::{Error, Result};
pub use pump::pump;
use record::{ExecRecord, Meta};

/// Commands of a session not yet ended, at most.
pub const MAX_RUNNING_PER_SESSION: usize = 32;
/// Ended commands kept listable per session.
pub const MAX_ENDED_KEPT: usize = 256;
/// Ended commands that keep their output per session (the newest).
pub const MAX_ENDED_WITH_OUTPUT: usize = 16;

/// A session's commands, oldest first.
#[derive(Debug, Default)]
pub struct ExecTable {
    records: Mutex<VecDeque<Arc<ExecRecord>>>,
}

impl ExecTable {
    fn records(&self) -> std::sync::MutexGuard<'_, VecDeque<Arc<ExecRecord>>> {
        // A poisoned lock only means a panic elsewhere; the list is whole.
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a command just requested; refused with RESOURCE_EXHAUSTED when
    /// the session already has [`MAX_RUNNING_PER_SESSION`] not yet ended.
    pub fn begin(&self, meta: Meta, argv: Vec<String>) -> Result<Arc<ExecRecord>> {
        let mut g = self.records();
        let running = g.iter().filter(|r| !r.ended()).count();
        if running >= MAX_RUNNING_PER_SESSION {
            return Err(Error::ResourceExhausted(format!(
                "session {} already runs {running} commands, the most a session may \
                 (each keeps up to 1 MiB of output); wait for one to end, or end its turn",
                meta.session_id
            )));
        }
        let rec = Arc::new(ExecRecord::new(meta, argv));
        g.push_back(rec.clone());
        trim(&mut g);
        Ok(rec)
    }

    /// Applies the limits on ended commands (called when one ends).
    pub fn trim(&self) {
        trim(&mut self.records());
    }

    /// Command `exec_id`.
    pub fn get(&self, exec_id: &str) -> Option<Arc<ExecRecord>> {
        self.records()
            .iter()
            .find(|r| r.meta.exec_id == exec_id)
            .cloned()
    }

    /// Every command kept, oldest first.
    pub fn list(&self) -> Vec<pb::ExecInfo> {
        let all: Vec<Arc<ExecRecord>> = self.records().iter().cloned().collect();
        all.iter().map(|r| r.info()).collect()
    }
}

/// Drops the output of ended commands past the newest
/// [`MAX_ENDED_WITH_OUTPUT`], and ended commands past [`MAX_ENDED_KEPT`].
fn trim(records: &mut VecDeque<Arc<ExecRecord>>) {
    let mut ended = 0usize;
    let mut i = records.len();
    while i > 0 {
        i -= 1;
        if !records[i].ended() {
            continue;
        }
        ended += 1;
        if ended > MAX_ENDED_KEPT {
            records.remove(i);
        } else if ended > MAX_ENDED_WITH_OUTPUT {
            let rec = &records[i];
            let had = {
                let mut st = rec.lock();
                let had = st.ring.end() > st.ring.start();
                st.ring.clear();
                had
            };
            if had {
                rec.notify();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::record::End;
    use super::*;

    fn meta(id: &str) -> Meta {
        Meta {
            exec_id: id.into(),
            session_id: "s".into(),
            turn_id: "t".into(),
            pty: false,
            stdin_open: false,
            timeout_ms: 0,
            started_at: 0,
        }
    }

    #[test]
    fn running_commands_are_bounded_and_ended_ones_trimmed() {
        let t = ExecTable::default();
        let mut recs = Vec::new();
        for i in 0..MAX_RUNNING_PER_SESSION {
            recs.push(t.begin(meta(&format!("e{i}")), vec!["x".into()]).unwrap());
        }
        let e = t.begin(meta("over"), vec![]).unwrap_err();
        assert!(matches!(e, Error::ResourceExhausted(_)), "{e}");
        // Ending them makes room; ended ones beyond the limits are trimmed.
        for r in &recs {
            r.lock().ring.push(ring::Stream::Stdout, b"out");
            r.finish(End::Lost("gone".into()));
        }
        t.trim();
        let with_output = t
            .list()
            .iter()
            .filter(|i| i.output_bytes > i.output_start_offset)
            .count();
        assert_eq!(with_output, MAX_ENDED_WITH_OUTPUT);
        for i in 0..MAX_ENDED_KEPT + 10 {
            let r = t.begin(meta(&format!("n{i}")), vec![]).unwrap();
            r.finish(End::Rejected("no".into()));
        }
        t.trim();
        let list = t.list();
        assert_eq!(list.len(), MAX_ENDED_KEPT);
        assert_eq!(
            list.last().unwrap().exec_id,
            format!("n{}", MAX_ENDED_KEPT + 9)
        );
        assert!(t.get("e0").is_none());
    }
}
