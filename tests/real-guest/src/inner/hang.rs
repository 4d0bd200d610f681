//! What a hung guest's vmm was doing, recorded before it is killed: each
//! thread's state, wait channel and kernel stack, KVM's exit counters for
//! the VM over two seconds (an exit storm or a silent vCPU shows there) and
//! a second of the `kvm_exit` tracepoint (which exits those are).

use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// Process `root` and every process under it, `root` first.
fn tree_pids(root: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let stat = read(e.path().join("stat"));
            // The parent is the second field after the parenthesised name.
            if let Some(ppid) = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok())
            {
                parents.push((pid, ppid));
            }
        }
    }
    let mut tree = vec![root];
    let mut i = 0;
    while let Some(&p) = tree.get(i) {
        tree.extend(parents.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    tree
}

/// Each thread of process `root` and of every process under it: state,
/// wait channel and kernel stack (what a runner stuck in a scenario and its
/// vmm are doing), read from /proc only.
pub fn process_tree(root: u32) -> String {
    let mut out = String::new();
    for pid in tree_pids(root) {
        let cmd = read(format!("/proc/{pid}/cmdline")).replace('\0', " ");
        let cmd: String = cmd.trim().chars().take(160).collect();
        let _ = writeln!(out, "process {pid}: {cmd}");
        threads(pid, &mut out);
    }
    out
}

/// A thread waiting on the outer VM's 9p share (its kernel stack is in the
/// 9p client's request wait).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NinePWait {
    /// Thread id.
    pub tid: u32,
    /// `pid/comm` of its process and thread name, for the report.
    pub who: String,
    /// Its time on a CPU so far (ns, from schedstat; 0 if unknown): a
    /// thread that waits for good never runs.
    pub ran_ns: u64,
}

/// Whether a kernel stack (as /proc/<tid>/stack prints it) or wait channel
/// is in the 9p client's request path.
pub fn in_9p(stack: &str, wchan: &str) -> bool {
    wchan.starts_with("p9_")
        || stack.contains("p9_client_rpc")
        || stack.contains("p9_client_zc_rpc")
}

/// The threads of `root`'s process tree waiting on 9p now.
pub fn waiting_on_9p(root: u32) -> Vec<NinePWait> {
    let mut out = Vec::new();
    for pid in tree_pids(root) {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let p = t.path();
            let Some(tid) = t.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if !in_9p(&read(p.join("stack")), read(p.join("wchan")).trim()) {
                continue;
            }
            out.push(NinePWait {
                tid,
                who: format!("{pid}/{}", read(p.join("comm")).trim()),
                ran_ns: read(p.join("schedstat"))
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0),
            });
        }
    }
    out
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

/// KVM tracepoints sampled for a second: which exits, and for nested page
/// faults which guest-physical addresses.
const TRACEPOINTS: &[&str] = &["kvm_exit", "kvm_page_fault"];

/// Set once a tracefs write has not come back: tracing is not tried again.
static TRACE_STUCK: AtomicBool = AtomicBool::new(false);

/// Longest [`trace`] may take beyond its sampling time before the wait is
/// given up (its thread is left behind).
const TRACE_SLACK: Duration = Duration::from_secs(20);

/// The text of `points` traced for `secs`, or `None` without tracefs or
/// when tracing did not come back in time. Run in a thread of its own: a
/// write to tracefs that never returns (enabling a tracepoint patches the
/// kernel's text and waits on every CPU) must not hang the runner, whose
/// own timeouts are what bound a scenario.
fn trace(points: &'static [&'static str], secs: u64) -> Option<String> {
    if TRACE_STUCK.load(Ordering::Relaxed) {
        return None;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("rg-trace".into())
        .spawn(move || {
            let _ = tx.send(trace_now(points, secs));
        });
    if spawned.is_err() {
        return None;
    }
    match rx.recv_timeout(Duration::from_secs(secs) + TRACE_SLACK) {
        Ok(t) => t,
        Err(_) => {
            TRACE_STUCK.store(true, Ordering::Relaxed);
            println!(
                "{}",
                crate::report::info_line(
                    "runner",
                    &format!(
                        "tracing {points:?} did not come back in {} s; not traced again",
                        (Duration::from_secs(secs) + TRACE_SLACK).as_secs()
                    )
                )
            );
            None
        }
    }
}

/// [`trace`]'s work, in the calling thread.
fn trace_now(points: &[&str], secs: u64) -> Option<String> {
    let root = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.join("events/kvm/kvm_exit/enable").exists())?;
    let enables: Vec<_> = points
        .iter()
        .map(|t| root.join(format!("events/kvm/{t}/enable")))
        .collect();
    let _ = std::fs::write(root.join("trace"), "");
    for e in &enables {
        let _ = std::fs::write(e, "1");
    }
    std::thread::sleep(Duration::from_secs(secs));
    for e in &enables {
        let _ = std::fs::write(e, "0");
    }
    Some(read(root.join("trace")))
}

fn kvm_exit_reasons(out: &mut String) {
    let Some(trace) = trace(TRACEPOINTS, 1) else {
        return;
    };
    for point in TRACEPOINTS {
        let marker = format!("{point}: ");
        let mut counts: std::collections::BTreeMap<String, u64> = Default::default();
        for line in trace.lines() {
            if let Some((_, rest)) = line.split_once(&marker) {
                let key: String = rest.split_whitespace().collect::<Vec<_>>().join(" ");
                *counts.entry(key).or_default() += 1;
            }
        }
        let mut v: Vec<_> = counts.into_iter().collect();
        v.sort_by_key(|e| std::cmp::Reverse(e.1));
        for (k, n) in v.into_iter().take(5) {
            let _ = writeln!(out, "{point} x{n}: {k}");
        }
    }
}

/// Lowest guest-physical address the stall signature accepts: above the
/// 32-bit hole where the vmm puts its MMIO devices, and above the RAM.
fn stall_floor(ram_bytes: Option<u64>) -> u64 {
    ram_bytes.unwrap_or(0).max(1 << 32)
}

/// Nested page faults a second that make a storm.
const STORM: usize = 1000;
/// AMD's nested-page-fault error code bit: the fault hit the guest's own
/// page-table walk (KVM's PFERR_GUEST_PAGE_MASK).
const PFERR_GUEST_PAGE: u64 = 1 << 33;

/// Recognises the one livelock this harness blames on the outer VM, from a
/// second of `kvm_page_fault` trace lines. Seen in about one boot in five of
/// a 2-vCPU guest on QEMU 7.2's software-emulated nested paging (never with
/// one vCPU, with or without dirty logging; none in 16 boots on QEMU 10): one vCPU
/// takes the same nested page fault over and over, thousands a second,
/// while walking its page tables, on a guest-physical address ending in
/// `ff8` (the last entry of a table) far beyond the guest's RAM and every
/// device, while the other vCPU idles. No guest frame the vmm gave out is
/// near that address, so the walk was handed a table the guest never wrote.
/// `None` unless at least [`STORM`] such faults on one address make up nine
/// in ten of all.
pub fn stall_in(trace: &str, ram_bytes: Option<u64>) -> Option<String> {
    let floor = stall_floor(ram_bytes);
    let mut all = 0usize;
    let mut hits: std::collections::BTreeMap<(u64, String), usize> = Default::default();
    for line in trace.lines() {
        let Some((_, rest)) = line.split_once("kvm_page_fault: ") else {
            continue;
        };
        all += 1;
        let words: Vec<&str> = rest.split_whitespace().collect();
        let field = |name: &str| {
            words
                .iter()
                .position(|w| *w == name)
                .and_then(|i| words.get(i + 1))
                .copied()
        };
        let hex = |v: Option<&str>| {
            v.and_then(|v| u64::from_str_radix(v.trim_start_matches("0x"), 16).ok())
        };
        let (Some(addr), Some(code)) = (hex(field("address")), hex(field("error_code"))) else {
            continue;
        };
        if addr >= floor && code & PFERR_GUEST_PAGE != 0 {
            let where_ = format!(
                "vcpu {} at rip {}",
                field("vcpu").unwrap_or("?"),
                field("rip").unwrap_or("?")
            );
            *hits.entry((addr, where_)).or_default() += 1;
        }
    }
    let ((addr, where_), n) = hits.into_iter().max_by_key(|(_, n)| *n)?;
    if n < STORM || n * 10 < all * 9 {
        return None;
    }
    Some(format!(
        "the outer VM's emulated nested paging livelocked the guest: {n} nested page faults \
         in 1 s, {where_}, all on guest-physical {addr:#x} (beyond its RAM and every device) \
         in its own page-table walk"
    ))
}

/// Samples the tracepoint for a second and applies [`stall_in`].
pub fn emulation_stall(ram_bytes: Option<u64>) -> Option<String> {
    stall_in(&trace(&["kvm_page_fault"], 1)?, ram_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(vcpu: u32, addr: u64, code: u64) -> String {
        format!(
            " vcpu{vcpu}-231 [001] d.... 412.3: kvm_page_fault: vcpu {vcpu} \
             rip 0xffffffffc06ae20c address 0x{addr:016x} error_code 0x{code:x}\n"
        )
    }

    #[test]
    fn the_process_tree_names_the_runners_children_and_their_threads() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        // `spawn` returns once the child's exec has begun (its close-on-exec
        // pipe closed), which is before the kernel has laid out the new
        // program's arguments: until then /proc/<pid>/cmdline reads empty.
        let cmdline = format!("/proc/{}/cmdline", child.id());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while read(&cmdline).is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let tree = process_tree(std::process::id());
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            tree.contains(&format!("process {}: sleep 30", child.id())),
            "{tree}"
        );
        assert!(
            tree.starts_with(&format!("process {}:", std::process::id())),
            "{tree}"
        );
        // The child's one thread, with its state and stack.
        assert!(tree.contains("thread sleep state="), "{tree}");
        assert!(tree.contains(" stack: "), "{tree}");
    }

    #[test]
    fn a_9p_request_wait_is_recognised() {
        let stuck = "[<0>] p9_client_rpc+0x1a2/0x3c0 [9pnet]\n[<0>] p9_client_read_once+0x9f/0x1b0 [9pnet]\n[<0>] v9fs_issue_read+0x41/0xa0 [9p]\n[<0>] netfs_read_folio+0x14a/0x1d0";
        assert!(in_9p(stuck, "0"));
        assert!(in_9p("", "p9_client_rpc"));
        assert!(!in_9p(
            "[<0>] pipe_read+0x3df/0x470\n[<0>] vfs_read+0x2db/0x310",
            "pipe_read"
        ));
        // Nothing under a process that waits on nothing of 9p.
        assert!(waiting_on_9p(std::process::id()).is_empty());
    }

    #[test]
    fn the_recorded_livelock_is_recognised() {
        // What a stalled boot's hang report showed (x12770 in 1 s).
        let trace = line(1, 0x1_b7d0_6ff8, 0x2_0000_000e).repeat(STORM + 5);
        let why = stall_in(&trace, Some(256 << 20)).expect("the signature");
        assert!(why.contains("0x1b7d06ff8"), "{why}");
        assert!(why.contains("vcpu 1 at rip 0xffffffffc06ae20c"), "{why}");
    }

    #[test]
    fn ordinary_fault_traffic_is_not_a_stall() {
        // Too few.
        assert_eq!(
            stall_in(&line(1, 0x1_0000_0ff8, 0x2_0000_000e).repeat(10), None),
            None
        );
        // Inside the guest's RAM (lazy restore faults in every page once).
        let in_ram = line(0, 0x0ff0_0ff8, 0x2_0000_000e).repeat(2 * STORM);
        assert_eq!(stall_in(&in_ram, Some(256 << 20)), None);
        // MMIO below 4 GiB.
        let mmio = line(0, 0xd000_0050, 0x2_0000_000e).repeat(2 * STORM);
        assert_eq!(stall_in(&mmio, Some(256 << 20)), None);
        // Not in a page-table walk.
        let data = line(1, 0x1_0000_0ff8, 0x1_0000_0006).repeat(2 * STORM);
        assert_eq!(stall_in(&data, Some(256 << 20)), None);
        // A storm that is not one address's nine in ten.
        let mixed = line(1, 0x1_0000_0ff8, 0x2_0000_000e).repeat(STORM)
            + &line(0, 0x0100_0000, 0x1_0000_0006).repeat(STORM);
        assert_eq!(stall_in(&mixed, Some(256 << 20)), None);
        // A guest with more RAM than the address.
        let big = line(1, 0x1_0000_0ff8, 0x2_0000_000e).repeat(2 * STORM);
        assert_eq!(stall_in(&big, Some(8 << 30)), None);
    }
}
