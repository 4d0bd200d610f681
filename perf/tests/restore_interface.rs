//! The restore, creation-rate, memory-overhead, density and snapshot-write scenarios
//! driven end to end through the snapshot/restore interface of issue 3
//! (`vmm restore --snapshot DIR`, control op `snapshot`) and through
//! Firecracker's API, against tests/support/fake_vmm.py: a stand-in that
//! speaks both interfaces but runs no guest (for the network scenarios it
//! plays the net_perf guest's part on the tap itself). This checks the harness's
//! logic and reports, not any VMM; nothing about speed is asserted.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

fn support(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/support")
        .join(name)
}

fn have_python() -> bool {
    let ok = Command::new("python3")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("skipped: python3 is not installed, and the fake VMM is a Python script");
    }
    ok
}

fn perf(args: &[&str], out: &std::path::Path, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(common::perf_bin());
    cmd.args(args).arg("--out").arg(out);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run perf")
}

fn scenario<'a>(json: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    json["scenarios"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == name)
        .unwrap_or_else(|| panic!("no scenario {name}"))
}

#[test]
fn restore_scenarios_run_against_the_snapshot_interface_and_compare() {
    if !have_python() {
        return;
    }
    let out = common::out_dir("fake-all");
    let vmm = support("fake_vmm.py");
    let fc = support("fake_firecracker.py");
    let output = perf(
        &[
            "all",
            "--runs",
            "1",
            "--warmup",
            "0",
            "--mem-sizes",
            "64",
            "--concurrency",
            "2",
            "--net-frames",
            "64",
            "--net-pings",
            "2",
            "--density-counts",
            "2",
            "--vmm",
            vmm.to_str().unwrap(),
            "--vs-firecracker",
            fc.to_str().unwrap(),
        ],
        &out,
        &[],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let json = common::check_reports(&out);
    for name in [
        "cold-boot",
        "restore",
        "creation-rate",
        "memory-overhead",
        "density",
        "snapshot-write",
    ] {
        assert_eq!(
            scenario(&json, name)["status"],
            "ok",
            "{:#}",
            scenario(&json, name)
        );
    }
    // host-agent drives only the vmm of its own release, never the fake.
    for name in ["session-persist", "session-fork", "session-create"] {
        let s = scenario(&json, name);
        assert_eq!(s["status"], "skipped", "{s:#}");
        assert!(
            s["reason"].as_str().unwrap().starts_with("skipped: "),
            "{s:#}"
        );
    }
    // The network scenarios: the fake plays the net_perf guest on the tap
    // perf hands it (`--net`, `PUT /network-interfaces/eth0`); without root
    // or /dev/net/tun they are skipped, saying why.
    let net = scenario(&json, "net-throughput");
    if net["status"] == "skipped" {
        println!("net-throughput: {}", net["reason"]);
    } else {
        assert_eq!(net["status"], "ok", "{net:#}");
        assert_eq!(scenario(&json, "net-latency")["status"], "ok");
        for id in [
            "net-throughput.tx.1514b.frames",
            "net-throughput.rx.64b.mib",
            "net-latency.rtt.64b",
        ] {
            let scenario_name = &id[..id.find('.').unwrap()];
            let m = common::metric(&json, scenario_name, id);
            assert!(!m["samples"].as_array().unwrap().is_empty(), "{m:#}");
            assert!(
                json["comparisons"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|c| c["id"] == id),
                "no vmm/Firecracker ratio for {id}"
            );
        }
    }
    for id in [
        "restore.latency.mem64",
        "restore.prestarted.mem64",
        "creation-rate.rate",
        "creation-rate.latency",
        "memory-overhead.idle.mem64",
        "memory-overhead.restored.mem64",
        "snapshot-write.full.mem64",
        "snapshot-write.diff-10permille.mem64",
        "snapshot-write.diff-100permille.mem64",
        "density.pss-sum.n2",
        "density.fit-in-host.n2",
    ] {
        let scenario_name = id.split('.').next().unwrap();
        let m = common::metric(&json, scenario_name, id);
        assert!(!m["samples"].as_array().unwrap().is_empty(), "{m:#}");
    }
    assert_eq!(
        common::metric(&json, "creation-rate", "creation-rate.latency")["samples"]
            .as_array()
            .unwrap()
            .len(),
        10,
        "2 workers x 5 restores"
    );
    // Every metric was measured on both, so every one has a ratio.
    let comparisons = json["comparisons"].as_array().unwrap();
    for id in [
        "restore.latency.mem64",
        "restore.prestarted.mem64",
        "density.pss-sum.n2",
    ] {
        assert!(
            comparisons.iter().any(|c| c["id"] == id),
            "no vmm/Firecracker ratio for {id}"
        );
    }
    assert!(comparisons
        .iter()
        .all(|c| c["ratio"].is_number() || c["ratio"].is_null()));
    let md = common::read(&out.join("results.md"));
    assert!(md.contains("| firecracker median | ratio vmm/fc |"), "{md}");
    let svg = common::read(&out.join("latency.svg"));
    let doc = roxmltree::Document::parse(&svg).unwrap();
    assert!(doc
        .descendants()
        .any(|n| n.has_tag_name("text") && n.text().is_some_and(|t| t.starts_with("firecracker"))));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn without_restore_the_restore_scenarios_are_skipped_not_failed() {
    if !have_python() {
        return;
    }
    let out = common::out_dir("fake-no-restore");
    let vmm = support("fake_vmm.py");
    let output = perf(
        &[
            "all",
            "--runs",
            "1",
            "--warmup",
            "0",
            "--mem-sizes",
            "64",
            "--net-frames",
            "64",
            "--net-pings",
            "2",
            "--density-counts",
            "2",
            "--vmm",
            vmm.to_str().unwrap(),
        ],
        &out,
        &[("FAKE_NO_RESTORE", "1")],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "stderr:\n{stderr}");
    let json = common::check_reports(&out);
    for name in ["restore", "creation-rate", "snapshot-write", "density"] {
        let s = scenario(&json, name);
        assert_eq!(s["status"], "skipped", "{s:#}");
        assert_eq!(s["reason"], "skipped: vmm has no restore");
    }
    let mem = scenario(&json, "memory-overhead");
    assert_eq!(mem["status"], "ok");
    assert!(mem["notes"][0]
        .as_str()
        .unwrap()
        .contains("skipped: vmm has no restore"));
    let md = common::read(&out.join("results.md"));
    assert!(
        md.contains("* **restore**: skipped: vmm has no restore"),
        "{md}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_vmm_that_cannot_start_ahead_has_no_prestarted_metric_on_either_side() {
    if !have_python() {
        return;
    }
    let out = common::out_dir("fake-no-standby");
    let output = perf(
        &[
            "restore",
            "--runs",
            "1",
            "--warmup",
            "0",
            "--mem-sizes",
            "64",
            "--vmm",
            support("fake_vmm.py").to_str().unwrap(),
            "--vs-firecracker",
            support("fake_firecracker.py").to_str().unwrap(),
        ],
        &out,
        &[("FAKE_NO_STANDBY", "1")],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "stderr:\n{stderr}");
    let json = common::check_reports(&out);
    let restore = scenario(&json, "restore");
    assert_eq!(restore["status"], "ok", "{restore:#}");
    let ids: Vec<&str> = restore["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert!(ids.contains(&"restore.latency.mem64"), "{ids:?}");
    assert!(
        !ids.iter().any(|id| id.starts_with("restore.prestarted")),
        "{ids:?}"
    );
    assert!(
        restore["notes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n.as_str().unwrap().contains("restore.prestarted: skipped")),
        "{restore:#}"
    );
    let _ = std::fs::remove_dir_all(&out);
}
