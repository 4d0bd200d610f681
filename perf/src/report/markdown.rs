//! results.md: the machine, a table of every metric (median, p90, p99) and,
//! when compared, Firecracker's median and the ratio. Metrics that are not
//! like for like between the VMMs (the restore onto a standby vmm) are
//! listed apart when compared, both medians and why there is no ratio.

use std::fmt::Write;

use crate::backend::Subject;
use crate::results::{Results, Status};

use super::fmt_value;

/// Renders the markdown report.
pub fn render(r: &Results) -> String {
    let mut s = String::new();
    let m = &r.machine;
    // Writing to a String cannot fail.
    let _ = writeln!(s, "# perf results\n");
    let _ = writeln!(
        s,
        "{} · {} cores · kernel {} · hardware virtualization: {} · started {} · took {:.1} s\n",
        m.cpu_model,
        m.cores,
        m.kernel,
        if m.hardware_virtualization {
            "yes"
        } else {
            "no"
        },
        r.started_at,
        r.duration_s
    );
    let _ = writeln!(
        s,
        "vmm: `{}` ({}), source commit {}",
        m.vmm.path,
        m.vmm.version.as_deref().unwrap_or("version unknown"),
        m.source_commit.as_deref().unwrap_or("unknown")
    );
    if let Some(fc) = &m.firecracker {
        let _ = writeln!(
            s,
            "\nfirecracker: `{}` ({})",
            fc.path,
            fc.version.as_deref().unwrap_or("version unknown")
        );
    }
    let _ = writeln!(
        s,
        "\nWarm-up runs discarded: {}. Percentiles interpolate between closest ranks.\n",
        r.settings.warmup
    );
    let compared = m.firecracker.is_some();
    if compared {
        let _ = writeln!(
            s,
            "| scenario | metric | unit | n | median | p90 | p99 | firecracker median | ratio vmm/fc |"
        );
        let _ = writeln!(s, "|---|---|---|---:|---:|---:|---:|---:|---:|");
    } else {
        let _ = writeln!(s, "| scenario | metric | unit | n | median | p90 | p99 |");
        let _ = writeln!(s, "|---|---|---|---:|---:|---:|---:|");
    }
    let mut apart = Vec::new();
    for scenario in &r.scenarios {
        for metric in scenario
            .metrics
            .iter()
            .filter(|m| m.subject == Subject::Vmm)
        {
            if compared && metric.not_like_for_like.is_some() {
                apart.push((scenario, metric));
                continue;
            }
            let (n, med, p90, p99) = match &metric.summary {
                Some(x) => (
                    x.n.to_string(),
                    fmt_value(x.median),
                    fmt_value(x.p90),
                    fmt_value(x.p99),
                ),
                None => ("0".into(), "-".into(), "-".into(), "-".into()),
            };
            let _ = write!(
                s,
                "| {} | {} | {} | {n} | {med} | {p90} | {p99} |",
                scenario.name,
                metric.label.replace('|', "/"),
                metric.unit
            );
            if compared {
                match r.comparisons.iter().find(|c| c.id == metric.id) {
                    Some(c) => {
                        let ratio = c
                            .ratio
                            .map(|x| format!("{x:.2}"))
                            .unwrap_or_else(|| "-".into());
                        let _ = write!(s, " {} | {ratio} |", fmt_value(c.firecracker_median));
                    }
                    None => {
                        let _ = write!(s, " - | - |");
                    }
                }
            }
            let _ = writeln!(s);
        }
    }
    let _ = writeln!(s);
    if !apart.is_empty() {
        let _ = writeln!(
            s,
            "Not like for like, so no ratio and no place in the table above \
             (the two VMMs do different work before the clock starts):\n"
        );
        for (scenario, metric) in apart {
            let ours = match &metric.summary {
                Some(x) => format!(
                    "{} {} (p90 {}, p99 {}, n {})",
                    fmt_value(x.median),
                    metric.unit,
                    fmt_value(x.p90),
                    fmt_value(x.p99),
                    x.n
                ),
                None => "not measured".into(),
            };
            let theirs = match r.comparisons.iter().find(|c| c.id == metric.id) {
                Some(c) => format!("{} {}", fmt_value(c.firecracker_median), metric.unit),
                None => "not measured".into(),
            };
            let _ = writeln!(
                s,
                "* {}: {}: vmm median {ours}; firecracker median {theirs}; no ratio: {}",
                scenario.name,
                metric.label,
                metric
                    .not_like_for_like
                    .as_deref()
                    .unwrap_or("not like for like")
            );
        }
        let _ = writeln!(s);
    }
    for scenario in &r.scenarios {
        match scenario.status {
            Status::Ok => {}
            Status::Skipped => {
                let _ = writeln!(
                    s,
                    "* **{}**: {}",
                    scenario.name,
                    scenario.reason.as_deref().unwrap_or("skipped")
                );
            }
            Status::Failed => {
                let _ = writeln!(
                    s,
                    "* **{}** failed: {}",
                    scenario.name,
                    scenario.reason.as_deref().unwrap_or("unknown error")
                );
            }
        }
        for note in &scenario.notes {
            let _ = writeln!(s, "* {}: {note}", scenario.name);
        }
    }
    if compared {
        let _ = writeln!(
            s,
            "\nRatio = vmm median / Firecracker median, measured side by side in this run: \
             below 1 the vmm is faster or leaner (for rates, above 1 is better)."
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use crate::backend::Subject;
    use crate::machine::{BinaryInfo, MachineInfo};
    use crate::results::{compare, Metric, Results, ScenarioResult, Settings, SCHEMA_VERSION};
    use crate::scenarios::restore::{standby_metric, STANDBY_LABEL, STANDBY_NOT_LIKE_FOR_LIKE};

    /// A restore run with the spawn restore and the restore onto a standby
    /// vmm, for the vmm and, when `compared`, Firecracker.
    fn restore_run(compared: bool) -> Results {
        let mut scenario = ScenarioResult::new("restore");
        let mut subjects = vec![(Subject::Vmm, 2.0, 1.25)];
        if compared {
            subjects.push((Subject::Firecracker, 10.0, 8.5));
        }
        for (subject, spawn, standby) in subjects {
            let mut latency = Metric::new(
                "restore.latency.mem64",
                "restore: spawn -> first guest output, 64 MiB",
                "ms",
                subject,
            );
            let mut ahead = standby_metric(64, subject);
            for _ in 0..3 {
                latency.push(spawn, false);
                ahead.push(standby, false);
            }
            scenario.metrics.push(latency.finish());
            scenario.metrics.push(ahead.finish());
        }
        let binary = |path: &str| BinaryInfo {
            path: path.into(),
            version: None,
        };
        let scenarios = vec![scenario];
        Results {
            schema_version: SCHEMA_VERSION,
            started_at: "2026-12-06T00:00:00Z".into(),
            duration_s: 1.0,
            machine: MachineInfo {
                cpu_model: "test".into(),
                cores: 2,
                kernel: "6.1".into(),
                hardware_virtualization: true,
                mem_total_mib: 1024,
                vmm: binary("vmm"),
                firecracker: compared.then(|| binary("firecracker")),
                source_commit: None,
            },
            settings: Settings {
                scenario: "restore".into(),
                runs: Some(3),
                warmup: 0,
                quick: false,
                mem_sizes_mib: vec![64],
                concurrency: 1,
                kernel: None,
                memory_backend: None,
                memory: None,
                timeout_s: 10,
                net_frames: None,
                net_pings: None,
                session_mem_mib: 256,
                dirty_permille: vec![],
                density_counts: vec![],
            },
            comparisons: compare(&scenarios),
            scenarios,
        }
    }

    /// The rows of the metric table.
    fn table_rows(md: &str) -> Vec<&str> {
        md.lines()
            .filter(|l| l.starts_with("| restore |"))
            .collect()
    }

    #[test]
    fn the_standby_restore_is_reported_apart_without_a_ratio() {
        let md = super::render(&restore_run(true));
        let rows = table_rows(&md);
        assert_eq!(rows.len(), 1, "{md}");
        assert!(rows[0].contains("spawn -> first guest output"), "{md}");
        assert!(rows[0].ends_with("| 10.0 | 0.20 |"), "{md}");
        assert!(!md.contains("pre-started"), "{md}");
        let apart: Vec<&str> = md.lines().filter(|l| l.contains(STANDBY_LABEL)).collect();
        assert_eq!(apart.len(), 1, "{md}");
        let line = apart[0];
        assert!(line.starts_with("* restore: restore onto a standby vmm (not like for like): load request -> first guest output, 64 MiB"), "{line}");
        assert!(
            line.contains("vmm median 1.25 ms (p90 1.25, p99 1.25, n 3)"),
            "{line}"
        );
        assert!(line.contains("firecracker median 8.50 ms"), "{line}");
        assert!(
            line.contains(&format!("no ratio: {STANDBY_NOT_LIKE_FOR_LIKE}")),
            "{line}"
        );
        assert!(!line.contains("0.15"), "no ratio (1.25 / 8.5): {line}");
        let heading = md
            .find("Not like for like, so no ratio")
            .expect("a heading");
        assert!(heading < md.find(line).unwrap_or(0), "{md}");
    }

    #[test]
    fn without_firecracker_the_standby_restore_stays_in_the_table() {
        let md = super::render(&restore_run(false));
        let rows = table_rows(&md);
        assert_eq!(rows.len(), 2, "{md}");
        assert!(rows[1].contains(STANDBY_LABEL), "{md}");
        assert!(!md.contains("Not like for like, so no ratio"), "{md}");
    }
}
