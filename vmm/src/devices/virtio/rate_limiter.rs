//! Token-bucket rate limiting for virtio-net and virtio-blk.
//!
//! A [`TokenBucket`] holds at most `size` tokens and gains `size` tokens per
//! `refill_time`, continuously in proportion to the time elapsed (the
//! fraction of a token earned so far is carried, so no time is lost to
//! rounding). It may also have a one-time burst: extra tokens available
//! from the start, spent before the refilled ones and never refilled.
//!
//! A [`RateLimiter`] combines an optional bandwidth bucket (bytes) and an
//! optional operations bucket (packets, requests): [`RateLimiter::consume`]
//! takes tokens from both or from neither. When it refuses, it arms its
//! timerfd for the time until both buckets will have enough; the device
//! stops working its queue and the event loop calls it back when the timer
//! fires ([`RateLimiter::timer_fired`]).
//!
//! An operation larger than a bucket's `size` (a 64 KiB frame through a
//! bucket of 16 KiB) could never find enough tokens. Such an operation is
//! let through when the bucket is full (or when its burst covers it), and
//! the bucket then goes into debt by the surplus: nothing more passes until
//! refills have paid the debt back. Over time the rate is kept; what can
//! pass before time `t` is still bounded by
//! `size + burst + rate * t + (largest oversize surplus)`.
//!
//! The clock is a parameter (`now: Instant`) so that the accounting is
//! testable without sleeping; devices pass `Instant::now()`.

use std::io;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use vmm_api::rate_limit::{IoLimit, RateLimit};
use vmm_sys_util::timerfd::TimerFd;

/// The shortest time the timer is armed for (a zero duration would disarm it).
const MIN_WAIT: Duration = Duration::from_micros(50);

/// One token bucket.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    /// Capacity and tokens per refill period (above zero).
    size: u64,
    /// The refill period in nanoseconds (above zero).
    refill_ns: u128,
    /// Tokens held; negative while paying back an oversize operation.
    budget: i128,
    /// One-time burst tokens left.
    burst: u64,
    /// When tokens were last added.
    last_update: Instant,
    /// The part of a token earned but not yet added, in token-nanoseconds
    /// (always below `refill_ns`).
    earned: u128,
}

impl TokenBucket {
    /// A full bucket of `size` tokens per `refill_time`, with `burst` extra
    /// tokens once. `None` when `size` or `refill_time` is zero (no bucket
    /// can be built for them; the option parser refuses them first).
    pub fn new(size: u64, burst: u64, refill_time: Duration, now: Instant) -> Option<TokenBucket> {
        let refill_ns = refill_time.as_nanos();
        if size == 0 || refill_ns == 0 {
            return None;
        }
        Some(TokenBucket {
            size,
            refill_ns,
            budget: i128::from(size),
            burst,
            last_update: now,
            earned: 0,
        })
    }

    /// The bucket for a configured limit.
    pub fn from_limit(limit: &RateLimit, now: Instant) -> Option<TokenBucket> {
        TokenBucket::new(
            limit.size,
            limit.burst,
            Duration::from_millis(limit.refill_ms),
            now,
        )
    }

    /// Tokens per refill period, and the capacity.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Refilled tokens held now (negative while in debt); the burst is apart.
    pub fn budget(&mut self, now: Instant) -> i128 {
        self.refill(now);
        self.budget
    }

    /// One-time burst tokens left.
    pub fn burst_left(&self) -> u64 {
        self.burst
    }

    /// Adds the tokens earned since the last update.
    fn refill(&mut self, now: Instant) {
        // A clock that went backwards (it cannot, Instant is monotonic) adds nothing.
        let elapsed = now.saturating_duration_since(self.last_update).as_nanos();
        self.last_update = self.last_update.max(now);
        if elapsed == 0 {
            return;
        }
        let size = u128::from(self.size);
        let cap = i128::from(self.size);
        // Capped so that the product cannot overflow: the bucket is full
        // after any period at least as long as its own (plus its debt), so a
        // long idle time is as good as one period per `size` tokens owed.
        let owed = u128::try_from(cap - self.budget).unwrap_or(0);
        let periods = owed / size + 2;
        let elapsed = elapsed.min(self.refill_ns.saturating_mul(periods));
        let earned = elapsed.saturating_mul(size).saturating_add(self.earned);
        let tokens = earned / self.refill_ns;
        self.earned = earned % self.refill_ns;
        let tokens = i128::try_from(tokens).unwrap_or(i128::MAX);
        self.budget = self.budget.saturating_add(tokens);
        if self.budget >= cap {
            self.budget = cap;
            self.earned = 0;
        }
    }

    /// Whether `tokens` can be taken now (full or burst-covered oversize included).
    fn can_take(&self, tokens: u64) -> bool {
        let available = self.budget + i128::from(self.burst);
        available >= i128::from(tokens)
            || (tokens > self.size && self.budget == i128::from(self.size))
    }

    /// Takes `tokens` (burst first); the caller checked [`Self::can_take`].
    fn take(&mut self, tokens: u64) {
        let from_burst = tokens.min(self.burst);
        self.burst -= from_burst;
        self.budget -= i128::from(tokens - from_burst);
    }

    /// Takes `tokens` if available at `now`; returns whether it did.
    pub fn consume(&mut self, tokens: u64, now: Instant) -> bool {
        self.refill(now);
        if self.can_take(tokens) {
            self.take(tokens);
            true
        } else {
            false
        }
    }

    /// How long from `now` until `tokens` can be taken (zero if now).
    pub fn time_until(&mut self, tokens: u64, now: Instant) -> Duration {
        self.refill(now);
        if self.can_take(tokens) {
            return Duration::ZERO;
        }
        // An oversize operation waits for a full bucket; another for the
        // refilled tokens the burst does not cover.
        let target = if tokens > self.size {
            i128::from(self.size)
        } else {
            i128::from(tokens) - i128::from(self.burst)
        };
        let deficit = u128::try_from(target - self.budget).unwrap_or(0);
        // Tokens after t ns: (t * size + earned) / refill_ns; solve for >= deficit.
        let needed = deficit
            .saturating_mul(self.refill_ns)
            .saturating_sub(self.earned);
        let ns = needed.div_ceil(u128::from(self.size));
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }
}

/// A bandwidth bucket and an operations bucket, either optional, and the
/// timer that wakes the device when a refused operation can pass.
pub struct RateLimiter {
    bandwidth: Option<TokenBucket>,
    ops: Option<TokenBucket>,
    /// Created only when there is a bucket.
    timer: Option<TimerFd>,
    blocked: bool,
}

impl std::fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimiter")
            .field("bandwidth", &self.bandwidth)
            .field("ops", &self.ops)
            .field("blocked", &self.blocked)
            .finish()
    }
}

impl RateLimiter {
    /// A limiter that lets everything through (no timer).
    pub fn unlimited() -> RateLimiter {
        RateLimiter {
            bandwidth: None,
            ops: None,
            timer: None,
            blocked: false,
        }
    }

    /// The limiter for `limit`, with full buckets at `now`. A timerfd is
    /// created when there is a bucket.
    pub fn new(limit: &IoLimit, now: Instant) -> io::Result<RateLimiter> {
        let bandwidth = limit
            .bandwidth
            .as_ref()
            .and_then(|l| TokenBucket::from_limit(l, now));
        let ops = limit
            .ops
            .as_ref()
            .and_then(|l| TokenBucket::from_limit(l, now));
        let timer = if bandwidth.is_some() || ops.is_some() {
            Some(super::vsock::handshake::nonblocking_timer()?)
        } else {
            None
        };
        Ok(RateLimiter {
            bandwidth,
            ops,
            timer,
            blocked: false,
        })
    }

    /// Whether nothing is limited.
    pub fn is_unlimited(&self) -> bool {
        self.bandwidth.is_none() && self.ops.is_none()
    }

    /// Whether a refused operation waits for the timer.
    pub fn is_blocked(&self) -> bool {
        self.blocked
    }

    /// The timer's fd, to watch in the event loop (none when unlimited).
    pub fn timer_fd(&self) -> Option<&TimerFd> {
        self.timer.as_ref()
    }

    /// Whether `fd` is this limiter's timer.
    pub fn owns_fd(&self, fd: i32) -> bool {
        self.timer.as_ref().is_some_and(|t| t.as_raw_fd() == fd)
    }

    /// Takes `ops` operations and `bytes` bytes if both buckets have them
    /// at `now`, else nothing: the limiter is then blocked, with its timer
    /// armed for when both will.
    pub fn consume(&mut self, ops: u64, bytes: u64, now: Instant) -> bool {
        let wait = self.time_until(ops, bytes, now);
        if wait.is_zero() {
            if let Some(b) = &mut self.bandwidth {
                b.take(bytes);
            }
            if let Some(b) = &mut self.ops {
                b.take(ops);
            }
            return true;
        }
        self.blocked = true;
        if let Some(timer) = &mut self.timer {
            if let Err(e) = timer.reset(wait.max(MIN_WAIT), None) {
                // Without the timer the device resumes on the guest's next
                // notification (or the tap's next frame) instead.
                tracing::warn!(error = %e, "cannot arm a rate limiter timer");
            }
        }
        false
    }

    /// How long from `now` until `ops` and `bytes` can both be taken.
    pub fn time_until(&mut self, ops: u64, bytes: u64, now: Instant) -> Duration {
        let bw = self
            .bandwidth
            .as_mut()
            .map_or(Duration::ZERO, |b| b.time_until(bytes, now));
        let op = self
            .ops
            .as_mut()
            .map_or(Duration::ZERO, |b| b.time_until(ops, now));
        bw.max(op)
    }

    /// The timer fired (its fd is readable): the device may try again.
    pub fn timer_fired(&mut self) {
        if let Some(timer) = &mut self.timer {
            // Consumes the expiry; nothing to read (disarmed meanwhile) is fine.
            let _ = timer.wait();
        }
        self.blocked = false;
    }

    /// Forgets a wait (device reset); the buckets keep their tokens.
    pub fn unblock(&mut self) {
        self.blocked = false;
        if let Some(timer) = &mut self.timer {
            let _ = timer.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_bucket_refills_in_proportion_to_time_up_to_its_size() {
        let t0 = Instant::now();
        // 1000 tokens per second.
        let mut b = TokenBucket::new(1000, 0, ms(1000), t0).unwrap();
        assert!(b.consume(1000, t0));
        assert!(!b.consume(1, t0));
        assert_eq!(b.budget(t0 + ms(250)), 250);
        assert_eq!(b.budget(t0 + ms(999)), 999);
        // Never more than the size, however long it waited.
        assert_eq!(b.budget(t0 + Duration::from_secs(3600)), 1000);
        // Fractions of a token are carried, not lost: 3 x 0.5 ms = 1.5 tokens.
        let mut b = TokenBucket::new(1000, 0, ms(1000), t0).unwrap();
        assert!(b.consume(1000, t0));
        let half = Duration::from_micros(500);
        assert_eq!(b.budget(t0 + half), 0);
        assert_eq!(b.budget(t0 + half * 2), 1);
        assert_eq!(b.budget(t0 + half * 3), 1);
        assert_eq!(b.budget(t0 + half * 4), 2);
        // Sizes and periods that do not divide: 7 per 3 ms.
        let mut b = TokenBucket::new(7, 0, ms(3), t0).unwrap();
        assert!(b.consume(7, t0));
        assert_eq!(b.budget(t0 + ms(3)), 7);
        assert!(b.consume(7, t0 + ms(3)));
        assert_eq!(b.budget(t0 + ms(4)), 2, "7/3 tokens a ms, rounded down");
        assert_eq!(b.budget(t0 + ms(6)), 7);
    }

    #[test]
    fn the_burst_is_spent_first_and_only_once() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(100, 50, ms(1000), t0).unwrap();
        assert!(b.consume(150, t0), "size plus burst at the start");
        assert_eq!(b.burst_left(), 0);
        assert!(!b.consume(1, t0));
        // After a full refill only the size is there again, not the burst.
        let t1 = t0 + ms(5000);
        assert!(b.consume(100, t1));
        assert!(!b.consume(1, t1));
        // A burst is spent before the refilled tokens.
        let mut b = TokenBucket::new(100, 30, ms(1000), t0).unwrap();
        assert!(b.consume(20, t0));
        assert_eq!((b.burst_left(), b.budget(t0)), (10, 100));
        assert!(b.consume(20, t0));
        assert_eq!((b.burst_left(), b.budget(t0)), (0, 90));
    }

    #[test]
    fn time_until_is_when_enough_tokens_exist() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1000, 0, ms(1000), t0).unwrap();
        assert_eq!(b.time_until(1000, t0), Duration::ZERO);
        assert!(b.consume(600, t0));
        assert_eq!(b.time_until(400, t0), Duration::ZERO);
        assert_eq!(b.time_until(500, t0), ms(100));
        // Exactly then it passes, and one nanosecond earlier it does not.
        let mut early = b.clone();
        assert!(!early.consume(500, t0 + ms(100) - Duration::from_nanos(1)));
        assert!(b.consume(500, t0 + ms(100)));
        // With a carried fraction: 3 tokens per 10 ms, 1 token = 3.33 ms.
        let mut b = TokenBucket::new(3, 0, ms(10), t0).unwrap();
        assert!(b.consume(3, t0));
        let wait = b.time_until(1, t0);
        assert_eq!(wait, Duration::from_nanos(3_333_334));
        assert!(!b.clone().consume(1, t0 + wait - Duration::from_nanos(1)));
        assert!(b.consume(1, t0 + wait));
        // A burst shortens the wait by what it covers.
        let mut b = TokenBucket::new(100, 10, ms(1000), t0).unwrap();
        assert!(b.consume(110, t0));
        let mut b2 = TokenBucket::new(100, 10, ms(1000), t0).unwrap();
        assert!(b2.consume(100, t0));
        assert_eq!(
            b2.time_until(20, t0),
            ms(100),
            "10 from the burst, 10 refilled"
        );
        assert_eq!(b.time_until(20, t0), ms(200));
    }

    #[test]
    fn an_oversize_operation_passes_on_a_full_bucket_and_is_paid_back() {
        let t0 = Instant::now();
        // 1000 bytes per second, one 2500-byte frame.
        let mut b = TokenBucket::new(1000, 0, ms(1000), t0).unwrap();
        assert!(b.consume(1, t0));
        assert!(!b.consume(2500, t0), "only on a full bucket");
        assert_eq!(b.time_until(2500, t0), ms(1), "the one token back");
        assert!(b.consume(2500, t0 + ms(1)));
        assert_eq!(b.budget(t0 + ms(1)), -1500, "in debt by the surplus");
        // Nothing passes until the debt is paid and the tokens exist.
        assert_eq!(b.time_until(1, t0 + ms(1)), ms(1501));
        assert!(!b.consume(1, t0 + ms(1501)));
        assert!(b.consume(1, t0 + ms(1502)));
        // Long-run rate: 10 oversize frames of 2500 bytes take >= 22.5 s at 1000/s.
        let mut b = TokenBucket::new(1000, 0, ms(1000), t0).unwrap();
        let mut now = t0;
        for _ in 0..10 {
            now += b.time_until(2500, now);
            assert!(b.consume(2500, now));
        }
        assert!(now - t0 >= Duration::from_millis(22_500), "{:?}", now - t0);
        // A burst big enough covers an oversize operation too.
        let mut b = TokenBucket::new(1000, 5000, ms(1000), t0).unwrap();
        assert!(b.consume(1000, t0));
        assert!(b.consume(4000, t0), "from the burst alone");
        assert_eq!(b.budget(t0), 1000);
    }

    #[test]
    fn zero_sizes_and_periods_make_no_bucket() {
        let t0 = Instant::now();
        assert!(TokenBucket::new(0, 0, ms(1000), t0).is_none());
        assert!(TokenBucket::new(10, 0, Duration::ZERO, t0).is_none());
    }

    #[test]
    fn a_limiter_takes_from_both_buckets_or_from_neither() {
        let t0 = Instant::now();
        let limit = IoLimit {
            bandwidth: Some(RateLimit::per_second(1000)),
            ops: Some(RateLimit::per_second(3)),
        };
        let mut l = RateLimiter::new(&limit, t0).unwrap();
        assert!(l.timer_fd().is_some());
        for _ in 0..3 {
            assert!(l.consume(1, 300, t0));
        }
        // Bytes left but no operations: nothing taken, blocked, timer armed.
        assert!(!l.consume(1, 100, t0));
        assert!(l.is_blocked());
        assert!(l.timer_fd().unwrap().is_armed().unwrap());
        assert_eq!(l.bandwidth.as_mut().unwrap().budget(t0), 100);
        // Operations back, but the bytes are short: still nothing taken.
        let t1 = t0 + ms(334);
        assert_eq!(l.ops.as_mut().unwrap().budget(t1), 1);
        assert!(!l.consume(1, 500, t1));
        assert_eq!(l.ops.as_mut().unwrap().budget(t1), 1);
        assert_eq!(l.bandwidth.as_mut().unwrap().budget(t1), 434);
        // The wait is the longer of the two.
        assert_eq!(l.time_until(1, 1000, t1), ms(566), "566 bytes short");
        assert_eq!(l.time_until(2, 1000, t1), ms(566), "one op in 333 ms");
        let three_ops = l.time_until(3, 0, t1);
        assert!(three_ops > ms(566), "{three_ops:?}");
        assert_eq!(l.time_until(3, 1000, t1), three_ops);
        l.timer_fired();
        assert!(!l.is_blocked());
        assert!(l.consume(1, 100, t1));
        l.unblock();
        assert!(!l.timer_fd().unwrap().is_armed().unwrap());
    }

    #[test]
    fn an_unlimited_limiter_has_no_timer_and_passes_everything() {
        let t0 = Instant::now();
        for mut l in [
            RateLimiter::unlimited(),
            RateLimiter::new(&IoLimit::default(), t0).unwrap(),
        ] {
            assert!(l.is_unlimited());
            assert!(l.timer_fd().is_none());
            for _ in 0..1000 {
                assert!(l.consume(1, u64::MAX, t0));
            }
            assert!(!l.owns_fd(0));
        }
        // Only the ops bucket: bytes are free.
        let limit = IoLimit {
            bandwidth: None,
            ops: Some(RateLimit::per_second(1)),
        };
        let mut l = RateLimiter::new(&limit, t0).unwrap();
        assert!(l.consume(1, u64::MAX, t0));
        assert!(!l.consume(1, 0, t0));
        assert!(l.consume(0, 5, t0), "an operation that costs none passes");
    }
}
