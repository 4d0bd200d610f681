//! What a hung guest's vmm was doing, recorded before it is killed: each
//! thread's state, wait channel and kernel stack, KVM's exit counters for
//! the VM over two seconds (an exit storm or a silent vCPU shows there) and
//! a second of the `kvm_exit` tracepoint (which exits those are).

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

/// KVM debugfs counters worth comparing.
const COUNTERS: &[&str] = &[
    "exits",
    "halt_exits",
    "halt_wakeup",
    "irq_window_exits",
    "nmi_window_exits",
    "irq_injections",
    "nmi_injections",
    "io_exits",
    "mmio_exits",
    "irq_exits",
    "request_irq_exits",
];

/// A multi-line report on process `pid`.
pub fn report(pid: u32) -> String {
    let mut out = String::new();
    threads(pid, &mut out);
    kvm_counters(pid, &mut out);
    kvm_exit_reasons(&mut out);
    out
}

fn read(path: impl AsRef<Path>) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn threads(pid: u32, out: &mut String) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        let _ = writeln!(out, "process {pid} is gone");
        return;
    };
    for t in tasks.flatten() {
        let p = t.path();
        let stat = read(p.join("stat"));
        // The state is the field after the parenthesised command name.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("?")
            .to_string();
        let stack: Vec<String> = read(p.join("stack"))
            .lines()
            .take(8)
            .map(|l| l.split_whitespace().nth(1).unwrap_or(l).to_string())
            .collect();
        let _ = writeln!(
            out,
            "thread {} state={state} wchan={} stack: {}",
            read(p.join("comm")).trim(),
            read(p.join("wchan")).trim(),
            stack.join(" ")
        );
    }
}

fn kvm_counters(pid: u32, out: &mut String) {
    let Some(dir) = std::fs::read_dir("/sys/kernel/debug/kvm")
        .ok()
        .and_then(|d| {
            d.flatten().map(|e| e.path()).find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{pid}-")))
            })
        })
    else {
        let _ = writeln!(out, "no KVM debugfs directory for pid {pid}");
        return;
    };
    let sample = || -> Vec<u64> {
        COUNTERS
            .iter()
            .map(|c| read(dir.join(c)).trim().parse().unwrap_or(0))
            .collect()
    };
    let before = sample();
    std::thread::sleep(Duration::from_secs(2));
    let after = sample();
    for ((name, a), b) in COUNTERS.iter().zip(before).zip(after) {
        let _ = writeln!(
            out,
            "kvm {name} +{} in 2 s (total {b})",
            b.saturating_sub(a)
        );
    }
}

fn kvm_exit_reasons(out: &mut String) {
    let root = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.join("events/kvm/kvm_exit/enable").exists());
    let Some(root) = root else {
        return;
    };
    let enable = root.join("events/kvm/kvm_exit/enable");
    if std::fs::write(&enable, "1").is_err() {
        return;
    }
    let _ = std::fs::write(root.join("trace"), "");
    std::thread::sleep(Duration::from_secs(1));
    let _ = std::fs::write(&enable, "0");
    let trace = read(root.join("trace"));
    let mut counts: std::collections::BTreeMap<String, u64> = Default::default();
    for line in trace.lines() {
        if let Some((_, rest)) = line.split_once("kvm_exit: ") {
            let key: String = rest
                .split_whitespace()
                .take(4)
                .collect::<Vec<_>>()
                .join(" ");
            *counts.entry(key).or_default() += 1;
        }
    }
    let mut v: Vec<_> = counts.into_iter().collect();
    v.sort_by_key(|e| std::cmp::Reverse(e.1));
    for (k, n) in v.into_iter().take(5) {
        let _ = writeln!(out, "kvm_exit x{n}: {k}");
    }
}
