//! The gRPC services, one module per service, and the conversions and
//! request checks they share.

use std::future::Future;
use std::sync::Arc;

use prost::Message;
use proto::hostagent as pb;

use crate::auth::Caller;
use crate::error::{Error, Result};
use crate::sessions::{now_ms, Manager, Session};
use crate::store::{EventRow, ImageRow, SessionRow, UsageRow};

pub mod approvals;
pub mod attach;
pub mod events;
pub mod exec;
pub mod files;
pub mod fleet;
pub mod images;
pub mod listing;
pub mod node;
pub mod schedules;
pub mod sessions;
pub mod snapshots;
mod status;
pub mod usage;

/// Checks an idempotency key: empty, or 1..=128 printable ASCII characters.
pub fn check_key(key: &str) -> Result<()> {
    if key.len() > 128 {
        return Err(Error::invalid(format!(
            "idempotency_key is {} bytes; at most 128",
            key.len()
        )));
    }
    if !key.bytes().all(|b| (0x21..0x7f).contains(&b)) {
        return Err(Error::invalid(
            "idempotency_key must be printable ASCII without spaces",
        ));
    }
    Ok(())
}

/// Checks a session id field (non-empty, at most 64 bytes).
pub fn check_session_id(id: &str) -> Result<()> {
    if id.is_empty() {
        return Err(Error::invalid("session_id is required"));
    }
    if id.len() > 64 {
        return Err(Error::invalid(format!(
            "session_id is {} bytes; session ids are at most 64",
            id.len()
        )));
    }
    Ok(())
}

/// The session `id` if `caller` may see it. Another client's session is
/// NotFound, exactly as a session that does not exist, so that its
/// existence does not leak.
pub fn owned_session(mgr: &Manager, caller: &Caller, id: &str) -> Result<Arc<Session>> {
    check_session_id(id)?;
    let sess = mgr.session(id)?;
    if !caller.owns(&sess.row().owner) {
        return Err(Error::not_found("session", id));
    }
    Ok(sess)
}

/// Runs `f` once per idempotency key of `caller` (keys are scoped by
/// client): a retry returns the stored response; the same key with another
/// method or request is InvalidArgument.
pub async fn idempotent<T, F>(
    mgr: &Manager,
    caller: &Caller,
    key: &str,
    method: &str,
    fp: &str,
    f: F,
) -> Result<T>
where
    T: Message + Default,
    F: Future<Output = Result<T>>,
{
    check_key(key)?;
    if key.is_empty() {
        return f.await;
    }
    let shown = key;
    let key = caller.scoped_key(key);
    let key = key.as_str();
    let stored = |m: String, p: String, resp: Vec<u8>| -> Result<T> {
        if m != method || p != fp {
            return Err(Error::invalid(format!(
                "idempotency key {shown:?} was already used for a different request ({m})"
            )));
        }
        T::decode(resp.as_slice())
            .map_err(|e| Error::invalid(format!("stored response for key {shown:?}: {e}")))
    };
    if let Some((m, p, resp)) = mgr.store.idempotent(key)? {
        return stored(m, p, resp);
    }
    let r = f.await?;
    if !mgr
        .store
        .put_idempotent(key, method, fp, &r.encode_to_vec(), now_ms())?
    {
        if let Some((m, p, resp)) = mgr.store.idempotent(key)? {
            return stored(m, p, resp);
        }
    }
    Ok(r)
}

/// Image row to message.
pub fn image_pb(i: &ImageRow) -> pb::Image {
    pb::Image {
        image_id: i.id.clone(),
        kernel_path: i.kernel.clone(),
        rootfs_path: i.rootfs.clone(),
        cmdline: i.cmdline.clone(),
        mem_mib: i.mem_mib,
        vcpus: i.vcpus,
        guest_init: i.guest_init,
        golden_snapshot_dir: i.golden_dir.clone(),
        created_at: i.created_at,
        golden_built_at: i.golden_built_at,
        initrd_path: i.initrd.clone(),
        io_limits: limits_pb(&i.io_limits),
        source_session_id: i.source_session.clone(),
        shares: crate::shares::to_pb(&i.shares, &i.id),
    }
}

/// Stored limits as the API reports them (`None`: none set).
fn limits_pb(stored: &str) -> Option<pb::IoLimits> {
    if stored.is_empty() {
        return None;
    }
    match crate::io_limits::IoLimits::decode(stored) {
        Ok(l) => Some(l.to_pb()),
        Err(e) => {
            tracing::error!(error = %e, "stored rate limits do not read back");
            None
        }
    }
}

/// Session row to message.
pub fn session_pb(s: &SessionRow) -> pb::Session {
    pb::Session {
        session_id: s.id.clone(),
        image_id: s.image_id.clone(),
        state: s.state,
        execution_id: s.execution_id.clone(),
        reason: s.reason.clone(),
        detail: s.detail.clone(),
        created_at: s.created_at,
        ready_at: s.ready_at,
        ended_at: s.ended_at,
        vmm_pid: s.vmm_pid,
        limits: Some(pb::Limits {
            ttl_seconds: s.ttl_s,
            idle_timeout_seconds: s.idle_s,
        }),
        branch: s.branch.clone(),
        head_commit: s.head_commit.clone(),
        labels: s.labels.clone().into_iter().collect(),
        network: None,
        io_limits: limits_pb(&s.io_limits),
        resources: crate::sessions::resources::Resources::decode(&s.resources).map(|r| r.to_pb()),
        persisted: s.persisted,
        // Filled from the layer records where a Manager is at hand
        // (`Manager::session_out`).
        snapshot_bytes: 0,
        auto_resume: s.auto_resume,
        parent_session_id: s.parent_session.clone(),
        shares: crate::shares::to_pb(&s.shares, &s.id),
    }
}

/// Event row to message.
pub fn event_pb(e: &EventRow) -> pb::Event {
    pb::Event {
        seq: e.seq,
        session_id: e.session_id.clone(),
        execution_id: e.execution_id.clone(),
        at: e.at,
        from: e.from,
        to: e.to,
        reason: e.reason.clone(),
        detail: e.detail.clone(),
        kind: e.kind.clone(),
        schedule_id: e.schedule_id.clone(),
        run_id: e.run_id,
        trigger_id: e.trigger_id.clone(),
        node: String::new(),
    }
}

/// Usage row to message.
pub fn usage_pb(u: &UsageRow) -> pb::UsageRecord {
    pb::UsageRecord {
        seq: u.seq,
        session_id: u.session_id.clone(),
        execution_id: u.execution_id.clone(),
        interval_start: u.interval_start,
        interval_end: u.interval_end,
        billed_seconds: u.billed_ms as f64 / 1000.0,
        vcpu_seconds: u.vcpu_ns as f64 / 1e9,
        memory_allocated_gib_seconds: u.mem_alloc_gib_ms / 1000.0,
        memory_resident_gib_seconds: u.mem_resident_gib_ms / 1000.0,
        disk_bytes_written: u.disk_bytes,
        r#final: u.is_final,
        net_rx_bytes: u.net.rx_bytes,
        net_rx_packets: u.net.rx_packets,
        net_tx_bytes: u.net.tx_bytes,
        net_tx_packets: u.net.tx_packets,
        egress_denied_packets: u.net.denied_packets,
        dns_denied_queries: u.net.dns_denied,
        snapshot_gib_seconds: u.snapshot_gib_ms / 1000.0,
    }
}
