//! End to end with a real guest: build (or take from the cache) the kernel
//! and root filesystem, take the golden snapshot, restore it in a new vmm,
//! start a session on a small git repository over vsock, run a command the
//! policy allows and one it denies, end the turn (killing what it left
//! running), fetch the session branch back, shut down.
//!
//! Needs hardware virtualization: a stock Linux kernel cannot boot under an
//! emulating KVM (see DESIGN.md, "This machine's KVM"). Without `vmx`/`svm`
//! in /proc/cpuinfo the test prints why it was skipped and passes. On a
//! hardware-KVM host run it as root (debootstrap) with
//! `cargo nextest run -p images --no-capture -E 'test(real_guest)'`
//! (see images/README.md); `IMAGES_E2E_KERNEL` and `IMAGES_E2E_ROOTFS`
//! point it at prebuilt images instead.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{images, is_root, printed_dir, sh, shared_cache, workspace};
use images::golden::{RunDir, GUEST_CID};
use images::guest_channel::GuestChannel;
use proto::guest::guest_message::Kind as Out;
use proto::guest::host_message::Kind as In;
use proto::guest::{
    EndTurn, Exec, FetchBranch, GuestMessage, HostMessage, RepoChunk, Shutdown, StartSession,
};
use test_harness::git::git;
use vmm_api::command::{DiskSpec, RestoreSpec, Serial, VsockSpec};
use vmm_api::process::{file_tail, VmmChild};

const SKIP: &str = "skipped: no hardware virtualization (vmx/svm) on this host; run on bare metal or a nested-virt VM";
const WAIT: Duration = Duration::from_secs(60);

const RULES: &str = r#"---
description: end-to-end test agent
permission:
  bash:
    "*": deny
    "echo *": allow
    "git *": allow
    "git push *": deny
    "sleep *": allow
---
# e2e
"#;

fn hardware_virtualization() -> bool {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.contains("vmx") || l.contains("svm"))
}

/// An image from the environment, or built (cached) with `images`.
fn image(env: &str, args: &[&str], file: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    assert!(
        is_root(),
        "building the root filesystem needs root: run as root, or set IMAGES_E2E_KERNEL and IMAGES_E2E_ROOTFS"
    );
    let cache = shared_cache();
    let mut all = vec!["--cache-dir", cache.to_str().unwrap()];
    all.extend_from_slice(args);
    let (out, _) = images(&all);
    assert!(out.status.success(), "images {args:?} failed");
    printed_dir(&out).join(file)
}

fn build_vmm() -> PathBuf {
    let (ok, text) = sh(Command::new("cargo")
        .args(["build", "--release", "-p", "vmm"])
        .current_dir(workspace()));
    assert!(ok, "cargo build -p vmm: {text}");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target"));
    target.join("release/vmm")
}

fn send(c: &mut GuestChannel, kind: In) {
    c.send(&HostMessage { kind: Some(kind) })
        .expect("send to the guest");
}

/// Next message that is not an audit event.
fn next(c: &mut GuestChannel) -> Out {
    loop {
        match c.recv(WAIT).expect("message from the guest") {
            GuestMessage {
                kind: Some(Out::AuditEvent(_)),
            } => continue,
            GuestMessage { kind: Some(k) } => return k,
            GuestMessage { kind: None } => panic!("empty guest message"),
        }
    }
}

/// Outcome of one command.
#[derive(Debug, Default)]
struct Ran {
    stdout: Vec<u8>,
    code: Option<i32>,
    rejected: Option<(String, String)>,
}

fn exec(c: &mut GuestChannel, id: &str, turn: &str, argv: &[&str]) -> Ran {
    send(
        c,
        In::Exec(Exec {
            exec_id: id.into(),
            turn_id: turn.into(),
            argv: argv.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }),
    );
    let mut r = Ran::default();
    loop {
        match next(c) {
            Out::ExecStarted(_) => {}
            Out::Output(o) if o.exec_id == id && o.stream == 1 => r.stdout.extend(o.data),
            Out::Output(_) => {}
            Out::ExecExited(e) if e.exec_id == id => {
                r.code = match e.status {
                    Some(proto::guest::exec_exited::Status::Code(c)) => Some(c),
                    _ => None,
                };
                return r;
            }
            Out::ExecRejected(e) if e.exec_id == id => {
                r.rejected = Some((e.reason, e.rule));
                return r;
            }
            other => panic!("unexpected while running {argv:?}: {other:?}"),
        }
    }
}

#[test]
fn real_guest_session_from_a_golden_snapshot() {
    if !hardware_virtualization() {
        println!("{SKIP}");
        return;
    }
    assert!(
        Path::new("/dev/kvm").exists(),
        "this CPU has vmx/svm but /dev/kvm is missing: load kvm_intel or kvm_amd"
    );
    let kernel = image("IMAGES_E2E_KERNEL", &["kernel"], "vmlinux");
    let rootfs = image("IMAGES_E2E_ROOTFS", &["rootfs"], "rootfs.ext4");
    let vmm = build_vmm();

    // Golden snapshot (cached by its inputs).
    let golden = shared_cache().join("golden-e2e");
    let (out, _) = images(&[
        "golden",
        "--kernel",
        kernel.to_str().unwrap(),
        "--rootfs",
        rootfs.to_str().unwrap(),
        "--out",
        golden.to_str().unwrap(),
        "--vmm",
        vmm.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "golden snapshot failed");
    for f in [
        "snapshot/state",
        "snapshot/memory",
        "snapshot/manifest",
        "rootfs.ext4",
        "manifest.json",
    ] {
        assert!(
            golden.join(f).exists(),
            "{f} missing from the golden snapshot"
        );
    }

    // Restore into a new vmm with the session's own disk and vsock socket.
    let run = RunDir::new().unwrap();
    let disk = run.path().join("disk.ext4");
    images::golden::copy_disk(&golden.join("rootfs.ext4"), &disk).unwrap();
    let uds = run.path().join("v.sock");
    let ctl = run.path().join("c.sock");
    let console = run.path().join("console.log");
    let mut spec = RestoreSpec::new(golden.join("snapshot"));
    spec.devices.serial = Serial::File(console.clone());
    spec.devices.disks.push(DiskSpec::rw(&disk));
    spec.devices.vsock = Some(VsockSpec {
        cid: GUEST_CID,
        uds: uds.clone(),
    });
    spec.devices.control_socket = Some(ctl);
    let restored = Instant::now();
    let mut vm = VmmChild::spawn(&vmm, &spec.args()).unwrap();
    let mut c = loop {
        if let Some(status) = vm.exited() {
            panic!(
                "the vmm exited ({status}); console:\n{}",
                file_tail(&console, 30)
            );
        }
        let hello = GuestChannel::connect(&uds, proto::guest::DEFAULT_VSOCK_PORT, WAIT)
            .and_then(|mut c| c.hello("images e2e", WAIT).map(|h| (c, h)));
        match hello {
            Ok((c, h)) => {
                println!(
                    "guest-init ({}) answered {:?} after restore",
                    h.software,
                    restored.elapsed()
                );
                break c;
            }
            Err(e) if restored.elapsed() < Duration::from_secs(30) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!(
                "guest-init did not answer: {e}; console:\n{}",
                file_tail(&console, 30)
            ),
        }
    };

    // A small repository with the agent's rules.
    let repo = tempfile::tempdir().unwrap();
    git(repo.path(), &["init", "-q", "-b", "main"]);
    std::fs::create_dir_all(repo.path().join("agents")).unwrap();
    std::fs::write(repo.path().join("agents/e2e.md"), RULES).unwrap();
    std::fs::write(repo.path().join("README.md"), "hello\n").unwrap();
    git(repo.path(), &["add", "-A"]);
    git(repo.path(), &["commit", "-q", "-m", "initial"]);
    let bundle_path = run.path().join("repo.bundle");
    git(
        repo.path(),
        &["bundle", "create", bundle_path.to_str().unwrap(), "--all"],
    );
    let bundle = std::fs::read(&bundle_path).unwrap();

    send(
        &mut c,
        In::StartSession(StartSession {
            session_id: "e2e".into(),
            agent: "e2e".into(),
            base_ref: "main".into(),
            bundle_size: bundle.len() as u64,
            env: [
                ("GIT_AUTHOR_NAME", "Agent"),
                ("GIT_AUTHOR_EMAIL", "agent@example.com"),
                ("GIT_COMMITTER_NAME", "Agent"),
                ("GIT_COMMITTER_EMAIL", "agent@example.com"),
            ]
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect(),
            ..Default::default()
        }),
    );
    let chunks: Vec<&[u8]> = bundle.chunks(64 * 1024).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        send(
            &mut c,
            In::RepoChunk(RepoChunk {
                data: chunk.to_vec(),
                last: i + 1 == chunks.len(),
            }),
        );
    }
    match next(&mut c) {
        Out::Ready(r) => assert_eq!(r.branch, "session/e2e"),
        other => panic!(
            "expected Ready, got {other:?}; console:\n{}",
            file_tail(&console, 30)
        ),
    }

    // Allowed: runs in the guest, as the unprivileged user.
    let r = exec(&mut c, "a1", "t1", &["echo", "hello from the guest"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert_eq!(String::from_utf8_lossy(&r.stdout), "hello from the guest\n");
    let r = exec(
        &mut c,
        "a2",
        "t1",
        &[
            "git",
            "commit",
            "--allow-empty",
            "-q",
            "-m",
            "work from the guest",
        ],
    );
    assert_eq!(r.code, Some(0), "{r:?}");

    // Denied: never started.
    let r = exec(&mut c, "d1", "t1", &["git", "push", "origin", "main"]);
    let (reason, rule) = r.rejected.expect("git push must be denied");
    assert_eq!(reason, "denied by policy");
    assert!(rule.contains("git push *"), "{rule}");

    // End the turn with a command still running: it is killed.
    send(
        &mut c,
        In::Exec(Exec {
            exec_id: "long".into(),
            turn_id: "t1".into(),
            argv: vec!["sleep".into(), "600".into()],
            ..Default::default()
        }),
    );
    match next(&mut c) {
        Out::ExecStarted(s) => assert_eq!(s.exec_id, "long"),
        other => panic!("expected ExecStarted, got {other:?}"),
    }
    send(
        &mut c,
        In::EndTurn(EndTurn {
            turn_id: "t1".into(),
        }),
    );
    let ended = loop {
        match next(&mut c) {
            Out::TurnEnded(t) => break t,
            Out::ExecExited(_) | Out::Output(_) => {}
            other => panic!("expected TurnEnded, got {other:?}"),
        }
    };
    assert!(
        ended.killed.iter().any(|k| k.command.contains("sleep")),
        "{ended:?}"
    );

    // Fetch the session branch back.
    send(&mut c, In::FetchBranch(FetchBranch {}));
    let mut fetched = Vec::new();
    loop {
        match next(&mut c) {
            Out::BundleChunk(b) => {
                fetched.extend(b.data);
                if b.last {
                    break;
                }
            }
            Out::ExecExited(_) | Out::Output(_) => {}
            other => panic!("expected BundleChunk, got {other:?}"),
        }
    }
    let back = run.path().join("branch.bundle");
    std::fs::write(&back, &fetched).unwrap();
    git(
        repo.path(),
        &[
            "fetch",
            "-q",
            back.to_str().unwrap(),
            "session/e2e:refs/remotes/guest/e2e",
        ],
    );
    let log = git(
        repo.path(),
        &["log", "--format=%s", "refs/remotes/guest/e2e"],
    );
    assert!(log.lines().next() == Some("work from the guest"), "{log}");

    // Shut down: the guest powers off and the vmm exits.
    send(&mut c, In::Shutdown(Shutdown {}));
    assert!(matches!(next(&mut c), Out::ShutdownStarted(_)));
    let status = vm.wait_exit(Duration::from_secs(30));
    assert!(
        status.is_some(),
        "the vmm did not exit after the guest powered off"
    );
}
