//! A real host-agent process on a loopback port, with a real vmm and the
//! `counter` test guest, and its gRPC clients.
//!
//! host-agent is started as the local admin with files allowed from
//! anywhere (unless a test passes its own authorization flags or
//! `--no-test-defaults`); its vmm processes are killed with it when the
//! [`Agent`] is dropped.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use proto::hostagent as pb;
use proto::hostagent::{
    events_client::EventsClient, images_client::ImagesClient, node_client::NodeClient,
    sessions_client::SessionsClient, usage_client::UsageClient,
};
use tonic::transport::Channel;

use crate::bin::{host_agent_path, vmm_path};
use crate::guests::counter_kernel;
use crate::process::kill_processes_under;

/// Session states, short.
pub use pb::SessionState as S;

/// A host-agent process on a loopback port, SIGKILLed (with every vmm
/// under its directory) when dropped.
pub struct Agent {
    /// The test's directory: host-agent's logs and `state/`.
    pub dir: tempfile::TempDir,
    /// host-agent's gRPC address, `http://127.0.0.1:<port>`.
    pub addr: String,
    child: Option<Child>,
    extra: Vec<String>,
    envs: Vec<(String, String)>,
    spawns: u32,
}

impl Agent {
    /// Starts host-agent on a fresh state directory with `extra` flags.
    pub fn start(extra: &[&str]) -> Agent {
        Agent::start_with_env(extra, &[])
    }

    /// [`Agent::start`] with `envs` set in host-agent's environment (as
    /// `AGENTVM_VIRTIOFSD`, say), on every start.
    pub fn start_with_env(extra: &[&str], envs: &[(&str, &str)]) -> Agent {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut a = Agent {
            dir,
            addr: String::new(),
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            envs: envs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
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
        let mut cmd = Command::new(host_agent_path());
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
            .envs(self.envs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
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

    /// The log (stderr) of host-agent's latest start, for a failing
    /// test's message.
    pub fn log(&self) -> String {
        let path = self.dir.path().join(format!("agent-{}.log", self.spawns));
        std::fs::read_to_string(path).unwrap_or_default()
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
                ..Default::default()
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

    /// host-agent's state directory.
    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// A new connection to host-agent.
    pub async fn channel(&self) -> Channel {
        Channel::from_shared(self.addr.clone())
            .unwrap()
            .connect()
            .await
            .expect("connecting to host-agent")
    }

    /// An Images client.
    pub async fn images(&self) -> ImagesClient<Channel> {
        ImagesClient::new(self.channel().await)
    }
    /// A Sessions client.
    pub async fn sessions(&self) -> SessionsClient<Channel> {
        SessionsClient::new(self.channel().await)
    }
    /// An Events client.
    pub async fn events(&self) -> EventsClient<Channel> {
        EventsClient::new(self.channel().await)
    }
    /// A Usage client.
    pub async fn usage(&self) -> UsageClient<Channel> {
        UsageClient::new(self.channel().await)
    }
    /// A Node client.
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

    /// Creates a session of `image` with idempotency key `key`.
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

    /// Session `id`.
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

    /// Every usage record of session `id`.
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
                ..Default::default()
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

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
        kill_processes_under(self.dir.path());
    }
}
