//! `ask` decisions: the AskRequest sent to the host, waiting for its
//! Answer (or the timeout), and routing an Answer to the waiting command.

use super::*;

impl Session {
    /// Holds the command for an Answer; true when it may run.
    pub(super) async fn ask(&self, e: &Exec, decision: &ExecDecision) -> bool {
        let (subject, rule) = (decision.subject.as_str(), decision.rule.as_str());
        let ask_id = format!("ask-{}", e.exec_id);
        let (tx, rx) = oneshot::channel();
        lock(&self.asks).insert(ask_id.clone(), (e.turn_id.clone(), tx));
        self.audit(Entry {
            turn_id: &e.turn_id,
            actor: "guest-init",
            action: "ask.requested",
            resource: subject,
            decision: "ask",
            result: &ask_id,
        })
        .await;
        self.send(msg(Out::AskRequest(AskRequest {
            ask_id: ask_id.clone(),
            exec_id: e.exec_id.clone(),
            turn_id: e.turn_id.clone(),
            tool: crate::policy::EXEC_TOOL.into(),
            // The host records the subject in the session's events: no
            // secret values there.
            subject: self.secrets.redactor().redact(subject),
            rule: rule.to_string(),
            timeout_ms: u32::try_from(self.ask_timeout.as_millis()).unwrap_or(u32::MAX),
        })))
        .await;
        // Err(Elapsed): timed out; Ok(Err(_)): the turn or session ended.
        let outcome = tokio::time::timeout(self.ask_timeout, rx).await;
        lock(&self.asks).remove(&ask_id);
        let reply = match &outcome {
            Ok(Ok(r)) => Some(*r),
            _ => None,
        };
        let cancelled = matches!(outcome, Ok(Err(_)));
        let (word, ok) = match reply {
            Some(Reply::Once) => ("once", true),
            Some(Reply::Always) => ("always", true),
            Some(_) => ("reject", false),
            None if cancelled => ("cancelled", false),
            None => ("timeout", false),
        };
        self.audit(Entry {
            turn_id: &e.turn_id,
            actor: "host",
            action: "ask.answered",
            resource: subject,
            decision: word,
            result: &ask_id,
        })
        .await;
        if reply == Some(Reply::Always) {
            lock(&self.always).extend(decision.keys.iter().cloned());
        }
        if !ok {
            let reason = if cancelled {
                "the turn or session ended before the command was approved".to_string()
            } else if reply.is_none() {
                format!(
                    "approval timed out after {} ms",
                    self.ask_timeout.as_millis()
                )
            } else {
                "rejected by the control plane".to_string()
            };
            self.reject(&e.exec_id, &e.turn_id, &reason, rule).await;
        }
        ok
    }

    pub(super) fn answer(&self, ask_id: &str, reply: i32) -> Result<(), Failure> {
        let reply = Reply::try_from(reply)
            .ok()
            .filter(|r| *r != Reply::Unspecified)
            .ok_or_else(|| {
                error(
                    Code::InvalidArgument,
                    format!("Answer reply {reply} is not once, always or reject"),
                    "",
                )
            })?;
        let (_, tx) = lock(&self.asks).remove(ask_id).ok_or_else(|| {
            error(
                Code::InvalidArgument,
                format!("no pending ask {ask_id:?} (answered already, timed out, or never asked)"),
                "",
            )
        })?;
        let _ = tx.send(reply);
        Ok(())
    }
}
