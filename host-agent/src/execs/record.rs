//! One command's record: what it is, where it is, its output buffer, and
//! the streams attached to it.
//!
//! The pump ([`super::pump`]) is the only writer of a record's output and
//! end; attached streams ([`super::attach`]) read it through cursors. A
//! change wakes everyone waiting through one version counter.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use proto::hostagent as pb;
use tokio::sync::watch;

use super::ring::{OutputRing, Stream};
use crate::clock::now_ms;

/// How a command ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// It exited; the status and why guest-init ended it (empty: it ended
    /// by itself).
    Exited(pb::ExecExit),
    /// It never ran: the policy, an ask, or starting it failed.
    Rejected(String),
    /// guest-init reported an error for it (bad cwd, ...).
    Failed(String),
    /// Its guest channel closed before it ended.
    Lost(String),
}

/// What is set when a command is requested.
#[derive(Debug, Clone)]
pub struct Meta {
    /// Its id.
    pub exec_id: String,
    /// Its session.
    pub session_id: String,
    /// Its turn.
    pub turn_id: String,
    /// Whether it runs on a terminal.
    pub pty: bool,
    /// Whether its stdin stays open (keep_stdin_open or a terminal).
    pub stdin_open: bool,
    /// Its time limit (0: none).
    pub timeout_ms: u64,
    /// When it was requested, Unix ms.
    pub started_at: i64,
}

/// The changing part of a record.
#[derive(Debug)]
pub struct State {
    /// Its argv: as requested, then as guest-init reports it (redacted).
    pub argv: Vec<String>,
    /// Its pid in the guest, once started.
    pub pid: Option<u32>,
    /// How it ended.
    pub end: Option<End>,
    /// When it ended, Unix ms.
    pub ended_at: i64,
    /// Its output.
    pub ring: OutputRing,
    /// Where each attached stream is in the output, by attachment id.
    pub cursors: HashMap<u64, u64>,
    next_attachment: u64,
    /// Asks of the command, numbered from 1, newest last (at most
    /// [`MAX_ASKS_KEPT`]).
    pub asks: Vec<(u64, pb::Ask)>,
    /// Number of the last ask.
    pub last_ask: u64,
    /// Whether a client closed its stdin.
    pub stdin_closed: bool,
}

/// Asks kept per command for the streams attached (dropped when it ends).
pub const MAX_ASKS_KEPT: usize = 16;
/// Most bytes of argv a record keeps (the rest is cut, and said so).
pub const MAX_ARGV_BYTES: usize = 16 * 1024;
/// Most bytes of a rejection, error or exit reason a record keeps.
pub const MAX_DETAIL_BYTES: usize = 4 * 1024;

/// `argv` cut to [`MAX_ARGV_BYTES`]: whole arguments while they fit, then
/// one saying how many bytes were left out. A guest (or a client) cannot
/// make a record hold more.
pub fn bounded_argv(argv: Vec<String>) -> Vec<String> {
    let total: usize = argv.iter().map(String::len).sum();
    if total <= MAX_ARGV_BYTES {
        return argv;
    }
    let mut kept = Vec::new();
    let mut used = 0;
    for a in argv {
        if used + a.len() > MAX_ARGV_BYTES {
            break;
        }
        used += a.len();
        kept.push(a);
    }
    kept.push(format!("[{} more bytes not kept]", total - used));
    kept
}

/// `s` cut to at most `max` bytes (on a character boundary).
pub fn cut(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("[...]");
    }
    s
}

/// One command.
#[derive(Debug)]
pub struct ExecRecord {
    /// What was requested.
    pub meta: Meta,
    state: Mutex<State>,
    changed: watch::Sender<u64>,
}

impl ExecRecord {
    /// A record for a command just requested.
    pub fn new(meta: Meta, argv: Vec<String>) -> Self {
        Self {
            meta,
            state: Mutex::new(State {
                argv: bounded_argv(argv),
                pid: None,
                end: None,
                ended_at: 0,
                ring: OutputRing::default(),
                cursors: HashMap::new(),
                next_attachment: 0,
                asks: Vec::new(),
                last_ask: 0,
                stdin_closed: false,
            }),
            changed: watch::channel(0).0,
        }
    }

    /// Its state, locked.
    pub fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a panic elsewhere; the data is whole.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A receiver that wakes on the next change (changes before this call
    /// are seen as read).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        let mut rx = self.changed.subscribe();
        rx.borrow_and_update();
        rx
    }

    /// Wakes everyone waiting on this record.
    pub fn notify(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Whether it ended.
    pub fn ended(&self) -> bool {
        self.lock().end.is_some()
    }

    /// Records that guest-init started it.
    pub fn started(&self, pid: u32, argv: Vec<String>) {
        {
            let mut st = self.lock();
            st.pid = Some(pid);
            if !argv.is_empty() {
                st.argv = bounded_argv(argv);
            }
        }
        self.notify();
    }

    /// Records an ask of the command.
    pub fn ask(&self, ask: pb::Ask) {
        {
            let mut st = self.lock();
            st.last_ask += 1;
            let n = st.last_ask;
            st.asks.push((n, ask));
            if st.asks.len() > MAX_ASKS_KEPT {
                st.asks.remove(0);
            }
        }
        self.notify();
    }

    /// Records its end (the first one counts); texts are cut to
    /// [`MAX_DETAIL_BYTES`], and its asks are dropped.
    pub fn finish(&self, end: End) {
        let end = match end {
            End::Exited(mut e) => {
                e.reason = cut(e.reason, MAX_DETAIL_BYTES);
                End::Exited(e)
            }
            End::Rejected(r) => End::Rejected(cut(r, MAX_DETAIL_BYTES)),
            End::Failed(r) => End::Failed(cut(r, MAX_DETAIL_BYTES)),
            End::Lost(r) => End::Lost(cut(r, MAX_DETAIL_BYTES)),
        };
        {
            let mut st = self.lock();
            if st.end.is_some() {
                return;
            }
            st.end = Some(end);
            st.ended_at = now_ms();
            st.asks = Vec::new();
        }
        self.notify();
    }

    /// Registers an attached stream at `cursor`; returns its id.
    pub fn attach(&self, cursor: u64) -> u64 {
        let mut st = self.lock();
        st.next_attachment += 1;
        let id = st.next_attachment;
        st.cursors.insert(id, cursor);
        id
    }

    /// Moves attachment `id`'s cursor.
    pub fn advance(&self, id: u64, cursor: u64) {
        if let Some(c) = self.lock().cursors.get_mut(&id) {
            *c = cursor;
        }
        self.notify();
    }

    /// Removes attachment `id`.
    pub fn detach(&self, id: u64) {
        self.lock().cursors.remove(&id);
        self.notify();
    }

    /// Appends output, waiting while an attached stream has not read what
    /// the piece would push out of the buffer, unless `drop_behind` turns
    /// true (the session is stopping: output is no longer waited for).
    pub async fn append(
        &self,
        stream: Stream,
        data: &[u8],
        drop_behind: &mut watch::Receiver<bool>,
    ) {
        loop {
            let mut rx = self.subscribe();
            {
                let mut st = self.lock();
                let start = st.ring.start_after_push(stream, data.len());
                if *drop_behind.borrow() || st.cursors.values().all(|c| *c >= start) {
                    st.ring.push(stream, data);
                    drop(st);
                    self.notify();
                    return;
                }
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                r = drop_behind.changed() => if r.is_err() {
                    // Nobody can say "drop" any more: stop waiting.
                    self.lock().ring.push(stream, data);
                    self.notify();
                    return;
                },
            }
        }
    }

    /// Its listing.
    pub fn info(&self) -> pb::ExecInfo {
        let st = self.lock();
        let (state, exit, detail) = match &st.end {
            None if st.pid.is_some() => (pb::ExecState::Running, None, String::new()),
            None => (pb::ExecState::Starting, None, String::new()),
            Some(End::Exited(e)) => (pb::ExecState::Exited, Some(e.clone()), String::new()),
            Some(End::Rejected(r)) => (pb::ExecState::Rejected, None, r.clone()),
            Some(End::Failed(r) | End::Lost(r)) => (pb::ExecState::Lost, None, r.clone()),
        };
        pb::ExecInfo {
            exec_id: self.meta.exec_id.clone(),
            session_id: self.meta.session_id.clone(),
            turn_id: self.meta.turn_id.clone(),
            argv: st.argv.clone(),
            state: state as i32,
            exit,
            detail,
            pid: st.pid.unwrap_or(0),
            started_at: self.meta.started_at,
            ended_at: st.ended_at,
            output_bytes: st.ring.end(),
            output_start_offset: st.ring.start(),
            pty: self.meta.pty,
            timeout_ms: self.meta.timeout_ms,
            attached: u32::try_from(st.cursors.len()).unwrap_or(u32::MAX),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_record_keeps_is_bounded() {
        let short = vec!["echo".to_string(), "hi".to_string()];
        assert_eq!(bounded_argv(short.clone()), short);
        let long = vec!["a".repeat(10_000), "b".repeat(10_000), "c".into()];
        let kept = bounded_argv(long);
        assert_eq!(kept.len(), 2);
        assert_eq!(kept[1], "[10001 more bytes not kept]");
        let c = cut("ünïcode".repeat(1000), 4);
        assert_eq!(c, "ün[...]");
        let rec = ExecRecord::new(
            Meta {
                exec_id: "e".into(),
                session_id: "s".into(),
                turn_id: "t".into(),
                pty: false,
                stdin_open: false,
                timeout_ms: 0,
                started_at: 0,
            },
            vec![],
        );
        rec.ask(pb::Ask::default());
        rec.finish(End::Rejected("x".repeat(1 << 20)));
        let st = rec.lock();
        assert!(st.asks.is_empty());
        let Some(End::Rejected(r)) = &st.end else {
            panic!("{:?}", st.end)
        };
        assert!(r.len() <= MAX_DETAIL_BYTES + 5);
    }
}
