//! Ending a turn of a live session (`Exec.EndTurn`): guest-init kills every
//! process the turn's commands started, drops its commands still waiting
//! for an approval, audits it, and says what it killed.

use std::time::Duration;

use proto::guest::{guest_message::Kind as Out, host_message::Kind as In, EndTurn};

use super::*;

/// How long guest-init is given to kill a turn's processes and answer.
const END_TURN_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest turn id accepted.
pub const MAX_TURN_ID_BYTES: usize = 256;

/// A process EndTurn killed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Killed {
    /// Its pid in the guest.
    pub pid: u32,
    /// Its command line, secret values redacted by guest-init.
    pub command: String,
}

/// Checks a turn id from a client: 1 to [`MAX_TURN_ID_BYTES`] bytes, no
/// control characters.
pub fn check_turn_id(turn_id: &str) -> Result<()> {
    if turn_id.is_empty() {
        return Err(Error::invalid("turn_id is required"));
    }
    if turn_id.len() > MAX_TURN_ID_BYTES || turn_id.chars().any(char::is_control) {
        return Err(Error::invalid(format!(
            "turn_id must be at most {MAX_TURN_ID_BYTES} bytes without control characters"
        )));
    }
    Ok(())
}

impl Manager {
    /// Ends turn `turn_id` of RUNNING session `id` and returns the processes
    /// guest-init killed (none for a turn with nothing running); recorded as
    /// a `turn_ended` event.
    pub async fn end_turn(&self, id: &str, turn_id: &str) -> Result<Vec<Killed>> {
        check_turn_id(turn_id)?;
        let sess = self.session(id)?;
        // One caller of the guest's control messages at a time (Stop's
        // branch fetch, a channel re-open).
        let _op = sess.op.lock().await;
        let state = sess.row().state;
        if state != S::Running as i32 {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is {}; turns end only while RUNNING",
                state_name(state)
            )));
        }
        if !sess.guest_init() {
            return Err(Error::FailedPrecondition(format!(
                "session {id} runs an image without guest-init; it has no turns"
            )));
        }
        self.touch(&sess);
        let conn = self.guest_channel(&sess).await?;
        conn.send(In::EndTurn(EndTurn {
            turn_id: turn_id.to_string(),
        }))
        .await?;
        let deadline = tokio::time::Instant::now() + END_TURN_TIMEOUT;
        let killed = loop {
            match conn.next_control_before(deadline).await?.kind {
                Some(Out::TurnEnded(t)) if t.turn_id == turn_id => break t.killed,
                Some(Out::Error(e)) => {
                    return Err(Error::Guest(format!(
                        "guest-init could not end turn {turn_id:?}: {}",
                        e.message
                    )))
                }
                _ => continue,
            }
        };
        let killed: Vec<Killed> = killed
            .into_iter()
            .map(|k| Killed {
                pid: k.pid,
                command: k.command,
            })
            .collect();
        let pids: Vec<String> = killed.iter().map(|k| k.pid.to_string()).collect();
        self.note(
            &sess,
            "turn_ended",
            &format!(
                "turn {turn_id}: {} process(es) killed{}",
                killed.len(),
                if pids.is_empty() {
                    String::new()
                } else {
                    format!(" (pids {})", pids.join(", "))
                }
            ),
        )?;
        Ok(killed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turn_ids_are_checked() {
        assert!(check_turn_id("turn-1").is_ok());
        for bad in ["", "a\nb", &"x".repeat(MAX_TURN_ID_BYTES + 1)] {
            let e = check_turn_id(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e}");
            assert!(e.to_string().contains("turn_id"), "{e}");
        }
    }
}
