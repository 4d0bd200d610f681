//! Scenario `node-secrets`: a session created with an environment variable
//! and secrets, inline and from host-agent's `secrets_dir`, on a repository
//! whose manifest grants the agent one of each. In the real guest the
//! granted secrets are in a command's environment (`printenv` shows them
//! redacted; their SHA-256 through a pipe shows the value is right), the
//! ungranted ones are absent, the variable is there; after Stop no value is
//! in host-agent's database, logs or small files, nor in its events or
//! audit.

use std::path::{Path, PathBuf};

use proto::hostagent as pb;
use sha2::{Digest, Sha256};

use super::{agent, exec, expect_ok, keep_logs, IMAGE};
use crate::inner::{Check, Ctx};

const RULES: &str = r#"---
description: the real-guest secrets scenario's agent
permission:
  bash:
    "*": ask
    "printenv *": allow
    "sha256sum": allow
---
# Coder
"#;
const MANIFEST: &str = "version: 1\nagents:\n  coder:\n    secrets: [RG_TOKEN, RG_NODE_TOKEN]\n";
const GRANTED: &str = "rg-inline-secret-5e0c2a97d1";
const NOT_GRANTED: &str = "rg-ungranted-secret-b83f10";
const FROM_REF: &str = "rg-node-file-secret-7a64c2e9";
const REF_NOT_GRANTED: &str = "rg-node-file-ungranted-1d9e";
/// Files larger than this (guest memory and disk images) are not searched:
/// they are the guests' own, and reading them in the outer VM is slow.
const SEARCHED_FILE_LIMIT: u64 = 16 << 20;

/// A repository whose manifest grants `coder` two of the secrets.
fn repository(ctx: &Ctx) -> Result<PathBuf, String> {
    super::scratch_repository(
        ctx,
        "secrets-repo",
        &[
            ("agents/coder.md", RULES),
            ("agent-manifest.yaml", MANIFEST),
        ],
    )
}

/// Granted secrets reach the agent's commands, ungranted ones do not, and
/// no value stays with host-agent.
pub fn secrets(ctx: &mut Ctx, name: &str) -> Check {
    let result = secrets_flow(ctx, name);
    keep_logs(ctx);
    result
}

fn secrets_flow(ctx: &mut Ctx, name: &str) -> Check {
    let repo = repository(ctx)?;
    // host-agent's secrets_dir (made here too: host-agent may not have
    // started yet); read at each create, so files written now count.
    let dir = super::host_agent::secrets_dir(ctx);
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    for (file, value) in [
        ("RG_NODE_TOKEN", format!("{FROM_REF}\n")),
        ("RG_NODE_OTHER", REF_NOT_GRANTED.to_string()),
    ] {
        let path = dir.join(file);
        std::fs::write(&path, value).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let a = agent(ctx)?;
    let ch = a.channel()?;
    let s = a.block_on(async {
        pb::sessions_client::SessionsClient::new(ch.clone())
            .create_session(pb::CreateSessionRequest {
                image_id: IMAGE.into(),
                repository_path: repo.display().to_string(),
                agent: "coder".into(),
                base_ref: "main".into(),
                env: [("RG_GREETING", "hello-from-env")]
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .into(),
                secrets: [("RG_TOKEN", GRANTED), ("RG_OTHER", NOT_GRANTED)]
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .into(),
                secret_refs: vec!["RG_NODE_TOKEN".into(), "RG_NODE_OTHER".into()],
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner())
            .map_err(|e| format!("CreateSession: {}", e.message()))
    })?;
    if s.state != pb::SessionState::Running as i32 {
        return Err(format!("the new session is not RUNNING: {s:?}"));
    }
    let mut notes = Vec::new();
    a.block_on(async {
        for (var, value) in [("RG_TOKEN", GRANTED), ("RG_NODE_TOKEN", FROM_REF)] {
            let r = exec(ch.clone(), &s, &["printenv", var]).await?;
            expect_ok(&format!("printenv {var}"), &r)?;
            if r.stdout != format!("[REDACTED:{var}]\n") {
                return Err(format!("printenv {var} printed {:?}", r.stdout));
            }
            let script = format!("printenv {var} | sha256sum");
            let r = exec(ch.clone(), &s, &["sh", "-c", &script]).await?;
            expect_ok(&script, &r)?;
            let want = hex::encode(Sha256::digest(format!("{value}\n")));
            if r.stdout.split_whitespace().next() != Some(want.as_str()) {
                return Err(format!("{script} printed {:?}, not {want}", r.stdout));
            }
        }
        for var in ["RG_OTHER", "RG_NODE_OTHER"] {
            let r = exec(ch.clone(), &s, &["printenv", var]).await?;
            if r.code() != Some(1) || !r.stdout.is_empty() {
                return Err(format!("the ungranted {var} is there: {:?}", r.out));
            }
        }
        let r = exec(ch.clone(), &s, &["printenv", "RG_GREETING"]).await?;
        if r.stdout != "hello-from-env\n" {
            return Err(format!("printenv RG_GREETING printed {:?}", r.stdout));
        }
        Ok::<_, String>(())
    })?;
    notes.push(
        "granted secrets (inline and from secrets_dir) in the environment, redacted in output, \
         digests right; ungranted ones absent; env there"
            .to_string(),
    );
    let text = a.block_on(async {
        let call = pb::SessionCall {
            session_id: s.session_id.clone(),
            idempotency_key: String::new(),
        };
        let mut se = pb::sessions_client::SessionsClient::new(ch.clone());
        se.stop_session(call)
            .await
            .map_err(|e| format!("StopSession: {}", e.message()))?;
        let mut events = pb::events_client::EventsClient::new(ch.clone())
            .watch(pb::WatchRequest {
                session_id: s.session_id.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("Watch: {}", e.message()))?
            .into_inner();
        let mut text = String::new();
        while let Ok(Ok(Some(e))) =
            tokio::time::timeout(std::time::Duration::from_secs(10), events.message()).await
        {
            text.push_str(&format!("{e:?}"));
        }
        let audit = pb::approvals_client::ApprovalsClient::new(ch.clone())
            .list_audit(pb::ListAuditRequest {
                session_id: s.session_id.clone(),
                since_guest_seq: 0,
            })
            .await
            .map_err(|e| format!("ListAudit: {}", e.message()))?
            .into_inner();
        text.push_str(&format!("{audit:?}"));
        Ok::<_, String>(text)
    })?;
    if !text.contains("secret.delivered") || !text.contains(&s.session_id) {
        return Err("the events and audit read back are not the session's".into());
    }
    let state = ctx.scratch.join("host-agent");
    // The search reads what it must: the session's id is in the database.
    let mut found = Vec::new();
    files_holding(&state, s.session_id.as_bytes(), &mut found);
    if !found.iter().any(|f| f.contains("host-agent.db")) {
        return Err(format!("the search missed the database: {found:?}"));
    }
    let mut searched = 0;
    for v in [GRANTED, NOT_GRANTED, FROM_REF, REF_NOT_GRANTED] {
        if text.contains(v) {
            return Err(format!("host-agent's events or audit hold {v}"));
        }
        let mut found = Vec::new();
        searched = files_holding(&state, v.as_bytes(), &mut found);
        for log in logs(&ctx.scratch) {
            if std::fs::read(&log)
                .unwrap_or_default()
                .windows(v.len())
                .any(|w| w == v.as_bytes())
            {
                found.push(log.display().to_string());
            }
        }
        if !found.is_empty() {
            return Err(format!("{v} is in {found:?}"));
        }
    }
    notes.push(format!(
        "no value in events, audit, host-agent's logs or its {searched} state files up to 16 MiB \
         (the database among them)"
    ));
    let a = agent(ctx)?;
    super::delete_stopped(a, &a.channel()?, &s.session_id)?;
    ctx.info(name, &notes.join("; "));
    Ok(notes.join("; "))
}

/// host-agent's logs in the scratch directory.
fn logs(scratch: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(scratch)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("host-agent-") && n.ends_with(".log"))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Adds to `found` the files under `dir` (links not followed, files over
/// [`SEARCHED_FILE_LIMIT`] skipped) holding `needle`; returns how many
/// files were searched.
fn files_holding(dir: &Path, needle: &[u8], found: &mut Vec<String>) -> usize {
    let mut searched = 0;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    for e in entries.flatten() {
        let path = e.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.is_dir() {
            searched += files_holding(&path, needle, found);
        } else if meta.is_file() && meta.len() <= SEARCHED_FILE_LIMIT {
            searched += 1;
            let data = std::fs::read(&path).unwrap_or_default();
            if data.windows(needle.len()).any(|w| w == needle) {
                found.push(path.display().to_string());
            }
        }
    }
    searched
}
