//! Asks as events: what the guest asked, and what became of each ask, are
//! recorded in the session's events (`ask`, `ask_answered`,
//! `ask_unanswered`), so a control plane sees them in `Events.Watch`
//! without polling `ListAsks`.

use tokio::sync::mpsc;

use super::*;
use crate::guest::{AskNotice, PendingAsk};

/// Longest command text an event carries; longer ones are cut (the whole
/// ask is in `ListAsks` and the Exec stream).
const MAX_SUBJECT_CHARS: usize = 512;

/// `text` cut to `max` characters, with an ellipsis when cut.
fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

/// The event detail of a new ask.
pub fn asked_detail(a: &PendingAsk) -> String {
    format!(
        "ask {} for exec {} (turn {}): {} {:?} by rule {:?}; unanswered after {} ms it is refused",
        a.ask.ask_id,
        a.ask.exec_id,
        a.ask.turn_id,
        a.ask.tool,
        cut(&a.ask.subject, MAX_SUBJECT_CHARS),
        a.ask.rule,
        a.ask.timeout_ms
    )
}

impl Manager {
    /// Records the asks of `sess`'s guest channel as they come, in a task of
    /// their own, until the channel closes.
    pub(super) fn record_asks(&self, sess: &Session, notices: mpsc::Receiver<AskNotice>) {
        let (Some(me), Ok(sess)) = (self.me.upgrade(), self.session(&sess.id)) else {
            return;
        };
        tokio::spawn(me.asks_task(sess, notices));
    }

    async fn asks_task(
        self: Arc<Self>,
        sess: Arc<Session>,
        mut notices: mpsc::Receiver<AskNotice>,
    ) {
        while let Some(n) = notices.recv().await {
            let (reason, detail) = match &n {
                AskNotice::Asked(a) => ("ask", asked_detail(a)),
                AskNotice::Unanswered { ask, why } => (
                    "ask_unanswered",
                    format!("ask {}: {}", ask.ask.ask_id, cut(why, MAX_SUBJECT_CHARS)),
                ),
            };
            if let Err(e) = self.note(&sess, reason, &detail) {
                tracing::warn!(session = %sess.id, error = %e, "recording an ask event");
            }
        }
    }

    /// Records that ask `ask_id` of `sess` was answered with `reply`.
    pub fn note_answer(&self, sess: &Session, ask_id: &str, reply: &str) -> Result<()> {
        self.note(sess, "ask_answered", &format!("ask {ask_id}: {reply}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::guest::AskRequest;

    #[test]
    fn an_asks_event_names_the_command_and_rule_and_stays_short() {
        let a = PendingAsk {
            ask: AskRequest {
                ask_id: "ask-1".into(),
                exec_id: "e1".into(),
                turn_id: "t1".into(),
                tool: "bash".into(),
                subject: "rm -rf build".into(),
                rule: "rm *".into(),
                timeout_ms: 60_000,
            },
            asked_at: 0,
        };
        let d = asked_detail(&a);
        assert_eq!(
            d,
            "ask ask-1 for exec e1 (turn t1): bash \"rm -rf build\" by rule \"rm *\"; unanswered after 60000 ms it is refused"
        );
        let long = PendingAsk {
            ask: AskRequest {
                subject: "x".repeat(10_000),
                ..a.ask.clone()
            },
            asked_at: 0,
        };
        assert!(asked_detail(&long).len() < 1_000);
        assert_eq!(cut("ééé", 2), "éé…");
        assert_eq!(cut("ab", 2), "ab");
    }
}
