//! The network scenarios end to end, once and tiny, under real KVM with the
//! workspace's vmm: net-throughput and net-latency boot the net_perf guest
//! on a tap in a private network namespace, network-setup drives
//! host-agent's network library in a scratch node namespace. Checks what
//! results.json holds; nothing about speed. Skipped, saying why, without
//! root, /dev/net/tun or /dev/kvm (and, for network-setup, ip and nft).

mod common;

use std::process::Command;

/// Why the frame-level scenarios cannot run here, if they cannot.
fn missing() -> Option<&'static str> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root");
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        return Some("/dev/net/tun is missing");
    }
    if !std::path::Path::new("/dev/kvm").exists() {
        return Some("/dev/kvm is missing");
    }
    None
}

/// Runs perf with `args`; returns results.json and perf's process id.
fn perf(args: &[&str], name: &str) -> (serde_json::Value, u32) {
    let out = common::out_dir(name);
    let child = Command::new(common::perf_bin())
        .args(args)
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run perf");
    let pid = child.id();
    let output = child.wait_with_output().expect("wait for perf");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "perf {args:?} failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let json = common::check_reports(&out);
    let _ = std::fs::remove_dir_all(&out);
    (json, pid)
}

/// The one scenario of `json`, which must have run.
fn only_scenario<'a>(json: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    let scenarios = json["scenarios"].as_array().unwrap();
    assert_eq!(scenarios.len(), 1, "{json:#}");
    let s = &scenarios[0];
    assert_eq!(s["name"], name);
    s
}

/// Checks metric `id`: unit, direction of better, `samples` measured and
/// `warmup` warm-up samples, all finite and positive, and a summary.
fn check_metric(
    json: &serde_json::Value,
    scenario: &str,
    id: &str,
    unit: &str,
    higher_is_better: bool,
    samples: usize,
) -> serde_json::Value {
    let m = common::metric(json, scenario, id).clone();
    assert_eq!(m["unit"], unit, "{m:#}");
    assert_eq!(m["lower_is_better"], !higher_is_better, "{m:#}");
    let values = m["samples"].as_array().unwrap();
    assert_eq!(values.len(), samples, "{m:#}");
    assert!(
        values
            .iter()
            .all(|v| v.as_f64().is_some_and(|v| v.is_finite() && v > 0.0)),
        "{m:#}"
    );
    for field in ["n", "min", "max", "mean", "median", "p90", "p99"] {
        assert!(m["summary"][field].is_number(), "{m:#}");
    }
    m
}

#[test]
fn net_throughput_moves_frames_both_ways_at_both_sizes() {
    if let Some(why) = missing() {
        println!("skipped: {why}");
        return;
    }
    common::build_vmm();
    let (json, _) = perf(
        &[
            "net-throughput",
            "--runs",
            "1",
            "--warmup",
            "1",
            "--net-frames",
            "300",
        ],
        "net-throughput",
    );
    let s = only_scenario(&json, "net-throughput");
    assert_eq!(s["status"], "ok", "{s:#}");
    assert_eq!(json["settings"]["net_frames"], 300);
    for dir in ["tx", "rx"] {
        for size in [1514u64, 64] {
            let id = format!("net-throughput.{dir}.{size}b");
            let frames = check_metric(
                &json,
                "net-throughput",
                &format!("{id}.frames"),
                "frames/s",
                true,
                1,
            );
            assert_eq!(frames["warmup"].as_array().unwrap().len(), 1, "{frames:#}");
            assert_eq!(frames["params"]["direction"], dir);
            assert_eq!(frames["params"]["frame_bytes"], size);
            assert_eq!(frames["params"]["frames"], 300);
            let mib = check_metric(
                &json,
                "net-throughput",
                &format!("{id}.mib"),
                "MiB/s",
                true,
                1,
            );
            // Both come from one transfer: bytes / frames is the frame size.
            let per_frame = mib["samples"][0].as_f64().unwrap() * (1u64 << 20) as f64
                / frames["samples"][0].as_f64().unwrap();
            assert!(
                (per_frame - size as f64).abs() < 1e-6 * size as f64,
                "{per_frame}"
            );
        }
    }
}

#[test]
fn net_latency_times_round_trips_through_the_echo_guest() {
    if let Some(why) = missing() {
        println!("skipped: {why}");
        return;
    }
    common::build_vmm();
    let (json, _) = perf(
        &[
            "net-latency",
            "--runs",
            "2",
            "--warmup",
            "0",
            "--net-pings",
            "5",
        ],
        "net-latency",
    );
    let s = only_scenario(&json, "net-latency");
    assert_eq!(s["status"], "ok", "{s:#}");
    for size in [64u64, 1514] {
        let m = check_metric(
            &json,
            "net-latency",
            &format!("net-latency.rtt.{size}b"),
            "us",
            false,
            10,
        );
        assert_eq!(m["params"]["frame_bytes"], size);
        assert_eq!(m["params"]["pings_per_round"], 5);
    }
}

#[test]
fn network_setup_times_cold_warm_and_teardown_and_leaves_nothing() {
    if let Some(why) = missing() {
        println!("skipped: {why}");
        return;
    }
    for tool in ["ip", "nft"] {
        if Command::new(tool).arg("-V").output().is_err() {
            println!("skipped: {tool} is not installed");
            return;
        }
    }
    let (json, pid) = perf(
        &["network-setup", "--runs", "2", "--warmup", "1"],
        "network-setup",
    );
    let s = only_scenario(&json, "network-setup");
    assert_eq!(s["status"], "ok", "{s:#}");
    for id in ["cold", "warm-handover", "teardown"] {
        let m = check_metric(
            &json,
            "network-setup",
            &format!("network-setup.{id}"),
            "ms",
            false,
            2,
        );
        assert_eq!(m["warmup"].as_array().unwrap().len(), 1, "{m:#}");
    }
    // The scratch node and every VM namespace of the run are gone.
    let node = format!("perfnode{pid}");
    let vms = format!("perf{pid}-");
    let left: Vec<String> = std::fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|n| *n == node || n.starts_with(&vms))
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
}
