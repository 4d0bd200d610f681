//! [`JetStreamObjects`]: the fleet's NATS JetStream object store bucket.

use async_nats::jetstream::object_store::{self, GetErrorKind, InfoErrorKind};
use bytes::Bytes;
use tokio::io::AsyncReadExt;

use super::ObjectStore;
use crate::error::{Error, Result};

/// The object store bucket images are pushed to.
pub const BUCKET: &str = "agentvm_images";

/// Images' chunks and manifests in the JetStream object store [`BUCKET`].
#[derive(Clone)]
pub struct JetStreamObjects {
    store: object_store::ObjectStore,
    describe: String,
}

impl std::fmt::Debug for JetStreamObjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe)
    }
}

impl JetStreamObjects {
    /// Opens bucket [`BUCKET`], creating it when missing (another node creating
    /// it at the same moment is fine).
    pub async fn open(js: &async_nats::jetstream::Context) -> Result<JetStreamObjects> {
        let info = js.client().server_info();
        let describe = format!(
            "NATS object store {BUCKET} at nats://{}:{}",
            info.host, info.port
        );
        let store = match js.get_object_store(BUCKET).await {
            Ok(s) => s,
            Err(get_err) => {
                let config = object_store::Config {
                    bucket: BUCKET.to_string(),
                    description: Some(
                        "agentvm pushed images: chunks/<sha256>, manifests/<image>.json".into(),
                    ),
                    ..Default::default()
                };
                match js.create_object_store(config).await {
                    Ok(s) => s,
                    // Another node may have created it in between.
                    Err(create_err) => js.get_object_store(BUCKET).await.map_err(|again| {
                        Error::Fleet(format!(
                            "opening {describe}: getting it failed ({get_err}), creating it failed ({create_err}), getting it again failed ({again})"
                        ))
                    })?,
                }
            }
        };
        Ok(JetStreamObjects { store, describe })
    }
}

#[async_trait::async_trait]
impl ObjectStore for JetStreamObjects {
    async fn put(&self, name: &str, data: Bytes) -> Result<()> {
        self.store
            .put(name, &mut data.as_ref())
            .await
            .map_err(|e| Error::Fleet(format!("storing {name} in {}: {e}", self.describe)))?;
        Ok(())
    }

    async fn get(&self, name: &str) -> Result<Option<Bytes>> {
        let mut obj = match self.store.get(name).await {
            Ok(o) => o,
            Err(e) if e.kind() == GetErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(Error::Fleet(format!(
                    "fetching {name} from {}: {e}",
                    self.describe
                )))
            }
        };
        let mut buf = Vec::with_capacity(obj.info().size);
        obj.read_to_end(&mut buf).await.map_err(|e| {
            let msg = format!("reading {name} from {}: {e}", self.describe);
            if e.kind() == std::io::ErrorKind::InvalidData {
                Error::Corrupt(msg)
            } else {
                Error::Fleet(msg)
            }
        })?;
        Ok(Some(Bytes::from(buf)))
    }

    async fn exists(&self, name: &str) -> Result<bool> {
        match self.store.info(name).await {
            Ok(info) => Ok(!info.deleted),
            Err(e) if e.kind() == InfoErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::Fleet(format!(
                "looking up {name} in {}: {e}",
                self.describe
            ))),
        }
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

/// [`JetStreamObjects::open`]: opens bucket [`BUCKET`], creating it when
/// missing.
pub async fn open(js: &async_nats::jetstream::Context) -> Result<JetStreamObjects> {
    JetStreamObjects::open(js).await
}
