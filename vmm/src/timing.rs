//! Start-up phase marks, for benchmarks that split a boot or a restore into
//! its steps. With the `vmm::timing` log target at info, each mark logs the
//! CLOCK_MONOTONIC time (ns) at which the phase ended, so a harness that read
//! the same clock just before it spawned the vmm can tell how long exec and
//! dynamic linking, snapshot reading, memory mapping, VM and vCPU creation
//! and the way to the first KVM_RUN took. Off (the default), a mark costs one
//! check of the log filter.

/// The log target of the marks.
pub const TARGET: &str = vmm_api::timing::LOG_TARGET;

/// CLOCK_MONOTONIC now, in nanoseconds (the clock `std::time::Instant` reads).
pub use vmm_api::timing::monotonic_ns as now_ns;

/// Marks the end of `phase` now.
pub fn mark(phase: &'static str) {
    if tracing::enabled!(target: TARGET, tracing::Level::INFO) {
        mark_at(phase, now_ns());
    }
}

/// Marks the end of `phase` at `at_ns` (a time read earlier with [`now_ns`],
/// for a phase that ended before logging was set up).
pub fn mark_at(phase: &'static str, at_ns: u64) {
    tracing::info!(target: TARGET, phase, at_ns, "start-up phase");
}
