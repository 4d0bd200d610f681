//! Every scenario once, tiny, under real KVM with the workspace's vmm: the
//! snapshot and restore interface is exercised for real, and so are the
//! network scenarios where this host lets them run (root, /dev/net/tun;
//! tests/net.rs checks their metrics). Nothing about speed.

mod common;

use std::process::Command;

#[test]
fn every_scenario_runs_once_with_the_real_vmm() {
    common::build_vmm();
    common::build_host_agent();
    let out = common::out_dir("all-kvm");
    let output = Command::new(common::perf_bin())
        .args([
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
            "--session-mem-mib",
            "64",
            "--dirty-permille",
            "10",
            "--density-counts",
            "2",
            "--out",
        ])
        .arg(&out)
        .output()
        .expect("run perf");
    common::assert_success(&output);
    let json = common::check_reports(&out);
    let scenarios = json["scenarios"].as_array().unwrap();
    let names: Vec<&str> = scenarios
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "cold-boot",
            "restore",
            "restore-memory",
            "creation-rate",
            "memory-overhead",
            "density",
            "snapshot-write",
            "net-throughput",
            "net-latency",
            "network-setup",
            "files-throughput",
            "session-persist",
            "session-fork",
            "session-create",
            "fleet"
        ]
    );
    let has_restore = scenarios[1]["status"] == "ok";
    for s in scenarios {
        if s["name"] == "fleet" && s["status"] == "skipped" {
            // Needs nats-server (scripts/test installs it); says so.
            println!("fleet: {}", s["reason"]);
            assert!(
                s["reason"].as_str().unwrap().starts_with("skipped: "),
                "{s:#}"
            );
        } else if s["name"].as_str().unwrap().starts_with("net") {
            // Needs root and /dev/net/tun; says why when it is skipped.
            if s["status"] == "skipped" {
                println!("{}: {}", s["name"], s["reason"]);
                assert!(
                    s["reason"].as_str().unwrap().starts_with("skipped: "),
                    "{s:#}"
                );
            } else {
                assert_eq!(s["status"], "ok", "{s:#}");
                assert!(!s["metrics"].as_array().unwrap().is_empty(), "{s:#}");
            }
        } else if has_restore
            || ["cold-boot", "memory-overhead", "files-throughput"]
                .contains(&s["name"].as_str().unwrap())
        {
            assert_eq!(s["status"], "ok", "{s:#}");
        } else {
            assert_eq!(s["reason"], "skipped: vmm has no restore", "{s:#}");
        }
    }
    let fleet_ran = scenarios
        .iter()
        .any(|s| s["name"] == "fleet" && s["status"] == "ok");
    if fleet_ran {
        for id in ["fleet.first-session.mem256", "fleet.pull-throughput.mem256"] {
            let m = common::metric(&json, "fleet", id);
            assert_eq!(m["samples"].as_array().unwrap().len(), 1, "{m:#}");
        }
        let m = common::metric(&json, "fleet", "fleet.export-latency");
        assert!(!m["samples"].as_array().unwrap().is_empty(), "{m:#}");
    }
    if has_restore {
        // Every backing and fill of restore-memory, both clocks.
        for mode in ["private_file", "private_uffd", "shared_file", "shared_uffd"] {
            for what in ["ready", "redirtied"] {
                let id = format!("restore_memory.{what}.{mode}.mem64");
                let m = common::metric(&json, "restore-memory", &id);
                assert_eq!(m["samples"].as_array().unwrap().len(), 1, "{m:#}");
            }
        }
        for (scenario, id) in [
            ("restore", "restore.latency.mem64"),
            ("restore", "restore.prestarted.mem64"),
            ("restore", "restore.phase.snapshot-read.mem64"),
            ("restore", "restore.phase.first-run.mem64"),
            ("restore", "restore.phase.first-output.mem64"),
            ("memory-overhead", "memory-overhead.restored.mem64"),
            ("snapshot-write", "snapshot-write.full.mem64"),
            ("snapshot-write", "snapshot-write.diff-10permille.mem64"),
            ("snapshot-write", "snapshot-write.diff-100permille.mem64"),
            (
                "session-persist",
                "session-persist.persist.10permille.mem64",
            ),
            ("session-fork", "session-fork.fork10.mem256"),
            ("session-create", "session-create.warm-pool.latency"),
            ("session-create", "session-create.golden.latency"),
            ("density", "density.pss-sum.n2"),
            ("density", "density.rss-sum.n2"),
        ] {
            let m = common::metric(&json, scenario, id);
            assert_eq!(m["samples"].as_array().unwrap().len(), 1, "{m:#}");
        }
        let rate = common::metric(&json, "creation-rate", "creation-rate.latency");
        assert_eq!(
            rate["samples"].as_array().unwrap().len(),
            10,
            "2 workers x 5 restores"
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}
