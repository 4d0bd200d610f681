//! Group `soak` (opt-in: never in a plain run): is there an SMP or a
//! restore bug in the vmm behind the rare guest CPU crashes seen under
//! nested emulation? Each scenario repeats one thing N times (`--soak-n` or
//! `RG_SOAK_N` on the host, passed to the runner in the work directory's
//! `soak.json`) and counts how each iteration ended: passed, crashed (a
//! triple fault or a KVM internal error in the vmm's words), stalled (a
//! deadline passed) or failed otherwise.
//!
//! * `soak-smp-boots`: a 2-vCPU guest on the cloud kernel in the virtio
//!   group's mode (two disks, rng, net on the group's tap with the TCP ack
//!   server, 10 MiB of vsock each way), booted to `RG-DONE` and a clean exit,
//!   N times in a row.
//! * `soak-smp-restores`: a 2-vCPU guest in the probe's `tick` mode (every
//!   second a disk write and sync, an rng read and a TCP exchange; a vsock
//!   echo server), then N cycles of pause, full snapshot, restore paused in
//!   a new vmm (`--memory-backend` file and uffd alternately), resume, new
//!   ticks in order and a vsock echo. A cycle that fails ends its guest; the
//!   next boots a fresh one.
//!
//! The iterations that did not pass keep their guests' consoles and vmm
//! stderr in the group's logs folder under names with their index; the
//! vmm's `vCPU N at the failure: ...` lines of every crash are printed as
//! info lines and gathered in `<scenario>.crashes` there. The scenario
//! passes only when all N passed. Its result is final: the harness reruns a
//! scenario whose guest crashed once (`report::guest_cpu_crash`) in a fresh
//! outer VM, but a soak's crashes are what it counts, so its detail names
//! them in words that rule does not take for a crash (see [`neutral`]).
//! (Over 700 lines: its two scenarios share the tally, the crash records and
//! the log keeping below; splitting it is left for when a third soak comes.)

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vmm_api::command::{DiskSpec, NetSpec};
use vmm_api::{RestoreSpec, SnapshotKind, VsockSpec};

use super::checks::bad_kernel_messages;
use super::snapshot::{self, tick};
use super::virtio::network;
use super::{probe_args, BASE_CMDLINE};
use crate::catalogue::{SoakSettings, SOAK_BOOT_SECS, SOAK_CYCLE_SECS};
use crate::inner::vm::Guest;
use crate::inner::vsock::{self, Received};
use crate::inner::{net, Check, Ctx, INFRA_MARK};
use crate::report::guest_cpu_crash;

/// vCPUs of every soak guest: two is what the crashes were seen with.
const VCPUS: u8 = 2;
/// Bytes sent each way over vsock by each boot (as the virtio group does).
const VSOCK_BYTES: usize = 10 << 20;
/// Bytes echoed over vsock after each restore.
const ECHO_BYTES: usize = 256 << 10;
/// A boot's waits: to the guest's vsock listener (modules, disk, network
/// and 10 MiB guest->host before it), to `RG-DONE`, to the vmm's exit.
const TO_LISTENING: Duration = Duration::from_secs(300);
const TO_DONE: Duration = Duration::from_secs(240);
const TO_EXIT: Duration = Duration::from_secs(60);
/// A vsock connection's handshake, and each read or write on it.
const VSOCK_WAIT: Duration = Duration::from_secs(120);
/// A fresh ticking guest's wait for its third tick.
const TO_TICKING: Duration = Duration::from_secs(300);
/// After a resume, the wait for the guest's first new tick (the progress
/// deadline: none is a stall), and then for [`NEW_TICKS`] of them.
const TO_NEW_OUTPUT: Duration = Duration::from_secs(180);
const TO_MORE_TICKS: Duration = Duration::from_secs(180);
/// Ticks a restored guest prints past the last one before the pause.
const NEW_TICKS: u64 = 4;
/// A progress line every so many iterations (and after each that failed).
const PROGRESS_EVERY: u32 = 5;
/// Iterations listed by name per outcome in the result.
const LISTED: usize = 5;
/// Characters of a stall's or failure's reason kept in the result.
const REASON_CHARS: usize = 240;
/// Console lines of a kernel in trouble (its emergency, alert and error
/// messages reach the console despite `quiet`).
const KERNEL_TROUBLE: &[&str] = &["Kernel panic", "BUG:", "Oops", "general protection fault"];

/// How an iteration that did not pass ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The guest died at the CPU level ([`guest_cpu_crash`]).
    Crashed,
    /// A deadline passed: no console line, no exit, or the outer VM's
    /// recognised emulation stall.
    Stalled,
    /// Anything else.
    Failed,
}

/// An iteration that did not pass.
#[derive(Debug, Clone, PartialEq)]
struct Problem {
    kind: Kind,
    /// Short: the vmm's reason and vCPU state for a crash, the first
    /// [`REASON_CHARS`] of the reason otherwise.
    what: String,
}

/// Why an iteration that failed with `reason` did, given its guests' vmm
/// stderr (`stderr`, all of them).
fn classify(reason: &str, stderr: &str) -> Problem {
    if guest_cpu_crash(reason) || guest_cpu_crash(stderr) {
        return Problem {
            kind: Kind::Crashed,
            what: crash_digest(reason, stderr),
        };
    }
    let stalled = reason.contains(INFRA_MARK)
        || reason.contains(" not seen within ")
        || reason.contains("did not exit within");
    Problem {
        kind: if stalled { Kind::Stalled } else { Kind::Failed },
        what: shortened(reason, REASON_CHARS),
    }
}

/// `text` on one line, cut to `max` characters.
fn shortened(text: &str, max: usize) -> String {
    let line = crate::report::one_line(text);
    match line.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &line[..at]),
        None => line,
    }
}

/// The vmm's `vCPU N at the failure: ...` lines in its stderr, from `vCPU`
/// on (without the log's time and level).
fn failure_lines(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter_map(|l| {
            let at = l.find(" at the failure: ")?;
            let start = l[..at].rfind("vCPU ")?;
            Some(l[start..].trim_end().to_string())
        })
        .collect()
}

/// What the vmm said the VM failed of (`vmm: VM failed: <this>`).
fn failed_of(text: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (_, why) = l.split_once("VM failed: ")?;
        // In a failure's reason the vmm's lines are joined by " | " and the
        // reason's parts by "; ".
        let end = [" | ", "; "]
            .iter()
            .filter_map(|sep| why.find(sep))
            .min()
            .unwrap_or(why.len());
        let why = why[..end].trim();
        guest_cpu_crash(why).then(|| why.to_string())
    })
}

/// A crash in short: the vmm's reason, and for each `vCPU N at the failure`
/// line its rip and how many exits the vCPU made since the vmm set its
/// state (none: the state the vmm wrote faulted).
fn crash_digest(reason: &str, stderr: &str) -> String {
    let why = failed_of(stderr)
        .or_else(|| failed_of(reason))
        .unwrap_or_else(|| "a CPU-level crash".into());
    let mut parts = vec![why];
    for line in failure_lines(stderr) {
        let vcpu = line.split(" at the failure").next().unwrap_or("vCPU ?");
        let rip = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("rip="))
            .unwrap_or("?");
        let exits = line
            .split_once("exits since the vmm set this vCPU's state: ")
            .map(|(_, n)| n.trim())
            .unwrap_or("?");
        parts.push(format!(
            "{vcpu} at rip={rip}, exits since the vmm set its state: {exits}"
        ));
    }
    parts.join("; ")
}

/// `detail` with a guest CPU crash named in words that
/// [`guest_cpu_crash`] does not match, and without the outer-VM mark: the
/// harness would otherwise rerun the whole soak in a fresh outer VM (and
/// take a pass there for the verdict) or retry it as an infrastructure
/// failure, while the counts are the verdict.
fn neutral(detail: &str) -> String {
    detail
        .replace("triple-faulted", "triple fault")
        .replace("KVM internal error on vCPU", "KVM internal error, vCPU")
        .replace(INFRA_MARK, "(outer-VM emulation stall) ")
}

/// The iterations of one soak scenario and how each ended.
struct Tally {
    /// What one iteration is called ("boot", "restore").
    noun: &'static str,
    /// Iterations asked for.
    planned: u32,
    /// Iterations run.
    ran: u32,
    passed: u32,
    /// The ones that did not pass, by index.
    problems: Vec<(u32, Problem)>,
    /// The scenario's time budget, when it ran out before all were run.
    out_of_time: Option<Duration>,
    /// Where the iterations that did not pass left their logs, and under
    /// which names.
    logs: String,
    /// Where the crashes' vCPU states are gathered.
    crashes: String,
}

impl Tally {
    fn new(noun: &'static str, planned: u32, logs: String, crashes: String) -> Tally {
        Tally {
            noun,
            planned,
            ran: 0,
            passed: 0,
            problems: Vec::new(),
            out_of_time: None,
            logs,
            crashes,
        }
    }

    fn record(&mut self, index: u32, result: Result<(), Problem>) {
        self.ran += 1;
        match result {
            Ok(()) => self.passed += 1,
            Err(p) => self.problems.push((index, p)),
        }
    }

    fn of(&self, kind: Kind) -> Vec<&(u32, Problem)> {
        self.problems
            .iter()
            .filter(|(_, p)| p.kind == kind)
            .collect()
    }

    fn all_passed(&self) -> bool {
        self.ran == self.planned && self.passed == self.planned
    }

    /// `N passed, N crashed, N stalled, N failed otherwise`.
    fn counts(&self) -> String {
        format!(
            "{} passed, {} crashed, {} stalled, {} failed otherwise",
            self.passed,
            self.of(Kind::Crashed).len(),
            self.of(Kind::Stalled).len(),
            self.of(Kind::Failed).len()
        )
    }

    /// The progress line after iteration `ran`.
    fn progress(&self) -> String {
        format!(
            "{}/{} {}s: {}",
            self.ran,
            self.planned,
            self.noun,
            self.counts()
        )
    }

    /// ` (boot 3: why; boot 9: why; and 2 more)`, or nothing.
    fn listed(&self, kind: Kind) -> String {
        let all = self.of(kind);
        if all.is_empty() {
            return String::new();
        }
        let mut items: Vec<String> = all
            .iter()
            .take(LISTED)
            .map(|(i, p)| format!("{} {i}: {}", self.noun, p.what))
            .collect();
        if all.len() > LISTED {
            items.push(format!("and {} more", all.len() - LISTED));
        }
        format!(" ({})", items.join("; "))
    }

    /// The scenario's result: the counts, the iterations that did not pass
    /// and where their logs are.
    fn summary(&self) -> String {
        let mut s = match self.out_of_time {
            Some(budget) if self.ran < self.planned => format!(
                "{} of {} {}s ran before the scenario's budget of {} min was spent",
                self.ran,
                self.planned,
                self.noun,
                budget.as_secs() / 60
            ),
            _ => format!("{} {}s", self.ran, self.noun),
        };
        s.push_str(&format!(
            ": {} passed, {} crashed{}, {} stalled{}, {} failed otherwise{}",
            self.passed,
            self.of(Kind::Crashed).len(),
            self.listed(Kind::Crashed),
            self.of(Kind::Stalled).len(),
            self.listed(Kind::Stalled),
            self.of(Kind::Failed).len(),
            self.listed(Kind::Failed),
        ));
        if self.problems.is_empty() {
            s.push_str("; no logs kept (only those of iterations that do not pass are)");
        } else {
            s.push_str(&format!(
                "; consoles and vmm stderr of the {}s that did not pass in {}",
                self.noun, self.logs
            ));
        }
        if !self.of(Kind::Crashed).is_empty() {
            s.push_str(&format!(
                "; the vmm's vCPU states at the crashes in {}",
                self.crashes
            ));
        }
        s
    }
}

/// The files a guest called `name` leaves: in the scratch space (console,
/// stderr, control socket, vsock sockets) and, unless `keep`, the copies of
/// its console and stderr (and a hang report) in the logs folder.
fn forget(ctx: &Ctx, name: &str, keep: bool) {
    for ext in ["console", "stderr", "ctl", "vsock", "vsock_5000"] {
        let _ = std::fs::remove_file(ctx.scratch.join(format!("{name}.{ext}")));
    }
    if !keep {
        for ext in ["console", "stderr", "hang"] {
            let _ = std::fs::remove_file(ctx.out.join(format!("{name}.{ext}")));
        }
    }
}

/// The stderr of the guests called `names`, one after the other.
fn stderr_of(ctx: &Ctx, names: &[String]) -> String {
    names
        .iter()
        .map(|n| {
            std::fs::read_to_string(ctx.scratch.join(format!("{n}.stderr"))).unwrap_or_default()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Files iteration `index`'s end: counts it, and for a crash prints the
/// vmm's vCPU states and adds them to the crashes file; prints a progress
/// line every [`PROGRESS_EVERY`] iterations and after each that failed.
fn settle(
    ctx: &Ctx,
    scenario: &str,
    tally: &mut Tally,
    index: u32,
    result: Result<(), Problem>,
    stderr: &str,
    secs: f64,
) {
    if let Err(p) = &result {
        ctx.info(
            scenario,
            &neutral(&format!(
                "{} {index}: {:?} after {secs:.0} s: {}",
                tally.noun, p.kind, p.what
            )),
        );
        if p.kind == Kind::Crashed {
            let lines = failure_lines(stderr);
            let mut entry = format!("{} {index}: {}\n", tally.noun, p.what);
            for l in &lines {
                ctx.info(scenario, &neutral(l));
                entry.push_str(l);
                entry.push('\n');
            }
            let path = ctx.out.join(format!("{scenario}.crashes"));
            let appended = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .and_then(|mut f| f.write_all(entry.as_bytes()));
            if let Err(e) = appended {
                ctx.info(scenario, &format!("{}: {e}", path.display()));
            }
        }
    }
    let failed = result.is_err();
    tally.record(index, result);
    if failed || index % PROGRESS_EVERY == 0 {
        ctx.info(scenario, &tally.progress());
    }
}

/// Sends `data` to guest port `port` through the vsock device socket `uds`
/// and ends the write side, reading what the guest sends back meanwhile (an
/// echo server writes while it reads); every read and write is bounded by
/// [`VSOCK_WAIT`], and reads wait on while the writer still makes progress.
fn exchange(uds: &Path, port: u32, data: &[u8]) -> Result<Vec<u8>, String> {
    let mut stream = vsock::connect(uds, port, VSOCK_WAIT)?;
    stream
        .set_write_timeout(Some(VSOCK_WAIT))
        .map_err(|e| format!("vsock socket: {e}"))?;
    let mut writer = stream
        .try_clone()
        .map_err(|e| format!("vsock socket: {e}"))?;
    let writing = AtomicBool::new(true);
    std::thread::scope(|scope| {
        let wrote = scope.spawn(|| {
            let r = writer
                .write_all(data)
                .and_then(|_| writer.shutdown(std::net::Shutdown::Write))
                .map_err(|e| format!("sending {} bytes to port {port}: {e}", data.len()));
            writing.store(false, Ordering::SeqCst);
            r
        });
        let mut back = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        let read = loop {
            match stream.read(&mut buf) {
                Ok(0) => break Ok(()),
                Ok(n) => back.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) && writing.load(Ordering::SeqCst) => {}
                Err(e) => {
                    let _ = stream.shutdown(std::net::Shutdown::Both);
                    break Err(format!(
                        "reading port {port}'s answer: {e} (after {} bytes)",
                        back.len()
                    ));
                }
            }
        };
        let wrote = wrote
            .join()
            .unwrap_or_else(|_| Err("the vsock writer panicked".into()));
        wrote.and(read).map(|_| back)
    })
}

/// The cloud kernel's vmlinux.
fn cloud_vmlinux(ctx: &Ctx) -> Result<PathBuf, String> {
    ctx.env
        .cloud
        .vmlinux
        .clone()
        .ok_or_else(|| "no cloud vmlinux was prepared".to_string())
}

/// The value after `key ` in the guest's output.
fn said(lines: &[String], key: &str) -> String {
    let prefix = format!("{key} ");
    lines
        .iter()
        .find_map(|l| l.split_once(&prefix).map(|(_, v)| v.trim().to_string()))
        .unwrap_or_default()
}

/// Console lines of a kernel in trouble, and warnings it reported.
fn kernel_trouble(lines: &[String]) -> Vec<String> {
    let mut bad: Vec<String> = lines
        .iter()
        .filter(|l| !l.contains("RG-DMESG: ") && KERNEL_TROUBLE.iter().any(|k| l.contains(k)))
        .cloned()
        .collect();
    bad.extend(bad_kernel_messages(lines));
    bad
}

/// What a boot's guest reported of its traffic, against what the host saw:
/// `received` the guest->host vsock data, `sent` the host->guest transfer
/// (with `sent_sha` its hash). Empty when all of it went through.
fn boot_traffic_problems(
    lines: &[String],
    received: &Result<Received, String>,
    sent: &Result<Vec<u8>, String>,
    sent_sha: &str,
) -> Vec<String> {
    let mut problems = Vec::new();
    if said(lines, "RG-BLK-UMOUNT") != "ok" {
        problems.push(format!(
            "disk: the guest read {:?}, wrote {:?} and did not unmount it",
            said(lines, "RG-BLK-READ"),
            said(lines, "RG-BLK-WROTE")
        ));
    }
    let ping = said(lines, "RG-NET-PING");
    if ping != "ok" {
        problems.push(format!("ping {}: {ping:?}", net::HOST_IP));
    }
    let tcp = said(lines, "RG-NET-TCP");
    if !tcp.contains("ack hello-from-guest") {
        problems.push(format!("TCP to {}: the guest got {tcp:?}", net::HOST_IP));
    }
    let g2h = said(lines, "RG-VSOCK-G2H-SENT");
    match received {
        Ok(r) if r.len == VSOCK_BYTES && r.sha256 == g2h => {}
        Ok(r) => problems.push(format!(
            "vsock guest->host: the guest sent sha256 {g2h:?}, the host got {} bytes with {}",
            r.len, r.sha256
        )),
        Err(e) => problems.push(format!("vsock guest->host: {e}")),
    }
    if let Err(e) = sent {
        problems.push(format!("vsock host->guest: {e}"));
    }
    let got = said(lines, "RG-VSOCK-H2G-GOT");
    let want = format!("rc=0 bytes={VSOCK_BYTES} sha256={sent_sha}");
    if !got.starts_with(&want) {
        problems.push(format!(
            "vsock host->guest: the guest reports {got:?}, expected {want}"
        ));
    }
    let trouble = kernel_trouble(lines);
    if !trouble.is_empty() {
        problems.push(format!("kernel: {}", trouble.join(" / ")));
    }
    problems
}

/// One boot of the 2-vCPU virtio guest called `name`, to `RG-DONE` and a
/// clean exit, with its traffic checked.
fn one_boot(ctx: &Ctx, name: &str, tap: &str, data: &[u8], sha: &str) -> Result<(), String> {
    let kernel = cloud_vmlinux(ctx)?;
    let rw = ctx.scratch.join(format!("{name}-rw.ext4"));
    let ro = ctx.scratch.join(format!("{name}-ro.ext4"));
    for d in [&rw, &ro] {
        std::fs::copy(&ctx.env.test_disk, d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    let result = (|| {
        let uds = ctx.scratch.join(format!("{name}.vsock"));
        // Bounded by its own deadline; left to it when the guest never
        // gets as far as its transfer.
        let receiver = vsock::receive_one(&uds, 5000, TO_LISTENING)?;
        let cmdline = format!(
            "{BASE_CMDLINE} rg.mode=virtio rg.ip={} rg.peer={}",
            net::GUEST_CIDR,
            net::HOST_IP
        );
        let mut args = probe_args(&kernel, &ctx.env.cloud.probe_initrd, VCPUS, &cmdline);
        args.devices.disks = vec![DiskSpec::rw(&rw), DiskSpec::ro(ro.clone())];
        args.devices.rng = true;
        args.devices.net = Some(NetSpec::tap(tap));
        args.devices.vsock = Some(VsockSpec {
            cid: 3,
            uds: uds.clone(),
        });
        let mut g = Guest::start(ctx, name, args)?;
        g.wait_for("RG-VSOCK-LISTENING", TO_LISTENING)?;
        // The guest sent its bytes and read the answer before it listened.
        let received = receiver
            .join()
            .unwrap_or_else(|_| Err("the vsock listener thread panicked".into()));
        // A failed transfer is judged after the guest's own end, which
        // tells a crash from a host-side failure.
        let sent = exchange(&uds, 1024, data);
        g.wait_for("RG-DONE", TO_DONE)?;
        g.expect_clean_exit(TO_EXIT)?;
        let problems = boot_traffic_problems(&g.lines(), &received, &sent, sha);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    })();
    for d in [&rw, &ro] {
        let _ = std::fs::remove_file(d);
    }
    result
}

/// The scenario's settings and its time budget (`per` seconds an iteration).
fn settings_and_budget(ctx: &Ctx, per: u64) -> Result<(SoakSettings, Duration), String> {
    let settings = SoakSettings::load(&ctx.env.work)?;
    Ok((settings, Duration::from_secs(per * u64::from(settings.n))))
}

/// `soak-smp-boots`: N boots of a 2-vCPU guest with block, net and vsock
/// traffic, each to `RG-DONE` and a clean exit.
pub fn smp_boots(ctx: &mut Ctx, name: &str) -> Check {
    let (settings, budget) = settings_and_budget(ctx, SOAK_BOOT_SECS)?;
    let (tap, _) = network(&mut ctx.fixtures)?;
    let data = vsock::random_bytes(VSOCK_BYTES)?;
    let sha = vsock::sha256(&data);
    let mut tally = Tally::new(
        "boot",
        settings.n,
        format!(
            "{} (soak-boot-NNN.console, .stderr, .hang)",
            ctx.out.display()
        ),
        ctx.out
            .join(format!("{name}.crashes"))
            .display()
            .to_string(),
    );
    ctx.info(
        name,
        &format!(
            "{} boots of a {VCPUS}-vCPU virtio guest; none started after {} min",
            settings.n,
            budget.as_secs() / 60
        ),
    );
    let t0 = Instant::now();
    for i in 1..=settings.n {
        if t0.elapsed() >= budget {
            tally.out_of_time = Some(budget);
            break;
        }
        let started = Instant::now();
        let guest = format!("soak-boot-{i:03}");
        let result = one_boot(ctx, &guest, &tap, &data, &sha);
        let stderr = stderr_of(ctx, std::slice::from_ref(&guest));
        let result = result.map_err(|reason| classify(&reason, &stderr));
        forget(ctx, &guest, result.is_err());
        let secs = started.elapsed().as_secs_f64();
        settle(ctx, name, &mut tally, i, result, &stderr, secs);
    }
    let detail = neutral(&tally.summary());
    if tally.all_passed() {
        Ok(detail)
    } else {
        Err(detail)
    }
}

/// The last tick a guest printed (its console's last line may be cut by
/// the pause: a cut tick parses as itself or not at all).
fn last_tick(lines: &[String]) -> Option<(u64, f64)> {
    lines.iter().filter_map(|l| tick(l)).max_by_key(|t| t.0)
}

/// What is wrong with a restored guest's console `lines`, the last tick
/// before the pause being `last`: the ticks must go on from there in order
/// with a rising uptime, each with its disk write, one after the first with
/// a TCP answer; and the kernel must not be in trouble.
fn tick_problems(lines: &[String], last: (u64, f64)) -> Vec<String> {
    let mut problems = snapshot::tick_problems(lines, last, 1);
    let trouble = kernel_trouble(lines);
    if !trouble.is_empty() {
        problems.push(format!("kernel: {}", trouble.join(" / ")));
    }
    problems
}

/// The memory back end of restore cycle `index` (1-based): file, uffd, ...
fn backend(index: u32) -> &'static str {
    if index % 2 == 1 {
        "file"
    } else {
        "uffd"
    }
}

/// `vmm restore` of cycle `index`: paused, on its back end, the same devices.
fn restore_spec(snapshot: &Path, index: u32, disk: &Path, uds: &Path) -> RestoreSpec {
    let mut spec = RestoreSpec::new(snapshot);
    spec.memory_backend = Some(backend(index).into());
    spec.paused = true;
    spec.devices = snapshot::device_args(disk, uds);
    spec
}

/// The chain of restores: the guest running now and the snapshot it was
/// restored from (its memory may still be mapped from it).
#[derive(Default)]
struct Chain {
    guest: Option<Guest>,
    snapshot: Option<PathBuf>,
}

/// The snapshot directories of the restore scenario in the scratch space.
fn snapshot_dirs(ctx: &Ctx) -> Vec<PathBuf> {
    std::fs::read_dir(&ctx.scratch)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("soak-snap-"))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The disk of the restore scenario's guests (one chain at a time).
fn chain_disk(ctx: &Ctx) -> PathBuf {
    ctx.scratch.join("soak-restore.ext4")
}

/// Restore cycle `index`: a running guest (a fresh one when the chain has
/// none) is paused after a new tick, snapshotted and stopped; a new vmm
/// restores it paused, resumes it, and it must tick on and echo over vsock.
/// The guests it ran are added to `involved`; the restored one is left
/// running in `chain` when the cycle passed.
fn cycle(
    ctx: &Ctx,
    index: u32,
    chain: &mut Chain,
    involved: &mut Vec<String>,
) -> Result<(), String> {
    let disk = chain_disk(ctx);
    let mut old = match chain.guest.take() {
        Some(g) => g,
        None => {
            let name = format!("soak-restore-{index:03}-boot");
            involved.push(name.clone());
            std::fs::copy(&ctx.env.test_disk, &disk)
                .map_err(|e| format!("{}: {e}", disk.display()))?;
            let kernel = cloud_vmlinux(ctx)?;
            let cmdline = format!(
                "{BASE_CMDLINE} rg.mode=tick rg.end=none rg.ip={} rg.peer={}",
                net::GUEST_CIDR,
                net::HOST_IP
            );
            let mut args = probe_args(&kernel, &ctx.env.cloud.probe_initrd, VCPUS, &cmdline);
            args.devices = snapshot::device_args(&disk, &ctx.scratch.join(format!("{name}.vsock")));
            let mut g = Guest::start(ctx, &name, args)?;
            g.wait_for("RG-TICK 3 ", TO_TICKING)
                .map_err(|e| format!("the fresh guest to snapshot: {e}"))?;
            g
        }
    };
    if !involved.contains(&old.name) {
        involved.push(old.name.clone());
    }
    // Paused right after a new tick begins: its disk write, rng read and TCP
    // connection are under way.
    let from = old.lines().len();
    old.wait_from(from, "RG-TICK ", TO_NEW_OUTPUT)?;
    old.pause()?;
    let snap = ctx.scratch.join(format!("soak-snap-{index:03}"));
    let _ = std::fs::remove_dir_all(&snap);
    old.snapshot(&snap, SnapshotKind::Full)?;
    old.stop()?;
    old.expect_clean_exit(TO_EXIT)?;
    let last = last_tick(&old.lines()).ok_or("no tick before the pause")?;
    drop(old);
    // Nothing maps the snapshot the old guest came from any more.
    if let Some(done) = chain.snapshot.replace(snap.clone()) {
        let _ = std::fs::remove_dir_all(done);
    }
    let name = format!("soak-restore-{index:03}");
    involved.push(name.clone());
    let uds = ctx.scratch.join(format!("{name}.vsock"));
    let mut g = Guest::start(ctx, &name, restore_spec(&snap, index, &disk, &uds))?;
    g.status()
        .map_err(|e| format!("the restore on {}: {e}", backend(index)))?;
    g.resume()?;
    g.wait_from(0, "RG-TICK ", TO_NEW_OUTPUT)
        .map_err(|e| format!("no progress after the resume: {e}"))?;
    g.wait_from(
        0,
        &format!("RG-TICK {} ", last.0 + NEW_TICKS),
        TO_MORE_TICKS,
    )?;
    let mut problems = tick_problems(&g.lines(), last);
    let echo = vsock::random_bytes(ECHO_BYTES)?;
    match exchange(&uds, 1024, &echo) {
        Ok(back) if back == echo => {}
        Ok(back) => problems.push(format!(
            "vsock echo: {} bytes back for {} sent, {}",
            back.len(),
            echo.len(),
            if back.len() == echo.len() {
                "different"
            } else {
                "a different count"
            }
        )),
        Err(e) => problems.push(format!("vsock echo: {e}")),
    }
    if !problems.is_empty() {
        return Err(format!(
            "after the restore on {}: {}",
            backend(index),
            problems.join("; ")
        ));
    }
    chain.guest = Some(g);
    Ok(())
}

/// `soak-smp-restores`: N cycles of pause, full snapshot, restore into a new
/// vmm (file and uffd alternately) and resume of a 2-vCPU guest doing disk,
/// rng, TCP and vsock I/O, each with the guest making progress after it.
pub fn smp_restores(ctx: &mut Ctx, name: &str) -> Check {
    let (settings, budget) = settings_and_budget(ctx, SOAK_CYCLE_SECS)?;
    network(&mut ctx.fixtures)?;
    let mut tally = Tally::new(
        "restore",
        settings.n,
        format!(
            "{} (soak-restore-NNN.console, .stderr, .hang: the guest restored in cycle NNN; \
             soak-restore-NNN-boot.*: a fresh guest booted for it)",
            ctx.out.display()
        ),
        ctx.out
            .join(format!("{name}.crashes"))
            .display()
            .to_string(),
    );
    ctx.info(
        name,
        &format!(
            "{} pause/snapshot/restore/resume cycles of a {VCPUS}-vCPU guest (file and uffd \
             alternately); none started after {} min",
            settings.n,
            budget.as_secs() / 60
        ),
    );
    let mut chain = Chain::default();
    let t0 = Instant::now();
    for i in 1..=settings.n {
        if t0.elapsed() >= budget {
            tally.out_of_time = Some(budget);
            break;
        }
        let started = Instant::now();
        let mut involved = Vec::new();
        let result = cycle(ctx, i, &mut chain, &mut involved);
        let live = chain.guest.as_ref().map(|g| g.name.clone());
        let stderr = stderr_of(ctx, &involved);
        let result = result.map_err(|reason| {
            // The chain starts over from a fresh guest.
            chain.guest = None;
            chain.snapshot = None;
            for dir in snapshot_dirs(ctx) {
                let _ = std::fs::remove_dir_all(dir);
            }
            classify(&reason, &stderr)
        });
        // The guest left running keeps its files until its own cycle ends.
        for g in involved.iter().filter(|g| Some(*g) != live.as_ref()) {
            forget(ctx, g, result.is_err());
        }
        let secs = started.elapsed().as_secs_f64();
        settle(ctx, name, &mut tally, i, result, &stderr, secs);
    }
    if let Some(mut g) = chain.guest.take() {
        let name = g.name.clone();
        let ended = g.stop().and_then(|_| g.expect_clean_exit(TO_EXIT));
        drop(g);
        forget(ctx, &name, ended.is_err());
    }
    for dir in snapshot_dirs(ctx) {
        let _ = std::fs::remove_dir_all(dir);
    }
    let _ = std::fs::remove_file(chain_disk(ctx));
    let detail = neutral(&tally.summary());
    if tally.all_passed() {
        Ok(detail)
    } else {
        Err(detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{filing, Filing, Outcome, Status};

    fn lines(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// What the vmm's stderr holds after a triple fault.
    const TRIPLE: &str = "2025-01-01T00:00:00Z ERROR vmm::vcpu: vCPU 1 at the failure: \
        rip=0xfff0 rsp=0x0 rflags=0x2 (the reset state: ...); interrupt: none\
        ; last exits: hlt, io_out 0x3f8; exits since the vmm set this vCPU's state: 8812\n\
        2025-01-01T00:00:00Z ERROR vmm: VM failed kind=\"triple_fault\"\n\
        vmm: VM failed: vCPU 1 triple-faulted\n";

    #[test]
    fn outcomes_are_told_apart() {
        let console_ended = "the guest's console ended (vmm exit status: 1) before \"RG-DONE\"; \
            vmm stderr: vmm: VM failed: vCPU 1 triple-faulted; console tail: x";
        let crash = classify(console_ended, TRIPLE);
        assert_eq!(crash.kind, Kind::Crashed);
        assert_eq!(
            crash.what,
            "vCPU 1 triple-faulted; vCPU 1 at rip=0xfff0, exits since the vmm set its state: 8812"
        );
        // Found in the reason alone (stderr unreadable) too.
        let crash = classify(console_ended, "");
        assert_eq!(crash.kind, Kind::Crashed);
        assert_eq!(crash.what, "vCPU 1 triple-faulted");
        let internal = classify(
            "x",
            "vmm: VM failed: KVM internal error on vCPU 0: suberror 1 (emulation failure)",
        );
        assert_eq!(internal.kind, Kind::Crashed);
        assert!(internal.what.starts_with("KVM internal error on vCPU 0"));

        for stall in [
            "\"RG-DONE\" not seen within 240 s; vmm threads and KVM counters in /l/x.hang",
            "the vmm did not exit within 60 s; ...",
            &format!("{INFRA_MARK}vCPU 1 spins on one nested page fault"),
        ] {
            assert_eq!(classify(stall, "").kind, Kind::Stalled, "{stall}");
        }
        let other = classify(&format!("TCP: {}", "x".repeat(500)), "vmm: started");
        assert_eq!(other.kind, Kind::Failed);
        assert_eq!(other.what.chars().count(), REASON_CHARS + 1);
    }

    #[test]
    fn the_vcpu_state_lines_are_taken_from_the_vmm_s_log() {
        let got = failure_lines(TRIPLE);
        assert_eq!(got.len(), 1);
        assert!(got[0].starts_with("vCPU 1 at the failure: rip=0xfff0"));
        assert!(got[0].ends_with("exits since the vmm set this vCPU's state: 8812"));
        assert!(failure_lines("vmm: started\nvmm: VM failed: vCPU 0 triple-faulted").is_empty());
    }

    fn tally_of(results: Vec<Result<(), Problem>>, planned: u32) -> Tally {
        let mut t = Tally::new("boot", planned, "/l/soak-1".into(), "/l/soak-1/c".into());
        for (i, r) in results.into_iter().enumerate() {
            t.record(i as u32 + 1, r);
        }
        t
    }

    fn problem(kind: Kind, what: &str) -> Result<(), Problem> {
        Err(Problem {
            kind,
            what: what.into(),
        })
    }

    #[test]
    fn all_passed_is_a_pass_with_its_counts() {
        let t = tally_of(vec![Ok(()); 3], 3);
        assert!(t.all_passed());
        assert_eq!(
            t.summary(),
            "3 boots: 3 passed, 0 crashed, 0 stalled, 0 failed otherwise; \
             no logs kept (only those of iterations that do not pass are)"
        );
        assert_eq!(
            t.progress(),
            "3/3 boots: 3 passed, 0 crashed, 0 stalled, 0 failed otherwise"
        );
    }

    #[test]
    fn the_summary_names_what_did_not_pass_and_where_its_logs_are() {
        let mut results = vec![Ok(()); 50];
        results[16] = problem(
            Kind::Crashed,
            "vCPU 1 triple-faulted; vCPU 1 at rip=0xfff0, exits since the vmm set its state: 12",
        );
        results[29] = problem(Kind::Stalled, "\"RG-DONE\" not seen within 240 s");
        let t = tally_of(results, 50);
        assert!(!t.all_passed());
        let detail = neutral(&t.summary());
        assert_eq!(
            detail,
            "50 boots: 48 passed, 1 crashed (boot 17: vCPU 1 triple fault; vCPU 1 at \
             rip=0xfff0, exits since the vmm set its state: 12), 1 stalled (boot 30: \
             \"RG-DONE\" not seen within 240 s), 0 failed otherwise; consoles and vmm stderr \
             of the boots that did not pass in /l/soak-1; the vmm's vCPU states at the \
             crashes in /l/soak-1/c"
        );
        // The soak's failure is its verdict: not a crash the harness reruns
        // in a fresh outer VM, nor an infrastructure failure.
        assert!(!guest_cpu_crash(&detail));
        let o = Outcome {
            name: "soak-smp-boots".into(),
            status: Status::Fail,
            secs: 1.0,
            detail,
        };
        assert_eq!(filing(&o, false), Filing::Final);
        let infra = neutral(&format!(
            "{INFRA_MARK}stalled; KVM internal error on vCPU 0"
        ));
        assert!(
            !infra.contains(INFRA_MARK) && !guest_cpu_crash(&infra),
            "{infra}"
        );
    }

    #[test]
    fn a_long_list_is_cut_and_a_short_run_says_it_ran_out_of_time() {
        let mut results = vec![problem(Kind::Failed, "e2fsck"); 7];
        results.push(Ok(()));
        let mut t = tally_of(results, 10);
        t.out_of_time = Some(Duration::from_secs(30 * 60));
        assert!(!t.all_passed());
        let s = t.summary();
        assert!(
            s.starts_with(
                "8 of 10 boots ran before the scenario's budget of 30 min was spent: \
                 1 passed, 0 crashed, 0 stalled, 7 failed otherwise (boot 1: e2fsck; "
            ),
            "{s}"
        );
        assert!(s.contains("boot 5: e2fsck; and 2 more)"), "{s}");
        // Every iteration run passed, but not all ran: no pass.
        let t = tally_of(vec![Ok(()); 2], 3);
        assert!(!t.all_passed());
    }

    #[test]
    fn a_boot_s_traffic_is_checked() {
        let sha = "ab".repeat(32);
        let good = lines(&[
            "RG-BLK-UMOUNT ok",
            "RG-NET-PING ok",
            "RG-NET-TCP ack hello-from-guest ",
            "RG-VSOCK-G2H-SENT cd",
            &format!("RG-VSOCK-H2G-GOT rc=0 bytes={VSOCK_BYTES} sha256={sha} "),
        ]);
        let received = Ok(Received {
            len: VSOCK_BYTES,
            sha256: "cd".into(),
        });
        let sent = Ok(Vec::new());
        assert_eq!(
            boot_traffic_problems(&good, &received, &sent, &sha),
            Vec::<String>::new()
        );
        let mut bad = good.clone();
        bad[1] = "RG-NET-PING failed: 100% packet loss".into();
        bad.push("[ 12.0] BUG: kernel NULL pointer dereference".into());
        let problems = boot_traffic_problems(&bad, &Err("no connection".into()), &sent, &sha);
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[0].starts_with("ping 172.16.0.1"));
        assert_eq!(problems[1], "vsock guest->host: no connection");
        assert!(problems[2].contains("NULL pointer"));
    }

    fn tick(n: u64, up: f64, tcp: bool) -> String {
        let tcp = if tcp {
            format!("ack tick {n} ")
        } else {
            String::new()
        };
        format!("RG-TICK {n} uptime={up} rng=00 disk=tick_{n} tcp={tcp}")
    }

    #[test]
    fn a_restored_guest_must_tick_on_in_order() {
        let before = lines(&[&tick(7, 10.0, true), "RG-TICK 8 upt"]);
        let last = last_tick(&before).expect("a tick");
        assert_eq!(last, (7, 10.0));
        let after = vec![
            "ime=11.0 rng=00".to_string(),
            tick(9, 12.0, false),
            tick(10, 13.0, true),
            tick(11, 14.0, true),
        ];
        assert_eq!(tick_problems(&after, last), Vec::<String>::new());
        let skipped = vec![tick(9, 12.0, false), tick(11, 14.0, true)];
        assert_eq!(tick_problems(&skipped, last).len(), 1);
        let replayed = vec![tick(7, 11.0, true), tick(8, 12.0, true)];
        let p = tick_problems(&replayed, last);
        assert!(p[0].contains("first tick after the resume is 7"), "{p:?}");
        let no_tcp = vec![tick(8, 12.0, true), tick(9, 13.0, false)];
        assert!(tick_problems(&no_tcp, last)[0].starts_with("no TCP answer"));
        assert_eq!(tick_problems(&[], last), ["no tick after the resume"]);
    }

    #[test]
    fn restores_alternate_back_ends_and_keep_the_devices() {
        assert_eq!([1, 2, 3, 4].map(backend), ["file", "uffd", "file", "uffd"]);
        let spec = restore_spec(
            Path::new("/s/soak-snap-002"),
            2,
            Path::new("/s/d.ext4"),
            Path::new("/s/v.sock"),
        );
        assert_eq!(
            spec.args().join(" "),
            "restore --snapshot /s/soak-snap-002 --memory-backend uffd --paused --serial stdout \
             --disk /s/d.ext4 --vsock 3:/s/v.sock --net rgtap0 --rng"
        );
    }
}
