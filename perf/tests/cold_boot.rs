//! End to end under real KVM: `perf cold-boot --runs 2` on the hello guest
//! writes valid results.json, results.md and latency.svg. Nothing about speed.

mod common;

use std::process::Command;

/// The measured samples of metric `m`.
fn samples(m: &serde_json::Value) -> Vec<f64> {
    m["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_f64().unwrap())
        .collect()
}

#[test]
fn cold_boot_runs_end_to_end_and_writes_valid_reports() {
    common::build_vmm();
    let out = common::out_dir("cold-boot");
    let output = Command::new(common::perf_bin())
        .args(["cold-boot", "--runs", "2", "--warmup", "1", "--out"])
        .arg(&out)
        .output()
        .expect("run perf");
    let stdout = common::assert_success(&output);

    let json = common::check_reports(&out);
    assert_eq!(json["settings"]["scenario"], "cold-boot");
    let scenarios = json["scenarios"].as_array().unwrap();
    assert_eq!(scenarios.len(), 1);
    assert_eq!(scenarios[0]["name"], "cold-boot");
    assert_eq!(scenarios[0]["status"], "ok", "{:#}", scenarios[0]);
    for id in ["cold-boot.wall", "cold-boot.cpu", "cold-boot.first-output"] {
        let m = common::metric(&json, "cold-boot", id);
        assert_eq!(m["unit"], "ms");
        assert_eq!(m["samples"].as_array().unwrap().len(), 2, "{m:#}");
        assert_eq!(m["warmup"].as_array().unwrap().len(), 1, "{m:#}");
        let summary = &m["summary"];
        for field in ["n", "min", "max", "mean", "median", "p90", "p99"] {
            assert!(summary[field].is_number(), "summary lacks {field}: {m:#}");
        }
        assert!(samples(m).iter().all(|s| *s >= 0.0), "{m:#}");
    }
    // The vmm's own breakdown: ACPI and MP table construction, in µs.
    for id in ["cold-boot.acpi-tables", "cold-boot.mp-table"] {
        let m = common::metric(&json, "cold-boot", id);
        assert_eq!(m["unit"], "us");
        assert_eq!(m["samples"].as_array().unwrap().len(), 2, "{m:#}");
        assert!(samples(m).iter().all(|s| *s > 0.0), "{m:#}");
    }
    // The start-up phases the vmm marks, in the order they happen (one
    // thread after another in the vmm, so always in this order), then perf's
    // own events. The guest exits right after its output, so the vmm's
    // `vm-ended` and perf's read of that output race: first output comes
    // after the first run and before the reap, on either side of `vm-ended`.
    let marks = [
        "main",
        "keeper-forked",
        "cli-parsed",
        "logging",
        "seccomp-installed",
        "memory-mapped",
        "kernel-loaded",
        "vm-created",
        "devices-created",
        "vcpus-created",
        "main-filtered",
        "first-run",
        "vm-ended",
        "reaped",
    ];
    let ids: Vec<String> = json["scenarios"][0]["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .filter(|id| id.starts_with("cold-boot.phase."))
        .map(String::from)
        .collect();
    let phase = |s: &str| format!("cold-boot.phase.{s}");
    let first_output = phase("first-output");
    let without_output: Vec<String> = ids
        .iter()
        .filter(|id| **id != first_output)
        .cloned()
        .collect();
    let want_marks: Vec<String> = marks.iter().map(|s| phase(s)).collect();
    assert_eq!(
        without_output, want_marks,
        "vmm marks, in start-up order: {ids:?}"
    );
    let at = |id: &str| ids.iter().position(|i| i == id);
    let output_at = at(&first_output).unwrap_or_else(|| panic!("no first output step: {ids:?}"));
    assert!(
        at(&phase("first-run")).unwrap() < output_at && output_at < at(&phase("reaped")).unwrap(),
        "first output between the first run and the reap: {ids:?}"
    );
    let want = ids.clone();
    for id in &want {
        let m = common::metric(&json, "cold-boot", id);
        assert_eq!(m["unit"], "us");
        assert_eq!(m["samples"].as_array().unwrap().len(), 2, "{m:#}");
        assert!(samples(m).iter().all(|s| *s >= 0.0), "{m:#}");
    }
    // First output comes before the exit in every run.
    let wall = common::metric(&json, "cold-boot", "cold-boot.wall")["samples"].clone();
    let first = common::metric(&json, "cold-boot", "cold-boot.first-output")["samples"].clone();
    for (w, f) in wall
        .as_array()
        .unwrap()
        .iter()
        .zip(first.as_array().unwrap())
    {
        assert!(f.as_f64().unwrap() <= w.as_f64().unwrap());
    }

    let md = common::read(&out.join("results.md"));
    assert!(
        md.contains(
            "| cold-boot | cold boot: spawn -> guest output -> clean exit (wall) | ms | 2 |"
        ),
        "{md}"
    );
    let svg = common::read(&out.join("latency.svg"));
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let dots = doc
        .descendants()
        .filter(|n| n.has_tag_name("circle"))
        .count();
    assert_eq!(
        dots,
        2 * (5 + want.len()),
        "one dot per measured sample of the five metrics and the phases"
    );
    assert!(stdout.contains("wrote"), "{stdout}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_missing_vmm_is_an_actionable_error() {
    let out = common::out_dir("missing-vmm");
    let output = Command::new(common::perf_bin())
        .args(["cold-boot", "--vmm", "/nonexistent/vmm", "--out"])
        .arg(&out)
        .output()
        .expect("run perf");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("no vmm binary at /nonexistent/vmm"),
        "{stderr}"
    );
    assert!(stderr.contains("cargo build -p vmm"), "{stderr}");
    assert!(!out.join("results.json").exists());
    let _ = std::fs::remove_dir_all(&out);
}
