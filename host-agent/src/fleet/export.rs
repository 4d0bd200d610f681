//! Publishing the outbox to JetStream: every event, ask, usage record and
//! audit record, in commit order, to `agentvm.<node>.<kind>` with the
//! message id `<node>:<kind>:<outbox seq>`, trimmed from the outbox only
//! once JetStream acknowledged it.
//!
//! Messages are published one at a time, each after the previous one's
//! acknowledgement, so a subject's messages are in the outbox's order in
//! the stream. A publish that fails (NATS down, no acknowledgement in
//! [`REQUEST_TIMEOUT`](super::connect::REQUEST_TIMEOUT)) is tried again
//! with the same message id: JetStream drops it as a duplicate within the
//! streams' duplicate window, and past the window (a longer outage, or a
//! host-agent restart between an acknowledgement and its trim) the
//! exporter first reads the last message id of each of its subjects and
//! trims what it names, so nothing is published twice and nothing skipped.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use prost::Message as _;
use proto::hostagent as pb;

use super::config::FleetConfig;
use crate::error::{Error, Result};
use crate::store::{OutboxKind, Outgoing, Record, Store};

/// Rows read from the outbox at a time.
const BATCH: u32 = 256;
/// Longest wait between retries while NATS is unreachable.
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// The streams' duplicate window (at most their max age).
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// The stream holding every node's messages of `kind`.
pub fn stream_name(kind: OutboxKind) -> &'static str {
    match kind {
        OutboxKind::Events => "AGENTVM_EVENTS",
        OutboxKind::Usage => "AGENTVM_USAGE",
        OutboxKind::Asks => "AGENTVM_ASKS",
        OutboxKind::Audit => "AGENTVM_AUDIT",
    }
}

/// `agentvm.<node>.<kind>`.
pub fn subject(node: &str, kind: OutboxKind) -> String {
    format!("agentvm.{node}.{}", kind.name())
}

/// `<node>:<kind>:<seq>`.
pub fn message_id(node: &str, kind: OutboxKind, seq: u64) -> String {
    format!("{node}:{}:{seq}", kind.name())
}

/// The outbox seq in a message id of `node` and `kind`.
pub fn seq_of_message_id(id: &str, node: &str, kind: OutboxKind) -> Option<u64> {
    id.strip_prefix(node)?
        .strip_prefix(':')?
        .strip_prefix(kind.name())?
        .strip_prefix(':')?
        .parse()
        .ok()
}

/// The message type names in the `Agentvm-Type` header.
fn type_name(record: &Record) -> &'static str {
    match record {
        Record::Event(_) => "hostagent.v1.Event",
        Record::Usage(_) => "hostagent.v1.UsageRecord",
        Record::Audit(_) => "hostagent.v1.AuditRecord",
    }
}

/// The record as the protobuf message the gRPC API returns for it.
pub fn encode(record: &Record, node: &str) -> Vec<u8> {
    match record {
        Record::Event(e) => {
            let mut ev = crate::api::event_pb(e);
            ev.node = node.to_string();
            ev.encode_to_vec()
        }
        Record::Usage(u) => crate::api::usage_pb(u).encode_to_vec(),
        Record::Audit(a) => pb::AuditRecord {
            session_id: a.session_id.clone(),
            guest_seq: a.guest_seq,
            json: a.json.clone(),
            host_hash: a.host_hash.clone(),
            received_at: a.received_at,
        }
        .encode_to_vec(),
    }
}

/// The stream configuration host-agent creates a missing stream with.
pub fn stream_config(kind: OutboxKind, cfg: &FleetConfig) -> stream::Config {
    let max_age = Duration::from_secs(cfg.stream_max_age_seconds);
    stream::Config {
        name: stream_name(kind).to_string(),
        description: Some(format!(
            "agentvm host-agent {} of every node (agentvm.<node>.{})",
            kind.name(),
            kind.name()
        )),
        subjects: vec![format!("agentvm.*.{}", kind.name())],
        max_age,
        max_bytes: i64::try_from(cfg.stream_max_bytes)
            .ok()
            .filter(|b| *b > 0)
            .unwrap_or(-1),
        num_replicas: cfg.stream_replicas,
        duplicate_window: DUPLICATE_WINDOW.min(max_age),
        storage: stream::StorageType::File,
        ..Default::default()
    }
}

/// Counters of the export, for metrics and tests.
#[derive(Debug, Default)]
pub struct ExportStats {
    /// Messages JetStream acknowledged.
    pub published: std::sync::atomic::AtomicU64,
    /// Of those, the ones it said were duplicates.
    pub duplicates: std::sync::atomic::AtomicU64,
    /// Failed publish attempts (each retried).
    pub failures: std::sync::atomic::AtomicU64,
}

/// The exporter of one node.
pub struct Exporter {
    /// The node's database.
    pub store: Arc<Store>,
    /// JetStream.
    pub js: jetstream::Context,
    /// This node's name.
    pub node: String,
    /// Retention of the streams it creates.
    pub cfg: FleetConfig,
    /// Its counters.
    pub stats: Arc<ExportStats>,
}

impl Exporter {
    /// Publishes the outbox for as long as host-agent runs, reconnecting
    /// with backoff after every failure.
    pub async fn run(self) {
        const FIRST_BACKOFF: Duration = Duration::from_millis(500);
        let mut backoff = FIRST_BACKOFF;
        let mut failing = false;
        loop {
            let mut published = false;
            let e = self.serve(&mut published).await;
            if published {
                // A good spell ended: the outage starts anew.
                backoff = FIRST_BACKOFF;
                failing = false;
            }
            if !failing {
                tracing::warn!(error = %e, "fleet export paused; records wait in the outbox");
            } else {
                tracing::debug!(error = %e, "fleet export still paused");
            }
            failing = true;
            self.stats
                .failures
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// One connected spell: streams found or made, the outbox trimmed to
    /// what the streams hold, then published until something fails (and
    /// `published` set once a message was).
    async fn serve(&self, published: &mut bool) -> Error {
        let streams = match self.streams().await {
            Ok(s) => s,
            Err(e) => return e,
        };
        if let Err(e) = self.resync(&streams).await {
            return e;
        }
        tracing::info!(node = %self.node, "fleet export publishing");
        loop {
            let batch = match self.store.outbox_pending(BATCH) {
                Ok(b) => b,
                Err(e) => return e,
            };
            if batch.is_empty() {
                tokio::select! {
                    _ = self.store.outbox_written() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                continue;
            }
            let mut done = None;
            let mut failed = None;
            for row in &batch {
                if let Err(e) = self.publish(row).await {
                    failed = Some(e);
                    break;
                }
                done = Some(row.seq);
                *published = true;
            }
            if let Some(seq) = done {
                if let Err(e) = self.store.outbox_trim(seq, None) {
                    return e;
                }
            }
            if let Some(e) = failed {
                return e;
            }
        }
    }

    /// Each kind's stream, created when missing.
    async fn streams(&self) -> Result<HashMap<OutboxKind, stream::Stream>> {
        let mut out = HashMap::new();
        for kind in OutboxKind::ALL {
            let s = self
                .js
                .get_or_create_stream(stream_config(kind, &self.cfg))
                .await
                .map_err(|e| {
                    Error::Fleet(format!(
                        "finding or creating stream {}: {e}",
                        stream_name(kind)
                    ))
                })?;
            out.insert(kind, s);
        }
        Ok(out)
    }

    /// Trims the outbox rows each subject's last message says were stored.
    async fn resync(&self, streams: &HashMap<OutboxKind, stream::Stream>) -> Result<()> {
        for (kind, s) in streams {
            let subject = subject(&self.node, *kind);
            let last = match s.get_last_raw_message_by_subject(&subject).await {
                Ok(m) => m,
                Err(e)
                    if e.kind()
                        == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
                {
                    continue
                }
                Err(e) => {
                    return Err(Error::Fleet(format!(
                        "reading the last message of {subject}: {e}"
                    )))
                }
            };
            let id = last
                .headers
                .get(async_nats::header::NATS_MESSAGE_ID)
                .map(|v| v.as_str().to_string())
                .unwrap_or_default();
            match seq_of_message_id(&id, &self.node, *kind) {
                Some(seq) => {
                    let n = self.store.outbox_trim(seq, Some(*kind))?;
                    if n > 0 {
                        tracing::info!(
                            %subject, through = seq, rows = n,
                            "fleet export: JetStream already had these; trimmed"
                        );
                    }
                }
                None => tracing::warn!(
                    %subject, message_id = %id,
                    "the last message on this node's subject has no message id of ours \
                     (another node with the same name?)"
                ),
            }
        }
        Ok(())
    }

    /// Publishes one row and waits for its acknowledgement.
    async fn publish(&self, row: &Outgoing) -> Result<()> {
        let Some(record) = &row.record else {
            tracing::warn!(seq = row.seq, "outbox row without its record; dropped");
            return Ok(());
        };
        let id = message_id(&self.node, row.kind, row.seq);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
        headers.insert("Agentvm-Node", self.node.as_str());
        headers.insert("Agentvm-Type", type_name(record));
        headers.insert("Content-Type", "application/protobuf");
        let subject = subject(&self.node, row.kind);
        let ack = self
            .js
            .publish_with_headers(subject.clone(), headers, encode(record, &self.node).into())
            .await
            .map_err(|e| Error::Fleet(format!("publishing {id} to {subject}: {e}")))?
            .await
            .map_err(|e| Error::Fleet(format!("no acknowledgement of {id} on {subject}: {e}")))?;
        use std::sync::atomic::Ordering::Relaxed;
        self.stats.published.fetch_add(1, Relaxed);
        if ack.duplicate {
            self.stats.duplicates.fetch_add(1, Relaxed);
            tracing::debug!(%id, "JetStream had this message already");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_round_trip_and_name_node_kind_and_seq() {
        let id = message_id("node-a", OutboxKind::Usage, 42);
        assert_eq!(id, "node-a:usage:42");
        assert_eq!(
            seq_of_message_id(&id, "node-a", OutboxKind::Usage),
            Some(42)
        );
        assert_eq!(seq_of_message_id(&id, "node-a", OutboxKind::Events), None);
        assert_eq!(seq_of_message_id(&id, "node", OutboxKind::Usage), None);
        assert_eq!(
            seq_of_message_id("node-a:usage:", "node-a", OutboxKind::Usage),
            None
        );
        assert_eq!(subject("node-a", OutboxKind::Asks), "agentvm.node-a.asks");
    }

    #[test]
    fn streams_are_made_with_the_configured_retention() {
        let cfg = FleetConfig {
            stream_max_age_seconds: 60,
            stream_max_bytes: 1 << 30,
            stream_replicas: 3,
            ..Default::default()
        };
        let s = stream_config(OutboxKind::Audit, &cfg);
        assert_eq!(s.name, "AGENTVM_AUDIT");
        assert_eq!(s.subjects, ["agentvm.*.audit"]);
        assert_eq!(s.max_age, Duration::from_secs(60));
        assert_eq!(s.duplicate_window, Duration::from_secs(60));
        assert_eq!((s.max_bytes, s.num_replicas), (1 << 30, 3));
        let unbounded = stream_config(OutboxKind::Events, &FleetConfig::default());
        assert_eq!(unbounded.max_bytes, -1);
        assert_eq!(unbounded.duplicate_window, DUPLICATE_WINDOW);
    }
}
