//! The vmm's start-up phase marks, as both sides see them: with its
//! [`LOG_TARGET`] at info the vmm logs, at the end of each phase, the
//! CLOCK_MONOTONIC time in ns ([`monotonic_ns`]); a harness that read the
//! same clock before it spawned the vmm can split its start-up into steps.

/// The vmm's log target of the marks (JSON fields `phase` and `at_ns`).
pub const LOG_TARGET: &str = "vmm::timing";

/// CLOCK_MONOTONIC now, in nanoseconds (the clock `std::time::Instant` reads).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the struct we own;
    // CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}
