//! session-persist, session-fork and session-create once each, tiny,
//! through a real
//! host-agent (the workspace's, built next to perf) with the workspace's
//! vmm under real KVM: their metrics in results.json, and that a session
//! paused to disk writes the pages its guest dirtied, not its memory.
//! Without /dev/kvm it prints why and skips. Nothing about speed.

mod common;

use std::path::Path;
use std::process::Command;

fn have_kvm() -> bool {
    let ok = std::fs::metadata("/dev/kvm").is_ok();
    if !ok {
        eprintln!("skipped: no /dev/kvm");
    }
    ok
}

/// Runs perf with `args` (and one run, no warm-up) into `out` and returns
/// results.json's scenario.
fn run(args: &[&str], out: &Path) -> serde_json::Value {
    let mut all = args.to_vec();
    all.extend(["--runs", "1", "--warmup", "0"]);
    run_exactly(&all, out)
}

/// Runs perf with `args` into `out` and returns results.json's scenario.
fn run_exactly(args: &[&str], out: &Path) -> serde_json::Value {
    common::build_vmm();
    common::build_host_agent();
    let output = Command::new(common::perf_bin())
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
        .expect("run perf");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let json = common::check_reports(out);
    let scenarios = json["scenarios"].as_array().unwrap();
    assert_eq!(scenarios.len(), 1, "{json:#}");
    scenarios[0].clone()
}

fn samples(json: &serde_json::Value, scenario: &str, id: &str) -> Vec<f64> {
    common::metric(json, scenario, id)["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

#[test]
fn session_persist_writes_the_dirtied_pages_and_resumes() {
    if !have_kvm() {
        return;
    }
    let out = common::out_dir("session-persist");
    let s = run(
        &[
            "session-persist",
            "--session-mem-mib",
            "64",
            "--dirty-permille",
            "10,100",
        ],
        &out,
    );
    assert_eq!(s["status"], "ok", "{s:#}");
    let json = common::check_reports(&out);
    for permille in [10u64, 100] {
        let id = |what: &str| format!("session-persist.{what}.{permille}permille.mem64");
        for (what, unit) in [
            ("persist", "ms"),
            ("snapshot", "MiB"),
            ("snapshot-vs-dirtied", "ratio"),
            ("snapshot-vs-memory", "ratio"),
            ("resume", "ms"),
        ] {
            let m = common::metric(&json, "session-persist", &id(what));
            assert_eq!(m["unit"], unit, "{m:#}");
            assert_eq!(m["params"]["dirty_permille"], permille, "{m:#}");
            assert_eq!(samples(&json, "session-persist", &id(what)).len(), 1);
        }
        let dirtied_mib = common::metric(&json, "session-persist", &id("snapshot"))["params"]
            ["dirtied_mib"]
            .as_f64()
            .unwrap();
        // permille thousandths of 64 MiB (less what the e820 map keeps).
        let want = 64.0 * permille as f64 / 1000.0;
        assert!(
            dirtied_mib > want * 0.9 && dirtied_mib <= want,
            "{dirtied_mib} MiB dirtied, {want} asked"
        );
        // The snapshot holds the dirtied pages (and a few more: the
        // guest's stack), not the guest's 64 MiB.
        let mib = samples(&json, "session-persist", &id("snapshot"))[0];
        assert!(
            mib >= dirtied_mib * 0.9 && mib <= dirtied_mib + 4.0,
            "{mib} MiB written for {dirtied_mib} MiB dirtied"
        );
        let ratio = samples(&json, "session-persist", &id("snapshot-vs-dirtied"))[0];
        assert!((ratio - mib / dirtied_mib).abs() < 1e-6, "{ratio}");
        let of_memory = samples(&json, "session-persist", &id("snapshot-vs-memory"))[0];
        assert!((of_memory - mib / 64.0).abs() < 1e-6, "{of_memory}");
        for what in ["persist", "resume"] {
            assert!(samples(&json, "session-persist", &id(what))[0] > 0.0);
        }
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn session_fork_times_forks_of_1_and_10_or_says_why_not() {
    if !have_kvm() {
        return;
    }
    let out = common::out_dir("session-fork");
    let s = run(&["session-fork"], &out);
    if s["status"] == "skipped" {
        // A host-agent without ForkSession.
        println!("session-fork: {}", s["reason"]);
        assert!(
            s["reason"]
                .as_str()
                .unwrap()
                .starts_with("skipped: host-agent has no ForkSession"),
            "{s:#}"
        );
        return;
    }
    assert_eq!(s["status"], "ok", "{s:#}");
    let json = common::check_reports(&out);
    for count in [1u64, 10] {
        let id = format!("session-fork.fork{count}.mem256");
        let m = common::metric(&json, "session-fork", &id);
        assert_eq!(m["unit"], "ms", "{m:#}");
        assert_eq!(m["params"]["count"], count, "{m:#}");
        let got = samples(&json, "session-fork", &id);
        assert!(got.len() == 1 && got[0] > 0.0, "{m:#}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn session_create_times_warm_pool_and_golden_creates() {
    if !have_kvm() {
        return;
    }
    let out = common::out_dir("session-create");
    // Two creates in flight per path, after one warm-up round of four.
    let s = run_exactly(&["session-create", "--runs", "2", "--warmup", "1"], &out);
    assert_eq!(s["status"], "ok", "{s:#}");
    let json = common::check_reports(&out);
    for path in ["warm-pool", "golden"] {
        let id = format!("session-create.{path}.latency");
        let m = common::metric(&json, "session-create", &id);
        assert_eq!(m["unit"], "ms", "{m:#}");
        assert_eq!(m["params"]["path"], path, "{m:#}");
        assert_eq!(m["params"]["in_flight"], 4, "{m:#}");
        assert_eq!(m["params"]["mem_mib"], 256, "{m:#}");
        assert_eq!(m["warmup"].as_array().unwrap().len(), 4, "{m:#}");
        let got = samples(&json, "session-create", &id);
        assert!(got.len() == 2 && got.iter().all(|&t| t > 0.0), "{m:#}");
        let summary = &m["summary"];
        assert_eq!(summary["n"], 2, "{m:#}");
        assert!(summary["p99"].as_f64().unwrap() >= summary["median"].as_f64().unwrap());
    }
    let _ = std::fs::remove_dir_all(&out);
}
