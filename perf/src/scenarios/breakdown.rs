//! Breakdowns: extra runs of our vmm with its start-up phase marks logged
//! (see [`crate::phases`]), after a scenario's timed runs and apart from
//! them, so the logging never touches the figures compared with Firecracker.
//! Each step becomes a metric, `PREFIX.STEP[.SUFFIX]`, in microseconds.

use std::time::{Duration, Instant};

use crate::backend::Subject;
use crate::phases::{self, Step};
use crate::process::VmProcess;
use crate::results::Metric;
use crate::runner::Context;

/// Breakdown runs (after the warm-ups): 10, or 3 with `--quick`.
pub fn runs(ctx: &Context) -> u32 {
    ctx.runs(10, 3)
}

/// The metrics of one breakdown, one per step, in the order first seen.
pub struct Breakdown {
    prefix: String,
    suffix: String,
    label: String,
    params: Vec<(&'static str, serde_json::Value)>,
    metrics: Vec<Metric>,
}

impl Breakdown {
    /// A breakdown whose metrics are named `prefix.STEP` plus `suffix`
    /// (e.g. `.mem256`) and labelled `label: STEP`.
    pub fn new(prefix: &str, suffix: &str, label: &str) -> Self {
        Breakdown {
            prefix: prefix.into(),
            suffix: suffix.into(),
            label: label.into(),
            params: Vec::new(),
            metrics: Vec::new(),
        }
    }

    /// Adds a parameter to every metric of the breakdown.
    pub fn param(mut self, key: &'static str, value: impl Into<serde_json::Value>) -> Self {
        self.params.push((key, value.into()));
        self
    }

    /// Records one run's steps.
    pub fn push(&mut self, steps: &[Step], warmup: bool) {
        for step in steps {
            let name = format!("{}.{}{}", self.prefix, step.phase, self.suffix);
            let index = match self.metrics.iter().position(|m| m.id == name) {
                Some(i) => i,
                None => {
                    let mut metric = Metric::new(
                        name,
                        format!("{}: {}", self.label, step.phase),
                        "us",
                        Subject::Vmm,
                    )
                    .param("step", step.phase.clone());
                    for (key, value) in &self.params {
                        metric = metric.param(key, value.clone());
                    }
                    self.metrics.push(metric);
                    self.metrics.len() - 1
                }
            };
            self.metrics[index].push(step.us, warmup);
        }
    }

    /// The finished metrics (none when no run was recorded).
    pub fn finish(self) -> Vec<Metric> {
        self.metrics.into_iter().map(Metric::finish).collect()
    }
}

/// The vmm's stderr once it holds the mark of `phase` (read by another
/// thread, so it may lag the output that followed the mark), or after
/// `timeout` whatever it holds.
pub fn stderr_with_mark(process: &VmProcess, phase: &str, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let stderr = process.stderr_text();
        if phases::has_mark(&stderr, phase) || Instant::now() >= deadline {
            return stderr;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
