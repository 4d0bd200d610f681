//! Group `share`: virtio-fs. A probe guest on the cloud kernel (its
//! `virtiofs` and `fuse` modules loaded from the initramfs) mounts two
//! shares, each served by its own virtiofsd in the outer VM: `rgshare`
//! (read-write, holding 100 MiB of random bytes) and `rgro` (virtiofsd
//! `--readonly`). `share-read` and `share-read-only` are judged from that
//! guest's run; the guest is then snapshotted with the big file held open,
//! and the restore scenarios bring it back onto fresh virtiofsd processes.
//! `share-perf` (perf.rs) measures virtio-fs against virtio-blk.

mod perf;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use vmm_api::{RestoreSpec, SnapshotKind};

use super::checks::bad_kernel_messages;
use super::{probe_args, BASE_CMDLINE};
use crate::inner::virtiofsd::{self, Virtiofsd};
use crate::inner::vm::Guest;
use crate::inner::{Check, Ctx};

pub use perf::perf;

/// The read-write share's tag.
const TAG_RW: &str = "rgshare";
/// The read-only share's tag.
const TAG_RO: &str = "rgro";
/// Size of the random file on the read-write share.
const BIG_BYTES: u64 = 100 << 20;
/// What the guest reads from the held-open file before the snapshot.
const HELD_OFFSET: u64 = 1 << 20;
/// `small.txt` on the read-write share (the guest's `ping` answer).
const SMALL: &str = "small file on the share";
/// `ro.txt` on the read-only share.
const RO_TEXT: &str = "read-only share, written by the host";
/// What the guest writes to `from-guest.txt`.
const FROM_GUEST: &str = "written by the guest\n";
/// Longest wait for one step of a guest (it hashes 100 MiB under nested
/// emulation).
const LIMIT: Duration = Duration::from_secs(900);

/// The shared directories in the outer VM and what the host put there.
#[derive(Clone)]
pub struct Dirs {
    /// Served read-write as `rgshare`.
    rw: PathBuf,
    /// Served `--readonly` as `rgro`.
    ro: PathBuf,
    /// SHA-256 of `big.bin`.
    big_sha: String,
    /// SHA-256 of `big.bin` after its first [`HELD_OFFSET`] bytes.
    held_sha: String,
}

/// What the share guest's one run left behind.
pub struct ShareRun {
    lines: Vec<String>,
    /// Whether it got to the point where it is snapshotted.
    ready: Result<(), String>,
    /// The snapshot taken there.
    snapshot: Result<PathBuf, String>,
    secs: f64,
}

/// The group's fixtures.
#[derive(Default)]
pub struct Fixtures {
    dirs: Option<Dirs>,
    run: Option<ShareRun>,
}

/// The shared directories, made on first use: `big.bin` with 100 MiB from
/// the outer VM's getrandom, hashed as it is written.
fn dirs(ctx: &mut Ctx) -> Result<Dirs, String> {
    if let Some(d) = &ctx.fixtures.share.dirs {
        return Ok(d.clone());
    }
    let rw = ctx.scratch.join("share-rw");
    let ro = ctx.scratch.join("share-ro");
    for d in [&rw, &ro] {
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    let write = |path: &Path, text: &str| {
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
    };
    write(&rw.join("small.txt"), &format!("{SMALL}\n"))?;
    write(&ro.join("ro.txt"), &format!("{RO_TEXT}\n"))?;
    let big = rw.join("big.bin");
    let mut file = std::fs::File::create(&big).map_err(|e| format!("{}: {e}", big.display()))?;
    let (mut all, mut held) = (Sha256::new(), Sha256::new());
    let mut chunk = vec![0u8; 1 << 20];
    let mut written = 0;
    while written < BIG_BYTES {
        getrandom::fill(&mut chunk).map_err(|e| format!("no randomness: {e}"))?;
        file.write_all(&chunk)
            .map_err(|e| format!("{}: {e}", big.display()))?;
        all.update(&chunk);
        if written >= HELD_OFFSET {
            held.update(&chunk);
        }
        written += chunk.len() as u64;
    }
    let d = Dirs {
        rw,
        ro,
        big_sha: hex::encode(all.finalize()),
        held_sha: hex::encode(held.finalize()),
    };
    ctx.fixtures.share.dirs = Some(d.clone());
    Ok(d)
}

/// The two virtiofsd processes one share guest's vmm needs, fresh.
fn backends(ctx: &Ctx, name: &str, dirs: &Dirs) -> Result<(Virtiofsd, Virtiofsd), String> {
    let rw = Virtiofsd::start(
        ctx,
        &format!("{name}-rw"),
        &dirs.rw,
        virtiofsd::Options::default(),
    )?;
    let ro = Virtiofsd::start(
        ctx,
        &format!("{name}-ro"),
        &dirs.ro,
        virtiofsd::Options { readonly: true },
    )?;
    Ok((rw, ro))
}

/// The share guest's run, made on first use (`scenario` notes what it saw).
fn the_run<'a>(ctx: &'a mut Ctx, scenario: &str) -> Result<&'a ShareRun, String> {
    if ctx.fixtures.share.run.is_none() {
        let run = run_guest(ctx, scenario)?;
        ctx.fixtures.share.run = Some(run);
    }
    ctx.fixtures
        .share
        .run
        .as_ref()
        .ok_or_else(|| "no share run".into())
}

/// Boots the share guest, lets it check the shares, and snapshots it when
/// it is ready (big.bin open on fd 3, 1 MiB read).
fn run_guest(ctx: &mut Ctx, scenario: &str) -> Result<ShareRun, String> {
    let t0 = Instant::now();
    let dirs = dirs(ctx)?;
    let (rw, ro) = backends(ctx, "share", &dirs)?;
    let kernel = ctx.env.cloud.vmlinux.clone().ok_or("no cloud vmlinux")?;
    let cmdline = format!("{BASE_CMDLINE} rg.mode=share rg.end=none");
    let mut args = probe_args(&kernel, &ctx.env.cloud.probe_initrd, 1, &cmdline);
    args.devices.fs = vec![rw.device(TAG_RW)?, ro.device(TAG_RO)?];
    let mut g = Guest::start(ctx, "share", args)?;
    let ready = g.wait_for("RG-FS-SNAPSHOT-READY", LIMIT).map(|_| ());
    let snapshot = match &ready {
        Ok(()) => snapshot(ctx, scenario, &mut g, &mut [rw, ro]),
        Err(e) => Err(format!("the guest never got ready: {e}")),
    };
    Ok(ShareRun {
        lines: g.lines(),
        ready,
        snapshot,
        secs: t0.elapsed().as_secs_f64(),
    })
}

/// Pauses and snapshots the ready guest, stops its vmm, and notes whether
/// its virtiofsd processes ended with it.
fn snapshot(
    ctx: &Ctx,
    scenario: &str,
    g: &mut Guest,
    backends: &mut [Virtiofsd],
) -> Result<PathBuf, String> {
    let dir = ctx.scratch.join("share-snap");
    g.pause()?;
    let t0 = Instant::now();
    g.snapshot(&dir, SnapshotKind::Full)
        .map_err(|e| format!("snapshot: {e}; {}", g.stderr_tail()))?;
    let secs = t0.elapsed().as_secs_f64();
    g.stop()?;
    g.expect_clean_exit(Duration::from_secs(60))?;
    for b in backends.iter_mut() {
        let ended = match b.exited_within(Duration::from_secs(30)) {
            Some(s) => format!("exited ({s}) after its vmm"),
            None => "still running 30 s after its vmm exited (killed)".into(),
        };
        ctx.info(scenario, &format!("virtiofsd {}: {ended}", b.name));
    }
    ctx.info(scenario, &format!("snapshot written in {secs:.1} s"));
    Ok(dir)
}

/// The value after `key ` in `lines`.
fn said(lines: &[String], key: &str) -> String {
    let prefix = format!("{key} ");
    lines
        .iter()
        .find_map(|l| l.split_once(&prefix).map(|(_, v)| v.trim().to_string()))
        .unwrap_or_default()
}

/// The run, failed if the guest did not get through its checks.
fn judged<'a>(ctx: &'a mut Ctx, scenario: &str) -> Result<&'a ShareRun, String> {
    let run = the_run(ctx, scenario)?;
    run.ready
        .clone()
        .map_err(|e| format!("the share guest did not finish: {e}"))?;
    let bad = bad_kernel_messages(&run.lines);
    if !bad.is_empty() {
        return Err(format!("kernel warnings: {}", bad.join(" / ")));
    }
    Ok(run)
}

/// (a) The read-write share: mounted as virtiofs, the guest's SHA-256 of
/// the host's 100 MiB file is the host's, and what it writes the host reads.
pub fn read(ctx: &mut Ctx, name: &str) -> Check {
    let dirs = dirs(ctx)?;
    let run = judged(ctx, name)?;
    let mount = said(&run.lines, "RG-FS-MOUNT");
    if !mount.starts_with("ok ") || !mount.contains(" virtiofs ") {
        return Err(format!(
            "mount -t virtiofs {TAG_RW}: {mount:?}; {}",
            driver_said(&run.lines)
        ));
    }
    let guest = said(&run.lines, "RG-FS-BIG");
    if guest != dirs.big_sha {
        return Err(format!(
            "the guest read big.bin with sha256 {guest:?}, the host wrote {}",
            dirs.big_sha
        ));
    }
    let wrote = said(&run.lines, "RG-FS-WROTE");
    let path = dirs.rw.join("from-guest.txt");
    let host = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "the guest wrote ({wrote}), the host cannot read {}: {e}",
            path.display()
        )
    })?;
    if wrote != "ok" || host != FROM_GUEST {
        return Err(format!(
            "the guest's write: {wrote}; the host reads {host:?}"
        ));
    }
    Ok(format!(
        "100 MiB read through virtio-fs, sha256 {}… as on the host; the guest's write reached the host; guest ran {:.0} s",
        &guest[..12],
        run.secs
    ))
}

/// What the guest's kernel said about its virtiofs devices (why a mount
/// found no tag, say), and which driver each device has.
fn driver_said(lines: &[String]) -> String {
    let said: Vec<&str> = lines
        .iter()
        .filter(|l| {
            l.contains("RG-VIRTIO ") || (l.contains("RG-DMESG: ") && l.contains("virtiofs"))
        })
        .map(|l| l.trim())
        .collect();
    format!("the guest's devices and kernel: {}", said.join(" | "))
}

/// The guest's `RG-FSRO <mount> <op>` results.
fn ro_results(lines: &[String], mount: &str) -> Vec<(String, String)> {
    let prefix = format!("RG-FSRO {mount} ");
    lines
        .iter()
        .filter_map(|l| l.split_once(&prefix))
        .filter_map(|(_, rest)| {
            let (op, result) = rest.split_once(' ')?;
            Some((op.to_string(), result.trim().to_string()))
        })
        .collect()
}

/// Every file under `dir` with its contents, sorted (a directory as its name).
fn tree(dir: &Path) -> Result<Vec<(String, Vec<u8>)>, String> {
    let mut out = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for e in entries {
        let e = e.map_err(|e| format!("{}: {e}", dir.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let path = e.path();
        if path.is_dir() {
            out.push((format!("{name}/"), Vec::new()));
        } else {
            let data = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            out.push((name, data));
        }
    }
    out.sort();
    Ok(out)
}

/// The writes the guest tries on each mount of the read-only share.
const RO_OPS: [&str; 4] = ["create", "append", "mkdir", "remove"];

/// (b) The `--readonly` share: mounted `-o ro`, and mounted read-write too,
/// every write the guest tries (create, append, mkdir, remove) fails with
/// EROFS or EACCES while reads work, and the host's directory is as it was.
pub fn read_only(ctx: &mut Ctx, name: &str) -> Check {
    let dirs = dirs(ctx)?;
    let run = judged(ctx, name)?;
    let mut problems = Vec::new();
    for mount in ["ro", "rw"] {
        let mounted = said(&run.lines, &format!("RG-FSRO-MOUNT {mount}"));
        if !mounted.starts_with("ok ") {
            problems.push(format!(
                "the {mount} mount of {TAG_RO}: {mounted}; {}",
                driver_said(&run.lines)
            ));
            continue;
        }
        let read = said(&run.lines, &format!("RG-FSRO-READ {mount}"));
        if read != RO_TEXT {
            problems.push(format!("the {mount} mount reads ro.txt as {read:?}"));
        }
        let results = ro_results(&run.lines, mount);
        for op in RO_OPS {
            match results.iter().find(|(o, _)| o == op) {
                Some((_, r))
                    if r.starts_with("refused:")
                        && (r.contains("Read-only file system")
                            || r.contains("Permission denied")) => {}
                Some((_, r)) => problems.push(format!("{op} on the {mount} mount: {r}")),
                None => problems.push(format!("{op} on the {mount} mount: not tried")),
            }
        }
    }
    let now = tree(&dirs.ro)?;
    let want = vec![("ro.txt".to_string(), format!("{RO_TEXT}\n").into_bytes())];
    if now != want {
        problems.push(format!(
            "the read-only share's directory changed: it holds {:?}",
            now.iter().map(|(n, _)| n).collect::<Vec<_>>()
        ));
    }
    if problems.is_empty() {
        let errors: Vec<String> = ro_results(&run.lines, "rw")
            .into_iter()
            .map(|(op, r)| format!("{op}: {}", r.rsplit(": ").next().unwrap_or(&r)))
            .collect();
        Ok(format!(
            "-o ro and read-write mounts both refuse create, append, mkdir, remove (rw mount: {}); reads work; the directory is unchanged",
            errors.join(", ")
        ))
    } else {
        Err(problems.join("; "))
    }
}

/// A restore of the share guest's snapshot on `backend` with fresh
/// virtiofsd processes: when the vmm answered, and when the guest first
/// answered from the share.
pub struct Restored {
    guest: Guest,
    _backends: (Virtiofsd, Virtiofsd),
    /// Seconds from starting the vmm to its first control answer.
    pub answered: f64,
    /// Seconds from starting the vmm to the guest's `ping` answer, which
    /// reads small.txt through the share.
    pub first_read: f64,
    /// The console index after that answer.
    after: usize,
}

fn restore_share(ctx: &mut Ctx, name: &str, backend: &str) -> Result<Restored, String> {
    let dirs = dirs(ctx)?;
    let snap = the_run(ctx, name)?
        .snapshot
        .clone()
        .map_err(|e| format!("no snapshot to restore: {e}"))?;
    let backends = backends(ctx, name, &dirs)?;
    let mut spec = RestoreSpec::new(&snap);
    spec.memory_backend = Some(backend.into());
    spec.devices.fs = vec![backends.0.device(TAG_RW)?, backends.1.device(TAG_RO)?];
    let t0 = Instant::now();
    let mut guest = Guest::start(ctx, name, spec)?;
    guest.status().map_err(|e| {
        format!(
            "the restored vmm does not answer: {e}; {}",
            guest.stderr_tail()
        )
    })?;
    let answered = t0.elapsed().as_secs_f64();
    let from = guest.lines().len();
    guest.send("ping\n")?;
    let (at, pong) = guest.wait_from(from, "RG-PONG", LIMIT)?;
    let first_read = t0.elapsed().as_secs_f64();
    let got = pong.split_once("RG-PONG ").map_or("", |x| x.1.trim());
    if got != SMALL {
        return Err(format!(
            "after the restore the guest reads small.txt as {got:?}; {} | {}",
            backends.0.log_tail(),
            guest.stderr_tail()
        ));
    }
    Ok(Restored {
        guest,
        _backends: backends,
        answered,
        first_read,
        after: at + 1,
    })
}

impl Restored {
    /// Ends the restored VM.
    fn stop(mut self) -> Result<(), String> {
        self.guest.stop()?;
        self.guest
            .expect_clean_exit(Duration::from_secs(60))
            .map(|_| ())
    }
}

/// (c) The share guest restored on `backend` onto fresh virtiofsd
/// processes: the big file reads by hash again, the file it held open
/// across the snapshot reads on from where it was, a file the host wrote
/// after the snapshot and the read-only share read, and its write reaches
/// the host.
pub fn restore(ctx: &mut Ctx, name: &str, backend: &str) -> Check {
    let dirs = dirs(ctx)?;
    let after_host = format!("{name} from the host");
    let write = |path: PathBuf, text: &str| {
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))
    };
    write(dirs.rw.join("after.txt"), &format!("{after_host}\n"))?;
    let _ = std::fs::remove_file(dirs.rw.join("after-guest.txt"));
    let mut r = restore_share(ctx, name, backend)?;
    r.guest.send(&format!("after {name}\n"))?;
    r.guest.wait_from(r.after, "RG-FS-AFTER-DONE", LIMIT)?;
    let lines = r.guest.lines()[r.after..].to_vec();
    let mut problems = Vec::new();
    let big = said(&lines, "RG-FS-AFTER-BIG");
    if big != dirs.big_sha {
        problems.push(format!(
            "big.bin reads with sha256 {big:?}, the host's is {}",
            dirs.big_sha
        ));
    }
    let held = said(&lines, "RG-FS-AFTER-HELD");
    if held != dirs.held_sha {
        problems.push(format!(
            "the file held open across the snapshot reads on with sha256 {held:?}, the host's bytes from 1 MiB on are {}",
            dirs.held_sha
        ));
    }
    let new = said(&lines, "RG-FS-AFTER-NEW");
    if new != after_host {
        problems.push(format!(
            "after.txt (written after the snapshot) reads {new:?}"
        ));
    }
    let ro = said(&lines, "RG-FS-AFTER-RO");
    if ro != RO_TEXT {
        problems.push(format!("the read-only share's ro.txt reads {ro:?}"));
    }
    let wrote = said(&lines, "RG-FS-AFTER-WROTE");
    let host = std::fs::read_to_string(dirs.rw.join("after-guest.txt")).unwrap_or_default();
    if wrote != "ok" || host.trim() != name {
        problems.push(format!(
            "the guest's write after the restore: {wrote}; the host reads {host:?}"
        ));
    }
    let bad = bad_kernel_messages(&lines);
    if !bad.is_empty() {
        problems.push(format!(
            "kernel warnings after the restore: {}",
            bad.join(" / ")
        ));
    }
    let (answered, first_read) = (r.answered, r.first_read);
    if !problems.is_empty() {
        problems.push(r.guest.stderr_tail());
        return Err(problems.join("; "));
    }
    r.stop()?;
    Ok(format!(
        "big.bin by hash, the held file from 1 MiB on, a file new since the snapshot, the read-only share and a write all work; vmm answered {answered:.1} s, first share read {first_read:.1} s after start"
    ))
}
