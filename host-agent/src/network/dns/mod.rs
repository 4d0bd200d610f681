//! The per-session DNS resolver. host-agent runs one per VM, listening at
//! the guest's gateway ([`GATEWAY_IP`]`:53`, UDP and TCP) inside the VM's
//! network namespace. It answers only the names the session may resolve
//! ([`NameRule`], from the repository manifest's `host:` entries), by
//! asking the node's upstream resolvers from host-agent's own namespace,
//! and adds the addresses in each answer to the namespace's learned sets
//! ([`crate::network::rules::LEARNED_ANY`], `LEARNED_PORT`) for the
//! record's TTL (clamped to [`wire::MIN_TTL_SECS`]..=[`wire::MAX_TTL_SECS`]),
//! within the node's allowlist (the ceiling): so a name keeps working as
//! its addresses change. The addresses are added before the answer goes
//! out, so that the guest never connects ahead of its rule.
//!
//! Every other query is answered here without asking upstream: NXDOMAIN for
//! a name not allowed, no records for an allowed name's AAAA when the VM
//! has no IPv6 (with IPv6, AAAA is forwarded and learned like A) or
//! another type, REFUSED for a message that is not
//! one plain query. Denied queries are counted and sent on a bounded
//! channel ([`DnsHandle::take_denied_events`]) for audit events; when it is
//! full they are dropped and counted, the server never waits. Datagrams
//! that are not DNS are dropped and counted.
//!
//! Bounds, whatever the guest sends: [`DnsConfig::max_in_flight`] forwarded
//! queries (more are dropped and counted as `overloaded`), 16 TCP
//! connections of at most 64 messages each, 4 KiB datagrams, 32 addresses
//! learned per answer, 4096 learned elements tracked.

mod names;
mod server;
mod tracker;
mod upstream;
pub mod wire;

use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;

pub use names::{NamePolicy, NameRule, Ports};

use crate::error::{Error, Result};
use crate::network::addressing::GATEWAY_IP;
use crate::network::rules::Allow;
use server::{Counters, Shared};
use tracker::Tracker;

/// The resolver's port.
pub const DNS_PORT: u16 = 53;

/// How to start a VM's resolver.
#[derive(Debug, Clone)]
pub struct DnsConfig {
    /// The VM's network namespace (`/run/netns/<netns>`).
    pub netns: String,
    /// Where to listen inside it (the gateway's port 53 by default).
    pub listen: SocketAddrV4,
    /// The names the session may resolve.
    pub names: Vec<NameRule>,
    /// The node's resolvers, asked in turn (see [`upstreams_from_resolv_conf`]).
    pub upstreams: Vec<SocketAddr>,
    /// The node policy's allowlist: a learned address opens only what some
    /// entry of it covers.
    pub ceiling: Vec<Allow>,
    /// How long each upstream is given before the next is asked.
    pub upstream_timeout: Duration,
    /// Forwarded queries in flight at most.
    pub max_in_flight: usize,
    /// Denied queries queued for the audit at most.
    pub events_capacity: usize,
    /// Whether the VM has IPv6: AAAA queries are forwarded and their
    /// addresses learned (otherwise answered with no records).
    pub ipv6: bool,
}

impl DnsConfig {
    /// A configuration with the defaults: listening at the gateway's port
    /// 53, 2 s per upstream, 64 queries in flight, 256 queued events.
    pub fn new(
        netns: impl Into<String>,
        names: Vec<NameRule>,
        upstreams: Vec<SocketAddr>,
        ceiling: Vec<Allow>,
    ) -> Self {
        Self {
            netns: netns.into(),
            listen: SocketAddrV4::new(GATEWAY_IP, DNS_PORT),
            names,
            upstreams,
            ceiling,
            upstream_timeout: Duration::from_secs(2),
            max_in_flight: 64,
            events_capacity: 256,
            ipv6: false,
        }
    }
}

/// A query the resolver refused to forward, for an audit event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeniedQuery {
    /// The name asked (lowercase; escaped where it has odd bytes).
    pub name: String,
    /// The record type asked (`A`, `TXT`, ...).
    pub qtype: String,
}

/// The resolver's counters since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DnsStats {
    /// Queries answered with the upstream's answer (or no records, AAAA).
    pub answered: u64,
    /// Queries refused: names not allowed, types not forwarded.
    pub denied: u64,
    /// Datagrams and messages that were not one plain DNS query.
    pub malformed: u64,
    /// Allowed queries no upstream answered (answered SERVFAIL).
    pub upstream_failures: u64,
    /// Allowed queries or TCP connections dropped at the in-flight bound.
    pub overloaded: u64,
    /// Denied queries not reported because the event channel was full.
    pub events_dropped: u64,
}

/// Starts resolvers.
#[derive(Debug)]
pub struct DnsResolver;

/// A running resolver; dropping it stops its tasks and closes its sockets.
#[derive(Debug)]
pub struct DnsHandle {
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
    events: Option<mpsc::Receiver<DeniedQuery>>,
}

impl DnsResolver {
    /// Binds in the VM's namespace and starts serving (on the current tokio
    /// runtime).
    pub async fn start(config: DnsConfig) -> Result<DnsHandle> {
        if config.upstreams.is_empty() {
            return Err(Error::invalid(
                "the DNS resolver needs at least one upstream resolver (none in /etc/resolv.conf?)",
            ));
        }
        if config.max_in_flight == 0 || config.events_capacity == 0 {
            return Err(Error::invalid(
                "the DNS resolver's max_in_flight and events_capacity must be at least 1",
            ));
        }
        let policy = NamePolicy::new(&config.names)?;
        let (udp, tcp) = server::bind_in_netns(&config.netns, config.listen).await?;
        let context = |what: &str| {
            format!(
                "serving the DNS resolver's {what} socket in {}",
                config.netns
            )
        };
        let udp = tokio::net::UdpSocket::from_std(udp).map_err(|e| Error::io(context("UDP"), e))?;
        let tcp =
            tokio::net::TcpListener::from_std(tcp).map_err(|e| Error::io(context("TCP"), e))?;
        let (tx, rx) = mpsc::channel(config.events_capacity);
        let shared = Arc::new(Shared {
            policy: RwLock::new(Arc::new(policy)),
            learning: tokio::sync::RwLock::new(()),
            counters: Counters::default(),
            events: tx,
            upstreams: config.upstreams,
            upstream_timeout: config.upstream_timeout,
            ceiling: config.ceiling,
            netns: config.netns,
            ipv6: config.ipv6,
            in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
            tracker: Mutex::new(Tracker::default()),
        });
        let tasks = vec![
            tokio::spawn(server::serve_udp(shared.clone(), udp)),
            tokio::spawn(server::serve_tcp(shared.clone(), tcp)),
        ];
        Ok(DnsHandle {
            shared,
            tasks,
            events: Some(rx),
        })
    }
}

impl DnsHandle {
    /// Replaces the names the session may resolve, at once; what the
    /// removed names opened in the learned sets is taken back (addresses
    /// still opened by a remaining name stay).
    pub async fn set_names(&self, names: Vec<NameRule>) -> Result<()> {
        let policy = NamePolicy::new(&names)?;
        self.shared.set_policy(policy).await
    }

    /// Puts back the learned addresses that have not expired, after
    /// [`crate::network::namespace::VmNetwork::update_policy`] rewrote the
    /// namespace's rules (which empties the learned sets).
    pub async fn restore_learned(&self) -> Result<()> {
        self.shared.restore().await
    }

    /// The counters.
    pub fn stats(&self) -> DnsStats {
        self.shared.counters.snapshot()
    }

    /// The denied queries, once (`None` after the first call).
    pub fn take_denied_events(&mut self) -> Option<mpsc::Receiver<DeniedQuery>> {
        self.events.take()
    }

    /// Stops serving; the sockets are closed when this returns.
    pub async fn stop(mut self) {
        for task in std::mem::take(&mut self.tasks) {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for DnsHandle {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The resolvers of a `resolv.conf` text: each `nameserver` line's address
/// (IPv4 or IPv6, a `%zone` dropped), port 53, in order; anything else is
/// ignored.
pub fn upstreams_from_resolv_conf(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            if words.next() != Some("nameserver") {
                return None;
            }
            let addr = words.next()?;
            let addr = addr.split('%').next().unwrap_or(addr);
            let ip: IpAddr = addr.parse().ok()?;
            Some(SocketAddr::new(ip, DNS_PORT))
        })
        .collect()
}

/// The node's resolvers from `path` (`/etc/resolv.conf`); an error when it
/// cannot be read or names none.
pub fn read_upstreams(path: &Path) -> Result<Vec<SocketAddr>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::io(
            format!("reading the node's resolvers from {}", path.display()),
            e,
        )
    })?;
    let upstreams = upstreams_from_resolv_conf(&text);
    if upstreams.is_empty() {
        return Err(Error::invalid(format!(
            "{} has no nameserver line: sessions' DNS resolvers need an upstream",
            path.display()
        )));
    }
    Ok(upstreams)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_nameservers_are_the_upstreams() {
        let text = "# generated\nsearch example.com\nnameserver 10.0.0.2\n  nameserver\t1.1.1.1  # comment\n;nameserver 9.9.9.9\nnameserver fe80::1%eth0\nnameserver bogus\noptions edns0\nnameserver\n";
        let got = upstreams_from_resolv_conf(text);
        let want: Vec<SocketAddr> = ["10.0.0.2:53", "1.1.1.1:53", "[fe80::1]:53"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(got, want);
        assert!(upstreams_from_resolv_conf("search x\n").is_empty());
    }

    #[test]
    fn a_missing_resolv_conf_says_which_file() {
        let dir = tempfile::tempdir().unwrap();
        let e = read_upstreams(&dir.path().join("resolv.conf")).unwrap_err();
        assert!(e.to_string().contains("resolv.conf"), "{e}");
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "search x\n").unwrap();
        let e = read_upstreams(&empty).unwrap_err().to_string();
        assert!(e.contains("no nameserver"), "{e}");
    }
}
