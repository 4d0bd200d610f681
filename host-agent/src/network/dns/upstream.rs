//! Asking the node's upstream resolvers, from host-agent's own namespace:
//! a fresh socket (a fresh source port) and a fresh transaction id per
//! query, each upstream in turn until one answers within the timeout.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hickory_proto::op::{Message, Query};
use tokio::net::UdpSocket;
use tokio::time::Instant;

use super::wire::{upstream_answer, upstream_query, UPSTREAM_PAYLOAD};

/// An unpredictable transaction id: SipHash of a counter under the keys
/// std draws from the OS for every `RandomState`.
fn random_id() -> u16 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    // Truncation intended: any 16 bits of the hash.
    h.finish() as u16
}

/// Asks one upstream; the first datagram answering this id and question
/// wins, anything else from it is ignored until `deadline`.
async fn ask(upstream: SocketAddr, query: &Query, deadline: Instant) -> std::io::Result<Message> {
    let any: SocketAddr = if upstream.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = UdpSocket::bind(any).await?;
    // Connected: datagrams from any other address are not delivered.
    sock.connect(upstream).await?;
    let id = random_id();
    sock.send(&upstream_query(query, id)).await?;
    let mut buf = vec![0u8; usize::from(UPSTREAM_PAYLOAD) * 2];
    loop {
        let n = tokio::time::timeout_at(deadline, sock.recv(&mut buf))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
        if let Some(answer) = buf.get(..n).and_then(|b| upstream_answer(b, id, query)) {
            return Ok(answer);
        }
    }
}

/// The first answer of `upstreams`, each given `timeout`; `None` when none
/// answered.
pub async fn forward(
    upstreams: &[SocketAddr],
    timeout: Duration,
    query: &Query,
) -> Option<Message> {
    for &upstream in upstreams {
        match ask(upstream, query, Instant::now() + timeout).await {
            Ok(answer) => return Some(answer),
            Err(e) => tracing::debug!(%upstream, error = %e, "DNS upstream did not answer"),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_vary() {
        let ids: std::collections::HashSet<u16> = (0..64).map(|_| random_id()).collect();
        assert!(ids.len() > 32, "{ids:?}");
    }
}
