//! results.md: the machine, a table of every metric (median, p90, p99) and,
//! when compared, Firecracker's median and the ratio.

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
    for scenario in &r.scenarios {
        for metric in scenario
            .metrics
            .iter()
            .filter(|m| m.subject == Subject::Vmm)
        {
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
