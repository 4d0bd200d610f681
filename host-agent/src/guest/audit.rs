//! The host side of a session's audit chain: each audit event the guest
//! sends is checked for sequence, bounded, chained
//! (`host_hash = sha256(prev_host_hash || json)`) and stored.

use super::*;

/// The host side of a session's audit chain.
pub(super) struct AuditChain {
    pub(super) sink: AuditSink,
    pub(super) prev_hash: String,
    pub(super) last_seq: u64,
    pub(super) stored_bytes: u64,
    /// Set once an event was refused: later ones are dropped.
    pub(super) refused: bool,
}

impl AuditChain {
    pub(super) fn load(sink: AuditSink, session_id: &str) -> Result<AuditChain> {
        let last = sink.store.last_audit(session_id)?;
        let stored_bytes = sink.store.audit_bytes(session_id)?;
        let (prev_hash, last_seq) = last.map(|a| (a.host_hash, a.guest_seq)).unwrap_or_default();
        Ok(AuditChain {
            sink,
            prev_hash,
            last_seq,
            stored_bytes,
            refused: false,
        })
    }

    fn append(&mut self, session_id: &str, seq: u64, json: String) {
        let mut h = Sha256::new();
        h.update(self.prev_hash.as_bytes());
        h.update(json.as_bytes());
        let hash = hex::encode(h.finalize());
        self.stored_bytes += json.len() as u64;
        let row = AuditRow {
            session_id: session_id.to_string(),
            guest_seq: seq,
            json,
            host_hash: hash.clone(),
            received_at: now_ms(),
        };
        if let Err(e) = self.sink.store.insert_audit(&row) {
            tracing::error!(session = session_id, error = %e, "storing audit event");
        }
        self.prev_hash = hash;
        self.last_seq = seq;
    }

    /// Stores `a` if it is the next event and within the session's volume;
    /// otherwise refuses it and says why the session must stop.
    pub(super) fn accept(&mut self, session_id: &str, a: AuditEvent) -> Option<Violation> {
        if self.refused {
            metrics::guest_dropped("audit_refused");
            return None;
        }
        let expected = self.last_seq.saturating_add(1);
        if a.seq != expected {
            self.refused = true;
            metrics::guest_dropped("audit_out_of_order");
            return Some(Violation {
                reason: reason::AUDIT_OUT_OF_ORDER,
                detail: format!(
                    "the guest sent audit event seq {} where seq {expected} was due; the event \
                     was refused and later ones are not stored",
                    a.seq
                ),
            });
        }
        let max = self.sink.max_bytes;
        if self.stored_bytes + a.json.len() as u64 > max {
            self.refused = true;
            metrics::guest_dropped("audit_limit");
            let detail = format!(
                "audit volume limit of {max} bytes reached: {} bytes stored, event seq {} of {} \
                 bytes refused, later ones not stored",
                self.stored_bytes,
                a.seq,
                a.json.len()
            );
            // The host's own record ends the chain, so ListAudit says it too.
            let note = serde_json::json!({
                "actor": "host-agent",
                "action": "audit.limit_exceeded",
                "result": detail,
                "refused_seq": a.seq,
            })
            .to_string();
            self.append(session_id, a.seq, note);
            return Some(Violation {
                reason: reason::AUDIT_LIMIT,
                detail,
            });
        }
        self.append(session_id, a.seq, a.json);
        None
    }
}
