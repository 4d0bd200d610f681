//! `share-perf`: measured, asserted only to have completed with the right
//! byte and file counts. Inside one probe guest the same 100 MiB file is
//! read through virtio-fs and from an ext4 virtio-blk disk (caches dropped
//! before each read, five rounds alternating), and N empty files are created, stat'ed
//! and unlinked on each (`guest/fsbench.c`, timed by the guest's clock).
//! Both back ends live in the outer VM's memory (tmpfs), so the figures
//! compare the two paths, not the media. Nested emulation makes absolute
//! figures meaningless: only the fs/blk ratios are reported as results.
//! Then, for orientation, restore times: the share guest's snapshot
//! (shared memory) on both memory back ends, and a guest without shares
//! (private memory) of the same size on both.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use vmm_api::command::DiskSpec;
use vmm_api::{RestoreSpec, SnapshotKind};

use super::{dirs, restore_share, BIG_BYTES, LIMIT, TAG_RW};
use crate::inner::groups::{probe_args, BASE_CMDLINE};
use crate::inner::virtiofsd::{self, Virtiofsd};
use crate::inner::vm::Guest;
use crate::inner::{Check, Ctx};

/// Files per metadata round.
const FILES: u32 = 500;
/// Reads of the file on each (the guest's `rg.rounds`).
const READ_ROUNDS: usize = 5;
/// The ext4 disk holding the same file.
const DISK_SIZE: &str = "256M";

/// One `fsbench read` result: MiB/s.
fn read_rate(line: &str, want_bytes: u64) -> Result<f64, String> {
    let field = |k: &str| -> Option<u64> {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.parse().ok())
    };
    match (field("bytes="), field("ns=")) {
        (Some(b), Some(ns)) if b == want_bytes && ns > 0 => {
            Ok(b as f64 / f64::from(1 << 20) / (ns as f64 / 1e9))
        }
        _ => Err(format!("a read did not complete: {line:?}")),
    }
}

/// One `fsbench meta` result: operations per second for create, stat, unlink.
fn meta_rates(line: &str, want_files: u32) -> Result<[f64; 3], String> {
    let field = |k: &str| -> Option<u64> {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.parse().ok())
    };
    let n = field("n=");
    let phases = [field("create_ns="), field("stat_ns="), field("unlink_ns=")];
    match (n, phases) {
        (Some(n), [Some(c), Some(s), Some(u)])
            if n == u64::from(want_files) && c > 0 && s > 0 && u > 0 =>
        {
            let rate = |ns: u64| n as f64 / (ns as f64 / 1e9);
            Ok([rate(c), rate(s), rate(u)])
        }
        _ => Err(format!("a metadata round did not complete: {line:?}")),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The guest's `RG-PERF <kind> <where> ...` lines' rest.
fn perf_lines<'a>(lines: &'a [String], kind: &str, place: &str) -> Vec<&'a str> {
    let prefix = format!("RG-PERF {kind} {place} ");
    lines
        .iter()
        .filter_map(|l| l.split_once(&prefix).map(|x| x.1))
        .collect()
}

/// Measured figures and the restore timings, printed; fails only when a
/// measurement did not complete.
pub fn perf(ctx: &mut Ctx, name: &str) -> Check {
    let dirs = dirs(ctx)?;
    // Its own directory (big.bin hard-linked), so its files stay out of
    // the snapshotted guest's share.
    let shared = ctx.scratch.join("share-perf");
    std::fs::create_dir_all(&shared).map_err(|e| format!("{}: {e}", shared.display()))?;
    let big = shared.join("big.bin");
    if !big.exists() {
        std::fs::hard_link(dirs.rw.join("big.bin"), &big)
            .map_err(|e| format!("{}: {e}", big.display()))?;
    }
    let disk = ctx.scratch.join("share-perf.ext4");
    let _ = std::fs::remove_file(&disk);
    mkfs_with(&shared, &disk)?;
    let fs = Virtiofsd::start(ctx, "perf", &shared, virtiofsd::Options::default())?;
    let kernel = ctx.env.cloud.vmlinux.clone().ok_or("no cloud vmlinux")?;
    let cmdline = format!(
        "{BASE_CMDLINE} rg.mode=fsperf rg.files={FILES} rg.rounds={READ_ROUNDS} rg.end=poweroff"
    );
    let mut args = probe_args(&kernel, &ctx.env.cloud.probe_initrd, 1, &cmdline);
    args.devices.disks = vec![DiskSpec::rw(&disk)];
    args.devices.fs = vec![fs.device(TAG_RW)?];
    let mut g = Guest::start(ctx, "perf", args)?;
    g.wait_for("RG-DONE", LIMIT)?;
    g.expect_clean_exit(Duration::from_secs(120))?;
    let lines = g.lines();
    drop(g);
    drop(fs);

    let mut read = Vec::new();
    let mut meta = Vec::new();
    for place in [TAG_RW, "blk"] {
        let rounds = perf_lines(&lines, "read", place);
        if rounds.len() != READ_ROUNDS {
            return Err(format!(
                "{place}: {} read rounds reported, not {READ_ROUNDS}: {rounds:?}",
                rounds.len()
            ));
        }
        let rates = rounds
            .iter()
            .map(|l| read_rate(l, BIG_BYTES))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{place}: {e}"))?;
        read.push(median(rates));
        let m = perf_lines(&lines, "meta", place);
        let line = m
            .first()
            .ok_or_else(|| format!("{place}: no metadata round reported"))?;
        meta.push(meta_rates(line, FILES).map_err(|e| format!("{place}: {e}"))?);
    }
    let figures = format!(
        "sequential read of 100 MiB (median of {READ_ROUNDS}, caches dropped): virtio-fs {:.1} MiB/s, virtio-blk {:.1} MiB/s, fs/blk {:.2}; \
         {FILES} files create/stat/unlink per s: virtio-fs {:.0}/{:.0}/{:.0}, virtio-blk {:.0}/{:.0}/{:.0}, fs/blk {:.3}/{:.3}/{:.3}",
        read[0],
        read[1],
        read[0] / read[1],
        meta[0][0],
        meta[0][1],
        meta[0][2],
        meta[1][0],
        meta[1][1],
        meta[1][2],
        meta[0][0] / meta[1][0],
        meta[0][1] / meta[1][1],
        meta[0][2] / meta[1][2],
    );
    ctx.info(name, &figures);
    let timings =
        restore_timings(ctx, name).map_err(|e| format!("{figures}; restore timings: {e}"))?;
    ctx.info(name, &timings);
    Ok(format!("{figures}; restores (orientation): {timings}"))
}

/// An ext4 image of `size` holding `dir`'s files.
fn mkfs_with(dir: &Path, image: &Path) -> Result<(), String> {
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-L", "rgperf", "-d"])
        .arg(dir)
        .arg(image)
        .arg(DISK_SIZE)
        .output()
        .map_err(|e| format!("mkfs.ext4: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "mkfs.ext4 -d {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Restore timings: the share guest's snapshot (shared memory) and an
/// idle guest's (private memory), each on both memory back ends: seconds
/// from starting `vmm restore` to its first control answer, and to the
/// guest's answer to a console line (from the share, where it has one).
fn restore_timings(ctx: &mut Ctx, name: &str) -> Result<String, String> {
    let mut out = Vec::new();
    for backend in ["file", "uffd"] {
        let r = restore_share(ctx, &format!("{name}-shared-{backend}"), backend)?;
        out.push(format!(
            "shared {backend} {:.1} s / {:.1} s",
            r.answered, r.first_read
        ));
        r.stop()?;
    }
    let snap = idle_snapshot(ctx)?;
    for backend in ["file", "uffd"] {
        let mut spec = RestoreSpec::new(&snap);
        spec.memory_backend = Some(backend.into());
        let t0 = Instant::now();
        let mut g = Guest::start(ctx, &format!("{name}-private-{backend}"), spec)?;
        g.status()?;
        let answered = t0.elapsed().as_secs_f64();
        let from = g.lines().len();
        g.send("ping\n")?;
        g.wait_from(from, "RG-PONG idle", LIMIT)?;
        let first = t0.elapsed().as_secs_f64();
        g.stop()?;
        g.expect_clean_exit(Duration::from_secs(60))?;
        out.push(format!("private {backend} {answered:.1} s / {first:.1} s"));
    }
    Ok(format!(
        "vmm answered / guest answered after start: {}",
        out.join(", ")
    ))
}

/// A snapshot of a probe guest without shares (private memory, the same
/// size as the share guest's) waiting on its console.
fn idle_snapshot(ctx: &mut Ctx) -> Result<std::path::PathBuf, String> {
    let kernel = ctx.env.cloud.vmlinux.clone().ok_or("no cloud vmlinux")?;
    let cmdline = format!("{BASE_CMDLINE} rg.mode=idle rg.end=none");
    let args = probe_args(&kernel, &ctx.env.cloud.probe_initrd, 1, &cmdline);
    let mut g = Guest::start(ctx, "idle", args)?;
    g.wait_for("RG-IDLE-READY", LIMIT)?;
    g.pause()?;
    let dir = ctx.scratch.join("idle-snap");
    let _ = std::fs::remove_dir_all(&dir);
    g.snapshot(&dir, SnapshotKind::Full)?;
    g.stop()?;
    g.expect_clean_exit(Duration::from_secs(60))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fsbench_lines_parse_and_short_ones_fail() {
        let r = read_rate("bytes=104857600 ns=2000000000", 100 << 20).unwrap();
        assert!((r - 50.0).abs() < 1e-9);
        assert!(read_rate("bytes=1048576 ns=2000000000", 100 << 20)
            .unwrap_err()
            .contains("did not complete"));
        assert!(read_rate("error: open /mnt/x: No such file", 1).is_err());
        let m = meta_rates(
            "n=500 create_ns=1000000000 stat_ns=500000000 unlink_ns=250000000",
            500,
        )
        .unwrap();
        assert_eq!(m, [500.0, 1000.0, 2000.0]);
        assert!(meta_rates("error: create /mnt/blk/meta/f0: Read-only", 500).is_err());
        assert!(meta_rates("n=499 create_ns=1 stat_ns=1 unlink_ns=1", 500).is_err());
    }

    #[test]
    fn the_middle_of_three_is_the_median() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    }
}
