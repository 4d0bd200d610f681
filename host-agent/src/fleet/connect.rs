//! The NATS connection and its JetStream context.

use std::time::Duration;

use super::config::FleetConfig;
use crate::error::{Error, Result};

/// How long a JetStream request (a publish's acknowledgement, a stream
/// lookup) may take before it counts as failed and is retried.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects to `cfg.nats` with its credentials and TLS settings. The
/// connection is made in the background and remade after every outage, so
/// host-agent starts (and keeps its records in the outbox) while NATS is
/// down.
pub async fn connect(cfg: &FleetConfig, node: &str) -> Result<async_nats::Client> {
    let url = cfg
        .nats
        .as_deref()
        .ok_or_else(|| Error::invalid("fleet: no NATS URL (--nats)"))?;
    let mut opts = async_nats::ConnectOptions::new()
        .name(format!("host-agent {node}"))
        .retry_on_initial_connect()
        .connection_timeout(REQUEST_TIMEOUT)
        .event_callback(|event| async move {
            match event {
                async_nats::Event::Connected => tracing::info!("NATS connected"),
                async_nats::Event::Disconnected => {
                    tracing::warn!("NATS disconnected; records wait in the outbox")
                }
                other => tracing::debug!(event = %other, "NATS"),
            }
        });
    if let Some(path) = &cfg.creds_file {
        opts = opts
            .credentials_file(path)
            .await
            .map_err(|e| Error::io(format!("reading NATS credentials {}", path.display()), e))?;
    }
    if let Some(path) = &cfg.token_file {
        let token = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading NATS token {}", path.display()), e))?;
        opts = opts.token(token.trim().to_string());
    }
    if let Some(ca) = &cfg.tls_ca {
        opts = opts.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let (Some(cert), Some(key)) = (&cfg.tls_cert, &cfg.tls_key) {
        opts = opts.add_client_certificate(cert.clone(), key.clone());
    }
    let servers: Vec<async_nats::ServerAddr> = url
        .split(',')
        .map(|u| {
            u.trim()
                .parse()
                .map_err(|e| Error::invalid(format!("fleet.nats {u:?}: {e}")))
        })
        .collect::<Result<_>>()?;
    opts.connect(servers)
        .await
        .map_err(|e| Error::Fleet(format!("connecting to NATS at {url}: {e}")))
}

/// The JetStream context of `client`.
pub fn jetstream(client: async_nats::Client) -> async_nats::jetstream::Context {
    async_nats::jetstream::ContextBuilder::new()
        .timeout(REQUEST_TIMEOUT)
        .build(client)
}
