//! KVM integration tests for virtio-fs: the vmm is the vhost-user frontend
//! of a real virtiofsd (found through $AGENTVM_VIRTIOFSD, then PATH, then
//! the agentvm cache; the tests that need it print SKIP without it), and the
//! `virtio_fs` test guest speaks FUSE to the device by polling. Covered: a
//! share read and written by the guest, a missing file, a read-only share, a
//! snapshot restored onto a new virtiofsd (and refused by one that cannot
//! take its state), and a backend that dies under a running guest (between
//! requests and with one pending). Fake backends that misbehave while the
//! vmm sets them up are in virtio_fs_hostile.rs.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

/// The tag every test's share has.
const TAG: &str = "share";

/// Empty loop iterations between two rounds of the looping guest, so its
/// log stays small (their speed varies a thousandfold between bare metal
/// and nested virtualization).
const ROUND_SPINS: u64 = 100_000;

/// How long a test waits for something a working vmm does in well under a
/// second (a guest round, an exit): only a hang reaches it.
const PATIENCE: Duration = Duration::from_secs(60);

/// virtiofsd: $AGENTVM_VIRTIOFSD, then `virtiofsd` on PATH, then
/// ~/.cache/agentvm/virtiofsd-1.14.0/bin/virtiofsd; or why there is none.
fn virtiofsd_binary() -> Result<PathBuf, String> {
    // Empty counts as unset, as host-agent reads it.
    if let Some(path) = std::env::var_os("AGENTVM_VIRTIOFSD").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!(
                "AGENTVM_VIRTIOFSD={} is not a file",
                path.display()
            ))
        };
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("virtiofsd"))
            .find(|p| p.is_file())
    });
    let cached = || {
        let home = PathBuf::from(std::env::var_os("HOME")?);
        Some(home.join(".cache/agentvm/virtiofsd-1.14.0/bin/virtiofsd")).filter(|p| p.is_file())
    };
    on_path.or_else(cached).ok_or_else(|| {
        "no virtiofsd (set AGENTVM_VIRTIOFSD, put it on PATH or install it at \
         ~/.cache/agentvm/virtiofsd-1.14.0/bin/virtiofsd)"
            .to_string()
    })
}

/// virtiofsd, or a SKIP line saying why the test cannot run.
fn virtiofsd_or_skip() -> Option<PathBuf> {
    match virtiofsd_binary() {
        Ok(path) => Some(path),
        Err(why) => {
            println!("SKIP: {why}");
            None
        }
    }
}

/// A virtiofsd process serving one directory on one socket; killed when
/// dropped.
struct Virtiofsd {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl Virtiofsd {
    /// Starts `bin` on `shared` (read-only if asked) with its socket and log
    /// at `<dir>/<name>.vfs.sock` and `<dir>/<name>.vfs.log`, and waits
    /// until it listens there.
    fn start(bin: &Path, dir: &Path, name: &str, shared: &Path, readonly: bool) -> Virtiofsd {
        let socket = dir.join(format!("{name}.vfs.sock"));
        let log = dir.join(format!("{name}.vfs.log"));
        let log_file = std::fs::File::create(&log).unwrap();
        let mut cmd = test_harness::process::command(bin);
        cmd.arg("--shared-dir")
            .arg(shared)
            .arg("--socket-path")
            .arg(&socket)
            .args(["--sandbox", "none", "--cache", "never"])
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file);
        if readonly {
            cmd.arg("--readonly");
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let mut fs = Virtiofsd { child, socket, log };
        let start = Instant::now();
        // Listening, not only bound: the vmm's connect is refused in between.
        while !test_harness::process::unix_socket_listening(&fs.socket) {
            if let Some(status) = fs.child.try_wait().unwrap() {
                panic!("virtiofsd exited ({status}): {}", fs.output());
            }
            assert!(
                start.elapsed() < PATIENCE,
                "virtiofsd never made {}: {}",
                fs.socket.display(),
                fs.output()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        fs
    }

    /// The `--fs` argument for this backend.
    fn fs_arg(&self) -> String {
        format!("{TAG}:{}", self.socket.display())
    }

    /// What virtiofsd has printed so far.
    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILLs virtiofsd and reaps it.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Virtiofsd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A shared directory `<dir>/<name>` holding `files` (name, contents).
fn share(dir: &Path, name: &str, files: &[(&str, &str)]) -> PathBuf {
    let shared = dir.join(name);
    std::fs::create_dir(&shared).unwrap();
    for (file, contents) in files {
        std::fs::write(shared.join(file), contents).unwrap();
    }
    shared
}

/// Runs the `virtio_fs` guest to its end with `cmdline` and the vmm flags
/// `extra`; returns (exit code, serial output, stderr).
fn run_fs_guest(cmdline: &str, extra: &[&str]) -> (Option<i32>, String, String) {
    let g = guest("virtio_fs");
    let mut args = vec![
        "run",
        "--kernel",
        g.to_str().unwrap(),
        "--mem-mib",
        "64",
        "--serial",
        "stdout",
        "--cmdline",
        cmdline,
    ];
    args.extend_from_slice(extra);
    let out = wait_with_deadline(spawn_vmm(&args), PATIENCE);
    (out.status.code(), stdout(&out), stderr(&out))
}

/// The value of the first `key=` line of guest output.
fn value<'a>(out: &'a str, key: &str) -> Option<&'a str> {
    out.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

/// One round of the looping guest: `fs.round=N len=L data=D`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Round {
    n: u64,
    len: u64,
    data: String,
}

/// The complete round lines of a serial log, in order (a line cut by a
/// pause or snapshot is skipped).
fn rounds(log: &Path) -> Vec<Round> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.split_inclusive('\n')
        .filter_map(|l| l.strip_suffix('\n'))
        .filter_map(|l| l.strip_prefix("fs.round="))
        .filter_map(|rest| {
            let (n, rest) = rest.split_once(" len=")?;
            let (len, data) = rest.split_once(" data=")?;
            Some(Round {
                n: n.parse().ok()?,
                len: len.parse().ok()?,
                data: data.to_string(),
            })
        })
        .collect()
}

/// Waits until `done` holds for the rounds in `log`; panics with the log
/// when the guest reports an error or the vmm `child` exits first, or when
/// PATIENCE runs out.
fn wait_for_rounds(log: &Path, child: &mut Child, done: impl Fn(&[Round]) -> bool) -> Vec<Round> {
    let start = Instant::now();
    loop {
        let r = rounds(log);
        if done(&r) {
            return r;
        }
        let text = std::fs::read_to_string(log).unwrap_or_default();
        assert!(
            !text.contains("fs.error=") && !text.contains("fs: timeout"),
            "the guest failed:\n{text}"
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the vmm exited ({status}) while the guest looped:\n{text}");
        }
        assert!(
            start.elapsed() < PATIENCE,
            "the guest's rounds did not get there in {PATIENCE:?}:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The guest output lines that only a failing device makes the guest print.
fn assert_no_guest_failure(out: &str) {
    for bad in [
        "fs: no device",
        "fs: features refused",
        "fs: timeout",
        "fs.short_reply",
        "fs.unique_mismatch",
    ] {
        assert!(!out.contains(bad), "guest printed {bad:?}:\n{out}");
    }
}

#[test]
fn guest_reads_a_file_of_the_share_and_creates_one() {
    let Some(bin) = virtiofsd_or_skip() else {
        return;
    };
    let t = tempfile::tempdir().unwrap();
    let contents = "hello from the host share\nsecond line\n";
    let shared = share(t.path(), "shared", &[("hello.txt", contents)]);
    let fs = Virtiofsd::start(&bin, t.path(), "rw", &shared, false);
    let (code, out, err) = run_fs_guest("console=ttyS0", &["--fs", &fs.fs_arg()]);
    assert_eq!(code, Some(0), "{out}\n{err}\nvirtiofsd: {}", fs.output());
    assert_no_guest_failure(&out);
    assert_eq!(value(&out, "fs.tag"), Some(TAG), "{out}");
    assert_eq!(value(&out, "fs.num_request_queues"), Some("1"));
    assert_eq!(value(&out, "fs.queue0_ready"), Some("1"));
    assert_eq!(value(&out, "fs.queue1_ready"), Some("1"));
    assert_eq!(value(&out, "fs.driver_ok"), Some("1"));
    assert_eq!(value(&out, "fs.init_error"), Some("0"), "{out}");
    assert_eq!(value(&out, "fs.init_major"), Some("7"));
    assert_eq!(value(&out, "fs.lookup_error"), Some("0"), "{out}");
    let len = contents.len().to_string();
    assert_eq!(value(&out, "fs.size"), Some(len.as_str()));
    assert_eq!(value(&out, "fs.open_error"), Some("0"));
    assert_eq!(value(&out, "fs.read_error"), Some("0"));
    assert_eq!(value(&out, "fs.read_len"), Some(len.as_str()));
    // The guest prints the data up to its first newline.
    assert_eq!(value(&out, "fs.data"), Some("hello from the host share"));
    assert_eq!(value(&out, "fs.release_error"), Some("0"));
    assert_eq!(value(&out, "fs.create_error"), Some("0"), "{out}");
    assert_eq!(value(&out, "fs.create_release_error"), Some("0"));
    assert!(out.contains("fs: end"), "{out}");
    assert!(
        shared.join("new.txt").is_file(),
        "the guest's CREATE made no new.txt in the share"
    );
}

#[test]
fn a_missing_file_is_enoent() {
    let Some(bin) = virtiofsd_or_skip() else {
        return;
    };
    let t = tempfile::tempdir().unwrap();
    let shared = share(t.path(), "shared", &[("hello.txt", "x")]);
    let fs = Virtiofsd::start(&bin, t.path(), "enoent", &shared, false);
    let (code, out, err) = run_fs_guest("console=ttyS0 file=absent.txt", &["--fs", &fs.fs_arg()]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert_no_guest_failure(&out);
    assert_eq!(value(&out, "fs.init_error"), Some("0"), "{out}");
    assert_eq!(value(&out, "fs.lookup_error"), Some("-2"), "ENOENT: {out}");
    assert_eq!(
        value(&out, "fs.open_error"),
        None,
        "no OPEN after a failed LOOKUP"
    );
}

#[test]
fn a_read_only_share_reads_and_refuses_create() {
    let Some(bin) = virtiofsd_or_skip() else {
        return;
    };
    let t = tempfile::tempdir().unwrap();
    let shared = share(t.path(), "shared", &[("notes.txt", "read-only notes")]);
    let fs = Virtiofsd::start(&bin, t.path(), "ro", &shared, true);
    // The longest tag, 36 bytes, fills the config field with no NUL.
    let tag = "t".repeat(35) + "z";
    let arg = format!("{tag}:{}", fs.socket.display());
    let (code, out, err) = run_fs_guest("console=ttyS0 file=notes.txt", &["--fs", &arg]);
    assert_eq!(code, Some(0), "{out}\n{err}\nvirtiofsd: {}", fs.output());
    assert_no_guest_failure(&out);
    assert_eq!(value(&out, "fs.tag"), Some(tag.as_str()), "{out}");
    assert_eq!(value(&out, "fs.init_error"), Some("0"), "{out}");
    assert_eq!(value(&out, "fs.lookup_error"), Some("0"));
    assert_eq!(value(&out, "fs.read_error"), Some("0"));
    assert_eq!(value(&out, "fs.read_len"), Some("15"));
    assert_eq!(value(&out, "fs.data"), Some("read-only notes"));
    assert_eq!(value(&out, "fs.create_error"), Some("-30"), "EROFS: {out}");
    assert!(!shared.join("new.txt").exists());
}

/// Starts the looping guest on `fs`, `round_spins` loop iterations between
/// rounds, with its serial log at `<dir>/<name>.log` and control socket
/// `<dir>/<name>.sock`.
fn boot_looping(
    dir: &Path,
    name: &str,
    fs: &Virtiofsd,
    round_spins: u64,
) -> (Child, Control, PathBuf) {
    let log = dir.join(format!("{name}.log"));
    let sock = dir.join(format!("{name}.sock"));
    let g = guest("virtio_fs");
    let mut child = spawn_vmm(&[
        "run",
        "--kernel",
        g.to_str().unwrap(),
        "--mem-mib",
        "64",
        "--cmdline",
        &format!("console=ttyS0 loop=1 round_spins={round_spins}"),
        "--serial",
        &format!("file:{}", log.display()),
        "--control-socket",
        sock.to_str().unwrap(),
        "--fs",
        &fs.fs_arg(),
    ]);
    let ctl = connect(&mut child, &sock, fs);
    (child, ctl, log)
}

/// Connects to the control socket `sock` of the vmm `child`; panics with
/// the vmm's stderr and what its backend `fs` printed when it exits first.
fn connect(child: &mut Child, sock: &Path, fs: &Virtiofsd) -> Control {
    let start = Instant::now();
    while !sock.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                let _ = pipe.read_to_string(&mut err);
            }
            panic!(
                "the vmm exited ({status}) before making its control socket: {err}\n\
                 virtiofsd: {}",
                fs.output()
            );
        }
        assert!(
            start.elapsed() < PATIENCE,
            "no {} in {PATIENCE:?}",
            sock.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    Control::connect(sock)
}

/// Sends `stop` and checks that the vmm ends cleanly.
fn stop_vmm(mut ctl: Control, child: Child) {
    assert_eq!(ctl.send_raw(r#"{"op":"stop"}"#)["ok"], true);
    let out = wait_with_deadline(child, PATIENCE);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
}

/// Starts `vmm restore` of `snap` with memory `backend` onto the backend
/// `fs`, with its serial log at `<dir>/<name>.log` and control socket
/// `<dir>/<name>.sock`; returns the vmm and those two paths.
fn spawn_restore(
    snap: &Path,
    backend: &str,
    dir: &Path,
    name: &str,
    fs: &Virtiofsd,
) -> (Child, PathBuf, PathBuf) {
    let log = dir.join(format!("{name}.log"));
    let sock = dir.join(format!("{name}.sock"));
    let child = spawn_vmm(&[
        "restore",
        "--snapshot",
        snap.to_str().unwrap(),
        "--memory-backend",
        backend,
        "--serial",
        &format!("file:{}", log.display()),
        "--control-socket",
        sock.to_str().unwrap(),
        "--fs",
        &fs.fs_arg(),
    ]);
    (child, log, sock)
}

/// Snapshots the looping guest, ends it and its virtiofsd, restores it
/// with memory `backend` onto a new virtiofsd serving other contents, and
/// checks that the rounds go on, served by the new backend.
fn rounds_continue_after_a_restore(backend: &str) {
    let Some(bin) = virtiofsd_or_skip() else {
        return;
    };
    let t = tempfile::tempdir().unwrap();
    let first = share(
        t.path(),
        "first",
        &[("hello.txt", "served by the first backend")],
    );
    let mut fs1 = Virtiofsd::start(&bin, t.path(), "first", &first, false);
    let (mut child, mut ctl, log) = boot_looping(t.path(), "origin", &fs1, ROUND_SPINS);
    let before = wait_for_rounds(&log, &mut child, |r| r.len() >= 3);
    assert_eq!(before[0].data, "served by the first backend", "{before:?}");
    assert_eq!(before[0].len, 27);

    assert_eq!(ctl.send_raw(r#"{"op":"pause"}"#)["ok"], true);
    let snap = t.path().join("snap");
    let req = json!({"op": "snapshot", "dir": snap, "kind": "full"}).to_string();
    let resp = ctl.send_raw(&req);
    assert_eq!(resp["ok"], true, "snapshot: {resp}");
    let last = rounds(&log).last().unwrap().n;
    stop_vmm(ctl, child);
    fs1.kill();

    // The snapshot holds virtiofsd's state, the files the guest looked up
    // or created among it: a new backend on a share without one of them
    // (new.txt) cannot take it, and the restore fails naming its socket.
    let partial = share(
        t.path(),
        "partial",
        &[("hello.txt", "served by the second backend")],
    );
    let fs_partial = Virtiofsd::start(&bin, t.path(), "partial", &partial, false);
    let (child, _, _) = spawn_restore(&snap, backend, t.path(), "partial", &fs_partial);
    let out = wait_with_deadline(child, PATIENCE);
    let err = stderr(&out);
    assert!(
        !out.status.success(),
        "restored onto a share without new.txt: {err}"
    );
    assert!(
        err.contains(&fs_partial.socket.display().to_string()),
        "{err}"
    );
    drop(fs_partial);

    // A new virtiofsd on a new socket, serving the same files with other
    // contents: what the guest reads after the restore comes from it.
    let second = share(
        t.path(),
        "second",
        &[
            ("hello.txt", "served by the second backend"),
            ("new.txt", ""),
        ],
    );
    let fs2 = Virtiofsd::start(&bin, t.path(), "second", &second, false);
    let (mut child, log2, sock2) = spawn_restore(&snap, backend, t.path(), "restored", &fs2);
    let ctl = connect(&mut child, &sock2, &fs2);
    let after = wait_for_rounds(&log2, &mut child, |r| {
        r.iter()
            .filter(|round| round.data == "served by the second backend")
            .count()
            >= 2
    });
    // The count goes on from the snapshot: the next round, or the one after
    // if the pause cut that round's line.
    assert!(
        after[0].n == last + 1 || after[0].n == last + 2,
        "rounds restarted or jumped: last before the snapshot {last}, after the restore {after:?}"
    );
    assert!(after.windows(2).all(|w| w[1].n == w[0].n + 1), "{after:?}");
    // Every round read after the restore (all but perhaps the first, whose
    // READ may have been answered before the snapshot) came from the new
    // backend.
    assert!(
        after[1..]
            .iter()
            .all(|r| r.data == "served by the second backend" && r.len == 28),
        "{after:?}"
    );
    stop_vmm(ctl, child);
    drop(fs2);
}

#[test]
fn rounds_continue_after_a_restore_onto_a_new_virtiofsd_file_backend() {
    rounds_continue_after_a_restore("file");
}

#[test]
fn rounds_continue_after_a_restore_onto_a_new_virtiofsd_uffd_backend() {
    rounds_continue_after_a_restore("uffd");
}

#[test]
fn a_dying_backend_fails_the_guests_requests_with_eio() {
    let Some(bin) = virtiofsd_or_skip() else {
        return;
    };
    let t = tempfile::tempdir().unwrap();
    let shared = share(t.path(), "shared", &[("hello.txt", "soon gone")]);
    let mut fs = Virtiofsd::start(&bin, t.path(), "dying", &shared, false);
    let (mut child, _ctl, log) = boot_looping(t.path(), "origin", &fs, ROUND_SPINS);
    wait_for_rounds(&log, &mut child, |r| r.len() >= 2);
    fs.kill();
    // The vmm answers the guest's next request with -EIO; the guest prints
    // it and resets, and the vmm ends as for any reset.
    assert_guest_got_eio(child, &log);
}

#[test]
fn a_request_pending_when_the_backend_dies_gets_eio() {
    let Some(bin) = virtiofsd_or_skip() else {
        return;
    };
    let t = tempfile::tempdir().unwrap();
    let shared = share(t.path(), "shared", &[("hello.txt", "soon gone")]);
    let mut fs = Virtiofsd::start(&bin, t.path(), "stuck", &shared, false);
    // Rounds back to back: the guest always has a request out or about to be.
    let (mut child, _ctl, log) = boot_looping(t.path(), "origin", &fs, 0);
    wait_for_rounds(&log, &mut child, |r| r.len() >= 2);
    // Stop virtiofsd and wait until the rounds stop too, the guest waiting
    // on a request nobody serves; then kill it. The vmm must answer that
    // pending request itself.
    // SAFETY: kill(2) has no memory-safety preconditions.
    assert_eq!(
        unsafe { libc::kill(fs.child.id() as i32, libc::SIGSTOP) },
        0
    );
    let start = Instant::now();
    let mut seen = rounds(&log).len();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = rounds(&log).len();
        if now == seen {
            break;
        }
        seen = now;
        assert!(
            start.elapsed() < PATIENCE,
            "the rounds went on with virtiofsd stopped"
        );
    }
    fs.kill();
    assert_guest_got_eio(child, &log);
}

/// The looping guest of the vmm `child` got -EIO for a request after its
/// backend died, said so in `log` and reset, and the vmm ended cleanly.
fn assert_guest_got_eio(child: Child, log: &Path) {
    let out = wait_with_deadline(child, PATIENCE);
    let text = std::fs::read_to_string(log).unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}\nstderr: {}",
        stderr(&out)
    );
    assert_no_guest_failure(&text);
    assert_eq!(value(&text, "fs.error"), Some("-5"), "{text}");
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
}
