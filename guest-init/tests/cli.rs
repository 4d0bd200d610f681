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
        Err(e) => println!(
            "SKIPPED vsock_transport_binds_where_the_kernel_has_vsock: no AF_VSOCK here: {e}"
        ),
    }
}
