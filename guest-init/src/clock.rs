//! The guest's wall clock, moved to the host's. A guest restored from a
//! snapshot wakes with the time the snapshot was taken (the golden snapshot
//! may be weeks old), so audit timestamps, commit dates and certificate
//! checks would be wrong; the host sends its time with StartSession and
//! ResumeSession and guest-init, as PID 1, sets CLOCK_REALTIME from it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Differences up to this are left alone (message transit, clock noise).
pub const TOLERANCE: Duration = Duration::from_secs(1);

/// Errors setting the clock.
#[derive(Debug, thiserror::Error)]
pub enum ClockError {
    /// clock_settime(2) failed.
    #[error("cannot set the guest clock: {0}")]
    Set(#[source] std::io::Error),
}

/// How far (nanoseconds, host minus guest) the guest clock must move to
/// match `host_ns`, or None when it is within [`TOLERANCE`] or the host sent
/// no time (0 or negative).
pub fn adjustment(host_ns: i64, guest_ns: i128) -> Option<i128> {
    if host_ns <= 0 {
        return None;
    }
    let delta = i128::from(host_ns) - guest_ns;
    (delta.unsigned_abs() > TOLERANCE.as_nanos()).then_some(delta)
}

/// The guest's wall clock, Unix nanoseconds (negative before 1970).
pub fn now_ns() -> i128 {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(e) => -(e.duration().as_nanos() as i128),
    }
}

/// Moves CLOCK_REALTIME to `host_ns` if it is more than [`TOLERANCE`] off;
/// returns the step taken (nanoseconds), if any. Only for a guest's PID 1:
/// elsewhere this would set the host's clock.
pub fn sync_to(host_ns: i64) -> Result<Option<i128>, ClockError> {
    let Some(delta) = adjustment(host_ns, now_ns()) else {
        return Ok(None);
    };
    let ts = libc::timespec {
        tv_sec: host_ns.div_euclid(1_000_000_000),
        tv_nsec: host_ns.rem_euclid(1_000_000_000),
    };
    // SAFETY: clock_settime reads one timespec through a pointer valid for the call.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        return Err(ClockError::Set(std::io::Error::last_os_error()));
    }
    Ok(Some(delta))
}

/// Says how far the clock moved, for the audit log ("+3600.000 s").
pub fn describe(delta_ns: i128) -> String {
    format!("{:+.3} s", delta_ns as f64 / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_clock_more_than_a_second_off_moves() {
        let guest = 1_700_000_000_000_000_000i128;
        let host = |d: i128| (guest + d) as i64;
        assert_eq!(adjustment(host(0), guest), None);
        assert_eq!(adjustment(host(900_000_000), guest), None);
        assert_eq!(adjustment(host(-900_000_000), guest), None);
        assert_eq!(
            adjustment(host(86_400_000_000_000), guest),
            Some(86_400_000_000_000)
        );
        assert_eq!(
            adjustment(host(-5_000_000_000), guest),
            Some(-5_000_000_000)
        );
        assert_eq!(adjustment(0, guest), None, "no time given");
        assert_eq!(adjustment(-1, guest), None);
        assert_eq!(describe(86_400_000_000_000), "+86400.000 s");
        assert_eq!(describe(-1_500_000_000), "-1.500 s");
    }

    #[test]
    fn the_clock_is_left_alone_when_it_already_matches() {
        // Safe to run on a host: the "host time" is this machine's own clock,
        // so there is nothing to step (and nothing is set).
        let now = now_ns() as i64;
        assert_eq!(sync_to(now).unwrap(), None);
        assert_eq!(sync_to(0).unwrap(), None);
    }
}
