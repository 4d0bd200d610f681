//! Test harness: a real host-agent process on a loopback port, with a real
//! vmm and the `counter` test guest.
//!
//! The vmm binary is found next to the host-agent binary under
//! `target/<profile>/`; if it is missing, the harness builds it once with
//! `cargo build -p vmm` (same profile). `HOST_AGENT_TEST_VMM` overrides it.
#![allow(dead_code)]

pub mod fake_guest;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use proto::hostagent as pb;
use proto::hostagent::{
    events_client::EventsClient, images_client::ImagesClient, node_client::NodeClient,
    sessions_client::SessionsClient, usage_client::UsageClient,
};
use tonic::transport::Channel;

pub use pb::SessionState as S;

/// A workspace binary next to host-agent's, built with `cargo build -p
/// NAME` (same profile) if it is missing; `env` overrides the path.
fn workspace_binary(name: &str, env: &str) -> PathBuf {
    if let Ok(p) = std::env::var(env) {
        return PathBuf::from(p);
    }
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_host-agent"));
    let dir = exe.parent().expect("binary has a directory").to_path_buf();
    let bin = dir.join(name);
    if !bin.is_file() {
        let profile = dir.file_name().and_then(|n| n.to_str()).unwrap_or("debug");
        let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        cmd.args(["build", "-p", name]);
        if profile == "release" {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("running cargo build");
        assert!(status.success(), "cargo build -p {name} failed");
    }
    assert!(bin.is_file(), "no {name} binary at {}", bin.display());
    bin
}

/// The vmm binary (built on first use if needed; `HOST_AGENT_TEST_VMM`
/// overrides).
pub fn vmm_path() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| workspace_binary("vmm", "HOST_AGENT_TEST_VMM"))
        .clone()
}

/// The guest-init binary (built on first use if needed;
/// `HOST_AGENT_TEST_GUEST_INIT` overrides).
pub fn guest_init_path() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| workspace_binary("guest-init", "HOST_AGENT_TEST_GUEST_INIT"))
        .clone()
}

/// The counter test guest's ELF image.
pub fn counter_kernel() -> String {
    test_guests::path("counter")
        .expect("counter guest")
        .display()
        .to_string()
}

/// A host-agent process.
pub struct Agent {
    pub dir: tempfile::TempDir,
    pub addr: String,
    child: Option<Child>,
    extra: Vec<String>,
    spawns: u32,
}

impl Agent {
    /// Starts host-agent on a fresh state directory with `extra` flags.
    pub fn start(extra: &[&str]) -> Agent {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut a = Agent {
            dir,
            addr: String::new(),
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            spawns: 0,
        };
        a.spawn();
        a
    }

    /// Starts (again) on the same state directory.
    pub fn spawn(&mut self) {
        self.spawns += 1;
        let log_path = self.dir.path().join(format!("agent-{}.log", self.spawns));
        let log = std::fs::File::create(&log_path).expect("creating agent log");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_host-agent"));
        cmd.arg("serve")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--state-dir")
            .arg(self.dir.path().join("state"));
        if !self.extra.iter().any(|a| a == "--vmm") {
            cmd.arg("--vmm").arg(vmm_path());
        }
        // Tests not about authorization call as the local admin and use
        // files from anywhere (the test guests, temporary repositories); the
        // authorization tests pass their own settings.
        let has = |flag: &str| self.extra.iter().any(|a| a == flag);
        if !has("--clients-file")
            && !has("--tls-ca")
            && !has("--allow-unauthenticated-local")
            && !has("--no-test-defaults")
        {
            cmd.arg("--allow-unauthenticated-local");
        }
        if !has("--allowed-image-root") && !has("--no-test-defaults") {
            cmd.arg("--allowed-image-root").arg("/");
        }
        if !has("--allowed-repository-root") && !has("--no-test-defaults") {
            cmd.arg("--allowed-repository-root").arg("/");
        }
        let mut child = cmd
            .args(self.extra.iter().filter(|a| *a != "--no-test-defaults"))
            .env("RUST_LOG", "host_agent=debug,info")
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawning host-agent");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("reading host-agent's first line");
        let addr = line
            .trim()
            .strip_prefix("host-agent listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
        self.addr = format!("http://{addr}");
        self.child = Some(child);
    }

    /// SIGKILLs host-agent (its vmm processes keep running).
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().expect("SIGKILL host-agent");
            c.wait().expect("reaping host-agent");
        }
    }

    /// SIGTERMs host-agent and waits for it to exit; returns its status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("host-agent is running");
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe {
            libc::kill(c.id() as i32, libc::SIGTERM);
        }
        c.wait().expect("reaping host-agent")
    }

    /// The host-agent process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("host-agent is running").id()
    }

    /// A `kB` field (`VmRSS`, `VmHWM`) of host-agent's /proc status, in bytes.
    pub fn memory(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("reading host-agent's /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {field} in host-agent's status"))
            * 1024
    }

    /// Registers the counter guest as the guest-init image "gi" and builds
    /// its golden snapshot (the stand-in guest answers Hello).
    pub async fn guest_init_image(&self) {
        let mut im = self.images().await;
        im.register_image(pb::RegisterImageRequest {
            image_id: "gi".into(),
            kernel_path: counter_kernel(),
            cmdline: "interval=100000000".into(),
            mem_mib: 32,
            guest_init: true,
            ..Default::default()
        })
        .await
        .expect("register image");
        im.build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
            image_id: "gi".into(),
            ..Default::default()
        })
        .await
        .expect("golden snapshot after the guest's Hello");
    }

    /// Creates a session of image "gi" on `repo` for `agent` at `base_ref`.
    pub async fn guest_session(
        &self,
        repo: &Path,
        agent: &str,
        base_ref: &str,
    ) -> Result<pb::Session, tonic::Status> {
        self.sessions()
            .await
            .create_session(pb::CreateSessionRequest {
                image_id: "gi".into(),
                repository_path: repo.display().to_string(),
                agent: agent.into(),
                base_ref: base_ref.into(),
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner())
    }

    /// Stops session `id` and returns it.
    pub async fn stop(&self, id: &str) -> pb::Session {
        self.sessions()
            .await
            .stop_session(pb::SessionCall {
                session_id: id.into(),
                idempotency_key: String::new(),
            })
            .await
            .expect("stop session")
            .into_inner()
    }

    /// Every lifecycle event of session `id` so far.
    pub async fn session_events(&self, id: &str) -> Vec<pb::Event> {
        let mut w = self
            .events()
            .await
            .watch(pb::WatchRequest {
                since_seq: 0,
                session_id: id.into(),
            })
            .await
            .expect("watch")
            .into_inner();
        let mut out = Vec::new();
        // Watch goes on live: the stored events are those before the last one
        // Get shows (a terminal session has no more).
        let state = self.get(id).await.state;
        while let Ok(Ok(Some(e))) = tokio::time::timeout(Duration::from_secs(5), w.message()).await
        {
            let to = e.to;
            out.push(e);
            if to == state && (to == S::Stopped as i32 || to == S::Failed as i32) {
                break;
            }
        }
        out
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(self.addr.clone())
            .unwrap()
            .connect()
            .await
            .expect("connecting to host-agent")
    }

    pub async fn images(&self) -> ImagesClient<Channel> {
        ImagesClient::new(self.channel().await)
    }
    pub async fn sessions(&self) -> SessionsClient<Channel> {
        SessionsClient::new(self.channel().await)
    }
    pub async fn events(&self) -> EventsClient<Channel> {
        EventsClient::new(self.channel().await)
    }
    pub async fn usage(&self) -> UsageClient<Channel> {
        UsageClient::new(self.channel().await)
    }
    pub async fn node(&self) -> NodeClient<Channel> {
        NodeClient::new(self.channel().await)
    }

    /// Registers the counter guest as image `id` and builds its golden
    /// snapshot.
    pub async fn counter_image(&self, id: &str) -> pb::Image {
        let mut c = self.images().await;
        c.register_image(pb::RegisterImageRequest {
            image_id: id.into(),
            kernel_path: counter_kernel(),
            cmdline: "interval=100000000".into(),
            mem_mib: 32,
            vcpus: 1,
            ..Default::default()
        })
        .await
        .expect("register image");
        c.build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
            image_id: id.into(),
            settle_ms: 50,
            ..Default::default()
        })
        .await
        .expect("build golden snapshot")
        .into_inner()
    }

    pub async fn create(&self, image: &str, key: &str) -> pb::Session {
        self.sessions()
            .await
            .create_session(pb::CreateSessionRequest {
                image_id: image.into(),
                idempotency_key: key.into(),
                ..Default::default()
            })
            .await
            .expect("create session")
            .into_inner()
    }

    pub async fn get(&self, id: &str) -> pb::Session {
        self.sessions()
            .await
            .get_session(pb::SessionRef {
                session_id: id.into(),
            })
            .await
            .expect("get session")
            .into_inner()
    }

    /// Polls until session `id` is in `state` (generous timeout; asserts
    /// nothing about speed).
    pub async fn wait_state(&self, id: &str, state: S) -> pb::Session {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let s = self.get(id).await;
            if s.state == state as i32 {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "session {id} never became {state:?}; it is {:?}",
                S::try_from(s.state)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn usage_of(&self, id: &str) -> Vec<pb::UsageRecord> {
        self.usage()
            .await
            .list_usage(pb::ListUsageRequest {
                session_id: id.into(),
                limit: 10_000,
                ..Default::default()
            })
            .await
            .expect("list usage")
            .into_inner()
            .records
    }

    /// Reads events with seq > since until `n` arrived.
    pub async fn events_since(&self, since: u64, n: usize) -> Vec<pb::Event> {
        let mut stream = self
            .events()
            .await
            .watch(pb::WatchRequest {
                since_seq: since,
                session_id: String::new(),
            })
            .await
            .expect("watch")
            .into_inner();
        let mut out = Vec::new();
        while out.len() < n {
            let e = tokio::time::timeout(Duration::from_secs(120), stream.message())
                .await
                .expect("event in time")
                .expect("stream ok")
                .expect("stream open");
            out.push(e);
        }
        out
    }
}

/// Kills every process whose command line mentions `dir` (vmm processes of a
/// test's state directory).
pub fn kill_processes_under(dir: &Path) {
    let needle = dir.display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            if String::from_utf8_lossy(&cmd).contains(&needle) {
                // SAFETY: kill(2) has no memory-safety preconditions.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
        kill_processes_under(self.dir.path());
    }
}

/// Sends SIGKILL to `pid`.
pub fn sigkill(pid: u32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid as i32, libc::SIGKILL);
    }
}

/// Checks usage records of one session: seqs increase, intervals are
/// contiguous, cumulative counters never decrease.
pub fn check_usage_chain(recs: &[pb::UsageRecord]) {
    for w in recs.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        assert!(b.seq > a.seq, "seq increases");
        assert_eq!(
            b.interval_start, a.interval_end,
            "intervals are contiguous: {a:?} {b:?}"
        );
        assert!(b.interval_end >= b.interval_start);
        assert!(b.billed_seconds >= a.billed_seconds);
        assert!(b.vcpu_seconds >= a.vcpu_seconds);
        assert!(b.memory_allocated_gib_seconds >= a.memory_allocated_gib_seconds);
        assert!(b.memory_resident_gib_seconds >= a.memory_resident_gib_seconds);
        assert!(b.disk_bytes_written >= a.disk_bytes_written);
        assert!(!a.r#final, "only the last record is final");
    }
}

/// Whether `vmm jail` can run here; prints why not.
pub fn jail_supported() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: jailed vmm processes need root (namespaces, cgroups)");
        return false;
    }
    let cg = Path::new("/sys/fs/cgroup");
    if !cg.join("cgroup.controllers").exists() && !cg.join("memory/cgroup.procs").exists() {
        println!("skipped: no cgroup v2 or v1 memory hierarchy at /sys/fs/cgroup");
        return false;
    }
    true
}

/// Runs git in `dir` with a fixed identity and no system or user config;
/// panics with git's stderr on failure, returns its trimmed stdout.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=Test", "-c", "user.email=test@example.com"])
        .args(["-c", "safe.directory=*"])
        .args(args)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .output()
        .expect("git runs");
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// `dir/repo`: a repository with one commit on `main`, in a directory
/// everyone may enter (a jailed or dropped-privilege reader gets to it).
pub fn repo_with_main(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let repo = dir.join("repo");
    std::fs::create_dir_all(&repo).unwrap();
    git(&repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("README.md"), "hello\n").unwrap();
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-q", "-m", "initial"]);
    repo
}
