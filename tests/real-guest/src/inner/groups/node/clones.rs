//! Scenario `node-clones`: two sessions restored from the same golden
//! snapshot are two machines. Their first commands read different
//! `/dev/urandom` bytes (guest-init reseeded each kernel's CRNG with the
//! host's bytes before Ready), each is named after its session (hostname,
//! /etc/machine-id), and each audit log says so (`machine.fresh`).

use proto::hostagent as pb;

use super::sizing::open_repository;
use super::{agent, create_running, exec, expect_ok, keep_logs};
use crate::inner::{Check, Ctx};

/// Two clones of the node image's golden snapshot differ where they must.
pub fn clones(ctx: &mut Ctx, name: &str) -> Check {
    let result = clones_flow(ctx, name);
    keep_logs(ctx);
    result
}

fn clones_flow(ctx: &mut Ctx, name: &str) -> Check {
    let repo = open_repository(ctx)?;
    let a = agent(ctx)?;
    let ch = a.channel()?;
    let mut reads = Vec::new();
    let mut sessions = Vec::new();
    for _ in 0..2 {
        let (s, _) = create_running(a, &ch, &repo)?;
        let (random, host, machine_id, audit) = a.block_on(async {
            // The first command of the session: nothing ran before it.
            let script = "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'";
            let r = exec(ch.clone(), &s, &["sh", "-c", script]).await?;
            expect_ok(script, &r)?;
            let host = exec(ch.clone(), &s, &["hostname"]).await?;
            expect_ok("hostname", &host)?;
            let id = exec(ch.clone(), &s, &["cat", "/etc/machine-id"]).await?;
            expect_ok("cat /etc/machine-id", &id)?;
            let audit = pb::approvals_client::ApprovalsClient::new(ch.clone())
                .list_audit(pb::ListAuditRequest {
                    session_id: s.session_id.clone(),
                    since_guest_seq: 0,
                })
                .await
                .map_err(|e| format!("ListAudit: {}", e.message()))?
                .into_inner()
                .records;
            Ok::<_, String>((r.stdout, host.stdout, id.stdout, audit))
        })?;
        if random.len() != 64 {
            return Err(format!("the urandom read printed {random:?}"));
        }
        if host.trim() != s.session_id {
            return Err(format!(
                "hostname {:?}, not the session id {}",
                host.trim(),
                s.session_id
            ));
        }
        if machine_id.trim() != s.session_id.replace('-', "") {
            return Err(format!(
                "machine-id {:?} is not the session's",
                machine_id.trim()
            ));
        }
        if !audit
            .iter()
            .any(|r| r.json.contains("\"machine.fresh\"") && r.json.contains("CRNG reseeded"))
        {
            return Err("no machine.fresh record with a CRNG reseed in the audit".into());
        }
        reads.push(random);
        sessions.push(s);
    }
    if reads[0] == reads[1] {
        return Err(format!(
            "both clones read {} from /dev/urandom first: they share randomness",
            reads[0]
        ));
    }
    a.block_on(async {
        let mut se = pb::sessions_client::SessionsClient::new(ch.clone());
        for s in &sessions {
            se.stop_session(pb::SessionCall {
                session_id: s.session_id.clone(),
                idempotency_key: String::new(),
            })
            .await
            .map_err(|e| format!("StopSession: {}", e.message()))?;
        }
        Ok::<_, String>(())
    })?;
    for s in &sessions {
        super::delete_stopped(a, &ch, &s.session_id)?;
    }
    let note = format!(
        "first urandom reads {}… and {}… differ; hostname and machine-id are each session's; \
         machine.fresh audited",
        &reads[0][..16],
        &reads[1][..16]
    );
    ctx.info(name, &note);
    Ok(note)
}
