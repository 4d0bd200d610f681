//! Helpers shared by the perf integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The perf binary under test.
pub fn perf_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_perf"))
}

/// Builds the workspace's vmm in the profile perf was built with (cargo
/// does not build another package's binary for this package's tests; an
/// up-to-date vmm is left as it is) and returns its path: next to perf,
/// where perf looks by default.
pub fn build_vmm() -> PathBuf {
    let dir = test_harness::bin::profile_dir();
    test_harness::bin::build("vmm", &dir);
    let vmm = dir.join("vmm");
    assert!(vmm.is_file(), "{} not built", vmm.display());
    vmm
}

/// Builds the workspace's host-agent next to perf, as [`build_vmm`] does
/// the vmm (the session scenarios start it), and returns its path.
pub fn build_host_agent() -> PathBuf {
    let dir = test_harness::bin::profile_dir();
    test_harness::bin::build("host-agent", &dir);
    let bin = dir.join("host-agent");
    assert!(bin.is_file(), "{} not built", bin.display());
    bin
}

/// A fresh, empty folder for one test's output.
pub fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("perf-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Reads a file to a string, naming it on failure.
pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Checks the three reports in `out` are well-formed and returns results.json.
pub fn check_reports(out: &Path) -> serde_json::Value {
    let json: serde_json::Value =
        serde_json::from_str(&read(&out.join("results.json"))).expect("results.json is JSON");
    for field in [
        "schema_version",
        "started_at",
        "duration_s",
        "machine",
        "settings",
        "scenarios",
        "comparisons",
    ] {
        assert!(
            json.get(field).is_some(),
            "results.json lacks {field}: {json:#}"
        );
    }
    let machine = &json["machine"];
    assert!(machine["cpu_model"].is_string());
    assert!(machine["cores"].as_u64().unwrap() >= 1);
    assert!(!machine["kernel"].as_str().unwrap().is_empty());
    assert!(machine["vmm"]["path"].is_string());
    assert!(machine.get("source_commit").is_some());

    let md = read(&out.join("results.md"));
    assert!(md.starts_with("# perf results"), "{md}");
    assert!(
        md.contains("| scenario | metric | unit | n | median | p90 | p99 |"),
        "{md}"
    );

    let svg = read(&out.join("latency.svg"));
    let doc = roxmltree::Document::parse(&svg).expect("latency.svg is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    assert_eq!(
        doc.root_element().tag_name().namespace(),
        Some("http://www.w3.org/2000/svg")
    );
    json
}

/// The metric `id` of `subject` in scenario `scenario` of results.json.
pub fn metric<'a>(json: &'a serde_json::Value, scenario: &str, id: &str) -> &'a serde_json::Value {
    let s = json["scenarios"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == scenario)
        .unwrap_or_else(|| panic!("no scenario {scenario} in {json:#}"));
    s["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == id && m["subject"] == "vmm")
        .unwrap_or_else(|| panic!("no metric {id} in {s:#}"))
}

/// Asserts that perf exited 0, showing its stdout and stderr otherwise;
/// returns its stdout.
pub fn assert_success(output: &std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "perf failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    stdout
}
