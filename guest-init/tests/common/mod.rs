//! guest-init's test helpers: real temporary git repositories, the session
//! agent served in-process on a Unix socket, and a small protocol client.
//! git itself is the shared harness's (`test_harness::git`), run through
//! this process's reaper.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use guest_init::agent::{self, Config};
use guest_init::channel::unix::UnixTransport;
use guest_init::reaper;
use guest_init::turn::Backend;
use proto::framing::{decode_payload, encode_frame, FrameDecoder, DEFAULT_MAX_FRAME};
use proto::guest::{
    answer::Reply, exec_exited, guest_message::Kind as Out, host_message::Kind as In, output,
    Answer, EndTurn, Exec, GuestMessage, Hello, HostMessage, RepoChunk, StartSession,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

pub const TIMEOUT: Duration = Duration::from_secs(30);

/// Runs a command to completion. The agent's reaper runs in this process,
/// so the child is registered with it like every child guest-init spawns.
pub fn output(cmd: &mut Command) -> std::io::Result<std::process::Output> {
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let m = reaper::managed();
    let child = {
        let mut guard = m.lock();
        let child = cmd.spawn()?;
        guard.insert(child.id());
        child
    };
    let pid = child.id();
    let out = child.wait_with_output();
    reaper::release(Some(pid));
    out
}

/// Runs git (the shared harness's fixed identity and empty config) through
/// [`output`], panicking with its stderr on failure; returns its trimmed
/// stdout.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = output(&mut test_harness::git::command(dir, args)).expect("git runs");
    test_harness::git::check(args, &out)
}

/// A temporary origin repository.
pub struct Repo {
    pub dir: tempfile::TempDir,
}

pub const CODER_RULES: &str = r#"---
description: test agent
permission:
  edit: allow
  webfetch: deny
  bash:
    "*": ask
    "echo *": allow
    "git *": allow
    "git push *": deny
    "true": allow
    "env": allow
    "cat": allow
    "tee *": allow
    "sleep *": allow
    "pwd": allow
    "sh -c *": deny
---
# Coder
"#;

pub const MANIFEST: &str = "version: 1\nagents:\n  coder:\n    secrets: [TOKEN, OTHER]\n    egress:\n      - cidr: 198.51.100.0/24\n        ports: [443]\n  free:\n    egress:\n      - cidr: 203.0.113.0/24\n        ports: [443]\n";

pub const FREE_RULES: &str = "---\npermission:\n  bash: allow\n---\n";

impl Repo {
    /// A repository with the coder and free agents and the manifest on main.
    pub fn new() -> Self {
        Self::with_files(&[
            ("agents/coder.md", CODER_RULES),
            ("agents/free.md", FREE_RULES),
            ("agent-manifest.yaml", MANIFEST),
            ("README.md", "hello\n"),
        ])
    }

    pub fn with_files(files: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        git(dir.path(), &["init", "-q", "-b", "main"]);
        for (p, text) in files {
            let full = dir.path().join(p);
            std::fs::create_dir_all(full.parent().unwrap()).unwrap();
            std::fs::write(full, text).unwrap();
        }
        git(dir.path(), &["add", "-A"]);
        git(dir.path(), &["commit", "-q", "-m", "initial"]);
        git(dir.path(), &["tag", "v1"]);
        Self { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn head(&self) -> String {
        git(self.path(), &["rev-parse", "HEAD"])
    }

    /// `git bundle create - --all`.
    pub fn bundle(&self) -> Vec<u8> {
        let out = output(&mut test_harness::git::command(
            self.path(),
            &["bundle", "create", "-q", "-", "--all"],
        ))
        .unwrap();
        assert!(out.status.success());
        out.stdout
    }
}

/// The agent served in this process.
pub struct Harness {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub workspace: PathBuf,
    pub state_dir: PathBuf,
    pub task: tokio::task::JoinHandle<std::io::Result<agent::Stop>>,
}

pub struct Options {
    pub backend: Option<Backend>,
    pub max_frame: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            backend: None,
            max_frame: DEFAULT_MAX_FRAME,
        }
    }
}

impl Harness {
    pub async fn start() -> Self {
        Self::start_with(Options::default()).await
    }

    pub async fn start_with(opts: Options) -> Self {
        let dir = tempfile::tempdir().unwrap();
        // The agent's commands run as an unprivileged uid when we are root;
        // they must be able to reach the workspace.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let socket = dir.path().join("agent.sock");
        let workspace = dir.path().join("workspace");
        let state_dir = dir.path().join("state");
        let _ = reaper::become_subreaper();
        tokio::spawn(reaper::run());
        let cfg = Config {
            workspace: workspace.clone(),
            state_dir: state_dir.clone(),
            identity: guest_init::privilege::agent_identity(None),
            turn_backend: opts.backend.unwrap_or_else(guest_init::turn::detect),
            apply_egress: false,
            hosts_file: dir.path().join("hosts"),
            max_frame: opts.max_frame,
            set_clock: false,
            own_machine: false,
        };
        let mut transport = UnixTransport::bind(&socket).unwrap();
        let task = tokio::spawn(async move { agent::serve(&mut transport, cfg).await });
        Self {
            dir,
            socket,
            workspace,
            state_dir,
            task,
        }
    }

    pub async fn connect(&self) -> Client {
        Client::connect(&self.socket).await
    }

    /// Connects, says hello and starts a session of `agent` at `base_ref`.
    pub async fn session(&self, repo: &Repo, agent: &str, base_ref: &str) -> Client {
        let mut c = self.connect().await;
        c.hello().await;
        let ready = c
            .start_session(&SessionSpec::new("s1", agent, base_ref), &repo.bundle())
            .await;
        assert!(
            matches!(ready, Out::Ready(_)),
            "session did not start: {ready:?}"
        );
        c
    }

    pub fn audit_log(&self, session_id: &str) -> PathBuf {
        self.state_dir.join(format!("audit-{session_id}.jsonl"))
    }
}

pub struct SessionSpec {
    pub id: String,
    pub agent: String,
    pub base_ref: String,
    pub allowlist: Vec<String>,
    pub secrets: BTreeMap<String, String>,
    /// The session's env beyond the git identity every spec gets.
    pub env: BTreeMap<String, String>,
    pub ask_timeout_ms: u32,
    /// StartSession's size fields (vcpus, mem_mib, root_disk_bytes).
    pub size: (u32, u32, u64),
    /// StartSession's virtio-fs shares to mount.
    pub mounts: Vec<proto::guest::Mount>,
}

impl SessionSpec {
    pub fn new(id: &str, agent: &str, base_ref: &str) -> Self {
        Self {
            id: id.into(),
            agent: agent.into(),
            base_ref: base_ref.into(),
            allowlist: vec![],
            secrets: BTreeMap::new(),
            env: BTreeMap::new(),
            ask_timeout_ms: 0,
            size: (0, 0, 0),
            mounts: vec![],
        }
    }
}

/// What became of one Exec.
#[derive(Debug, Default)]
pub struct ExecResult {
    pub pid: Option<u32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub output_chunks: usize,
    pub status: Option<exec_exited::Status>,
    pub rejected: Option<(String, String)>,
    pub error: Option<(i32, String)>,
    pub asks: Vec<proto::guest::AskRequest>,
}

impl ExecResult {
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    pub fn code(&self) -> Option<i32> {
        match self.status {
            Some(exec_exited::Status::Code(c)) => Some(c),
            _ => None,
        }
    }
}

/// A protocol client.
pub struct Client {
    stream: UnixStream,
    decoder: FrameDecoder,
    /// Every AuditEvent JSON line received, in order.
    pub audit: Vec<String>,
    /// Every message received, for scanning.
    pub all: Vec<GuestMessage>,
    backlog: std::collections::VecDeque<Out>,
}

pub fn exec_msg(id: &str, turn: &str, argv: &[&str]) -> Exec {
    Exec {
        exec_id: id.into(),
        turn_id: turn.into(),
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

impl Client {
    /// Connects, retrying while the socket exists but does not listen yet.
    pub async fn connect(path: &Path) -> Self {
        let mut tries = 0;
        let stream = loop {
            match UnixStream::connect(path).await {
                Ok(s) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused && tries < 2000 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(e) => panic!("connect {}: {e}", path.display()),
            }
        };
        Self {
            stream,
            decoder: FrameDecoder::new(DEFAULT_MAX_FRAME),
            audit: Vec::new(),
            all: Vec::new(),
            backlog: Default::default(),
        }
    }

    pub async fn send(&mut self, kind: In) {
        let frame = encode_frame(&HostMessage { kind: Some(kind) }, DEFAULT_MAX_FRAME).unwrap();
        self.send_raw(&frame).await;
    }

    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    /// The next message (AuditEvents are recorded and skipped); None at EOF.
    pub async fn recv(&mut self) -> Option<Out> {
        if let Some(m) = self.backlog.pop_front() {
            return Some(m);
        }
        loop {
            let m = tokio::time::timeout(TIMEOUT, self.recv_any())
                .await
                .expect("timed out waiting for the agent")?;
            if let Out::AuditEvent(a) = &m {
                self.audit.push(a.json.clone());
                continue;
            }
            return Some(m);
        }
    }

    async fn recv_any(&mut self) -> Option<Out> {
        let mut buf = vec![0u8; 65536];
        loop {
            if let Some(p) = self.decoder.next_frame().unwrap() {
                let m: GuestMessage = decode_payload(&p).unwrap();
                self.all.push(m.clone());
                return m.kind;
            }
            let n = self.stream.read(&mut buf).await.ok()?;
            if n == 0 {
                return None;
            }
            self.decoder.push(&buf[..n]);
        }
    }

    /// Waits for a message matching `f`, keeping others for later.
    pub async fn expect<T>(&mut self, mut f: impl FnMut(&Out) -> Option<T>) -> T {
        let mut kept = Vec::new();
        loop {
            let m = self.recv().await.expect("connection closed while waiting");
            if let Some(t) = f(&m) {
                for k in kept.into_iter().rev() {
                    self.backlog.push_front(k);
                }
                return t;
            }
            kept.push(m);
        }
    }

    pub async fn expect_error(&mut self) -> (i32, String) {
        self.expect(|m| match m {
            Out::Error(e) => Some((e.code, e.message.clone())),
            _ => None,
        })
        .await
    }

    pub async fn hello(&mut self) {
        self.send(In::Hello(Hello {
            protocol_version: 1,
            software: "test".into(),
        }))
        .await;
        self.expect(|m| matches!(m, Out::Hello(_)).then_some(()))
            .await;
    }

    /// Sends StartSession and the bundle; returns Ready or Error.
    pub async fn start_session(&mut self, spec: &SessionSpec, bundle: &[u8]) -> Out {
        self.send(In::StartSession(StartSession {
            // No host time: these guests share this machine's clock, which must not move.
            host_time_unix_ns: 0,
            session_id: spec.id.clone(),
            agent: spec.agent.clone(),
            base_ref: spec.base_ref.clone(),
            bundle_size: bundle.len() as u64,
            secret_allowlist: spec.allowlist.clone(),
            secrets: spec.secrets.clone().into_iter().collect(),
            env: [
                ("GIT_AUTHOR_NAME", "Agent"),
                ("GIT_AUTHOR_EMAIL", "agent@example.com"),
                ("GIT_COMMITTER_NAME", "Agent"),
                ("GIT_COMMITTER_EMAIL", "agent@example.com"),
            ]
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .chain(spec.env.clone())
            .collect(),
            ask_timeout_ms: spec.ask_timeout_ms,
            vcpus: spec.size.0,
            mem_mib: spec.size.1,
            root_disk_bytes: spec.size.2,
            // Not PID 1: mixed into nothing (the test machine's pool stays).
            entropy: vec![7; 64],
            mounts: spec.mounts.clone(),
        }))
        .await;
        let chunks: Vec<&[u8]> = bundle.chunks(1000).collect();
        for (i, c) in chunks.iter().enumerate() {
            self.send(In::RepoChunk(RepoChunk {
                data: c.to_vec(),
                last: i + 1 == chunks.len(),
            }))
            .await;
        }
        self.expect(|m| matches!(m, Out::Ready(_) | Out::Error(_)).then(|| m.clone()))
            .await
    }

    pub async fn exec(&mut self, e: Exec) {
        self.send(In::Exec(e)).await;
    }

    /// Collects one exec's messages until it exits or is rejected. Asks are
    /// answered with `answer` (None: not answered).
    pub async fn finish(&mut self, exec_id: &str, answer: Option<Reply>) -> ExecResult {
        let mut r = ExecResult::default();
        let mut kept = Vec::new();
        loop {
            let m = self.recv().await.expect("connection closed during exec");
            match &m {
                Out::ExecStarted(s) if s.exec_id == exec_id => r.pid = Some(s.pid),
                Out::Output(o) if o.exec_id == exec_id => {
                    r.output_chunks += 1;
                    if o.stream == output::Stream::Stdout as i32 {
                        r.stdout.extend_from_slice(&o.data);
                    } else {
                        r.stderr.extend_from_slice(&o.data);
                    }
                }
                Out::ExecExited(x) if x.exec_id == exec_id => {
                    r.status = x.status;
                    break;
                }
                Out::ExecRejected(x) if x.exec_id == exec_id => {
                    r.rejected = Some((x.reason.clone(), x.rule.clone()));
                    break;
                }
                Out::Error(e) if e.exec_id == exec_id => {
                    r.error = Some((e.code, e.message.clone()));
                    break;
                }
                Out::AskRequest(a) if a.exec_id == exec_id => {
                    r.asks.push(a.clone());
                    if let Some(reply) = answer {
                        let ask_id = a.ask_id.clone();
                        self.send(In::Answer(Answer {
                            ask_id,
                            reply: reply as i32,
                        }))
                        .await;
                    }
                }
                _ => kept.push(m),
            }
        }
        for k in kept.into_iter().rev() {
            self.backlog.push_front(k);
        }
        r
    }

    /// Runs argv to completion in turn "t".
    pub async fn run(&mut self, id: &str, argv: &[&str]) -> ExecResult {
        self.exec(exec_msg(id, "t", argv)).await;
        self.finish(id, None).await
    }

    pub async fn end_turn(&mut self, turn: &str) -> proto::guest::TurnEnded {
        self.send(In::EndTurn(EndTurn {
            turn_id: turn.into(),
        }))
        .await;
        self.expect(|m| match m {
            Out::TurnEnded(t) if t.turn_id == turn => Some(t.clone()),
            _ => None,
        })
        .await
    }

    /// Every byte the agent sent on this connection, for redaction checks.
    pub fn transcript(&self) -> Vec<u8> {
        use proto::Message;
        let mut v = Vec::new();
        for m in &self.all {
            v.extend(m.encode_to_vec());
        }
        v
    }
}

/// Pids of live (non-zombie) processes whose command line is `cmd`.
/// Polls `cond` until it holds or 60 s have passed. Processes can take
/// seconds to start or vanish on a loaded machine; only a real failure runs
/// into the limit, and the caller's assertion then says which.
pub async fn wait_for(cond: impl Fn() -> bool) {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    while !cond() && tokio::time::Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn processes_matching(cmd: &str) -> Vec<u32> {
    reaper::all_processes()
        .into_iter()
        .filter(|p| p.state != 'Z' && reaper::cmdline(p.pid) == cmd)
        .map(|p| p.pid)
        .collect()
}

pub fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}
