//! PID 1 duties inside PID, mount and UTS namespaces (unshare): mounts under
//! a scratch root, hostname, orphan reaping, and SIGTERM shutdown.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use guest_init::reaper;

/// Children of every thread of `pid`.
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .flat_map(|t| {
            std::fs::read_to_string(t.path().join("children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|s| s.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// Kills unshare (and with it, through --kill-child, our PID 1) if the test fails.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn unshare_works() -> Result<(), String> {
    let out = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--mount",
            "--uts",
            "--net",
            "--mount-proc",
            "true",
        ])
        .output()
        .map_err(|e| format!("cannot run unshare: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

async fn wait_for(path: &Path) {
    let until = Instant::now() + Duration::from_secs(20);
    while !path.exists() {
        assert!(Instant::now() < until, "{} never appeared", path.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pid1_mounts_reaps_and_stops_on_sigterm() {
    if let Err(why) = unshare_works() {
        println!("SKIPPED pid1_mounts_reaps_and_stops_on_sigterm: unshare of PID/mount/UTS namespaces is not permitted here: {why}");
        return;
    }
    let repo = Repo::new();
    let dir = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let root = dir.path().join("root");
    let sock = dir.path().join("pid1.sock");
    let has_nft = Command::new("nft").arg("--version").output().is_ok();
    let mut egress_args = vec![];
    if has_nft {
        egress_args.push("--apply-egress".to_string());
        egress_args.push(format!(
            "--hosts-file={}",
            dir.path().join("hosts").display()
        ));
    } else {
        println!("SKIPPED egress part of pid1_mounts_reaps_and_stops_on_sigterm: the nft binary is not installed");
    }
    let unshare = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--mount",
            "--uts",
            "--net",
            "--mount-proc",
            "--kill-child",
        ])
        .arg(env!("CARGO_BIN_EXE_guest-init"))
        .arg("init")
        .arg("--root")
        .arg(&root)
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .arg("--workspace")
        .arg(dir.path().join("ws"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args(["--no-poweroff", "--hostname", "guest-under-test"])
        .args(&egress_args)
        // As the kernel starts init: no PATH, yet nft (in /usr/sbin) must be found.
        .env_remove("PATH")
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut unshare = KillOnDrop(unshare);
    wait_for(&sock).await;
    let init = children(unshare.0.id());
    assert_eq!(init.len(), 1, "unshare has one child, our PID 1");
    let init = init[0];

    let mut c = Client::connect(&sock).await;
    c.hello().await;
    let ready = c
        .start_session(&SessionSpec::new("p1", "free", "main"), &repo.bundle())
        .await;
    assert!(
        matches!(ready, proto::guest::guest_message::Kind::Ready(_)),
        "{ready:?}"
    );

    let r = c.run("h", &["hostname"]).await;
    assert_eq!(
        r.stdout(),
        "guest-under-test\n",
        "{r:?} {}",
        String::from_utf8_lossy(&r.stderr)
    );
    assert_eq!(
        c.run("pid", &["sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '"])
            .await
            .stdout()
            .split(' ')
            .nth(1),
        Some("init")
    );
    let mounts = c.run("m", &["cat", "/proc/self/mounts"]).await.stdout();
    for (fs, at) in [
        ("proc", "proc"),
        ("sysfs", "sys"),
        ("devtmpfs", "dev"),
        ("tmpfs", "tmp"),
        ("tmpfs", "run"),
    ] {
        let target = format!(" {} {fs} ", root.join(at).display());
        assert!(mounts.contains(&target), "no {fs} at {at}:\n{mounts}");
    }

    // PID 1 brought up lo in its network namespace.
    let r = c.run("lo", &["cat", "/sys/class/net/lo/flags"]).await;
    let flags = u32::from_str_radix(r.stdout().trim().trim_start_matches("0x"), 16).unwrap();
    assert_eq!(flags & 1, 1, "lo is not up: {r:?}");

    // The agent's commands are unprivileged: they cannot signal PID 1, read
    // the audit log or (with nftables) touch the egress rules.
    let r = c.run("kill", &["kill", "-TERM", "1"]).await;
    assert_ne!(r.code(), Some(0), "an agent command signalled PID 1");
    let log = dir.path().join("state/audit-p1.jsonl");
    let r = c.run("read-log", &["cat", log.to_str().unwrap()]).await;
    assert_ne!(r.code(), Some(0), "an agent command read the audit log");
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("Permission denied"),
        "{r:?}"
    );
    let r = c.run("id", &["id", "-u"]).await;
    assert_eq!(r.stdout(), "65534\n");
    if has_nft {
        let r = c.run("nft", &["nft", "flush", "ruleset"]).await;
        assert_ne!(
            r.code(),
            Some(0),
            "an agent command changed the egress rules"
        );
        // Loopback is not listed: the connection is dropped, and the denial
        // is reported when the turn ends.
        let r = c
            .run(
                "egress",
                &[
                    "timeout",
                    "2",
                    "bash",
                    "-c",
                    "echo x > /dev/tcp/127.0.0.1/9",
                ],
            )
            .await;
        assert_ne!(r.code(), Some(0), "{r:?}");
        c.end_turn("t").await;
        assert!(
            c.audit
                .iter()
                .any(|l| l.contains("\"egress.denied\"") && l.contains("packets denied")),
            "no egress.denied event: {:#?}",
            c.audit
        );
        let hosts = std::fs::read_to_string(dir.path().join("hosts")).unwrap();
        assert!(hosts.starts_with("# written by guest-init"), "{hosts}");
    }

    // An orphan is re-parented to PID 1 and reaped when it exits.
    let r = c
        .run(
            "orphan",
            &["sh", "-c", "sleep 1.5 </dev/null >/dev/null 2>&1 & exit 0"],
        )
        .await;
    assert_eq!(r.code(), Some(0));
    let kids: Vec<(u32, String)> = children(init)
        .into_iter()
        .map(|p| (p, reaper::cmdline(p)))
        .collect();
    assert!(
        kids.iter().any(|(_, c)| c == "sleep 1.5"),
        "the orphan was not re-parented to PID 1: {kids:?}"
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let zombies: Vec<u32> = children(init)
        .into_iter()
        .filter(|p| reaper::stat(*p).is_some_and(|s| s.state == 'Z'))
        .collect();
    assert!(zombies.is_empty(), "unreaped: {zombies:?}");
    assert!(!children(init)
        .into_iter()
        .any(|p| reaper::cmdline(p) == "sleep 1.5"));

    // SIGTERM: every process stops, and PID 1 exits (no power-off in tests).
    c.exec(exec_msg("long", "t", &["sleep", "4242"])).await;
    c.expect(|m| matches!(m, proto::guest::guest_message::Kind::ExecStarted(_)).then_some(()))
        .await;
    assert_eq!(processes_matching("sleep 4242").len(), 1);
    // SAFETY: kill(2) on the PID 1 we started.
    unsafe { libc::kill(init as libc::pid_t, libc::SIGTERM) };
    let until = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = unshare.0.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < until, "PID 1 did not stop on SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status:?}");
    assert!(
        processes_matching("sleep 4242").is_empty(),
        "a process survived shutdown"
    );
    // The session was ended properly: turns killed and the end audited.
    let log = std::fs::read_to_string(dir.path().join("state/audit-p1.jsonl")).unwrap();
    let last = log.lines().last().unwrap();
    assert!(
        last.contains("\"action\":\"session.end\"") && last.contains("SIGTERM"),
        "{last}"
    );
    assert!(log.contains("\"action\":\"turn.killed\""));
    if has_nft {
        assert!(log.contains("\"action\":\"egress.applied\""), "{log}");
    }
    let verdict = guest_init::audit::verify(log.as_bytes()).unwrap();
    assert!(
        matches!(verdict, guest_init::audit::VerifyOutcome::Holds { .. }),
        "{verdict}"
    );
}
