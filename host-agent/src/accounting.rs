//! Per-second usage accounting.
//!
//! A [`Meter`] per session turns raw process readings into cumulative,
//! billable counters. It is pure arithmetic over the timestamps it is given,
//! so tests drive it with an injected clock. Billing runs from READY to
//! STOPPED with a one-second minimum; while not billable (PAUSED, snapshot,
//! restore) no time, memory or billed seconds accrue.
//!
//! Raw readings come from `/proc`: CPU time of the vmm's vCPU threads
//! (threads named `vcpuN`), resident memory (`VmRSS`), and bytes written
//! (`write_bytes` in `/proc/PID/io`).

use std::path::Path;

use crate::store::UsageRow;

/// Raw readings of a vmm process at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Sample {
    /// CPU time of the vCPU threads (user + system), nanoseconds.
    pub vcpu_cpu_ns: u64,
    /// Resident set size, bytes.
    pub rss_bytes: u64,
    /// Bytes written to storage.
    pub disk_write_bytes: u64,
}

const GIB: f64 = (1u64 << 30) as f64;

/// The network counters of a session, raw or cumulative: what its
/// virtio-net device moved (from the vmm's status), what the host-side
/// rules dropped (the namespace's `denied` counter) and the DNS queries its
/// resolver refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NetIo {
    /// Bytes of frames delivered to the guest.
    pub rx_bytes: u64,
    /// Frames delivered to the guest.
    pub rx_packets: u64,
    /// Bytes of frames the guest sent.
    pub tx_bytes: u64,
    /// Frames the guest sent.
    pub tx_packets: u64,
    /// Guest packets the host-side egress rules dropped.
    pub denied_packets: u64,
    /// DNS queries the session's resolver refused.
    pub dns_denied: u64,
}

impl NetIo {
    fn fields(&self) -> [u64; 6] {
        [
            self.rx_bytes,
            self.rx_packets,
            self.tx_bytes,
            self.tx_packets,
            self.denied_packets,
            self.dns_denied,
        ]
    }

    fn from_fields(f: [u64; 6]) -> Self {
        Self {
            rx_bytes: f[0],
            rx_packets: f[1],
            tx_bytes: f[2],
            tx_packets: f[3],
            denied_packets: f[4],
            dns_denied: f[5],
        }
    }
}

/// Cumulative counters of one session.
#[derive(Debug, Clone, PartialEq)]
pub struct Meter {
    session_id: String,
    execution_id: String,
    mem_alloc_gib: f64,
    billable: bool,
    /// Time up to which time-based counters have accrued.
    accrued_to: i64,
    /// Start of the interval the next record covers.
    record_start: i64,
    billed_ms: i64,
    mem_alloc_gib_ms: f64,
    mem_resident_gib_ms: f64,
    vcpu_ns: u64,
    disk_bytes: u64,
    last_rss_gib: f64,
    raw_cpu_ns: Option<u64>,
    raw_disk: Option<u64>,
    /// Cumulative network counters.
    net: NetIo,
    /// The last raw network reading (`None`: the next one is a baseline).
    raw_net: Option<NetIo>,
    /// Snapshot storage held for the session now, GiB, and its cumulative
    /// GiB x ms (accrued whether or not the session is billable).
    snapshot_gib: f64,
    snapshot_gib_ms: f64,
    finished: bool,
}

impl Meter {
    /// A meter starting at `now` (the session's READY), billable from then.
    pub fn start(session_id: &str, execution_id: &str, mem_mib: u32, now: i64) -> Meter {
        Meter {
            session_id: session_id.to_string(),
            execution_id: execution_id.to_string(),
            mem_alloc_gib: f64::from(mem_mib) / 1024.0,
            billable: true,
            accrued_to: now,
            record_start: now,
            billed_ms: 0,
            mem_alloc_gib_ms: 0.0,
            mem_resident_gib_ms: 0.0,
            vcpu_ns: 0,
            disk_bytes: 0,
            last_rss_gib: 0.0,
            raw_cpu_ns: None,
            raw_disk: None,
            net: NetIo::default(),
            // A new session's network counters (its vmm process, resolver
            // and ruleset are new) start from zero.
            raw_net: Some(NetIo::default()),
            snapshot_gib: 0.0,
            snapshot_gib_ms: 0.0,
            finished: false,
        }
    }

    /// Continues from the last persisted record (after a host-agent restart).
    /// `billable` is whether the session is billable now.
    pub fn resume_from(last: &UsageRow, mem_mib: u32, billable: bool) -> Meter {
        Meter {
            session_id: last.session_id.clone(),
            execution_id: last.execution_id.clone(),
            mem_alloc_gib: f64::from(mem_mib) / 1024.0,
            billable,
            accrued_to: last.interval_end,
            record_start: last.interval_end,
            billed_ms: last.billed_ms,
            mem_alloc_gib_ms: last.mem_alloc_gib_ms,
            mem_resident_gib_ms: last.mem_resident_gib_ms,
            vcpu_ns: last.vcpu_ns,
            disk_bytes: last.disk_bytes,
            last_rss_gib: 0.0,
            raw_cpu_ns: Some(last.raw_cpu_ns),
            raw_disk: Some(last.raw_disk),
            net: last.net,
            // The raw network counters are not kept: the first reading after
            // a restart is a baseline (what moved since the last record is
            // not counted).
            raw_net: None,
            // Measured again at the next record.
            snapshot_gib: 0.0,
            snapshot_gib_ms: last.snapshot_gib_ms,
            finished: last.is_final,
        }
    }

    /// Whether the final record was produced.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Sets the execution id carried by later records.
    pub fn set_execution_id(&mut self, execution_id: &str) {
        self.execution_id = execution_id.to_string();
    }

    /// The VM moves to a new process (a restore): its counters start from
    /// zero, so the next reading is a baseline, not a delta.
    pub fn new_process(&mut self) {
        self.raw_cpu_ns = None;
        self.raw_disk = None;
    }

    fn accrue(&mut self, now: i64) {
        let now = now.max(self.accrued_to);
        let dt = now - self.accrued_to;
        if self.billable && dt > 0 {
            self.billed_ms += dt;
            self.mem_alloc_gib_ms += self.mem_alloc_gib * dt as f64;
            self.mem_resident_gib_ms += self.last_rss_gib * dt as f64;
        }
        if dt > 0 {
            self.snapshot_gib_ms += self.snapshot_gib * dt as f64;
        }
        self.accrued_to = now;
    }

    /// The session holds `bytes` of snapshot storage from `now` on (the
    /// time before is accrued at the previous size).
    pub fn set_snapshot_bytes(&mut self, now: i64, bytes: u64) {
        self.accrue(now);
        self.snapshot_gib = bytes as f64 / GIB;
    }

    /// Marks the session billable or not from `now` on (READY/RUNNING are
    /// billable; PAUSED, snapshotting, restoring and stopping are not).
    pub fn set_billable(&mut self, now: i64, billable: bool) {
        self.accrue(now);
        self.billable = billable;
    }

    /// Absorbs a raw network reading: each counter grows by what it grew
    /// since the last one (a counter that went down was reset, by a new
    /// vmm process, resolver or ruleset, and counts from zero).
    pub fn absorb_net(&mut self, reading: NetIo) {
        if let Some(prev) = self.raw_net {
            let mut total = self.net.fields();
            for (i, (now, before)) in reading.fields().into_iter().zip(prev.fields()).enumerate() {
                let delta = if now >= before { now - before } else { now };
                total[i] = total[i].saturating_add(delta);
            }
            self.net = NetIo::from_fields(total);
        }
        self.raw_net = Some(reading);
    }

    /// The cumulative network counters.
    pub fn net(&self) -> NetIo {
        self.net
    }

    /// The network counters' next reading is a baseline (the VM's network
    /// counters moved to a new process).
    pub fn new_net_baseline(&mut self) {
        self.raw_net = None;
    }

    fn absorb(&mut self, s: Option<Sample>) {
        let Some(s) = s else { return };
        // Counters of a process only grow; a smaller reading means a new
        // process (after a restore), whose counters start from zero.
        let dcpu = match self.raw_cpu_ns {
            Some(prev) if s.vcpu_cpu_ns >= prev => s.vcpu_cpu_ns - prev,
            Some(_) => s.vcpu_cpu_ns,
            None => 0,
        };
        let ddisk = match self.raw_disk {
            Some(prev) if s.disk_write_bytes >= prev => s.disk_write_bytes - prev,
            Some(_) => s.disk_write_bytes,
            None => 0,
        };
        self.vcpu_ns += dcpu;
        self.disk_bytes += ddisk;
        self.raw_cpu_ns = Some(s.vcpu_cpu_ns);
        self.raw_disk = Some(s.disk_write_bytes);
        self.last_rss_gib = s.rss_bytes as f64 / GIB;
    }

    /// Absorbs a reading without producing a record (e.g. at STOPPING,
    /// while the process still exists).
    pub fn observe(&mut self, s: Sample) {
        self.absorb(Some(s));
    }

    /// Takes a baseline reading without producing a record (at READY, so
    /// restore work is not counted).
    pub fn baseline(&mut self, s: Sample) {
        self.raw_cpu_ns = Some(s.vcpu_cpu_ns);
        self.raw_disk = Some(s.disk_write_bytes);
        self.last_rss_gib = s.rss_bytes as f64 / GIB;
    }

    /// Accrues up to `now` with the previous resident size, absorbs the new
    /// reading, and returns the record for the interval since the last one.
    pub fn record(&mut self, now: i64, sample: Option<Sample>) -> UsageRow {
        self.accrue(now);
        self.absorb(sample);
        self.emit(false)
    }

    /// The session's last record: accrues to `now`, applies the one-second
    /// minimum, and stops the meter.
    pub fn finish(&mut self, now: i64, sample: Option<Sample>) -> UsageRow {
        self.accrue(now);
        self.absorb(sample);
        self.billable = false;
        if self.billed_ms < 1000 {
            let pad = 1000 - self.billed_ms;
            self.billed_ms = 1000;
            self.mem_alloc_gib_ms += self.mem_alloc_gib * pad as f64;
            self.mem_resident_gib_ms += self.last_rss_gib * pad as f64;
        }
        self.finished = true;
        self.emit(true)
    }

    fn emit(&mut self, is_final: bool) -> UsageRow {
        let row = UsageRow {
            seq: 0,
            session_id: self.session_id.clone(),
            execution_id: self.execution_id.clone(),
            interval_start: self.record_start,
            interval_end: self.accrued_to,
            billed_ms: self.billed_ms,
            vcpu_ns: self.vcpu_ns,
            mem_alloc_gib_ms: self.mem_alloc_gib_ms,
            mem_resident_gib_ms: self.mem_resident_gib_ms,
            disk_bytes: self.disk_bytes,
            is_final,
            raw_cpu_ns: self.raw_cpu_ns.unwrap_or(0),
            raw_disk: self.raw_disk.unwrap_or(0),
            net: self.net,
            snapshot_gib_ms: self.snapshot_gib_ms,
        };
        self.record_start = self.accrued_to;
        row
    }
}

fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

/// Fields after the `(comm)` of a /proc stat line, starting at field 3.
fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    let close = stat.rfind(')')?;
    Some(stat[close + 1..].split_whitespace().collect())
}

/// utime + stime of a /proc stat line, in clock ticks.
fn stat_cpu_ticks(stat: &str) -> Option<u64> {
    let f = stat_fields(stat)?;
    // Fields 14 and 15 (1-based) are utime and stime; f[0] is field 3.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Start time of a process in clock ticks since boot (field 22), to tell a
/// re-used pid apart.
pub fn process_start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat_fields(&stat)?.get(19)?.parse().ok()
}

/// Parent of process `pid` (field 4), if it still exists.
pub fn parent_pid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat_fields(&stat)?.get(1)?.parse().ok()
}

/// Whether process `pid` is a zombie (exited, not yet reaped by its parent).
pub fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| stat_fields(&s).and_then(|f| f.first().map(|st| *st == "Z" || *st == "X")))
        .unwrap_or(false)
}

/// Reads the raw counters of process `pid`; `None` if it is gone.
pub fn read_sample(pid: u32) -> Option<Sample> {
    let base = format!("/proc/{pid}");
    let status = std::fs::read_to_string(format!("{base}/status")).ok()?;
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut ticks = 0u64;
    if let Ok(tasks) = std::fs::read_dir(format!("{base}/task")) {
        for t in tasks.flatten() {
            let dir = t.path();
            if !is_vcpu_thread(&dir) {
                continue;
            }
            if let Ok(stat) = std::fs::read_to_string(dir.join("stat")) {
                ticks += stat_cpu_ticks(&stat).unwrap_or(0);
            }
        }
    }
    let disk = std::fs::read_to_string(format!("{base}/io"))
        .ok()
        .and_then(|io| {
            io.lines()
                .find_map(|l| l.strip_prefix("write_bytes:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0);
    Some(Sample {
        vcpu_cpu_ns: ticks * (1_000_000_000 / clock_ticks_per_second()),
        rss_bytes: rss_kib * 1024,
        disk_write_bytes: disk,
    })
}

fn is_vcpu_thread(task_dir: &Path) -> bool {
    std::fs::read_to_string(task_dir.join("comm"))
        .map(|c| {
            let c = c.trim();
            c.strip_prefix("vcpu")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .unwrap_or(false)
}

/// Total memory of this node in MiB (0 if unknown).
pub fn host_memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map(|kib| kib / 1024)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: i64 = 1_700_000_000_000;

    fn sample(cpu_ms: u64, rss_mib: u64) -> Sample {
        Sample {
            vcpu_cpu_ns: cpu_ms * 1_000_000,
            rss_bytes: rss_mib << 20,
            disk_write_bytes: 0,
        }
    }

    #[test]
    fn one_second_minimum() {
        let mut m = Meter::start("s", "e", 1024, T0);
        m.baseline(sample(0, 512));
        let r = m.finish(T0 + 200, Some(sample(10, 512)));
        assert!(r.is_final);
        assert_eq!(r.billed_ms, 1000);
        assert!((r.mem_alloc_gib_ms - 1000.0).abs() < 1e-9);
        assert!((r.mem_resident_gib_ms - 500.0).abs() < 1e-9);
        assert_eq!(r.vcpu_ns, 10_000_000);
    }

    #[test]
    fn pause_is_not_billed_and_counters_are_cumulative() {
        let mut m = Meter::start("s", "e", 2048, T0);
        m.baseline(sample(0, 1024));
        let r1 = m.record(T0 + 1000, Some(sample(100, 1024)));
        assert_eq!((r1.interval_start, r1.interval_end), (T0, T0 + 1000));
        assert_eq!(r1.billed_ms, 1000);
        assert!((r1.mem_alloc_gib_ms - 2000.0).abs() < 1e-9);
        m.set_billable(T0 + 1500, false); // paused
        let r2 = m.record(T0 + 2000, Some(sample(150, 1024)));
        assert_eq!((r2.interval_start, r2.interval_end), (T0 + 1000, T0 + 2000));
        assert_eq!(r2.billed_ms, 1500);
        let r3 = m.record(T0 + 10_000, Some(sample(150, 1024)));
        assert_eq!(r3.billed_ms, 1500, "paused time is not billed");
        m.set_billable(T0 + 10_000, true); // resumed
        let r4 = m.finish(T0 + 11_000, Some(sample(300, 1024)));
        assert_eq!(r4.billed_ms, 2500);
        assert_eq!(r4.vcpu_ns, 300_000_000);
        assert!((r4.mem_alloc_gib_ms - 5000.0).abs() < 1e-9);
        assert!((r4.mem_resident_gib_ms - 2500.0).abs() < 1e-9);
        assert_eq!(r4.interval_start, T0 + 10_000);
    }

    #[test]
    fn resume_from_a_persisted_record_continues_counters() {
        let mut m = Meter::start("s", "e", 1024, T0);
        m.baseline(sample(0, 0));
        let r1 = m.record(T0 + 3000, Some(sample(500, 0)));
        let mut m2 = Meter::resume_from(&r1, 1024, true);
        let r2 = m2.record(T0 + 5000, Some(sample(700, 0)));
        assert_eq!(r2.interval_start, T0 + 3000);
        assert_eq!(r2.billed_ms, 5000);
        assert_eq!(r2.vcpu_ns, 700_000_000);
    }

    #[test]
    fn network_counters_grow_by_their_deltas_across_resets_and_restarts() {
        let io = |rx: u64, denied: u64, dns: u64| NetIo {
            rx_bytes: rx,
            rx_packets: rx / 100,
            denied_packets: denied,
            dns_denied: dns,
            ..Default::default()
        };
        let mut m = Meter::start("s", "e", 1024, T0);
        // From zero: the first reading counts whole.
        m.absorb_net(io(1000, 2, 1));
        let r1 = m.record(T0 + 1000, None);
        assert_eq!(r1.net, io(1000, 2, 1));
        // Deltas; no reading: no growth.
        m.absorb_net(io(1500, 2, 4));
        let r2 = m.record(T0 + 2000, None);
        assert_eq!(r2.net, io(1500, 2, 4));
        assert_eq!(m.record(T0 + 3000, None).net, io(1500, 2, 4));
        // A new vmm process and a rewritten ruleset: their counters went
        // down, and count from zero again.
        m.absorb_net(io(300, 1, 5));
        let r3 = m.record(T0 + 4000, None);
        assert_eq!(r3.net, io(1800, 3, 5));
        // After a host-agent restart the first reading is a baseline.
        let mut m2 = Meter::resume_from(&r3, 1024, true);
        m2.absorb_net(io(900, 7, 0));
        assert_eq!(m2.record(T0 + 5000, None).net, io(1800, 3, 5));
        m2.absorb_net(io(1000, 7, 2));
        let r5 = m2.finish(T0 + 6000, None);
        assert_eq!(r5.net, io(1900, 3, 7));
        assert_eq!(r5.net.rx_packets, 19);
    }

    #[test]
    fn stat_parsing_handles_parens_in_comm() {
        let line = "42 (a) b) R 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 1234 20";
        // Fields: utime is field 14 => "11"; stime field 15 => "12".
        assert_eq!(stat_cpu_ticks(line), Some(23));
        assert_eq!(stat_fields(line).unwrap()[19], "1234");
    }

    #[test]
    fn reads_own_process() {
        let s = read_sample(std::process::id()).unwrap();
        assert!(s.rss_bytes > 0);
        assert!(process_start_ticks(std::process::id()).is_some());
    }
}
