//! [`CloudObjects`]: S3-compatible or local-file storage through the
//! `object_store` crate.
//!
//! This build has the crate's `fs` and `aws` features: `file://` and
//! `s3://` URLs. `gs://` and `az://`/`abfs://` would need its `gcp` and
//! `azure` features and are refused with a message saying so.

use std::sync::Arc;

use bytes::Bytes;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::ObjectStore as _;

use super::ObjectStore;
use crate::error::{Error, Result};

/// The URL schemes this build supports, for messages.
const SUPPORTED: &str = "file:///dir and s3://bucket[/prefix]";

/// Images' chunks and manifests in an `object_store` backend.
#[derive(Clone)]
pub struct CloudObjects {
    store: Arc<dyn object_store::ObjectStore>,
    /// Key prefix ("" or "a/b"), without trailing '/'.
    prefix: String,
    /// The URL it was opened with.
    url: String,
}

impl std::fmt::Debug for CloudObjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url)
    }
}

impl CloudObjects {
    /// Opens the store at `url`: `file:///abs/dir` (the directory is
    /// created when missing) or `s3://bucket[/prefix]`, configured from the
    /// environment's `AWS_*` variables (`AWS_ENDPOINT`, `AWS_ALLOW_HTTP`,
    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, ...).
    pub fn from_url(url: &str) -> Result<CloudObjects> {
        Self::from_url_with(url, &[])
    }

    /// [`CloudObjects::from_url`] with explicit options on top of the
    /// environment's, named as `object_store`'s `AmazonS3ConfigKey` parses
    /// them, case-insensitive (`aws_endpoint`, `aws_allow_http`,
    /// `aws_access_key_id`, `region`, ...). Options apply to `s3://` only.
    pub fn from_url_with(url: &str, options: &[(&str, &str)]) -> Result<CloudObjects> {
        let (scheme, rest) = url.split_once("://").ok_or_else(|| {
            Error::invalid(format!(
                "object store URL {url:?} has no scheme: expected {SUPPORTED}"
            ))
        })?;
        match scheme.to_ascii_lowercase().as_str() {
            "file" => {
                if !options.is_empty() {
                    return Err(Error::invalid(format!(
                        "object store URL {url:?}: options apply to s3:// only"
                    )));
                }
                Self::local(url, rest)
            }
            "s3" | "s3a" => Self::s3(url, rest, options),
            "gs" | "az" | "abfs" | "abfss" | "azure" | "adl" => Err(Error::invalid(format!(
                "object store URL {url:?}: this host-agent is built with the object_store features fs and aws only (supports {SUPPORTED}); {scheme}:// needs the gcp or azure feature"
            ))),
            _ => Err(Error::invalid(format!(
                "object store URL {url:?}: scheme must be file or s3 ({SUPPORTED})"
            ))),
        }
    }

    /// `file:///abs/dir`.
    fn local(url: &str, rest: &str) -> Result<CloudObjects> {
        // `file://host/...` is not supported: only an empty host.
        if !rest.starts_with('/') {
            return Err(Error::invalid(format!(
                "object store URL {url:?}: a file URL needs an absolute path, file:///abs/dir"
            )));
        }
        let dir = std::path::Path::new(rest);
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating object store directory {rest}"), e))?;
        let fs = LocalFileSystem::new_with_prefix(dir)
            .map_err(|e| Error::Fleet(format!("opening object store directory {rest}: {e}")))?;
        Ok(CloudObjects {
            store: Arc::new(fs),
            prefix: String::new(),
            url: url.to_string(),
        })
    }

    /// `s3://bucket[/prefix]`.
    fn s3(url: &str, rest: &str, options: &[(&str, &str)]) -> Result<CloudObjects> {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(Error::invalid(format!(
                "object store URL {url:?} names no bucket: expected s3://bucket[/prefix]"
            )));
        }
        let prefix = prefix.trim_matches('/');
        if !prefix.is_empty() {
            ObjectPath::parse(prefix).map_err(|e| {
                Error::invalid(format!("object store URL {url:?}: bad key prefix: {e}"))
            })?;
        }
        let mut builder = AmazonS3Builder::from_env().with_url(format!("s3://{bucket}"));
        for (k, v) in options {
            let key: AmazonS3ConfigKey = k.to_ascii_lowercase().parse().map_err(|e| {
                Error::invalid(format!("object store URL {url:?}: option {k:?}: {e}"))
            })?;
            builder = builder.with_config(key, *v);
        }
        let s3 = builder
            .build()
            .map_err(|e| Error::invalid(format!("object store URL {url:?}: {e}")))?;
        Ok(CloudObjects {
            store: Arc::new(s3),
            prefix: prefix.to_string(),
            url: url.to_string(),
        })
    }

    /// The backend path of object `name`.
    fn path(&self, name: &str) -> Result<ObjectPath> {
        let full = if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}/{name}", self.prefix)
        };
        ObjectPath::parse(&full)
            .map_err(|e| Error::invalid(format!("object name {name:?} in {}: {e}", self.url)))
    }
}

#[async_trait::async_trait]
impl ObjectStore for CloudObjects {
    async fn put(&self, name: &str, data: Bytes) -> Result<()> {
        let path = self.path(name)?;
        self.store
            .put(&path, data.into())
            .await
            .map_err(|e| Error::Fleet(format!("storing {name} in {}: {e}", self.url)))?;
        Ok(())
    }

    async fn get(&self, name: &str) -> Result<Option<Bytes>> {
        let path = self.path(name)?;
        let fetched = match self.store.get(&path).await {
            Ok(r) => r.bytes().await,
            Err(e) => Err(e),
        };
        match fetched {
            Ok(b) => Ok(Some(b)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(Error::Fleet(format!(
                "fetching {name} from {}: {e}",
                self.url
            ))),
        }
    }

    async fn exists(&self, name: &str) -> Result<bool> {
        let path = self.path(name)?;
        match self.store.head(&path).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(Error::Fleet(format!(
                "looking up {name} in {}: {e}",
                self.url
            ))),
        }
    }

    fn describe(&self) -> String {
        self.url.clone()
    }
}
