//! Host connections wait while a restored guest handles its transport reset.
//!
//! A restored vsock device tells the guest, once it runs, that every
//! connection it had is gone (the transport-reset event). Linux handles the
//! event in a work item that resets every connected socket; a host
//! connection the device passed to the guest before that ran was reset with
//! the old ones (seen with a real guest: host-agent's first connection to a
//! freshly restored guest-init was closed within milliseconds). So while the
//! event is outstanding, host connections are not passed to the guest, until
//! the guest posts a new event buffer (Linux does that after handling the
//! event) or, for a guest that never does, until [`HOLD_LIMIT`] has passed.

use std::time::Duration;

use vmm_sys_util::timerfd::TimerFd;

/// Longest host connections wait for the guest to take the reset.
pub const HOLD_LIMIT: Duration = Duration::from_secs(5);

/// Where the reset stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing outstanding: host connections go through.
    Open,
    /// The event is owed or queued but not yet in the guest's event buffer.
    Announced,
    /// The event is in the guest's buffer; waiting for the guest to post
    /// another, i.e. for the event queue's available index to move from
    /// the value it had then.
    Delivered {
        /// The available index when the event was delivered.
        avail_at: u16,
    },
}

/// The hold on host connections after a restore.
pub struct ResetHold {
    phase: Phase,
    /// Ends the hold after [`HOLD_LIMIT`] (watched by the event loop).
    pub timer: TimerFd,
}

impl ResetHold {
    /// No hold.
    pub fn new() -> std::io::Result<ResetHold> {
        let timer = super::handshake::nonblocking_timer()?;
        Ok(ResetHold {
            phase: Phase::Open,
            timer,
        })
    }

    /// Whether host connections must wait.
    pub fn holding(&self) -> bool {
        self.phase != Phase::Open
    }

    /// The reset is announced: hold host connections from now.
    pub fn announced(&mut self) {
        self.phase = Phase::Announced;
        if let Err(e) = self.timer.reset(HOLD_LIMIT, None) {
            // Without the timer the guest's next event buffer still ends
            // the hold; a guest that never posts one keeps host
            // connections waiting, so say so.
            tracing::warn!(error = %e, "vsock: cannot arm the reset hold timer");
        }
    }

    /// The event went into the guest's event buffer; `avail_idx` is the
    /// event queue's available index (in guest memory) at that moment.
    pub fn delivered(&mut self, avail_idx: u16) {
        if self.phase == Phase::Announced {
            self.phase = Phase::Delivered {
                avail_at: avail_idx,
            };
        }
    }

    /// The event queue was notified and its available index is now
    /// `avail_idx`. Returns true when that ends the hold: the guest posted
    /// a new buffer after taking the event. A notification that added no
    /// buffer ends nothing (the vmm itself kicks every queue of a restored
    /// VM once when it first runs, and that kick must not open the gate).
    pub fn guest_notified(&mut self, avail_idx: u16) -> bool {
        match self.phase {
            Phase::Delivered { avail_at } if avail_at != avail_idx => {
                self.release();
                true
            }
            _ => false,
        }
    }

    /// The timer fired (its fd is readable). Returns true when that ends a
    /// hold.
    pub fn timed_out(&mut self) -> bool {
        // Consumes the expiry; nothing to read (cleared meanwhile) is fine.
        let _ = self.timer.wait();
        if self.holding() {
            tracing::warn!(
                limit_ms = HOLD_LIMIT.as_millis() as u64,
                "vsock: the guest did not take the transport reset in time; host connections go through"
            );
            self.release();
            return true;
        }
        false
    }

    /// Ends the hold (also on a device reset).
    pub fn release(&mut self) {
        self.phase = Phase::Open;
        let _ = self.timer.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hold_ends_when_the_guest_posts_a_buffer_after_the_event() {
        let mut h = ResetHold::new().unwrap();
        assert!(!h.holding());
        h.announced();
        assert!(h.holding());
        assert!(h.timer.is_armed().unwrap());
        // A notification before the event reached the guest ends nothing.
        assert!(!h.guest_notified(7));
        assert!(h.holding());
        h.delivered(7);
        // Nor one that added no buffer (the first-run kick).
        assert!(!h.guest_notified(7));
        assert!(h.holding());
        assert!(h.guest_notified(8));
        assert!(!h.holding());
        assert!(!h.timer.is_armed().unwrap());
        assert!(!h.guest_notified(9), "once");
    }

    #[test]
    fn a_hold_ends_on_time_if_the_guest_never_answers() {
        let mut h = ResetHold::new().unwrap();
        h.announced();
        h.delivered(0);
        // What the event loop does when the timer fd becomes readable.
        h.timer.reset(Duration::from_millis(1), None).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(h.timed_out());
        assert!(!h.holding());
        assert!(!h.timed_out(), "nothing left to end");
    }
}
