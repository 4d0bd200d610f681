//! Bounds on how long a host connection may wait to be established.
//!
//! A host process connecting to the device socket gets `OK <port>` or a
//! closed socket in bounded time, whatever the guest does:
//!
//! * [`ADMISSION_LIMIT`] bounds the wait before the guest is asked: for the
//!   `CONNECT <port>` line to arrive, for the guest to start the device
//!   (a guest without a vsock driver never does), and for a restored guest
//!   to take its transport reset (see `reset_hold`, which gives up sooner).
//! * [`CONNECT_TIMEOUT`] bounds the guest's answer to the REQUEST, as
//!   Firecracker does: a guest port nobody listens on is answered with a
//!   reset at once by Linux, but a guest that takes no packets (no receive
//!   buffers, a stuck driver) answers nothing. On expiry the host socket is
//!   closed and the guest gets a reset, so a late RESPONSE opens nothing.
//!
//! One timerfd, armed for the earliest deadline, wakes the event loop.

use std::io;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use vmm_sys_util::timerfd::TimerFd;

use super::conn::ConnState;
use super::Vsock;

/// Longest the guest may take to answer a host connection's REQUEST.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest a host connection waits before the guest can be asked (it is
/// longer than `reset_hold::HOLD_LIMIT`, so a restored guest that is slow to
/// take its reset does not cost host connections).
pub const ADMISSION_LIMIT: Duration = Duration::from_secs(10);

/// The two bounds (tests shorten them).
#[derive(Debug, Clone, Copy)]
pub struct HandshakeLimits {
    /// See [`CONNECT_TIMEOUT`].
    pub connect: Duration,
    /// See [`ADMISSION_LIMIT`].
    pub admission: Duration,
}

impl Default for HandshakeLimits {
    fn default() -> Self {
        HandshakeLimits {
            connect: CONNECT_TIMEOUT,
            admission: ADMISSION_LIMIT,
        }
    }
}

/// A non-blocking timerfd, so that reading one that has not fired (or was
/// cleared) never stalls the event thread.
pub fn nonblocking_timer() -> io::Result<TimerFd> {
    let timer = TimerFd::new()?;
    // SAFETY: fcntl on a file descriptor this function owns, with integer
    // arguments only; it touches no memory of ours.
    let flags = unsafe { libc::fcntl(timer.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0
        || unsafe { libc::fcntl(timer.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok(timer)
}

/// The timer that wakes the event loop at the earliest handshake deadline.
pub struct DeadlineTimer {
    /// Watched by the event loop.
    pub timer: TimerFd,
    armed_for: Option<Instant>,
}

impl DeadlineTimer {
    /// An unarmed timer.
    pub fn new() -> io::Result<DeadlineTimer> {
        Ok(DeadlineTimer {
            timer: nonblocking_timer()?,
            armed_for: None,
        })
    }

    /// Makes sure the timer fires no later than `deadline`.
    pub fn arm_by(&mut self, deadline: Instant) {
        if self.armed_for.is_some_and(|at| at <= deadline) {
            return;
        }
        self.set(Some(deadline));
    }

    fn set(&mut self, deadline: Option<Instant>) {
        let res = match deadline {
            // A zero duration would disarm the timer: fire at least 1 ms out.
            Some(at) => self.timer.reset(
                at.saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1)),
                None,
            ),
            None => self.timer.clear(),
        };
        match res {
            Ok(()) => self.armed_for = deadline,
            Err(e) => {
                // Without the timer, expired handshakes are still found on
                // the next event of any kind; say why they may linger.
                tracing::warn!(error = %e, "vsock: cannot arm the handshake timer");
                self.armed_for = None;
            }
        }
    }
}

impl Vsock {
    /// Ends every handshake whose deadline has passed (the host socket is
    /// closed; a guest that was asked gets a reset) and arms the timer for
    /// the next one. Runs when the timer fires.
    pub(super) fn expire_handshakes(&mut self) {
        // Consumes the expiry; nothing to read (cleared meanwhile) is fine.
        let _ = self.deadlines.timer.wait();
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        for p in self.pending_hosts.values_mut().filter(|p| !p.dead) {
            if p.deadline <= now {
                tracing::debug!(
                    waited_for_device = p.port.is_some(),
                    "vsock: host connection not admitted in time: closed"
                );
                p.dead = true;
                self.stats.handshake_timeouts += 1;
            } else {
                next = Some(next.map_or(p.deadline, |n| n.min(p.deadline)));
            }
        }
        let mut expired = Vec::new();
        for (key, c) in &self.conns {
            if c.dead || c.state != ConnState::AwaitingResponse {
                continue;
            }
            match c.deadline {
                Some(d) if d <= now => expired.push(*key),
                Some(d) => next = Some(next.map_or(d, |n| n.min(d))),
                None => {}
            }
        }
        for key in expired {
            tracing::debug!(
                port = key.1,
                "vsock: the guest did not answer a host connection in time: closed"
            );
            self.stats.handshake_timeouts += 1;
            self.kill(key, true);
        }
        self.deadlines.set(next);
    }

    /// Shortens the handshake bounds (tests only need them short).
    #[cfg(test)]
    pub(super) fn set_handshake_limits(&mut self, limits: HandshakeLimits) {
        self.limits = limits;
    }
}
