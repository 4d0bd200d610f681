//! Start-up phases the vmm marks itself: with `--log-format json
//! --log-level warn,vmm::timing=info` it logs, for each phase, the
//! CLOCK_MONOTONIC time (ns) at which it ended (`vmm::timing` in the vmm).
//! Together with the same clock read right before perf spawned the vmm and
//! the instant the guest's first output arrived, they split spawn -> first
//! output into consecutive steps that add up to the whole.

use std::time::Instant;

/// The vmm's log target of the marks.
pub const TARGET: &str = vmm_api::timing::LOG_TARGET;
/// The `--log-level` that logs the marks and nothing else below warnings.
pub const LOG_LEVEL: &str = "warn,vmm::timing=info";
/// The name of the step that ends when the guest's first output arrives.
pub const FIRST_OUTPUT: &str = "first-output";

/// CLOCK_MONOTONIC now, in nanoseconds (the clock `Instant` reads).
pub use vmm_api::timing::monotonic_ns as now_ns;

/// `at` as CLOCK_MONOTONIC ns, given that `base` was read at `base_ns`.
pub fn instant_ns(base: Instant, base_ns: u64, at: Instant) -> u64 {
    base_ns.saturating_add(at.saturating_duration_since(base).as_nanos() as u64)
}

/// One step of a start-up: the phase that ended at its mark, and how long it
/// took since the previous mark (or since the spawn, for the first).
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The vmm's phase name (`main`, `memory-mapped`, ...), or one of the
    /// events perf saw itself ([`FIRST_OUTPUT`], [`REAPED`]).
    pub phase: String,
    /// Microseconds since the previous mark.
    pub us: f64,
}

/// The name of the step that ends when `wait4` reaps the exited vmm.
pub const REAPED: &str = "reaped";

/// The steps from `spawned_ns` through the vmm's marks in `stderr` (its JSON
/// log lines; others are skipped) and the `events` perf saw itself (name,
/// CLOCK_MONOTONIC ns), all in time order. Anything before the spawn (a
/// line from elsewhere) is left out, so no step is negative.
pub fn steps(stderr: &str, spawned_ns: u64, events: &[(&str, u64)]) -> Vec<Step> {
    let mut marks: Vec<(String, u64)> = stderr
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|event| event["target"] == TARGET)
        .filter_map(|event| {
            let fields = &event["fields"];
            Some((
                fields["phase"].as_str()?.to_string(),
                fields["at_ns"].as_u64()?,
            ))
        })
        .chain(events.iter().map(|(name, at)| (name.to_string(), *at)))
        .filter(|(_, at)| *at >= spawned_ns)
        .collect();
    // Stable: a mark and an event at the same nanosecond keep their order.
    marks.sort_by_key(|(_, at)| *at);
    let mut previous = spawned_ns;
    marks
        .into_iter()
        .map(|(phase, at)| {
            let us = (at - previous) as f64 / 1000.0;
            previous = at;
            Step { phase, us }
        })
        .collect()
}

/// Whether `stderr` already holds the vmm's mark of `phase` (its stderr is
/// read by another thread, so a mark may arrive after the output it precedes).
pub fn has_mark(stderr: &str, phase: &str) -> bool {
    stderr
        .lines()
        .filter(|line| line.contains(TARGET))
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .any(|event| event["fields"]["phase"] == phase)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(phase: &str, at: u64) -> String {
        format!(
            r#"{{"level":"INFO","fields":{{"message":"start-up phase","phase":"{phase}","at_ns":{at}}},"target":"vmm::timing"}}"#
        )
    }

    #[test]
    fn steps_add_up_from_spawn_to_the_last_event() {
        let stderr = [
            mark("main", 1_500_000),
            "not json".into(),
            r#"{"fields":{"message":"other"},"target":"vmm::acpi"}"#.into(),
            mark("vm-created", 2_000_000),
            mark("first-run", 4_000_000),
            mark("vm-ended", 9_000_000),
        ]
        .join("\n");
        let s = steps(
            &stderr,
            1_000_000,
            &[(REAPED, 9_400_000), (FIRST_OUTPUT, 5_250_000)],
        );
        let names: Vec<_> = s.iter().map(|s| s.phase.as_str()).collect();
        assert_eq!(
            names,
            [
                "main",
                "vm-created",
                "first-run",
                FIRST_OUTPUT,
                "vm-ended",
                REAPED
            ]
        );
        let us: Vec<_> = s.iter().map(|s| s.us).collect();
        assert_eq!(us, [500.0, 500.0, 2000.0, 1250.0, 3750.0, 400.0]);
        assert_eq!(us.iter().sum::<f64>(), 8400.0);
        assert!(has_mark(&stderr, "first-run"));
        assert!(!has_mark(&stderr, "devices-restored"));
    }

    #[test]
    fn marks_before_the_spawn_are_left_out() {
        let stderr = [mark("stale", 500), mark("main", 2_000_000)].join("\n");
        let s = steps(&stderr, 1_500_000, &[(FIRST_OUTPUT, 3_000_000)]);
        let names: Vec<_> = s.iter().map(|s| s.phase.as_str()).collect();
        assert_eq!(names, ["main", FIRST_OUTPUT]);
        assert_eq!(s[1].us, 1000.0);
        assert!(steps("", 10, &[]).is_empty());
    }

    #[test]
    fn instants_convert_to_the_monotonic_clock() {
        let base = Instant::now();
        let later = base + std::time::Duration::from_micros(1500);
        assert_eq!(instant_ns(base, 1_000_000, later), 2_500_000);
        assert!(now_ns() > 0);
    }
}
