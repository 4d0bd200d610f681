//! Many nodes: host-agent's link to the fleet's shared services.
//!
//! * [`export`]: every event, ask, usage and audit record published to NATS
//!   JetStream from the SQLite outbox (`store::outbox`), in order, each once;
//! * [`registry`]: this node's capacity in the KV bucket `agentvm_nodes`,
//!   with a TTL, and the list of the fleet's nodes;
//! * [`objects`]: images pushed to and pulled from an object store (NATS
//!   JetStream's, or S3-compatible, GCS, Azure or local-file storage through
//!   the `object_store` crate), chunked and content-addressed by SHA-256;
//! * [`images`]: which of an image's files are pushed, and registering a
//!   pulled one;
//! * [`bundle`]: a session paused to disk as it moves to another node
//!   (MoveSession; taken in by that node's ResumeSession).

pub mod bundle;
pub mod config;
pub mod connect;
pub mod export;
pub mod images;
pub mod objects;
pub mod registry;

use std::sync::Arc;

use async_nats::jetstream;

use crate::error::{Error, Result};
use crate::sessions::Manager;
pub use config::FleetConfig;
use objects::ObjectStore;

/// This node in its fleet: the NATS connection, the exporter's counters and
/// the image store.
pub struct Fleet {
    /// The settings.
    pub cfg: FleetConfig,
    /// This node's name.
    pub node: String,
    /// The gRPC address the registry shows.
    pub address: String,
    /// JetStream, with `--nats`.
    pub js: Option<jetstream::Context>,
    /// The exporter's counters.
    pub export_stats: Arc<export::ExportStats>,
    /// The image store, opened on first use (NATS may be down at start).
    images: tokio::sync::OnceCell<Arc<dyn ObjectStore>>,
    /// Serializes pulls, so two creates of a missing image pull it once.
    pub pull_lock: tokio::sync::Mutex<()>,
    /// Serializes taking in sessions moved here, so two ResumeSession
    /// calls of one moved session take it in once.
    pub move_lock: tokio::sync::Mutex<()>,
}

impl Fleet {
    /// Joins the fleet `cfg` names: connects to NATS (in the background:
    /// an unreachable server is retried), turns the outbox on and starts
    /// the exporter and the registry; with no NATS URL, turns the outbox
    /// off (rows already there wait for a later start with one).
    pub async fn start(
        mgr: &Arc<Manager>,
        cfg: FleetConfig,
        address: String,
    ) -> Result<Arc<Fleet>> {
        cfg.validate()?;
        let node = cfg.node();
        let address = cfg.advertise_address.clone().unwrap_or(address);
        let export_stats = Arc::new(export::ExportStats::default());
        let js = match &cfg.nats {
            Some(_) => {
                let client = connect::connect(&cfg, &node).await?;
                let js = connect::jetstream(client);
                mgr.store.set_outbox(true)?;
                tokio::spawn(
                    export::Exporter {
                        store: mgr.store.clone(),
                        js: js.clone(),
                        node: node.clone(),
                        cfg: cfg.clone(),
                        stats: export_stats.clone(),
                    }
                    .run(),
                );
                tokio::spawn(registry::run(
                    mgr.clone(),
                    js.clone(),
                    cfg.clone(),
                    node.clone(),
                    address.clone(),
                ));
                tracing::info!(%node, %address, "in the fleet: exporting to JetStream, in the registry");
                Some(js)
            }
            None => {
                mgr.store.set_outbox(false)?;
                let (waiting, _) = mgr.store.outbox_backlog()?;
                if waiting > 0 {
                    tracing::warn!(
                        rows = waiting,
                        "records wait in the fleet outbox from an earlier start with --nats; \
                         they are published when host-agent starts with it again"
                    );
                }
                None
            }
        };
        Ok(Arc::new(Fleet {
            cfg,
            node,
            address,
            js,
            export_stats,
            images: tokio::sync::OnceCell::new(),
            pull_lock: tokio::sync::Mutex::new(()),
            move_lock: tokio::sync::Mutex::new(()),
        }))
    }

    /// Whether images can be pushed and pulled (NATS or an image store URL).
    pub fn has_image_store(&self) -> bool {
        self.js.is_some() || self.cfg.image_store.is_some()
    }

    fn js(&self) -> Result<&jetstream::Context> {
        self.js.as_ref().ok_or_else(|| {
            Error::FailedPrecondition(
                "this node is not in a fleet: start host-agent with --nats URL".into(),
            )
        })
    }

    /// The image store, opened on first use.
    pub async fn image_store(&self) -> Result<Arc<dyn ObjectStore>> {
        self.images
            .get_or_try_init(|| async {
                let store: Arc<dyn ObjectStore> = match self.cfg.image_store.as_deref() {
                    None | Some("nats") => {
                        let js = self.js().map_err(|_| {
                            Error::FailedPrecondition(
                                "no image store: start host-agent with --nats URL or \
                                 --image-store URL"
                                    .into(),
                            )
                        })?;
                        Arc::new(objects::jetstream::open(js).await?)
                    }
                    Some(url) => Arc::new(objects::cloud::CloudObjects::from_url(url)?),
                };
                tracing::info!(store = %store.describe(), "image store opened");
                Ok::<_, Error>(store)
            })
            .await
            .cloned()
    }

    /// The registry's nodes.
    pub async fn nodes(&self) -> Result<Vec<registry::NodeEntry>> {
        let b = registry::bucket(self.js()?, &self.cfg).await?;
        registry::list(&b).await
    }

    /// Leaves the registry (a clean shutdown).
    pub async fn leave(&self) {
        if let Some(js) = &self.js {
            registry::leave(js, &self.node).await;
        }
    }
}
