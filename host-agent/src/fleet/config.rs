//! The `fleet` settings: the NATS connection, this node's name in the
//! fleet, the streams' retention, the registry's period and TTL, and where
//! images are pushed.

use std::path::PathBuf;

use serde::Deserialize;

use crate::error::{Error, Result};

/// Longest node name.
pub const MAX_NODE_NAME: usize = 64;

/// How this node takes part in a fleet. Without `nats` it does not: no
/// export, no registry, no image store unless `image_store` names one.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct FleetConfig {
    /// NATS server URLs, comma-separated (`nats://host:4222`, `tls://...`).
    pub nats: Option<String>,
    /// This node's name in subjects (`agentvm.<node>.events`), message ids
    /// and the registry: 1..=64 of `[A-Za-z0-9_-]`. Default: the host name
    /// with other characters replaced by `-`.
    pub node_name: Option<String>,
    /// The gRPC address control planes reach this node at, as the registry
    /// shows it. Default: the address host-agent listens on.
    pub advertise_address: Option<String>,
    /// A NATS credentials file (JWT and NKey seed, `nsc`'s `.creds`).
    pub creds_file: Option<PathBuf>,
    /// A file holding a NATS token.
    pub token_file: Option<PathBuf>,
    /// CA of the NATS servers' certificates (PEM); with it TLS is required.
    pub tls_ca: Option<PathBuf>,
    /// Client certificate for NATS (PEM), with `tls_key`.
    pub tls_cert: Option<PathBuf>,
    /// Client key for NATS (PEM), with `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// How long the streams keep messages, seconds (when host-agent creates
    /// them; existing streams are left as their operator configured them).
    pub stream_max_age_seconds: u64,
    /// Most bytes each stream keeps (oldest dropped first); 0: no limit.
    pub stream_max_bytes: u64,
    /// Replicas of the streams and buckets host-agent creates (1 for a
    /// single server; 3 in a clustered JetStream).
    pub stream_replicas: usize,
    /// How often this node puts its entry into the registry, seconds.
    pub registry_interval_seconds: u64,
    /// How long an entry lives without being put again, seconds: a node
    /// that died drops out of the registry this long after its last put.
    pub registry_ttl_seconds: u64,
    /// Where `images push` and pulls go: `nats` (JetStream's object store,
    /// bucket `agentvm_images`; the default with `nats`), or an
    /// `object_store` URL: `s3://bucket/prefix` (configured by the AWS_*
    /// environment variables, e.g. AWS_ENDPOINT for an S3-compatible
    /// server) or `file:///dir`.
    pub image_store: Option<String>,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            nats: None,
            node_name: None,
            advertise_address: None,
            creds_file: None,
            token_file: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            stream_max_age_seconds: 7 * 86_400,
            stream_max_bytes: 0,
            stream_replicas: 1,
            registry_interval_seconds: 5,
            registry_ttl_seconds: 15,
            image_store: None,
        }
    }
}

/// Checks a node name: 1..=64 of `[A-Za-z0-9_-]` (a NATS subject token and
/// a KV key).
pub fn check_node_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > MAX_NODE_NAME
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
    {
        return Err(Error::invalid(format!(
            "fleet.node_name {name:?} must be 1 to {MAX_NODE_NAME} letters, digits, '_' or '-' \
             (it is a NATS subject token)"
        )));
    }
    Ok(())
}

/// The host name made into a node name.
pub fn default_node_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name: String = host
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(MAX_NODE_NAME)
        .collect();
    if name.is_empty() {
        "node".into()
    } else {
        name
    }
}

impl FleetConfig {
    /// This node's name.
    pub fn node(&self) -> String {
        self.node_name.clone().unwrap_or_else(default_node_name)
    }

    /// Checks the values.
    pub fn validate(&self) -> Result<()> {
        if let Some(n) = &self.node_name {
            check_node_name(n)?;
        }
        if self.nats.as_deref().is_some_and(|n| n.trim().is_empty()) {
            return Err(Error::invalid(
                "fleet.nats is empty: give a URL or leave it out",
            ));
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(Error::invalid(
                "fleet.tls_cert and fleet.tls_key go together (--nats-tls-cert, --nats-tls-key)",
            ));
        }
        if self.registry_interval_seconds == 0 {
            return Err(Error::invalid(
                "fleet.registry_interval_seconds must be at least 1",
            ));
        }
        if self.registry_ttl_seconds < 2 * self.registry_interval_seconds {
            return Err(Error::invalid(format!(
                "fleet.registry_ttl_seconds {} must be at least twice registry_interval_seconds \
                 ({}), or a live node would blink out of the registry",
                self.registry_ttl_seconds, self.registry_interval_seconds
            )));
        }
        if self.stream_max_age_seconds == 0 {
            return Err(Error::invalid(
                "fleet.stream_max_age_seconds must be at least 1",
            ));
        }
        if !(1..=5).contains(&self.stream_replicas) {
            return Err(Error::invalid(format!(
                "fleet.stream_replicas {} is out of range 1..=5",
                self.stream_replicas
            )));
        }
        match self.image_store.as_deref() {
            Some("nats") if self.nats.is_none() => Err(Error::invalid(
                "fleet.image_store \"nats\" needs fleet.nats (--nats)",
            )),
            Some(url) if url != "nats" && !url.contains("://") => Err(Error::invalid(format!(
                "fleet.image_store {url:?} must be \"nats\" or a URL (s3://bucket/prefix, file:///dir)"
            ))),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_subject_tokens() {
        for good in ["node-a", "A_1", &"x".repeat(64)] {
            check_node_name(good).unwrap();
        }
        for bad in ["", "a.b", "a b", "a*", ">", &"x".repeat(65)] {
            let e = check_node_name(bad).unwrap_err().to_string();
            assert!(e.contains("fleet.node_name"), "{e}");
        }
        check_node_name(&default_node_name()).unwrap();
    }

    #[test]
    fn settings_that_cannot_work_are_refused_with_the_field() {
        let ok = FleetConfig {
            nats: Some("nats://127.0.0.1:4222".into()),
            ..Default::default()
        };
        ok.validate().unwrap();
        let cases = [
            (
                FleetConfig {
                    registry_ttl_seconds: 5,
                    ..ok.clone()
                },
                "registry_ttl_seconds",
            ),
            (
                FleetConfig {
                    registry_interval_seconds: 0,
                    ..ok.clone()
                },
                "registry_interval_seconds",
            ),
            (
                FleetConfig {
                    tls_cert: Some("/c".into()),
                    ..ok.clone()
                },
                "tls_key",
            ),
            (
                FleetConfig {
                    image_store: Some("nats".into()),
                    nats: None,
                    ..ok.clone()
                },
                "needs fleet.nats",
            ),
            (
                FleetConfig {
                    image_store: Some("bucket".into()),
                    ..ok.clone()
                },
                "image_store",
            ),
            (
                FleetConfig {
                    stream_replicas: 0,
                    ..ok.clone()
                },
                "stream_replicas",
            ),
        ];
        for (cfg, field) in cases {
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{field}: {e}");
        }
    }
}
