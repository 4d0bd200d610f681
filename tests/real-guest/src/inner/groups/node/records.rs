//! What the `node-session` scenario checks after Stop: the audit chain
//! (host and guest agree) and the usage records.

use super::*;

/// The host's audit records chain (sha256(prev || json)), the guest's own
/// chain inside them verifies with `guest-init audit verify`, and the guest
/// sequence numbers run from 1 without a gap.
pub(super) fn audit_agrees(ctx: &Ctx, s: &pb::Session, guest_init: &Path) -> Check {
    let a = ctx.fixtures.agent.as_ref().ok_or("no host-agent")?;
    let ch = a.channel()?;
    let records = a.block_on(async {
        pb::approvals_client::ApprovalsClient::new(ch)
            .list_audit(pb::ListAuditRequest {
                session_id: s.session_id.clone(),
                since_guest_seq: 0,
            })
            .await
            .map(|r| r.into_inner().records)
            .map_err(|e| format!("ListAudit: {}", e.message()))
    })?;
    let mut prev = String::new();
    for (i, r) in records.iter().enumerate() {
        let mut h = Sha256::new();
        h.update(prev.as_bytes());
        h.update(r.json.as_bytes());
        if r.host_hash != hex::encode(h.finalize()) {
            return Err(format!(
                "the host's audit chain breaks at guest seq {}",
                r.guest_seq
            ));
        }
        if r.guest_seq != i as u64 + 1 {
            return Err(format!("audit record {i} has guest seq {}", r.guest_seq));
        }
        prev = r.host_hash.clone();
    }
    if !records.iter().any(|r| r.json.contains("git push")) {
        return Err("the denied git push is not in the audit log".into());
    }
    let file = ctx.scratch.join(format!("audit-{}.jsonl", s.session_id));
    let text: String = records.iter().map(|r| format!("{}\n", r.json)).collect();
    std::fs::write(&file, text).map_err(|e| e.to_string())?;
    let out = Command::new(guest_init)
        .args(["audit", "verify"])
        .arg(&file)
        .output()
        .map_err(|e| format!("{}: {e}", guest_init.display()))?;
    if !out.status.success() {
        return Err(format!(
            "guest-init audit verify on the guest's records: {}{}",
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(format!(
        "{} audit records: guest chain verified, host chain holds",
        records.len()
    ))
}

/// Usage records of the stopped session: one chain, ending in a final
/// record, billing at least the one-second minimum and no more than its life.
pub(super) fn usage_covers(ctx: &Ctx, stopped: &pb::Session) -> Check {
    let a = ctx.fixtures.agent.as_ref().ok_or("no host-agent")?;
    let ch = a.channel()?;
    let recs = a.block_on(async {
        pb::usage_client::UsageClient::new(ch)
            .list_usage(pb::ListUsageRequest {
                session_id: stopped.session_id.clone(),
                limit: 10_000,
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().records)
            .map_err(|e| format!("ListUsage: {}", e.message()))
    })?;
    let last = recs.last().ok_or("no usage records")?;
    for w in recs.windows(2) {
        if w[1].interval_start != w[0].interval_end || w[1].billed_seconds < w[0].billed_seconds {
            return Err(format!(
                "usage records do not chain: {:?} then {:?}",
                w[0], w[1]
            ));
        }
    }
    if !last.r#final {
        return Err(format!("the last usage record is not final: {last:?}"));
    }
    let life = (stopped.ended_at - stopped.ready_at) as f64 / 1000.0;
    if last.billed_seconds < 1.0 || last.billed_seconds > life.max(1.0) + 1.0 {
        return Err(format!(
            "billed {} s for a session READY for {life:.1} s",
            last.billed_seconds
        ));
    }
    if recs[0].interval_start < stopped.ready_at || last.interval_end > stopped.ended_at + 1000 {
        return Err(format!(
            "usage covers {}..{}, the session was READY {}..{}",
            recs[0].interval_start, last.interval_end, stopped.ready_at, stopped.ended_at
        ));
    }
    Ok(format!(
        "{} usage records, {:.1} s billed, {:.2} vCPU s",
        recs.len(),
        last.billed_seconds,
        last.vcpu_seconds
    ))
}
