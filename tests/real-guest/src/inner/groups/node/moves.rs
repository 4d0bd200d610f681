//! Scenario `node-move`: a real session paused to disk moves to another
//! node. The group's host-agent (node `node-a`) and a second one started
//! here (`node-b`, its own state directory) share an image store (a
//! directory). The session commits a file on its branch and is paused to
//! disk on node-a; MoveSession to node-b pushes the image and the session's
//! bundle and leaves it STOPPED (`moved`) on node-a; node-b's
//! ResumeSession pulls both and restores it: RUNNING under the same id,
//! the file and its commit there, guest-init answering on the new node, its
//! audit chain continuing node-a's without a gap, and its branch fetched
//! back into the repository at Stop. Every session is removed afterwards,
//! passed or not, and node-b stopped.

use std::time::Instant;

use proto::hostagent as pb;
use tonic::transport::Channel;

use super::fork::{commit_file, run};
use super::host_agent::{image_store_dir, NODE_A, NODE_B};
use super::persist::{bounded, record_vmm, remove_sessions};
use super::sizing::open_repository;
use super::{agent, create_running, git, keep_logs, HostAgent};
use crate::inner::{Check, Ctx};

/// The file the session commits before its move, and what it holds.
const FILE: &str = "moved.txt";
const TEXT: &str = "committed on node-a before the move";

/// Move a paused real session from one node to another.
pub fn moves(ctx: &mut Ctx, name: &str) -> Check {
    let result = move_flow(ctx);
    keep_logs(ctx);
    let note = result?;
    ctx.info(name, &note);
    Ok(note)
}

fn move_flow(ctx: &mut Ctx) -> Check {
    let repo = open_repository(ctx)?;
    agent(ctx)?;
    let b = HostAgent::start_as(ctx, NODE_B, 0, None)?;
    let a = ctx.fixtures.agent.as_ref().ok_or("no host-agent")?;
    let (ch_a, ch_b) = (a.channel()?, b.channel()?);
    let (s, _) = create_running(a, &ch_a, &repo)?;
    let id = s.session_id.clone();
    let checked = move_checks(a, &ch_a, &b, &ch_b, &s, &repo, &ctx.out);
    keep_logs(ctx);
    // Wherever the session ended up: node-b's copy (none when the check
    // failed before the move), then node-a's row.
    let removed_b = remove_sessions(&b, &ch_b, std::slice::from_ref(&id));
    let removed_a = remove_sessions(a, &ch_a, std::slice::from_ref(&id));
    drop(b);
    // The outer VM's scratch space is memory: node-b's state and the store go.
    let _ = std::fs::remove_dir_all(ctx.scratch.join(format!("host-agent-{NODE_B}")));
    let _ = std::fs::remove_dir_all(image_store_dir(ctx));
    let note = checked?;
    removed_b?;
    removed_a?;
    Ok(note)
}

/// Audit records of `id` as host-agent `a` holds them.
async fn audit(ch: &Channel, id: &str) -> Result<Vec<pb::AuditRecord>, String> {
    let mut out: Vec<pb::AuditRecord> = Vec::new();
    loop {
        let page = pb::approvals_client::ApprovalsClient::new(ch.clone())
            .list_audit(pb::ListAuditRequest {
                session_id: id.into(),
                since_guest_seq: out.last().map_or(0, |r| r.guest_seq),
            })
            .await
            .map_err(|e| format!("ListAudit {id}: {}", e.message()))?
            .into_inner();
        out.extend(page.records);
        if !page.more {
            return Ok(out);
        }
    }
}

fn move_checks(
    a: &HostAgent,
    ch_a: &Channel,
    b: &HostAgent,
    ch_b: &Channel,
    s: &pb::Session,
    repo: &std::path::Path,
    out: &std::path::Path,
) -> Check {
    let id = s.session_id.clone();
    let head = a.block_on(commit_file(ch_a, s, FILE, TEXT, "before the move"))?;
    let paused = a.block_on(bounded(
        &format!("PauseSession(persist) {id}"),
        pb::sessions_client::SessionsClient::new(ch_a.clone()).pause_session(
            pb::PauseSessionRequest {
                session_id: id.clone(),
                idempotency_key: String::new(),
                persist: true,
            },
        ),
    ))?;
    if paused.state != pb::SessionState::Paused as i32 || !paused.persisted {
        return Err(format!("the session did not pause to disk: {paused:?}"));
    }
    let audit_a = a.block_on(audit(ch_a, &id))?;
    let t0 = Instant::now();
    let moved = a.block_on(bounded(
        &format!("MoveSession {id} to {NODE_B}"),
        pb::fleet_client::FleetClient::new(ch_a.clone()).move_session(pb::MoveSessionRequest {
            session_id: id.clone(),
            to_node: NODE_B.into(),
        }),
    ))?;
    let move_secs = t0.elapsed().as_secs_f64();
    if moved.state != pb::SessionState::Stopped as i32 || moved.reason != "moved" {
        return Err(format!(
            "after MoveSession on {NODE_A}: {:?} {:?} (want STOPPED, moved): {moved:?}",
            pb::SessionState::try_from(moved.state),
            moved.reason
        ));
    }
    let t0 = Instant::now();
    let resumed = b.block_on(bounded(
        &format!("ResumeSession {id} on {NODE_B}"),
        pb::sessions_client::SessionsClient::new(ch_b.clone()).resume_session(pb::SessionCall {
            session_id: id.clone(),
            idempotency_key: String::new(),
        }),
    ))?;
    let resume_secs = t0.elapsed().as_secs_f64();
    if resumed.state != pb::SessionState::Running as i32 || resumed.session_id != id {
        return Err(format!(
            "ResumeSession on {NODE_B}: {:?} (want RUNNING, same id): {resumed:?}",
            pb::SessionState::try_from(resumed.state)
        ));
    }
    let (text, head_b) = b.block_on(async {
        let text = run(ch_b, &resumed, &["cat", FILE]).await.map_err(|e| {
            format!(
                "the first command on {NODE_B} after the move: {e}{}",
                record_vmm(out, "node-move-resumed-vmm", resumed.vmm_pid)
            )
        })?;
        let head = run(ch_b, &resumed, &["git", "rev-parse", "HEAD"]).await?;
        Ok::<_, String>((text, head))
    })?;
    if text != TEXT || head_b != head {
        return Err(format!(
            "on {NODE_B} {FILE} holds {text:?} and HEAD is {head_b} (want {TEXT:?} at {head})"
        ));
    }
    // The audit chain: node-a's records as they were, then the guest's
    // records on node-b, its seq without a gap.
    let audit_b = b.block_on(audit(ch_b, &id))?;
    if audit_b.len() <= audit_a.len() || audit_b[..audit_a.len()] != audit_a[..] {
        return Err(format!(
            "{NODE_B} holds {} audit records, which do not begin with {NODE_A}'s {}",
            audit_b.len(),
            audit_a.len()
        ));
    }
    if let Some(gap) = audit_b
        .windows(2)
        .find(|w| w[1].guest_seq != w[0].guest_seq + 1)
    {
        return Err(format!(
            "the audit chain on {NODE_B} skips from guest seq {} to {}",
            gap[0].guest_seq, gap[1].guest_seq
        ));
    }
    // Stop on node-b fetches the branch back into the repository.
    let stopped = b.block_on(bounded(
        &format!("StopSession {id} on {NODE_B}"),
        pb::sessions_client::SessionsClient::new(ch_b.clone()).stop_session(pb::SessionCall {
            session_id: id.clone(),
            idempotency_key: String::new(),
        }),
    ))?;
    let branch = format!("session/{id}");
    let fetched = git(repo, &["rev-parse", &branch])?;
    if fetched.trim() != head {
        return Err(format!(
            "after Stop on {NODE_B} the repository's {branch} is {} (want {head}); stop: {} {}",
            fetched.trim(),
            stopped.reason,
            stopped.detail
        ));
    }
    Ok(format!(
        "paused to disk on {NODE_A}, moved in {move_secs:.1} s (image and bundle through the \
         image store), resumed on {NODE_B} in {resume_secs:.1} s under the same id; {FILE} and \
         commit {} there, {} audit records continuing {NODE_A}'s {} without a gap, {branch} \
         fetched back at Stop",
        &head[..head.len().min(12)],
        audit_b.len(),
        audit_a.len()
    ))
}
