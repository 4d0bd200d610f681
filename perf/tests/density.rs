//! density once, tiny (2 VMs, 2 rounds), with the workspace's vmm under
//! real KVM: its metrics in results.json (names, units, sample counts, Pss
//! at most Rss, the per-session and fit-in-host figures following from the
//! sums), and that no VMM process outlives the run. Without /dev/kvm it
//! prints why and skips. Nothing about speed.

mod common;

use std::process::Command;

fn samples(json: &serde_json::Value, id: &str) -> Vec<f64> {
    let m = common::metric(json, "density", id);
    m["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

fn mem_total_kib() -> f64 {
    common::read(std::path::Path::new("/proc/meminfo"))
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap()
}

/// Processes whose command line names `needle`.
fn processes_naming(needle: &str) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(needle))
        .collect()
}

#[test]
fn density_sums_the_memory_of_idle_restored_vms() {
    if std::fs::metadata("/dev/kvm").is_err() {
        eprintln!("skipped: no /dev/kvm");
        return;
    }
    common::build_vmm();
    let out = common::out_dir("density");
    let work = out.join("work");
    let output = Command::new(common::perf_bin())
        .args([
            "density",
            "--runs",
            "2",
            "--density-counts",
            "2",
            "--work-dir",
        ])
        .arg(&work)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run perf");
    common::assert_success(&output);
    let json = common::check_reports(&out);
    let s = &json["scenarios"][0];
    assert_eq!(s["name"], "density", "{json:#}");
    assert_eq!(s["status"], "ok", "{s:#}");
    for (what, unit) in [
        ("rss-sum", "MiB"),
        ("pss-sum", "MiB"),
        ("pss-per-session", "MiB"),
        ("fit-in-host", "sessions"),
        ("cpu", "%"),
    ] {
        let id = format!("density.{what}.n2");
        let m = common::metric(&json, "density", &id);
        assert_eq!(m["unit"], unit, "{m:#}");
        assert_eq!(m["params"]["sessions"], 2, "{m:#}");
        assert_eq!(m["params"]["mem_mib"], 512, "{m:#}");
        assert_eq!(samples(&json, &id).len(), 2, "{m:#}");
    }
    let rss = samples(&json, "density.rss-sum.n2");
    let pss = samples(&json, "density.pss-sum.n2");
    let per = samples(&json, "density.pss-per-session.n2");
    let fit = samples(&json, "density.fit-in-host.n2");
    let mem_total_mib = mem_total_kib() / 1024.0;
    for i in 0..2 {
        assert!(
            pss[i] > 0.0 && pss[i] <= rss[i],
            "Pss {} Rss {}",
            pss[i],
            rss[i]
        );
        assert!(
            (per[i] - pss[i] / 2.0).abs() < 1e-9,
            "{} {}",
            per[i],
            pss[i]
        );
        // Idle VMs of a 512 MiB snapshot hold far less than their memory.
        assert!(rss[i] < 2.0 * 512.0, "{} MiB resident", rss[i]);
        let want = (mem_total_mib / per[i]).floor();
        assert!(
            (fit[i] - want).abs() <= 1.0,
            "{} sessions fit, {want} expected",
            fit[i]
        );
    }
    for cpu in samples(&json, "density.cpu.n2") {
        assert!(cpu >= 0.0, "{cpu}");
    }
    // Every VMM was killed and reaped.
    let left = processes_naming(work.to_str().unwrap());
    assert!(left.is_empty(), "left running: {left:?}");
    let _ = std::fs::remove_dir_all(&out);
}
