//! Group `snapshot`: a running real guest (disk, rng, net and vsock
//! attached, ticking once a second) is snapshotted and restored in new vmm
//! processes on both memory back ends; a chain of diff snapshots restores
//! byte for byte; two clones of one snapshot do not share randomness.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use vmm_api::command::{Devices, DiskSpec, NetSpec};
use vmm_api::{RestoreSpec, RunSpec, SnapshotKind, VsockSpec};

use super::checks::bad_kernel_messages;
use super::virtio::network;
use super::{probe_args, BASE_CMDLINE};
use crate::inner::net;
use crate::inner::vm::Guest;
use crate::inner::vsock;
use crate::inner::{Check, Ctx};

const LIMIT: Duration = Duration::from_secs(300);
const TAP: &str = "rgtap0";

/// A snapshot of the ticking guest and what was true when it was taken.
pub struct TickSnapshot {
    dir: PathBuf,
    /// The disk as the snapshotted guest left it.
    disk: PathBuf,
    /// Memory checksum of the paused guest, the same before and after the
    /// snapshot was written.
    checksum: String,
    /// Last complete tick printed before the pause: (number, uptime).
    last: (u64, f64),
    /// Snapshots taken again because memory changed while one was written.
    retaken: u32,
}

/// Attempts at a snapshot during which the paused guest's memory held still.
const STILL_TRIES: u32 = 3;

/// A snapshot written while the paused guest's memory held still.
struct StillSnapshot {
    dir: PathBuf,
    /// The memory's checksum, the same before and after the write.
    checksum: String,
    /// Snapshots taken before it whose memory moved (left on disk: a later
    /// diff may descend from them).
    retaken: u32,
}

/// Pauses `g` and writes a `kind` snapshot into `dir`, checksumming guest
/// memory before and after. A paused guest's memory can still change (a
/// device completing a request made before the pause, a frame arriving for
/// it), and only when both checksums agree is it known which memory the
/// snapshot must restore to; otherwise the guest runs to its next tick and
/// the snapshot is taken again, into `dir` with `-N` appended. The guest is
/// left paused. A snapshot that restores to other memory than it held
/// still fails its check as before.
fn snapshot_held_still(
    g: &mut Guest,
    dir: &Path,
    kind: SnapshotKind,
) -> Result<StillSnapshot, String> {
    let mut moved = Vec::new();
    for attempt in 0..STILL_TRIES {
        if attempt > 0 {
            g.resume()?;
            let from = g.lines().len();
            g.wait_from(from, "RG-TICK ", LIMIT)?;
        }
        g.pause()?;
        let before = g.checksum()?;
        let target = match attempt {
            0 => dir.to_path_buf(),
            n => PathBuf::from(format!("{}-{n}", dir.display())),
        };
        g.snapshot(&target, kind)?;
        let after = g.checksum()?;
        if before == after {
            return Ok(StillSnapshot {
                dir: target,
                checksum: before,
                retaken: attempt,
            });
        }
        moved.push(format!("{before} -> {after}"));
    }
    Err(format!(
        "the paused guest's memory changed while each of {STILL_TRIES} snapshots was written ({})",
        moved.join(", ")
    ))
}

/// " (N snapshot(s) retaken: memory moved while paused)" when N > 0.
fn retaken_note(retaken: u32) -> String {
    match retaken {
        0 => String::new(),
        n => format!(" ({n} snapshot(s) retaken: memory moved while paused)"),
    }
}

/// `RG-TICK <n> uptime=<s> ...` fields: the tick's number and uptime.
pub(super) fn tick(line: &str) -> Option<(u64, f64)> {
    let rest = line.split_once("RG-TICK ")?.1;
    let mut words = rest.split_whitespace();
    let n = words.next()?.parse().ok()?;
    let up = words.next()?.strip_prefix("uptime=")?.parse().ok()?;
    Some((n, up))
}

/// What is wrong with the ticks in a restored guest's console `lines`, the
/// last tick before the pause being `last`: they must go on from there in
/// order with a rising uptime, each with its disk write, and one after the
/// first `tcp_after` with a TCP answer.
pub(super) fn tick_problems(lines: &[String], last: (u64, f64), tcp_after: usize) -> Vec<String> {
    let mut problems = Vec::new();
    let ticks: Vec<(u64, f64, &String)> = lines
        .iter()
        .filter_map(|l| tick(l).map(|(n, u)| (n, u, l)))
        .collect();
    let Some(first) = ticks.first() else {
        return vec!["no tick after the resume".into()];
    };
    // The last console line before the pause is left out (it may be cut),
    // so the first whole tick after is the next one or the one after it.
    if first.0 != last.0 + 1 && first.0 != last.0 + 2 {
        problems.push(format!(
            "the first tick after the resume is {}, the last before the pause was {}",
            first.0, last.0
        ));
    }
    if first.1 <= last.1 {
        problems.push(format!(
            "the guest's clock went back: uptime {} after, {} before",
            first.1, last.1
        ));
    }
    for w in ticks.windows(2) {
        if w[1].0 != w[0].0 + 1 || w[1].1 <= w[0].1 {
            problems.push(format!(
                "ticks out of order: {:?} then {:?}",
                w[0].2, w[1].2
            ));
        }
    }
    for (n, _, l) in &ticks {
        if !l.contains(&format!("disk=tick_{n} ")) {
            problems.push(format!("disk not written: {l}"));
        }
    }
    if !ticks
        .iter()
        .skip(tcp_after)
        .any(|(n, _, l)| l.contains(&format!("tcp=ack tick {n}")))
    {
        problems.push(format!(
            "no TCP answer from {} after the resume: {:?}",
            net::HOST_IP,
            ticks.last().map(|t| t.2)
        ));
    }
    problems
}

fn tick_args(ctx: &Ctx, disk: &Path, uds: &Path) -> Result<RunSpec, String> {
    let kernel = ctx.env.cloud.vmlinux.clone().ok_or("no cloud vmlinux")?;
    let cmdline = format!(
        "{BASE_CMDLINE} rg.mode=tick rg.end=none rg.ip={} rg.peer={}",
        net::GUEST_CIDR,
        net::HOST_IP
    );
    let mut args = probe_args(&kernel, &ctx.env.cloud.probe_initrd, 1, &cmdline);
    args.devices = device_args(disk, uds);
    Ok(args)
}

/// The ticking guest's device back ends, the same for the first boot and
/// every restore (the console on stdout).
pub(super) fn device_args(disk: &Path, uds: &Path) -> Devices {
    Devices {
        disks: vec![DiskSpec::rw(disk)],
        rng: true,
        net: Some(NetSpec::tap(TAP)),
        vsock: Some(VsockSpec {
            cid: 3,
            uds: uds.to_path_buf(),
        }),
        ..Devices::default()
    }
}

fn restore_args(
    snapshot: &Path,
    backend: &str,
    disk: &Path,
    uds: &Path,
    paused: bool,
) -> RestoreSpec {
    let mut a = RestoreSpec::new(snapshot);
    a.memory_backend = Some(backend.into());
    a.paused = paused;
    a.devices = device_args(disk, uds);
    a
}

fn copy(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::copy(from, to)
        .map(|_| ())
        .map_err(|e| format!("copying {} to {}: {e}", from.display(), to.display()))
}

/// Boots the ticking guest, lets it tick, pauses it and takes a full snapshot.
fn tick_snapshot(ctx: &mut Ctx) -> Result<&TickSnapshot, String> {
    if ctx.fixtures.tick.is_none() {
        network(&mut ctx.fixtures)?;
        let disk = ctx.scratch.join("tick.ext4");
        copy(&ctx.env.test_disk, &disk)?;
        let uds = ctx.scratch.join("tick.vsock");
        let args = tick_args(ctx, &disk, &uds)?;
        let mut g = Guest::start(ctx, "tick", args)?;
        g.wait_for("RG-TICK 3 ", LIMIT)?;
        let still =
            snapshot_held_still(&mut g, &ctx.scratch.join("tick-snap"), SnapshotKind::Full)?;
        g.stop()?;
        g.expect_clean_exit(Duration::from_secs(60))?;
        let lines = g.lines();
        // The console's last line may be cut by the pause: leave it out, so
        // the first tick after the restore is this one's next or the one after.
        let last = lines[..lines.len().saturating_sub(1)]
            .iter()
            .filter_map(|l| tick(l))
            .max_by_key(|t| t.0)
            .ok_or("no tick before the snapshot")?;
        let kept = ctx.scratch.join("tick-snap.ext4");
        copy(&disk, &kept)?;
        ctx.fixtures.tick = Some(TickSnapshot {
            dir: still.dir,
            disk: kept,
            checksum: still.checksum,
            last,
            retaken: still.retaken,
        });
    }
    ctx.fixtures
        .tick
        .as_ref()
        .ok_or_else(|| "no snapshot".into())
}

/// Restores the ticking guest on `backend` in a new vmm and checks that it
/// goes on where it was: memory untouched until it runs, ticks continuing
/// in order, its clock monotonic, disk, rng, TCP and vsock working, no
/// kernel warnings, a clean file system afterwards.
pub fn restore(ctx: &mut Ctx, name: &str, backend: &str) -> Check {
    let snap = tick_snapshot(ctx)?;
    let (dir, kept, checksum, (last_n, last_up), retaken) = (
        snap.dir.clone(),
        snap.disk.clone(),
        snap.checksum.clone(),
        snap.last,
        snap.retaken,
    );
    let disk = ctx.scratch.join(format!("{name}.ext4"));
    copy(&kept, &disk)?;
    let uds = ctx.scratch.join(format!("{name}.vsock"));
    let mut g = Guest::start(ctx, name, restore_args(&dir, backend, &disk, &uds, true))?;
    let restored_sum = g.checksum()?;
    let mut problems = Vec::new();
    if restored_sum != checksum {
        problems.push(format!(
            "memory of the restored, paused VM differs from the snapshot's (checksum {checksum} before, {restored_sum} after)"
        ));
    }
    g.resume()?;
    let (at, _) = g.wait_from(0, &format!("RG-TICK {} ", last_n + 10), LIMIT)?;
    let lines = g.lines();
    let first = lines[..=at]
        .iter()
        .find_map(|l| tick(l))
        .ok_or("no tick after the restore")?;
    // A TCP connection is made every few ticks: one from the third tick on.
    problems.extend(tick_problems(&lines[..=at], (last_n, last_up), 2));
    let echoed = vsock::send_all(&uds, 1024, b"ping-after-restore\n", Duration::from_secs(60));
    match echoed {
        Ok(back) if back == b"ping-after-restore\n" => {}
        Ok(back) => problems.push(format!(
            "vsock echo returned {:?}",
            String::from_utf8_lossy(&back)
        )),
        Err(e) => problems.push(format!("vsock after the restore: {e}")),
    }
    let bad = bad_kernel_messages(&g.lines());
    if !bad.is_empty() {
        problems.push(format!(
            "kernel warnings after the restore: {}",
            bad.join(" / ")
        ));
    }
    g.stop()?;
    g.expect_clean_exit(Duration::from_secs(60))?;
    let fsck = Command::new("e2fsck")
        .arg("-fn")
        .arg(&disk)
        .output()
        .map_err(|e| format!("e2fsck: {e}"))?;
    if !fsck.status.success() {
        problems.push(format!(
            "e2fsck: {}",
            String::from_utf8_lossy(&fsck.stdout).trim()
        ));
    }
    if problems.is_empty() {
        Ok(format!(
            "memory identical until resumed; ticks {}..{} after {last_n}; disk, rng, TCP, vsock work{}",
            first.0,
            last_n + 10,
            retaken_note(retaken)
        ))
    } else {
        Err(problems.join("; "))
    }
}

/// A full snapshot and two diffs of a running guest; each layer restores
/// (paused) to memory with the checksum taken when it was written, on both
/// back ends.
pub fn diff_chain(ctx: &mut Ctx, _name: &str) -> Check {
    let snap = tick_snapshot(ctx)?;
    let (base, kept, last_n) = (snap.dir.clone(), snap.disk.clone(), snap.last.0);
    let disk = ctx.scratch.join("chain.ext4");
    copy(&kept, &disk)?;
    let uds = ctx.scratch.join("chain.vsock");
    let mut g = Guest::start(
        ctx,
        "chain",
        restore_args(&base, "file", &disk, &uds, false),
    )?;
    let mut layers = Vec::new();
    let mut retaken = 0;
    let mut next = last_n + 2;
    for (i, kind) in [SnapshotKind::Full, SnapshotKind::Diff, SnapshotKind::Diff]
        .into_iter()
        .enumerate()
    {
        g.wait_for(&format!("RG-TICK {next} "), LIMIT)?;
        let still = snapshot_held_still(&mut g, &ctx.scratch.join(format!("chain-{i}")), kind)?;
        g.resume()?;
        retaken += still.retaken;
        layers.push((still.dir, still.checksum, kind));
        next += 2;
    }
    g.stop()?;
    g.expect_clean_exit(Duration::from_secs(60))?;
    drop(g);
    let mut checked = 0;
    for (dir, sum, kind) in &layers {
        for backend in ["file", "uffd"] {
            let name = format!(
                "chain-{}-{backend}",
                dir.file_name().and_then(|n| n.to_str()).unwrap_or("layer")
            );
            let copy_disk = ctx.scratch.join(format!("{name}.ext4"));
            copy(&disk, &copy_disk)?;
            let uds = ctx.scratch.join(format!("{name}.vsock"));
            let mut r = Guest::start(
                ctx,
                &name,
                restore_args(dir, backend, &copy_disk, &uds, true),
            )?;
            let got = r.checksum()?;
            r.stop()?;
            r.expect_clean_exit(Duration::from_secs(60))?;
            if &got != sum {
                return Err(format!(
                    "{} layer {} restored on {backend}: checksum {got}, taken as {sum}",
                    kind.as_str(),
                    dir.display()
                ));
            }
            checked += 1;
        }
    }
    Ok(format!(
        "full + 2 diffs; {checked} restores byte-identical{}",
        retaken_note(retaken)
    ))
}

/// Two VMs restored from one snapshot of a guest that reads /dev/urandom
/// every second: right after they resume they must read different bytes.
/// Uses the generic kernel (it has the VMGENID driver) and the probe's own
/// init (no guest-init reseeding anything).
pub fn clones_randomness(ctx: &mut Ctx, _name: &str) -> Check {
    let kernel = ctx.env.generic.bzimage.clone();
    let cmdline = format!("{BASE_CMDLINE} rg.mode=urandom rg.end=none");
    let args = probe_args(&kernel, &ctx.env.generic.probe_initrd, 1, &cmdline);
    let mut g = Guest::start(ctx, "urandom", args)?;
    g.wait_for("RG-URANDOM 3 ", LIMIT)?;
    g.pause()?;
    let dir = ctx.scratch.join("urandom-snap");
    g.snapshot(&dir, SnapshotKind::Full)?;
    g.stop()?;
    g.expect_clean_exit(Duration::from_secs(60))?;
    let last = g
        .lines_with("RG-URANDOM ")
        .iter()
        .filter_map(|l| {
            l.split_once("RG-URANDOM ")?
                .1
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        })
        .max()
        .ok_or("no urandom line before the snapshot")?;
    drop(g);
    let mut reads = Vec::new();
    for clone in ["clone-a", "clone-b"] {
        let mut c = Guest::start(ctx, clone, RestoreSpec::new(&dir))?;
        let want = format!("RG-URANDOM {} ", last + 2);
        let line = c.wait_for(&want, LIMIT)?;
        c.stop()?;
        c.expect_clean_exit(Duration::from_secs(60))?;
        reads.push(
            line.split_once(&want)
                .map(|x| x.1.trim().to_string())
                .unwrap_or_default(),
        );
    }
    if reads[0] == reads[1] {
        return Err(format!(
            "both clones read {} from /dev/urandom after the restore: they share randomness",
            reads[0]
        ));
    }
    Ok(format!("clones read {} and {}", reads[0], reads[1]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restores_get_the_snapshotted_guest_s_devices() {
        let a = restore_args(
            Path::new("/s/tick"),
            "uffd",
            Path::new("/s/d.ext4"),
            Path::new("/s/v.sock"),
            true,
        );
        assert_eq!(
            a.args().join(" "),
            "restore --snapshot /s/tick --memory-backend uffd --paused --serial stdout \
             --disk /s/d.ext4 --vsock 3:/s/v.sock --net rgtap0 --rng"
        );
    }
}
