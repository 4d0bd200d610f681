//! The binary's command line: `serve` over a Unix socket until Shutdown,
//! refusing PID 1 mode elsewhere, bad listen addresses, and vsock binding.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use proto::guest::{guest_message::Kind as Out, host_message::Kind as In, Shutdown};

const BIN: &str = env!("CARGO_BIN_EXE_guest-init");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_a_session_and_exits_on_shutdown() {
    let repo = Repo::new();
    let dir = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = dir.path().join("s.sock");
    let mut child = Command::new(BIN)
        .arg("serve")
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .arg("--workspace")
        .arg(dir.path().join("ws"))
        .args(["--turns", "process-tree"])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    while !sock.exists() {
        assert!(Instant::now() < until, "socket never appeared");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut c = Client::connect(&sock).await;
    c.hello().await;
    let ready = c
        .start_session(&SessionSpec::new("cli", "free", "main"), &repo.bundle())
        .await;
    let Out::Ready(r) = ready else {
        panic!("{ready:?}")
    };
    assert_eq!(r.turn_backend, "process-tree");
    assert_eq!(c.run("e", &["echo", "served"]).await.stdout(), "served\n");
    c.send(In::Shutdown(Shutdown {})).await;
    c.expect(|m| matches!(m, Out::ShutdownStarted(_)).then_some(()))
        .await;
    let until = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < until, "serve did not exit after Shutdown");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success());
    // The default state directory sits beside the workspace and is private.
    let state = dir.path().join(".guest-init-state-ws");
    let meta = std::fs::metadata(&state).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o700);
    let out = output(
        Command::new(BIN)
            .args(["audit", "verify"])
            .arg(state.join("audit-cli.jsonl")),
    )
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn refuses_pid1_mode_outside_pid1_and_bad_addresses() {
    let out = output(&mut Command::new(BIN)).unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("runs as PID 1"));
    let out = output(Command::new(BIN).args(["serve", "--listen", "tcp:80"])).unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("must be unix:PATH or vsock:PORT"));
}

/// Why this host cannot listen on vsock, where `e` (from
/// `VsockTransport::bind` of a port below 1024) says exactly that:
/// EAFNOSUPPORT (this kernel has no AF_VSOCK), or EACCES without
/// `CAP_NET_BIND_SERVICE` (`bind_service` false: the kernel's own rule for
/// ports below 1024). The bind is on `VMADDR_CID_ANY`, so the kernel's "no
/// such local CID" (EADDRNOTAVAIL) cannot be the host's lack and is not a
/// skip. `None` for every other error, a test failure: the product's own
/// refusals (not OS errors, whatever their `ErrorKind`), EADDRINUSE, EINVAL,
/// EACCES with the capability...
fn vsock_unavailable(e: &std::io::Error, bind_service: bool) -> Option<String> {
    match e.raw_os_error()? {
        libc::EAFNOSUPPORT => Some(format!("no AF_VSOCK in this kernel ({e})")),
        libc::EACCES if !bind_service => Some(format!(
            "no CAP_NET_BIND_SERVICE to listen on vsock port {} ({e})",
            proto::guest::DEFAULT_VSOCK_PORT
        )),
        _ => None,
    }
}

#[test]
fn only_a_kernel_without_vsock_or_a_missing_capability_skips() {
    use std::io::{Error, ErrorKind};
    let os = Error::from_raw_os_error;
    for (e, bind_service) in [(os(libc::EAFNOSUPPORT), true), (os(libc::EACCES), false)] {
        let why = vsock_unavailable(&e, bind_service).unwrap_or_else(|| panic!("{e} is a skip"));
        assert!(why.contains("(os error "), "{why}");
    }
    for (e, bind_service) in [
        (os(libc::EACCES), true),
        (os(libc::EADDRNOTAVAIL), false),
        (os(libc::EADDRINUSE), false),
        (os(libc::EINVAL), false),
        (os(libc::EPERM), false),
        (
            Error::new(ErrorKind::InvalidInput, "vsock port 2048 is not below 1024"),
            false,
        ),
        (Error::new(ErrorKind::Unsupported, "refused"), false),
    ] {
        assert_eq!(
            vsock_unavailable(&e, bind_service),
            None,
            "{e} must fail the test"
        );
    }
    // The product's refusal of an unprivileged port is one of those failures.
    let Err(refused) = guest_init::channel::vsock::VsockTransport::bind(
        guest_init::channel::vsock::FIRST_UNPRIVILEGED_PORT,
    ) else {
        panic!("an unprivileged vsock port was bound");
    };
    assert_eq!(refused.kind(), ErrorKind::InvalidInput, "{refused}");
    assert_eq!(vsock_unavailable(&refused, false), None, "{refused}");
}

#[tokio::test]
async fn vsock_transport_binds_where_the_kernel_has_vsock() {
    match guest_init::channel::vsock::VsockTransport::bind(proto::guest::DEFAULT_VSOCK_PORT) {
        Ok(t) => {
            use guest_init::channel::Transport;
            assert_eq!(
                t.describe(),
                format!("vsock:{}", proto::guest::DEFAULT_VSOCK_PORT)
            );
        }
        Err(e) => match vsock_unavailable(
            &e,
            test_harness::host::has_capability(test_harness::host::CAP_NET_BIND_SERVICE),
        ) {
            Some(why) => println!("skipped: {why}"),
            None => panic!(
                "cannot listen on vsock port {}: {e}",
                proto::guest::DEFAULT_VSOCK_PORT
            ),
        },
    }
}

/// Runs `guest-init policy check` with `agents/coder.md` = the README's
/// rules; returns (exit code, stdout, stderr).
fn policy_check(extra: &[&str], argv: &[&str]) -> (Option<i32>, String, String) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("agents")).unwrap();
    std::fs::write(
        dir.path().join("agents/coder.md"),
        "---\npermission:\n  bash:\n    \"*\": ask\n    \"git *\": allow\n    \"git push *\": deny\n---\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("agent-manifest.yaml"),
        "version: 1\nagents:\n  coder:\n    secrets: [TOKEN]\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("bad-manifest.yaml"),
        "version: 1\nbogus: 1\n",
    )
    .unwrap();
    let out = output(
        Command::new(BIN)
            .current_dir(dir.path())
            .args(["policy", "check"])
            .args(extra)
            .arg("--")
            .args(argv),
    )
    .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn policy_check_prints_the_decision_and_the_rule() {
    let rules = ["--rules", "agents/coder.md"];
    let (code, out, err) = policy_check(&rules, &["git", "-C", ".", "push", "origin", "main"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        out,
        "deny\nrule: bash: \"git push *\" = deny (agents/coder.md:6, pattern 3)\nsubject: git push origin main\n"
    );
    let (code, out, _) = policy_check(&rules, &["git", "status"]);
    assert_eq!(code, Some(0));
    assert!(
        out.starts_with("allow\nrule: bash: \"git *\" = allow (agents/coder.md:5, pattern 2)\n"),
        "{out}"
    );
    let (code, out, _) = policy_check(
        &["--rules", "agents/coder.md", "--env", "PATH=/w"],
        &["git", "status"],
    );
    assert_eq!(code, Some(0));
    assert!(out.starts_with("ask\n"), "{out}");
    assert!(out.contains("the Exec's environment sets PATH"), "{out}");
    let (code, out, _) = policy_check(&rules, &["sh", "-c", "ls; git status"]);
    assert_eq!(code, Some(0));
    assert_eq!(
        out,
        "ask\nrule: bash: \"*\" = ask (agents/coder.md:4, pattern 1)\nsubject: ls\nsubject: git status\n"
    );
    let (code, out, _) = policy_check(
        &[
            "--rules",
            "agents/coder.md",
            "--manifest",
            "agent-manifest.yaml",
        ],
        &["true"],
    );
    assert_eq!(code, Some(0));
    assert!(
        out.ends_with("secrets granted: TOKEN\negress granted: none\n"),
        "{out}"
    );
}

/// Review item "Policy bypasses": each comes back ask from the CLI too,
/// where the README's rules allow the git command it shows.
#[test]
fn policy_check_asks_for_the_bypasses() {
    let rules = ["--rules", "agents/coder.md"];
    for (argv, why) in [
        (
            &["a/../../usr/bin/git", "status"][..],
            "a symbolic link can put elsewhere",
        ),
        (
            &["bash", "--rcfile", "./x.sh", "-ic", "git status"],
            "reads start-up files",
        ),
        (&["bash", "-lc", "git status"], "reads start-up files"),
        (
            &["git", "-c", "trailer.a.cmd=id", "commit"],
            "can make git run a program",
        ),
        (
            &["sh", "-c", "exec -l bash -c 'git status'"],
            "starts a login shell",
        ),
    ] {
        let (code, out, err) = policy_check(&rules, argv);
        assert_eq!(code, Some(0), "{argv:?}: {err}");
        assert!(out.starts_with("ask\n"), "{argv:?}: {out}");
        assert!(out.contains(why), "{argv:?}: {out}");
    }
    let (code, out, _) = policy_check(
        &[
            "--rules",
            "agents/coder.md",
            "--env",
            "TAR_OPTIONS=--to-command=id",
        ],
        &["git", "status"],
    );
    assert_eq!(code, Some(0));
    assert!(
        out.contains("the Exec's environment sets TAR_OPTIONS"),
        "{out}"
    );
}

#[test]
fn policy_check_refuses_bad_input() {
    let (code, _, err) = policy_check(&["--rules", "agents/nope.md"], &["ls"]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains("cannot read rules file agents/nope.md"),
        "{err}"
    );
    let (code, _, err) = policy_check(
        &[
            "--rules",
            "agents/coder.md",
            "--manifest",
            "bad-manifest.yaml",
        ],
        &["ls"],
    );
    assert_eq!(code, Some(2));
    assert!(
        err.contains("agent-manifest.yaml: unknown field `bogus`"),
        "{err}"
    );
    let (code, _, err) = policy_check(&["--rules", "agents/coder.md"], &["sh", "-c", "echo 'x"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("unterminated quote"), "{err}");
    let (code, _, err) = policy_check(
        &["--rules", "agents/coder.md", "--env", "NOEQUALS"],
        &["ls"],
    );
    assert_eq!(code, Some(2));
    assert!(err.contains("must be NAME=VALUE"), "{err}");
}
