//! virtio-fs shares through the API, with a stand-in virtiofsd
//! (`AGENTVM_VIRTIOFSD`: a script that records where it runs and its
//! arguments, then listens on its socket until killed), a `--vmm` wrapper
//! that records its command line and drops `--fs` before running the real
//! vmm (the test guests have no virtio-fs driver, and the stand-in speaks
//! no vhost-user), and the stand-in guest (its StartSession is kept).
//!
//! Covered: an image's share starts a virtiofsd for its golden build; a
//! session's share of the same tag is restored from the golden snapshot
//! with its own directory, its virtiofsd started with the right arguments
//! in the VM's socket directory (given to the jail's uid), `--fs` reaching
//! the vmm, the mounts reaching the guest; a session with another tag
//! boots the image instead; a virtiofsd that fails fails CreateSession
//! with its error and leaves nothing; every virtiofsd goes with its
//! session. Needs python3 (the stand-in's listening socket); says so and
//! skips without it.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::fake_guest::FakeGuest;
use common::*;
use proto::hostagent as pb;
use tonic::Code;

/// The stand-in virtiofsd. It fails for a directory named `broken`.
const STANDIN: &str = r#"#!/bin/sh
prev=; sock=; dir=
for a in "$@"; do
  [ "$prev" = --socket-path ] && sock=$a
  [ "$prev" = --shared-dir ] && dir=$a
  prev=$a
done
printf '%s|%s\n' "$PWD" "$*" >> "$(dirname "$0")/virtiofsd-calls"
case "$dir" in
  */broken) echo "virtiofsd: cannot serve $dir: the stand-in refuses it" >&2; exit 1;;
esac
exec python3 -c 'import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(1)
time.sleep(3600)' "$sock" "$@"
"#;

/// The `--vmm` wrapper: records its arguments, drops every `--fs X`.
fn vmm_wrapper() -> String {
    format!(
        r#"#!/bin/sh
printf '%s\n' "$*" >> "$(dirname "$0")/vmm-calls"
n=$#; skip=
for a in "$@"; do
  if [ -n "$skip" ]; then skip=; continue; fi
  if [ "$a" = --fs ]; then skip=1; continue; fi
  set -- "$@" "$a"
done
shift $n
exec '{}' "$@"
"#,
        vmm_path().display()
    )
}

/// The test's files: the scripts, their records and the share roots.
struct Fixture {
    dir: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        for d in ["cache", "other", "extra", "broken"] {
            std::fs::create_dir_all(dir.path().join("shares").join(d)).unwrap();
        }
        let f = Fixture { dir };
        f.script("virtiofsd", STANDIN);
        f.script("vmm", &vmm_wrapper());
        f
    }

    fn script(&self, name: &str, text: &str) {
        let p = self.path(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn share_dir(&self, name: &str) -> String {
        std::fs::canonicalize(self.path("shares").join(name))
            .unwrap()
            .display()
            .to_string()
    }

    fn lines(&self, name: &str) -> Vec<String> {
        std::fs::read_to_string(self.path(name))
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect()
    }

    /// The stand-in virtiofsd processes running for this test.
    fn daemons(&self) -> Vec<u32> {
        let needle = self.share_dir("");
        let mut out = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd);
            if cmd.contains("--shared-dir") && cmd.contains(&needle) && !is_zombie(pid) {
                out.push(pid);
            }
        }
        out
    }

    /// Waits until no stand-in virtiofsd of this test runs.
    async fn wait_no_daemons(&self, after: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.daemons().is_empty() {
            assert!(
                Instant::now() < deadline,
                "virtiofsd still running after {after}: {:?}",
                self.daemons()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        // Whatever a failed test left: the stand-ins name this directory.
        kill_processes_under(self.dir.path());
    }
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('Z'))
        })
        .unwrap_or(true)
}

fn share(tag: &str, host: &str, read_only: bool, mount: &str) -> pb::Share {
    pb::Share {
        tag: tag.into(),
        host_path: host.into(),
        read_only,
        mount_path: mount.into(),
    }
}

fn python3() -> bool {
    let ok = std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        println!("skipped: the stand-in virtiofsd needs python3");
    }
    ok
}

/// host-agent with the stand-ins, `extra` flags, jailed where it can be.
fn start_agent(f: &Fixture, guest: &FakeGuest, extra: &[&str]) -> (Agent, bool) {
    let jailed = jail_supported();
    let vmm = f.path("vmm").display().to_string();
    let standin = f.path("virtiofsd").display().to_string();
    let mut flags = vec![
        "--vmm",
        vmm.as_str(),
        "--guest-vsock-uds",
        guest_sock(guest),
        "--no-vsock-device",
    ];
    flags.extend_from_slice(extra);
    if !jailed {
        flags.push("--no-jail");
    }
    let agent = Agent::start_with_env(&flags, &[("AGENTVM_VIRTIOFSD", &standin)]);
    (agent, jailed)
}

fn guest_sock(guest: &FakeGuest) -> &'static str {
    // The flags outlive this call: the path is leaked once per test.
    Box::leak(guest.sock().into_boxed_str())
}

fn image(shares: Vec<pb::Share>) -> pb::RegisterImageRequest {
    pb::RegisterImageRequest {
        image_id: "fs".into(),
        kernel_path: counter_kernel(),
        cmdline: "interval=100000000".into(),
        mem_mib: 32,
        vcpus: 1,
        guest_init: true,
        shares,
        ..Default::default()
    }
}

fn session(repo: &Path, shares: Vec<pb::Share>) -> pb::CreateSessionRequest {
    pb::CreateSessionRequest {
        image_id: "fs".into(),
        repository_path: repo.display().to_string(),
        agent: "good".into(),
        base_ref: "main".into(),
        shares,
        ..Default::default()
    }
}

/// The detail of session `id`'s READY event.
async fn ready_detail(agent: &Agent, id: &str) -> String {
    agent
        .session_events(id)
        .await
        .into_iter()
        .find(|e| e.to == S::Ready as i32)
        .map(|e| e.detail)
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_get_their_virtiofsd_and_device_and_both_go_with_the_session() {
    if !python3() {
        return;
    }
    let f = Fixture::new();
    let guest = FakeGuest::start();
    let root = f.share_dir("");
    let (agent, jailed) = start_agent(&f, &guest, &["--allowed-share-root", &root]);
    let repo_dir = tempfile::tempdir().unwrap();
    let repo = repo_with_main(repo_dir.path());
    let mut images = agent.images().await;

    // The image's share: resolved, its mount path filled in; its golden
    // build runs a virtiofsd for it, gone after the build.
    let img = images
        .register_image(image(vec![share(
            "cache",
            &format!("{root}/./cache"),
            true,
            "",
        )]))
        .await
        .expect("register")
        .into_inner();
    assert_eq!(
        img.shares,
        vec![share("cache", &f.share_dir("cache"), true, "/mnt/cache")]
    );
    images
        .build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
            image_id: "fs".into(),
            ..Default::default()
        })
        .await
        .expect("golden snapshot");
    let calls = f.lines("virtiofsd-calls");
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert!(calls[0].contains("/images/fs/build-"), "{calls:?}");
    let golden = f.lines("vmm-calls");
    assert!(
        golden[0].contains(" run ") && golden[0].contains("--fs cache:"),
        "the golden boot has the share's device: {golden:?}"
    );
    f.wait_no_daemons("the golden build").await;

    // A session's share of the image's tag, another directory: restored from
    // the golden snapshot, its virtiofsd serving its own directory.
    let mut sessions = agent.sessions().await;
    let s = sessions
        .create_session(session(
            &repo,
            vec![share("cache", &f.share_dir("other"), true, "")],
        ))
        .await
        .expect("create with a share")
        .into_inner();
    assert_eq!(s.state, S::Running as i32);
    assert!(
        ready_detail(&agent, &s.session_id)
            .await
            .contains("from the golden snapshot"),
        "{:?}",
        agent.session_events(&s.session_id).await
    );
    let dir = agent.state_dir().join("sessions").join(&s.session_id);
    let socket_dir = match jailed {
        true => dir.join("jail/fs"),
        false => dir.join("fs"),
    };
    let calls = f.lines("virtiofsd-calls");
    assert_eq!(
        calls.last().unwrap(),
        &format!(
            "{}|--shared-dir {} --socket-path 0.sock --sandbox namespace --cache auto \
             --readonly --tag cache --migration-on-error guest-error --log-level error",
            socket_dir.display(),
            f.share_dir("other")
        )
    );
    let vmm = f.lines("vmm-calls");
    let inside = match jailed {
        true => "/fs/0.sock".to_string(),
        false => socket_dir.join("0.sock").display().to_string(),
    };
    let restore = vmm.last().unwrap();
    assert!(
        restore.contains(" restore ") && restore.ends_with(&format!("--fs cache:{inside}")),
        "{restore}"
    );
    let socket = std::fs::symlink_metadata(socket_dir.join("0.sock")).expect("the socket");
    if jailed {
        assert_ne!(socket.uid(), 0, "the socket is the jail's uid's");
        assert_eq!(
            std::fs::metadata(&socket_dir).unwrap().uid(),
            0,
            "its directory stays root's"
        );
    }
    // The guest is asked to mount it; the API reports it.
    let start = guest.seen.starts.lock().unwrap()[&s.session_id].clone();
    assert_eq!(start.mounts.len(), 1);
    assert_eq!(
        (
            start.mounts[0].tag.as_str(),
            start.mounts[0].path.as_str(),
            start.mounts[0].read_only
        ),
        ("cache", "/mnt/cache", true)
    );
    assert_eq!(
        agent.get(&s.session_id).await.shares,
        vec![share("cache", &f.share_dir("other"), true, "/mnt/cache")]
    );
    assert_eq!(f.daemons().len(), 1, "one virtiofsd per share");
    let stopped = agent.stop(&s.session_id).await;
    assert_eq!(stopped.state, S::Stopped as i32);
    f.wait_no_daemons("Stop").await;

    // Another tag: the golden snapshot lacks its device, so the image boots.
    let s = sessions
        .create_session(session(
            &repo,
            vec![share("extra", &f.share_dir("extra"), false, "/data")],
        ))
        .await
        .expect("create with an extra share")
        .into_inner();
    assert_eq!(s.state, S::Running as i32);
    assert!(
        ready_detail(&agent, &s.session_id).await.contains("booted"),
        "{:?}",
        agent.session_events(&s.session_id).await
    );
    let boot = f.lines("vmm-calls").last().unwrap().clone();
    assert!(boot.contains(" run "), "{boot}");
    assert!(
        boot.contains("--fs cache:") && boot.contains("--fs extra:"),
        "{boot}"
    );
    if jailed {
        assert!(
            boot.contains("--bind") && boot.contains(":/boot/kernel:ro"),
            "{boot}"
        );
    }
    let start = guest.seen.starts.lock().unwrap()[&s.session_id].clone();
    let mounts: Vec<(&str, &str, bool)> = start
        .mounts
        .iter()
        .map(|m| (m.tag.as_str(), m.path.as_str(), m.read_only))
        .collect();
    assert_eq!(
        mounts,
        [("cache", "/mnt/cache", true), ("extra", "/data", false)]
    );
    assert_eq!(f.daemons().len(), 2);
    agent.stop(&s.session_id).await;
    f.wait_no_daemons("Stop of a booted session").await;

    // A virtiofsd that fails: CreateSession fails with its error; no vmm
    // is started and nothing is left running.
    let vmm_before = f.lines("vmm-calls").len();
    let e = sessions
        .create_session(session(
            &repo,
            vec![share("cache", &f.share_dir("broken"), true, "")],
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("share \"cache\""), "{}", e.message());
    assert!(
        e.message().contains("the stand-in refuses it"),
        "{}",
        e.message()
    );
    assert_eq!(f.lines("vmm-calls").len(), vmm_before, "no vmm started");
    let failed = sessions
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sessions
        .into_iter()
        .find(|s| s.state == S::Failed as i32)
        .expect("the session is FAILED");
    assert!(
        failed.detail.contains("the stand-in refuses it"),
        "{failed:?}"
    );
    f.wait_no_daemons("a failed create").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_are_refused_without_roots_and_checked_naming_the_field() {
    let f = Fixture::new();
    let guest = FakeGuest::start();
    // No roots: any share is FAILED_PRECONDITION naming the setting.
    let (agent, _) = start_agent(&f, &guest, &[]);
    let e = agent
        .images()
        .await
        .register_image(image(vec![share("cache", &f.share_dir("cache"), true, "")]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("allowed_share_roots"),
        "{}",
        e.message()
    );
    drop(agent);

    let root = f.share_dir("cache");
    let (agent, _) = start_agent(&f, &guest, &["--allowed-share-root", &root]);
    let mut images = agent.images().await;
    for (s, code, says) in [
        (
            share("a b", &root, true, ""),
            Code::InvalidArgument,
            "shares[0].tag",
        ),
        (
            share("t", "", true, ""),
            Code::InvalidArgument,
            "shares[0].host_path",
        ),
        (
            share("t", &root, true, "/proc/x"),
            Code::InvalidArgument,
            "shares[0].mount_path",
        ),
        (
            share("t", &root, true, "/"),
            Code::InvalidArgument,
            "shares[0].mount_path",
        ),
        (
            share("t", "relative", true, ""),
            Code::InvalidArgument,
            "shares[0].host_path",
        ),
        (
            share("t", &format!("{root}/missing"), true, ""),
            Code::InvalidArgument,
            "shares[0].host_path",
        ),
        (
            share("t", &f.share_dir("other"), true, ""),
            Code::PermissionDenied,
            "allowed_share_roots",
        ),
    ] {
        let e = images
            .register_image(image(vec![s.clone()]))
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "{s:?}: {e:?}");
        assert!(e.message().contains(says), "{s:?}: {}", e.message());
    }
    let e = images
        .register_image(image(vec![
            share("t", &root, true, ""),
            share("t", &root, false, "/other"),
        ]))
        .await
        .unwrap_err();
    assert!(
        e.message()
            .contains("shares[1].tag \"t\" is also shares[0]'s"),
        "{}",
        e.message()
    );
    assert!(
        images
            .get_image(pb::GetImageRequest {
                image_id: "fs".into()
            })
            .await
            .is_err(),
        "nothing was registered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_virtiofsd_outlives_a_killed_host_agent_and_orphans_are_killed() {
    if !python3() {
        return;
    }
    let f = Fixture::new();
    let guest = FakeGuest::start();
    let root = f.share_dir("");
    let (mut agent, _) = start_agent(&f, &guest, &["--allowed-share-root", &root]);
    let repo_dir = tempfile::tempdir().unwrap();
    let repo = repo_with_main(repo_dir.path());
    let mut images = agent.images().await;
    images
        .register_image(image(vec![share("cache", &f.share_dir("cache"), true, "")]))
        .await
        .expect("register");
    images
        .build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
            image_id: "fs".into(),
            ..Default::default()
        })
        .await
        .expect("golden snapshot");
    f.wait_no_daemons("the golden build").await;
    let s = agent
        .sessions()
        .await
        .create_session(session(&repo, vec![]))
        .await
        .expect("create")
        .into_inner();
    let serving = f.daemons();
    assert_eq!(serving.len(), 1, "the image's share has its daemon");

    // host-agent dies; the VM and its daemon go on. A daemon that belongs to
    // no VM (left by a create that a crash interrupted) is there too.
    agent.kill9();
    let stray_dir = agent.state_dir().join("sessions/gone/jail/fs");
    std::fs::create_dir_all(&stray_dir).unwrap();
    let mut stray = std::process::Command::new(f.path("virtiofsd"))
        .args([
            "--shared-dir",
            &f.share_dir("extra"),
            "--socket-path",
            "0.sock",
        ])
        .current_dir(&stray_dir)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.daemons().len() < 2 {
        assert!(Instant::now() < deadline, "the stray daemon did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        f.daemons().contains(&serving[0]),
        "the VM's daemon outlives host-agent"
    );

    // Restarted: the session's daemon is taken back, the stray one killed.
    agent.spawn();
    // Polled, not waited on: the fake guest answers the restarted
    // host-agent from this test's (single-threaded) runtime, and a blocking
    // wait would starve it while host-agent re-attaches the session.
    let deadline = Instant::now() + Duration::from_secs(60);
    while stray.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "the restarted host-agent did not kill the stray virtiofsd"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(f.daemons(), serving, "only the session's daemon is left");
    let back = agent.get(&s.session_id).await;
    assert_eq!(back.state, S::Running as i32, "{back:?}");
    agent.stop(&s.session_id).await;
    f.wait_no_daemons("Stop after a restart").await;
}
