//! Each networked session's DNS resolver ([`crate::network::dns`]): started
//! with its network (and again for a network taken back after a restart),
//! answering the host names its manifest grants, within the node's
//! allowlist; stopped when the session ends. Denied queries become
//! `dns_denied` events, each name at most once a minute (all are counted
//! by the resolver), so a guest looping on a name cannot flood the event
//! log.

use std::collections::HashMap;

use super::*;
use crate::network::dns::{DeniedQuery, DnsConfig, DnsResolver, NameRule};

/// How often one denied name is recorded as an event at most.
const DENIED_EVENT_EVERY: Duration = Duration::from_secs(60);
/// Distinct denied names remembered for that at most.
const DENIED_NAMES: usize = 1024;

impl Manager {
    /// Starts the resolver of session `sess`'s network (replacing one it
    /// had); nothing when it has no network, or the node no upstream.
    pub(super) async fn start_resolver(self: &Arc<Self>, sess: &Arc<Session>) -> Result<()> {
        let Some(node) = self.network.clone() else {
            return Ok(());
        };
        if node.upstreams().is_empty() {
            tracing::warn!(session = %sess.id, "no DNS upstream on this node: the session's guest resolves nothing");
            return Ok(());
        }
        let (netns, ipv6, names, old) = {
            let mut i = sess.lock();
            let Some((netns, ipv6)) = i
                .network
                .as_ref()
                .map(|n| (n.netns.clone(), n.slot.v6.is_some()))
            else {
                return Ok(());
            };
            let names: Vec<NameRule> = i
                .net_hosts
                .iter()
                .map(|h| NameRule {
                    name: h.host.clone(),
                    ports: h.ports.clone(),
                })
                .collect();
            (netns, ipv6, names, i.dns.take())
        };
        if let Some(old) = old.and_then(|o| Arc::try_unwrap(o).ok()) {
            // Its sockets hold the gateway's port 53 (one still in use
            // elsewhere goes when that use ends: it is aborted on drop).
            old.stop().await;
        }
        let mut config = DnsConfig::new(
            netns,
            names,
            node.upstreams().to_vec(),
            node.policy().allow.clone(),
        );
        config.ipv6 = ipv6;
        let mut handle = DnsResolver::start(config).await?;
        if let Some(denied) = handle.take_denied_events() {
            tokio::spawn(self.clone().record_denied(sess.clone(), denied));
        }
        sess.lock().dns = Some(Arc::new(handle));
        Ok(())
    }

    /// Records denied queries as events until the resolver goes.
    async fn record_denied(
        self: Arc<Self>,
        sess: Arc<Session>,
        mut denied: tokio::sync::mpsc::Receiver<DeniedQuery>,
    ) {
        let mut last: HashMap<String, Instant> = HashMap::new();
        while let Some(q) = denied.recv().await {
            let now = Instant::now();
            if last
                .get(&q.name)
                .is_some_and(|t| now.duration_since(*t) < DENIED_EVENT_EVERY)
            {
                continue;
            }
            if last.len() >= DENIED_NAMES {
                last.retain(|_, t| now.duration_since(*t) < DENIED_EVENT_EVERY);
                if last.len() >= DENIED_NAMES {
                    continue;
                }
            }
            last.insert(q.name.clone(), now);
            let detail = format!("{} {}", q.name, q.qtype);
            if let Err(e) = self.note(&sess, "dns_denied", &detail) {
                tracing::warn!(session = %sess.id, error = %e, "recording a denied DNS query");
            }
        }
    }
}
