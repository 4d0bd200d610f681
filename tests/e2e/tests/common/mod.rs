//! What the suites that run guest-init as a host process share: guest-init
//! serving on a Unix socket behind the harness's CONNECT shim, its
//! repository, a session of it, and the Exec and audit calls.
// Each test file uses a part of this module.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use proto::hostagent as pb;
use proto::hostagent::exec_request::Kind as Req;
use proto::hostagent::exec_response::Kind as Resp;
use sha2::{Digest, Sha256};
use test_harness::agent::Agent;
use test_harness::bin::guest_init_path;
use test_harness::git::repo_with_files;
use test_harness::vsock_shim;

pub const RULES: &str = r#"---
description: test agent
permission:
  bash:
    "*": ask
    "echo *": allow
    "cat": allow
    "git *": allow
    "git push *": deny
---
# Coder
"#;

pub struct Guest {
    dir: tempfile::TempDir,
    child: Child,
}

impl Guest {
    pub fn repo(&self) -> PathBuf {
        self.dir.path().join("repo")
    }
    pub fn vsock(&self) -> PathBuf {
        self.dir.path().join("vsock.sock")
    }
}

impl Guest {
    /// Kills guest-init and starts a new one in the same place (the
    /// workspace stays): it knows no session, as a guest that lost its
    /// memory would not.
    #[allow(dead_code)]
    pub async fn restart_guest_init(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(self.dir.path().join("guest-init.sock"));
        self.child = spawn_guest_init(self.dir.path()).await;
    }
}

/// guest-init serving on `dir`/guest-init.sock (workspace `dir`/workspace,
/// log `dir`/guest-init.log), once it listens.
async fn spawn_guest_init(dir: &std::path::Path) -> Child {
    let gi_sock = dir.join("guest-init.sock");
    let child = Command::new(guest_init_path())
        .arg("serve")
        .arg("--listen")
        .arg(format!("unix:{}", gi_sock.display()))
        .arg("--workspace")
        .arg(dir.join("workspace"))
        .arg("--turns")
        .arg("process-tree")
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("guest-init.log"))
                .unwrap(),
        )
        .spawn()
        .expect("spawning guest-init");
    for _ in 0..600 {
        if gi_sock.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gi_sock.exists(), "guest-init did not listen");
    child
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// guest-init serving on a Unix socket, a repository, and the CONNECT shim.
pub async fn start_guest() -> Guest {
    start_guest_with_rules(RULES).await
}

/// As [`start_guest`], with `rules` as the coder agent's rules.
pub async fn start_guest_with_rules(rules: &str) -> Guest {
    let dir = tempfile::tempdir().unwrap();
    repo_with_files(
        dir.path(),
        &[
            ("agents/coder.md", rules),
            ("agent-manifest.yaml", "version: 1\nagents:\n  coder: {}\n"),
            ("README.md", "hello\n"),
        ],
    );

    let gi_sock = dir.path().join("guest-init.sock");
    let child = spawn_guest_init(dir.path()).await;
    // The shim: `CONNECT <guest-init's port>` on the "vsock" socket is
    // relayed to guest-init's socket.
    vsock_shim::relay(
        &dir.path().join("vsock.sock"),
        proto::guest::DEFAULT_VSOCK_PORT,
        gi_sock,
    )
    .unwrap();
    Guest { dir, child }
}

pub async fn exec(
    agent: &Agent,
    s: &pb::Session,
    argv: &[&str],
    stdin: Vec<Req>,
) -> Result<(Vec<Resp>, String), tonic::Status> {
    let mut msgs = vec![pb::ExecRequest {
        kind: Some(Req::Start(pb::ExecStart {
            session_id: s.session_id.clone(),
            execution_id: s.execution_id.clone(),
            argv: argv.iter().map(|a| a.to_string()).collect(),
            keep_stdin_open: !stdin.is_empty(),
            ..Default::default()
        })),
    }];
    msgs.extend(stdin.into_iter().map(|k| pb::ExecRequest { kind: Some(k) }));
    let mut ex = pb::exec_client::ExecClient::new(agent.channel().await);
    let mut stream = ex.exec(tokio_stream::iter(msgs)).await?.into_inner();
    let mut out = Vec::new();
    let mut stdout = String::new();
    while let Some(m) = tokio::time::timeout(Duration::from_secs(60), stream.message())
        .await
        .expect("exec output in time")?
    {
        let k = m.kind.unwrap();
        if let Resp::Stdout(d) = &k {
            stdout.push_str(&String::from_utf8_lossy(d));
        }
        out.push(k);
    }
    Ok((out, stdout))
}

pub fn exit_code(out: &[Resp]) -> Option<i32> {
    out.iter().find_map(|k| match k {
        Resp::Exit(pb::ExecExit {
            status: Some(pb::exec_exit::Status::Code(c)),
            ..
        }) => Some(*c),
        _ => None,
    })
}

pub async fn host_audit(agent: &Agent, s: &pb::Session) -> Vec<pb::AuditRecord> {
    let audit = pb::approvals_client::ApprovalsClient::new(agent.channel().await)
        .list_audit(pb::ListAuditRequest {
            session_id: s.session_id.clone(),
            since_guest_seq: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .records;
    let mut prev = String::new();
    for a in &audit {
        let mut h = Sha256::new();
        h.update(prev.as_bytes());
        h.update(a.json.as_bytes());
        assert_eq!(
            a.host_hash,
            hex::encode(h.finalize()),
            "chain broken at {a:?}"
        );
        prev = a.host_hash.clone();
    }
    audit
}

/// Creates a session of the guest-init image on the guest's repository.
pub async fn guest_init_session(agent: &Agent, guest: &Guest) -> pb::Session {
    agent
        .sessions()
        .await
        .create_session(pb::CreateSessionRequest {
            image_id: "gi".into(),
            repository_path: guest.repo().display().to_string(),
            agent: "coder".into(),
            base_ref: "main".into(),
            ..Default::default()
        })
        .await
        .expect("create on guest-init Ready")
        .into_inner()
}
