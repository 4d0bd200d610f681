//! A session's environment and secrets (CreateSession's `env`, `secrets`,
//! `secret_refs`) against the stand-in guest (`tests/common/fake_guest.rs`)
//! and a real vmm: the StartSession the guest gets carries the environment
//! and exactly the requested secrets the manifest grants the agent; bad
//! names, values and refs are refused naming the field; and after a run
//! (exec, snapshot, stop, a retry, a restart) no value is anywhere in
//! host-agent's state directory, its logs, the events, the audit or the
//! usage records.

mod common;

use std::collections::HashMap;
use std::path::Path;
use test_harness::files::files_holding;

use common::fake_guest::FakeGuest;
use common::*;
use proto::hostagent as pb;
use proto::hostagent::exec_request::Kind as Req;
use test_harness::bin::host_agent_path;
use test_harness::git::repo_with_files;
use tonic::Code;

/// Distinctive values, searched for after the run.
const INLINE: &str = "inline-secret-7c41e9d2b6";
const NOT_GRANTED: &str = "ungranted-secret-3f8a51c0";
const FROM_REF: &str = "node-file-secret-96d2e07b";
const REF_NOT_GRANTED: &str = "node-file-ungranted-0b7e44a1";
const FROM_STDIN: &str = "cli-stdin-secret-51aa6c3e";
const VALUES: [&str; 5] = [INLINE, NOT_GRANTED, FROM_REF, REF_NOT_GRANTED, FROM_STDIN];

const MANIFEST: &str =
    "version: 1\nagents:\n  good:\n    secrets: [INLINE_TOKEN, REF_TOKEN, CLI_TOKEN]\n";

fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The node's secrets_dir: one granted and one ungranted secret.
fn secrets_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("REF_TOKEN"), format!("{FROM_REF}\n")).unwrap();
    std::fs::write(d.path().join("REF_OTHER"), REF_NOT_GRANTED).unwrap();
    d
}

fn request(repo: &Path, key: &str) -> pb::CreateSessionRequest {
    pb::CreateSessionRequest {
        image_id: "gi".into(),
        repository_path: repo.display().to_string(),
        agent: "good".into(),
        base_ref: "main".into(),
        idempotency_key: key.into(),
        env: map(&[("GREETING", "hello"), ("RUST_LOG", "debug")]),
        secrets: map(&[("INLINE_TOKEN", INLINE), ("OTHER_TOKEN", NOT_GRANTED)]),
        secret_refs: vec!["REF_TOKEN".into(), "REF_OTHER".into()],
        ..Default::default()
    }
}

/// Everything the API says about session `id` (events, audit, usage), as text.
async fn api_text(agent: &Agent, id: &str) -> String {
    let mut text = format!("{:?}", agent.get(id).await);
    text.push_str(&format!("{:?}", agent.session_events(id).await));
    text.push_str(&format!("{:?}", agent.usage_of(id).await));
    let audit = pb::approvals_client::ApprovalsClient::new(agent.channel().await)
        .list_audit(pb::ListAuditRequest {
            session_id: id.into(),
            since_guest_seq: 0,
        })
        .await
        .expect("list audit")
        .into_inner();
    text.push_str(&format!("{audit:?}"));
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn granted_secrets_reach_the_guest_and_no_value_is_kept_anywhere() {
    let guest = FakeGuest::start();
    let secrets = secrets_dir();
    let mut agent = Agent::start(&[
        "--guest-vsock-uds",
        &guest.sock(),
        "--no-vsock-device",
        "--secrets-dir",
        &secrets.path().display().to_string(),
    ]);
    agent.guest_init_image().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_files(
        dir.path(),
        &[("agent-manifest.yaml", MANIFEST), ("README.md", "hi\n")],
    );

    let s = agent
        .sessions()
        .await
        .create_session(request(&repo, "k1"))
        .await
        .expect("create with env and secrets")
        .into_inner();
    assert_eq!(s.state, S::Running as i32);

    // The guest got the environment, and of the secrets exactly those both
    // requested and granted (OTHER_TOKEN and REF_OTHER never left the host).
    let start = guest.seen.starts.lock().unwrap()[&s.session_id].clone();
    assert_eq!(start.secret_allowlist, ["INLINE_TOKEN", "REF_TOKEN"]);
    assert_eq!(
        start.secrets,
        map(&[("INLINE_TOKEN", INLINE), ("REF_TOKEN", FROM_REF)])
    );
    assert_eq!(
        start.env,
        map(&[("GREETING", "hello"), ("RUST_LOG", "debug")])
    );

    // A retry is the same request; another secret value under the key is not.
    let again = agent
        .sessions()
        .await
        .create_session(request(&repo, "k1"))
        .await
        .expect("retry")
        .into_inner();
    assert_eq!(again.session_id, s.session_id);
    let mut changed = request(&repo, "k1");
    changed
        .secrets
        .insert("INLINE_TOKEN".into(), "another".into());
    let e = agent
        .sessions()
        .await
        .create_session(changed)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    // The CLI: a secret from standard input, an env variable, a ref.
    let mut cli = tokio::process::Command::new(host_agent_path())
        .args([
            "--addr",
            &agent.addr,
            "--output",
            "json",
            "sessions",
            "create",
            "gi",
        ])
        .args(["--repository", &repo.display().to_string()])
        .args(["--agent", "good", "--base-ref", "main"])
        .args(["--env", "FROM_CLI=yes", "--secret-stdin", "CLI_TOKEN"])
        .args(["--secret-ref", "REF_TOKEN"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use tokio::io::AsyncWriteExt;
        let mut stdin = cli.stdin.take().unwrap();
        stdin
            .write_all(format!("{FROM_STDIN}\n").as_bytes())
            .await
            .unwrap();
    }
    let out = cli.wait_with_output().await.unwrap();
    assert!(out.status.success(), "{out:?}");
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let cli_id = printed["session_id"].as_str().unwrap().to_string();
    let start = guest.seen.starts.lock().unwrap()[&cli_id].clone();
    assert_eq!(start.secret_allowlist, ["CLI_TOKEN", "REF_TOKEN"]);
    assert_eq!(start.secrets["CLI_TOKEN"], FROM_STDIN);
    assert_eq!(start.env, map(&[("FROM_CLI", "yes")]));

    // A command, a snapshot, a restart (its retry still matches: the
    // fingerprint key is kept), a stop.
    let mut ex = pb::exec_client::ExecClient::new(agent.channel().await);
    let mut stream = ex
        .exec(tokio_stream::iter(vec![pb::ExecRequest {
            kind: Some(Req::Start(pb::ExecStart {
                session_id: s.session_id.clone(),
                execution_id: s.execution_id.clone(),
                argv: vec!["printenv".into(), "INLINE_TOKEN".into()],
                ..Default::default()
            })),
        }]))
        .await
        .unwrap()
        .into_inner();
    while stream.message().await.unwrap().is_some() {}
    let snap = agent
        .sessions()
        .await
        .snapshot_session(pb::SessionCall {
            session_id: s.session_id.clone(),
            idempotency_key: String::new(),
        })
        .await
        .expect("snapshot")
        .into_inner();
    assert!(snap
        .snapshot_dir
        .starts_with(&agent.state_dir().display().to_string()));
    agent.kill9();
    agent.spawn();
    let retried = agent
        .sessions()
        .await
        .create_session(request(&repo, "k1"))
        .await
        .expect("retry after a restart")
        .into_inner();
    assert_eq!(retried.session_id, s.session_id);
    for id in [&s.session_id, &cli_id] {
        agent.stop(id).await;
    }

    // No value anywhere: the whole directory of host-agent (its state
    // directory with the database, its WAL and the snapshot, and its logs),
    // and everything the API tells about the sessions.
    let mut text = String::new();
    for id in [&s.session_id, &cli_id] {
        text.push_str(&api_text(&agent, id).await);
    }
    assert!(text.contains(&s.session_id) && text.contains(&cli_id));
    let logs: Vec<_> = std::fs::read_dir(agent.dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".log"))
        .collect();
    assert_eq!(logs.len(), 2, "one log per start");
    assert!(agent.state_dir().join("host-agent.db").exists());
    // The search reads what it must: the session's id is in the database.
    let mut found = Vec::new();
    files_holding(agent.dir.path(), s.session_id.as_bytes(), &mut found);
    assert!(
        found.iter().any(|f| f.contains("host-agent.db")),
        "the search missed the database: {found:?}"
    );
    for v in VALUES {
        let mut found = Vec::new();
        files_holding(agent.dir.path(), v.as_bytes(), &mut found);
        assert!(found.is_empty(), "{v} is in {found:?}");
        assert!(!text.contains(v), "the API tells {v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_environment_and_secrets_are_refused_naming_the_field() {
    let guest = FakeGuest::start();
    let secrets = secrets_dir();
    std::os::unix::fs::symlink("/etc/hostname", secrets.path().join("LINKED")).unwrap();
    let agent = Agent::start(&[
        "--guest-vsock-uds",
        &guest.sock(),
        "--no-vsock-device",
        "--secrets-dir",
        &secrets.path().display().to_string(),
    ]);
    agent.guest_init_image().await;
    agent.counter_image("plain").await;
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_files(dir.path(), &[("agent-manifest.yaml", MANIFEST)]);
    let with = |f: &dyn Fn(&mut pb::CreateSessionRequest)| {
        let mut r = pb::CreateSessionRequest {
            image_id: "gi".into(),
            repository_path: repo.display().to_string(),
            agent: "good".into(),
            base_ref: "main".into(),
            ..Default::default()
        };
        f(&mut r);
        r
    };
    let cases: Vec<(Code, &str, pb::CreateSessionRequest)> = vec![
        (
            Code::InvalidArgument,
            "env: the name \"PATH\" changes what commands run",
            with(&|r| r.env = map(&[("PATH", "/workspace/bin")])),
        ),
        (
            Code::InvalidArgument,
            "env: the name \"1X\" is not a variable name",
            with(&|r| r.env = map(&[("1X", "v")])),
        ),
        (
            Code::InvalidArgument,
            "env[\"A\"]: the value holds a NUL byte",
            with(&|r| r.env = map(&[("A", "a\0b")])),
        ),
        (
            Code::InvalidArgument,
            "secrets: the name \"LD_PRELOAD\"",
            with(&|r| r.secrets = map(&[("LD_PRELOAD", "x")])),
        ),
        (
            Code::InvalidArgument,
            "secrets[\"T\"]: the value is 65537 bytes",
            with(&|r| r.secrets = map(&[("T", &"v".repeat(65537))])),
        ),
        (
            Code::InvalidArgument,
            "secret_refs: the name \"../etc/shadow\"",
            with(&|r| r.secret_refs = vec!["../etc/shadow".into()]),
        ),
        (
            Code::FailedPrecondition,
            "secret_refs: \"MISSING\" is not a file in the node's secrets_dir",
            with(&|r| r.secret_refs = vec!["MISSING".into()]),
        ),
        (
            Code::FailedPrecondition,
            "secret_refs: \"LINKED\" in the node's secrets_dir is a symbolic link",
            with(&|r| r.secret_refs = vec!["LINKED".into()]),
        ),
        (
            Code::InvalidArgument,
            "env, secrets, secret_refs: image \"plain\" runs no guest-init",
            with(&|r| {
                r.image_id = "plain".into();
                r.secrets = map(&[("T", "v")]);
            }),
        ),
    ];
    let mut se = agent.sessions().await;
    for (code, needle, req) in cases {
        let e = se.create_session(req).await.unwrap_err();
        assert_eq!(e.code(), code, "{needle}: {e:?}");
        assert!(
            e.message().contains(needle),
            "{:?} lacks {needle:?}",
            e.message()
        );
    }
    // Nothing was created, nothing reached the guest.
    assert!(se
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sessions
        .is_empty());
    assert!(guest.seen.starts.lock().unwrap().is_empty());

    // A node without secrets_dir refuses refs; one whose secrets_dir is not a
    // directory does not start.
    let plain = Agent::start(&["--guest-vsock-uds", &guest.sock(), "--no-vsock-device"]);
    plain.guest_init_image().await;
    let e = plain
        .sessions()
        .await
        .create_session(with(&|r| r.secret_refs = vec!["REF_TOKEN".into()]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("no secrets_dir configured"), "{e:?}");
    let state = tempfile::tempdir().unwrap();
    let out = tokio::process::Command::new(host_agent_path())
        .args(["serve", "--listen", "127.0.0.1:0", "--no-jail"])
        .arg("--state-dir")
        .arg(state.path())
        .args(["--secrets-dir", "/nonexistent/secrets"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("secrets_dir /nonexistent/secrets is not a directory"),
        "{stderr}"
    );
}
