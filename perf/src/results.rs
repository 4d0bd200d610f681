//! What a run produces: machine description, settings, every sample of
//! every metric, and the vmm/Firecracker ratios. Serialized as results.json.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::backend::Subject;
use crate::machine::MachineInfo;
use crate::stats::Summary;

/// Version of the results.json layout.
pub const SCHEMA_VERSION: u32 = 1;

/// Everything one `perf` invocation measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    /// Layout version of this file.
    pub schema_version: u32,
    /// When the run started (UTC, RFC 3339).
    pub started_at: String,
    /// Wall-clock seconds the whole run took.
    pub duration_s: f64,
    /// The host and the binaries measured.
    pub machine: MachineInfo,
    /// The options the run used.
    pub settings: Settings,
    /// One entry per scenario run, in order.
    pub scenarios: Vec<ScenarioResult>,
    /// vmm/Firecracker median ratios for metrics measured on both.
    pub comparisons: Vec<Comparison>,
}

/// The effective options of a run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Settings {
    /// Scenario requested on the command line.
    pub scenario: String,
    /// Measured runs per metric (after warm-up), unless a scenario says otherwise.
    pub runs: Option<u32>,
    /// Warm-up runs discarded before measuring.
    pub warmup: u32,
    /// Whether `--quick` was given.
    pub quick: bool,
    /// Guest memory sizes, MiB.
    pub mem_sizes_mib: Vec<u64>,
    /// Concurrent restores in creation-rate.
    pub concurrency: usize,
    /// Kernel for cold-boot, when not the hello test guest.
    pub kernel: Option<String>,
    /// `--memory-backend` passed to `vmm restore`.
    pub memory_backend: Option<String>,
    /// `--memory` passed to `vmm run` and `vmm restore`.
    #[serde(default)]
    pub memory: Option<String>,
    /// Per-step timeout, seconds.
    pub timeout_s: u64,
    /// `--net-frames`: frames per net-throughput run, when given.
    #[serde(default)]
    pub net_frames: Option<u64>,
    /// `--net-pings`: round trips per frame size per net-latency round, when given.
    #[serde(default)]
    pub net_pings: Option<u64>,
    /// Guest memory of session-persist's sessions, MiB.
    #[serde(default)]
    pub session_mem_mib: u64,
    /// Dirty fractions of session-persist, thousandths of the guest's pages.
    #[serde(default)]
    pub dirty_permille: Vec<u64>,
    /// How many sessions density restores at once, one round per count.
    #[serde(default)]
    pub density_counts: Vec<u64>,
}

/// How a scenario ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// It ran; its metrics are valid.
    Ok,
    /// It could not run here (see `reason`).
    Skipped,
    /// It broke (see `reason`); metrics measured before the failure are kept.
    Failed,
}

/// The outcome of one scenario.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScenarioResult {
    /// Scenario name (`cold-boot`, `restore`, ...).
    pub name: String,
    /// How it ended.
    pub status: Status,
    /// Why it was skipped or failed.
    pub reason: Option<String>,
    /// Remarks about parts that were skipped or about the method.
    pub notes: Vec<String>,
    /// The metrics it measured.
    pub metrics: Vec<Metric>,
}

impl ScenarioResult {
    /// An empty, successful result for `name`.
    pub fn new(name: &str) -> Self {
        ScenarioResult {
            name: name.into(),
            status: Status::Ok,
            reason: None,
            notes: Vec::new(),
            metrics: Vec::new(),
        }
    }

    /// A result for a scenario that could not run here.
    pub fn skipped(name: &str, reason: impl Into<String>) -> Self {
        ScenarioResult {
            status: Status::Skipped,
            reason: Some(reason.into()),
            ..ScenarioResult::new(name)
        }
    }
}

/// One measured quantity for one VMM: all its samples and their summary.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Metric {
    /// Stable identifier, the same for both VMMs: `restore.latency.mem128`.
    pub id: String,
    /// Human label: `restore: start -> first output, 128 MiB`.
    pub label: String,
    /// Unit of the samples: `ms`, `MiB`, `restores/s`.
    pub unit: String,
    /// Whether smaller is better (latencies, memory) or larger (rates).
    pub lower_is_better: bool,
    /// Which VMM was measured.
    pub subject: Subject,
    /// Parameters of the measurement (memory size, dirty fraction...).
    pub params: BTreeMap<String, serde_json::Value>,
    /// Warm-up samples, discarded from the summary.
    pub warmup: Vec<f64>,
    /// Measured samples, in the order taken.
    pub samples: Vec<f64>,
    /// Summary of `samples`; absent when there are none.
    pub summary: Option<Summary>,
    /// Why the vmm's and Firecracker's figures of this metric must not be
    /// divided (the two do different work outside the clock); absent for a
    /// like-for-like metric.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_like_for_like: Option<String>,
}

impl Metric {
    /// An empty metric.
    pub fn new(
        id: impl Into<String>,
        label: impl Into<String>,
        unit: &str,
        subject: Subject,
    ) -> Self {
        Metric {
            id: id.into(),
            label: label.into(),
            unit: unit.into(),
            lower_is_better: true,
            subject,
            params: BTreeMap::new(),
            warmup: Vec::new(),
            samples: Vec::new(),
            summary: None,
            not_like_for_like: None,
        }
    }

    /// Adds a parameter.
    pub fn param(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.params.insert(key.into(), value.into());
        self
    }

    /// Marks the metric as not like for like between the VMMs, for `why`:
    /// reported beside Firecracker's figure, never as a ratio.
    pub fn not_like_for_like(mut self, why: impl Into<String>) -> Self {
        self.not_like_for_like = Some(why.into());
        self
    }

    /// Marks the metric as higher-is-better.
    pub fn higher_is_better(mut self) -> Self {
        self.lower_is_better = false;
        self
    }

    /// Records a sample: a warm-up one while `warmup` is true.
    pub fn push(&mut self, value: f64, warmup: bool) {
        if warmup {
            self.warmup.push(value);
        } else {
            self.samples.push(value);
        }
    }

    /// Computes the summary from the samples.
    pub fn finish(mut self) -> Self {
        self.summary = Summary::of(&self.samples);
        self
    }
}

/// A metric measured on both VMMs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Comparison {
    /// The metric id.
    pub id: String,
    /// The metric label.
    pub label: String,
    /// Unit of both medians.
    pub unit: String,
    /// Median for the vmm.
    pub vmm_median: f64,
    /// Median for Firecracker.
    pub firecracker_median: f64,
    /// `vmm_median / firecracker_median`: below 1 means the vmm is smaller
    /// (faster, leaner) — better for latencies and memory, worse for rates.
    /// Absent when Firecracker's median is zero, and when the metric is not
    /// like for like (`not_like_for_like`).
    pub ratio: Option<f64>,
    /// Whether smaller is better for this metric.
    pub lower_is_better: bool,
    /// Why the two medians are not divided (see [`Metric::not_like_for_like`]);
    /// absent for a like-for-like metric.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_like_for_like: Option<String>,
}

/// Pairs every vmm metric with the Firecracker metric of the same id; a pair
/// that is not like for like keeps both medians but gets no ratio.
pub fn compare(scenarios: &[ScenarioResult]) -> Vec<Comparison> {
    let metrics: Vec<&Metric> = scenarios.iter().flat_map(|s| &s.metrics).collect();
    let mut out = Vec::new();
    for ours in metrics.iter().filter(|m| m.subject == Subject::Vmm) {
        let Some(theirs) = metrics
            .iter()
            .find(|m| m.subject == Subject::Firecracker && m.id == ours.id)
        else {
            continue;
        };
        let (Some(a), Some(b)) = (ours.summary, theirs.summary) else {
            continue;
        };
        let not_like_for_like = ours
            .not_like_for_like
            .clone()
            .or_else(|| theirs.not_like_for_like.clone());
        out.push(Comparison {
            id: ours.id.clone(),
            label: ours.label.clone(),
            unit: ours.unit.clone(),
            vmm_median: a.median,
            firecracker_median: b.median,
            ratio: (b.median != 0.0 && not_like_for_like.is_none()).then(|| a.median / b.median),
            lower_is_better: ours.lower_is_better,
            not_like_for_like,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metric(id: &str, subject: Subject, median: f64) -> Metric {
        let mut m = Metric::new(id, id, "ms", subject);
        m.push(median, false);
        m.finish()
    }

    #[test]
    fn a_pair_that_is_not_like_for_like_keeps_its_medians_but_has_no_ratio() {
        let mut scenario = ScenarioResult::new("restore");
        scenario.metrics = vec![
            metric("like", Subject::Vmm, 1.0),
            metric("unlike", Subject::Vmm, 1.0).not_like_for_like("different work"),
            metric("like", Subject::Firecracker, 4.0),
            metric("unlike", Subject::Firecracker, 8.0).not_like_for_like("different work"),
        ];
        let out = compare(&[scenario]);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].id, "like");
        assert_eq!(out[0].ratio, Some(0.25));
        assert_eq!(out[0].not_like_for_like, None);
        assert_eq!(out[1].id, "unlike");
        assert_eq!(out[1].ratio, None);
        assert_eq!((out[1].vmm_median, out[1].firecracker_median), (1.0, 8.0));
        assert_eq!(out[1].not_like_for_like.as_deref(), Some("different work"));
        // results.json names why, and only where there is a reason.
        let json = serde_json::to_value(&out).unwrap_or_default();
        assert!(json[0].get("not_like_for_like").is_none(), "{json}");
        assert_eq!(json[1]["not_like_for_like"], "different work");
        assert!(json[1]["ratio"].is_null(), "{json}");
    }
}
