//! A session's environment and secrets end to end: host-agent (with a
//! `secrets_dir`), guest-init run as a host process behind the CONNECT shim,
//! and the vmm. A secret the repository's manifest grants the agent is in
//! its commands' environment (inline and from a `secret_refs` file), one it
//! does not grant is not; the session's `env` reaches every command; the
//! values are redacted from output; and after the run no value is anywhere
//! in host-agent's directory (database, WAL, logs, the snapshot) or in what
//! its API says (events, audit, usage).

mod common;

use std::collections::HashMap;
use std::path::Path;
use test_harness::files::files_holding;

use common::{exec, exit_code, host_audit, start_guest};
use proto::hostagent as pb;
use sha2::{Digest, Sha256};
use test_harness::agent::{Agent, S};
use test_harness::git::git;

const INLINE: &str = "e2e-inline-secret-4be1c07d";
const NOT_GRANTED: &str = "e2e-ungranted-secret-93a2f6";
const FROM_REF: &str = "e2e-node-file-secret-2d7c85e1";
const REF_NOT_GRANTED: &str = "e2e-node-file-ungranted-6f0b";

const RULES: &str = r#"---
description: secrets test agent
permission:
  bash:
    "*": ask
    "printenv *": allow
    "sha256sum": allow
---
# Coder
"#;
const MANIFEST: &str = "version: 1\nagents:\n  coder:\n    secrets: [GRANTED_TOKEN, NODE_TOKEN]\n";

fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_granted_secret_reaches_commands_an_ungranted_one_does_not_and_none_is_kept() {
    let guest = start_guest().await;
    // This test's rules and grant, committed on main.
    let repo = guest.repo();
    std::fs::write(repo.join("agents/coder.md"), RULES).unwrap();
    std::fs::write(repo.join("agent-manifest.yaml"), MANIFEST).unwrap();
    git(&repo, &["commit", "-q", "-am", "grant secrets"]);
    let secrets = tempfile::tempdir().unwrap();
    std::fs::write(secrets.path().join("NODE_TOKEN"), format!("{FROM_REF}\n")).unwrap();
    std::fs::write(secrets.path().join("NODE_OTHER"), REF_NOT_GRANTED).unwrap();

    let vsock = guest.vsock().display().to_string();
    let agent = Agent::start(&[
        "--guest-vsock-uds",
        &vsock,
        "--no-vsock-device",
        "--secrets-dir",
        &secrets.path().display().to_string(),
    ]);
    agent.guest_init_image().await;
    let s = agent
        .sessions()
        .await
        .create_session(pb::CreateSessionRequest {
            image_id: "gi".into(),
            repository_path: repo.display().to_string(),
            agent: "coder".into(),
            base_ref: "main".into(),
            env: map(&[("GREETING", "hello-env")]),
            secrets: map(&[("GRANTED_TOKEN", INLINE), ("OTHER_TOKEN", NOT_GRANTED)]),
            secret_refs: vec!["NODE_TOKEN".into(), "NODE_OTHER".into()],
            ..Default::default()
        })
        .await
        .expect("create with env and secrets")
        .into_inner();
    assert_eq!(s.state, S::Running as i32);

    // Granted, inline and from the node's file: in the environment, and
    // redacted from the output.
    for name in ["GRANTED_TOKEN", "NODE_TOKEN"] {
        let (out, stdout) = exec(&agent, &s, &["printenv", name], vec![]).await.unwrap();
        assert_eq!(exit_code(&out), Some(0), "{name}: {out:?}");
        assert_eq!(stdout, format!("[REDACTED:{name}]\n"));
    }
    // The value itself, through a digest the redaction cannot recognise.
    let (out, stdout) = exec(
        &agent,
        &s,
        &["sh", "-c", "printenv GRANTED_TOKEN | sha256sum"],
        vec![],
    )
    .await
    .unwrap();
    assert_eq!(exit_code(&out), Some(0), "{out:?}");
    let digest = hex::encode(Sha256::digest(format!("{INLINE}\n")));
    assert_eq!(stdout, format!("{digest}  -\n"));
    // Not granted: not there.
    for name in ["OTHER_TOKEN", "NODE_OTHER"] {
        let (out, stdout) = exec(&agent, &s, &["printenv", name], vec![]).await.unwrap();
        assert_eq!(exit_code(&out), Some(1), "{name}: {out:?}");
        assert_eq!(stdout, "", "{name}");
    }
    // The session's environment reaches every command.
    let (_, stdout) = exec(&agent, &s, &["printenv", "GREETING"], vec![])
        .await
        .unwrap();
    assert_eq!(stdout, "hello-env\n");
    // Deliveries are audited by name.
    let audit = host_audit(&agent, &s).await;
    let delivered: Vec<&str> = audit
        .iter()
        .filter(|a| a.json.contains("\"secret.delivered\""))
        .map(|a| a.json.as_str())
        .collect();
    assert!(
        delivered.iter().any(|j| j.contains("\"GRANTED_TOKEN\"")),
        "{delivered:?}"
    );
    assert!(
        delivered.iter().any(|j| j.contains("\"NODE_TOKEN\"")),
        "{delivered:?}"
    );
    assert!(
        !delivered.iter().any(|j| j.contains("OTHER")),
        "{delivered:?}"
    );

    // A snapshot and a stop, then look for the values everywhere.
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
    assert!(Path::new(&snap.snapshot_dir).starts_with(agent.state_dir()));
    agent.stop(&s.session_id).await;
    let mut text = format!("{:?}", agent.session_events(&s.session_id).await);
    text.push_str(&format!("{:?}", host_audit(&agent, &s).await));
    text.push_str(&format!("{:?}", agent.usage_of(&s.session_id).await));
    assert!(
        text.contains("secret.delivered"),
        "the audit is in the text"
    );
    let mut found = Vec::new();
    files_holding(agent.dir.path(), s.session_id.as_bytes(), &mut found);
    assert!(
        found.iter().any(|f| f.contains("host-agent.db")),
        "the search missed the database: {found:?}"
    );
    for v in [INLINE, NOT_GRANTED, FROM_REF, REF_NOT_GRANTED] {
        let mut found = Vec::new();
        files_holding(agent.dir.path(), v.as_bytes(), &mut found);
        assert!(found.is_empty(), "{v} is in {found:?}");
        assert!(!text.contains(v), "the API tells {v}");
    }
}
