//! The node registry: each node puts its entry (capacity, warm VMs, images,
//! version, address) into the KV bucket `agentvm_nodes` every
//! `registry_interval_seconds`; the bucket's max age is
//! `registry_ttl_seconds`, so the entry of a node that stopped putting (it
//! died, or lost NATS) drops out by itself. A node that shuts down deletes
//! its entry at once.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, kv, stream};
use futures::TryStreamExt as _;
use proto::hostagent as pb;
use serde::{Deserialize, Serialize};

use super::config::FleetConfig;
use crate::error::{Error, Result};
use crate::sessions::Manager;

/// The registry's KV bucket.
pub const BUCKET: &str = "agentvm_nodes";

/// A node's entry, stored as JSON (the fields of [`pb::FleetNode`], its
/// capacity flattened), so a control plane reads it with any NATS client.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeEntry {
    /// The node's name.
    pub node: String,
    /// Its gRPC address.
    pub address: String,
    /// host-agent's version.
    pub version: String,
    /// When it was put (Unix ms).
    pub updated_at: i64,
    /// Host CPUs.
    pub vcpus_total: u32,
    /// vCPUs of live sessions.
    pub vcpus_used: u32,
    /// Host memory, MiB.
    pub memory_mib_total: u64,
    /// Memory committed to live sessions, MiB.
    pub memory_mib_used: u64,
    /// What may be committed, MiB.
    pub memory_mib_limit: u64,
    /// The node's overcommit ratio.
    pub memory_overcommit_ratio: f64,
    /// Most live sessions.
    pub sessions_max: u32,
    /// Live sessions.
    pub sessions_live: u32,
    /// Snapshot bytes held for sessions.
    pub snapshot_bytes_used: u64,
    /// The node's snapshot quota, bytes (0: none).
    pub snapshot_bytes_quota: u64,
    /// Warm VMs ready, per image.
    pub warm_vms: BTreeMap<String, u32>,
    /// Images registered on it.
    pub images: Vec<String>,
}

impl NodeEntry {
    /// The entry of `mgr`'s node now.
    pub fn of(mgr: &Manager, node: &str, address: &str) -> Result<NodeEntry> {
        let c = crate::api::node::capacity(mgr)?;
        let images: Vec<String> = mgr.store.images()?.into_iter().map(|i| i.id).collect();
        let warm_vms = images
            .iter()
            .filter_map(|id| {
                let n = mgr.pool.count(id) as u32;
                (n > 0).then(|| (id.clone(), n))
            })
            .collect();
        Ok(NodeEntry {
            node: node.to_string(),
            address: address.to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            updated_at: crate::clock::now_ms(),
            vcpus_total: c.vcpus_total,
            vcpus_used: c.vcpus_used,
            memory_mib_total: c.memory_mib_total,
            memory_mib_used: c.memory_mib_used,
            memory_mib_limit: c.memory_mib_limit,
            memory_overcommit_ratio: c.memory_overcommit_ratio,
            sessions_max: c.sessions_max,
            sessions_live: c.sessions_live,
            snapshot_bytes_used: c.snapshot_bytes_used,
            snapshot_bytes_quota: c.snapshot_bytes_quota,
            warm_vms,
            images,
        })
    }

    /// As the API's message.
    pub fn to_pb(&self) -> pb::FleetNode {
        pb::FleetNode {
            node: self.node.clone(),
            address: self.address.clone(),
            version: self.version.clone(),
            capacity: Some(pb::Capacity {
                vcpus_total: self.vcpus_total,
                vcpus_used: self.vcpus_used,
                memory_mib_total: self.memory_mib_total,
                memory_mib_used: self.memory_mib_used,
                sessions_max: self.sessions_max,
                sessions_live: self.sessions_live,
                warm_pool_ready: self.warm_vms.values().sum(),
                memory_mib_limit: self.memory_mib_limit,
                memory_overcommit_ratio: self.memory_overcommit_ratio,
                snapshot_bytes_used: self.snapshot_bytes_used,
                snapshot_bytes_quota: self.snapshot_bytes_quota,
            }),
            warm_vms: self.warm_vms.clone().into_iter().collect(),
            images: self.images.clone(),
            updated_at: self.updated_at,
        }
    }
}

/// The stream behind the registry bucket, as the KV convention lays it out
/// (`KV_<bucket>`, subjects `$KV.<bucket>.>`, one value per key, rollups,
/// direct gets), with max age = the TTL.
///
/// Made as a stream rather than with async-nats' `create_key_value`, which
/// first reads the account's limits in a form NATS servers before 2.10
/// (Debian bookworm's 2.9) do not answer with; the bucket is the same.
pub fn bucket_stream(cfg: &FleetConfig) -> stream::Config {
    stream::Config {
        name: format!("KV_{BUCKET}"),
        description: Some(
            "agentvm nodes: capacity, warm VMs, images; each entry lives \
             registry_ttl_seconds after its node's last put"
                .to_string(),
        ),
        subjects: vec![format!("$KV.{BUCKET}.>")],
        max_messages_per_subject: 1,
        max_age: Duration::from_secs(cfg.registry_ttl_seconds),
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: stream::DiscardPolicy::New,
        num_replicas: cfg.stream_replicas,
        ..Default::default()
    }
}

/// The registry bucket, created when missing.
pub async fn bucket(js: &jetstream::Context, cfg: &FleetConfig) -> Result<kv::Store> {
    if let Ok(b) = js.get_key_value(BUCKET).await {
        return Ok(b);
    }
    // Another node may make it at the same moment: then it is there.
    if let Err(e) = js.get_or_create_stream(bucket_stream(cfg)).await {
        return Err(Error::Fleet(format!("creating KV bucket {BUCKET}: {e}")));
    }
    js.get_key_value(BUCKET)
        .await
        .map_err(|e| Error::Fleet(format!("opening KV bucket {BUCKET}: {e}")))
}

/// Every node's entry, by name; entries that do not parse are left out
/// (and logged).
pub async fn list(b: &kv::Store) -> Result<Vec<NodeEntry>> {
    let keys: Vec<String> = b
        .keys()
        .await
        .map_err(|e| Error::Fleet(format!("listing {BUCKET}: {e}")))?
        .try_collect()
        .await
        .map_err(|e| Error::Fleet(format!("listing {BUCKET}: {e}")))?;
    let mut out = Vec::new();
    for k in keys {
        let Some(v) = b
            .get(&k)
            .await
            .map_err(|e| Error::Fleet(format!("reading {BUCKET} {k}: {e}")))?
        else {
            continue;
        };
        match serde_json::from_slice::<NodeEntry>(&v) {
            Ok(e) => out.push(e),
            Err(e) => tracing::warn!(key = %k, error = %e, "a registry entry that does not parse"),
        }
    }
    out.sort_by(|a, b| a.node.cmp(&b.node));
    Ok(out)
}

/// Puts this node's entry every interval for as long as host-agent runs.
pub async fn run(
    mgr: Arc<Manager>,
    js: jetstream::Context,
    cfg: FleetConfig,
    node: String,
    address: String,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(cfg.registry_interval_seconds));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    let mut store: Option<kv::Store> = None;
    loop {
        tick.tick().await;
        let put = async {
            if store.is_none() {
                store = Some(bucket(&js, &cfg).await?);
            }
            let entry = NodeEntry::of(&mgr, &node, &address)?;
            let json = serde_json::to_vec(&entry)
                .map_err(|e| Error::Fleet(format!("encoding the registry entry: {e}")))?;
            if let Some(b) = &store {
                b.put(&node, json.into())
                    .await
                    .map_err(|e| Error::Fleet(format!("putting {BUCKET} {node}: {e}")))?;
            }
            Ok::<_, Error>(())
        }
        .await;
        match put {
            Ok(()) if failing => {
                tracing::info!(%node, "registry entry put again");
                failing = false;
            }
            Ok(()) => {}
            Err(e) if !failing => {
                tracing::warn!(error = %e, "registry entry not put; retrying each interval");
                failing = true;
            }
            Err(e) => tracing::debug!(error = %e, "registry entry still not put"),
        }
    }
}

/// Deletes this node's entry (a clean shutdown), within a second or two.
pub async fn leave(js: &jetstream::Context, node: &str) {
    let gone = async {
        let b = js.get_key_value(BUCKET).await.ok()?;
        b.delete(node).await.ok()
    };
    match tokio::time::timeout(Duration::from_secs(2), gone).await {
        Ok(Some(())) => tracing::info!(%node, "left the registry"),
        _ => tracing::warn!(%node, "could not delete the registry entry; it expires by itself"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_reads_back_from_its_json_and_as_the_api_message() {
        let e = NodeEntry {
            node: "a".into(),
            address: "10.0.0.1:50051".into(),
            vcpus_total: 8,
            memory_mib_used: 512,
            warm_vms: [("img".to_string(), 2)].into_iter().collect(),
            images: vec!["img".into()],
            ..Default::default()
        };
        let json = serde_json::to_vec(&e).unwrap();
        assert_eq!(serde_json::from_slice::<NodeEntry>(&json).unwrap(), e);
        // A newer node's extra fields do not stop an older one reading it.
        let mut v: serde_json::Value = serde_json::from_slice(&json).unwrap();
        v["gpus"] = 4.into();
        let back: NodeEntry = serde_json::from_value(v).unwrap();
        assert_eq!(back, e);
        let p = e.to_pb();
        let c = p.capacity.unwrap();
        assert_eq!(
            (c.vcpus_total, c.memory_mib_used, c.warm_pool_ready),
            (8, 512, 2)
        );
        assert_eq!(p.warm_vms.get("img"), Some(&2));
    }
}
