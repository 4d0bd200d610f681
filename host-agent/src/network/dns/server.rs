//! The resolver's sockets and tasks: sockets made inside the VM's
//! namespace on a short-lived thread, served by tokio; each datagram or TCP
//! message triaged at once, allowed ones forwarded under a bound on
//! queries in flight.

use std::fs::File;
use std::net::{SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use hickory_proto::op::ResponseCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;

use super::names::NamePolicy;
use super::tracker::{Revoke, Tracker};
use super::wire::{self, Decision, Forward};
use super::{upstream, DeniedQuery, DnsStats};
use crate::error::{Error, Result};
use crate::network::namespace::{add_learned, flush_learned, forget_learned};
use crate::network::rules::{Allow, Learned};

/// Largest query read from a datagram (longer ones are cut and fail to
/// parse).
const MAX_DATAGRAM: usize = 4096;
/// TCP connections served at once.
const MAX_TCP_CONNECTIONS: usize = 16;
/// Messages served on one TCP connection.
const MAX_TCP_MESSAGES: usize = 64;
/// How long a TCP connection may stay silent.
const TCP_IDLE: Duration = Duration::from_secs(10);

/// The counters behind [`DnsStats`].
#[derive(Debug, Default)]
pub struct Counters {
    answered: AtomicU64,
    denied: AtomicU64,
    malformed: AtomicU64,
    upstream_failures: AtomicU64,
    overloaded: AtomicU64,
    events_dropped: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    /// A snapshot.
    pub fn snapshot(&self) -> DnsStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DnsStats {
            answered: get(&self.answered),
            denied: get(&self.denied),
            malformed: get(&self.malformed),
            upstream_failures: get(&self.upstream_failures),
            overloaded: get(&self.overloaded),
            events_dropped: get(&self.events_dropped),
        }
    }
}

/// What the tasks share with the handle.
#[derive(Debug)]
pub struct Shared {
    /// The names allowed now.
    pub policy: RwLock<Arc<NamePolicy>>,
    /// Held for reading while an answer's addresses are added, for writing
    /// while the names change: a narrowing never misses an answer in flight.
    pub learning: tokio::sync::RwLock<()>,
    /// The counters.
    pub counters: Counters,
    /// Denied queries, for audit events.
    pub events: mpsc::Sender<DeniedQuery>,
    /// The node's resolvers.
    pub upstreams: Vec<SocketAddr>,
    /// How long each upstream is given.
    pub upstream_timeout: Duration,
    /// The node policy's allowlist: what learned elements may open at most.
    pub ceiling: Vec<Allow>,
    /// The VM's namespace.
    pub netns: String,
    /// Whether AAAA queries are forwarded (the VM has IPv6).
    pub ipv6: bool,
    /// Bound on forwarded queries in flight.
    pub in_flight: Arc<Semaphore>,
    /// What was learned, for which names.
    pub tracker: Mutex<Tracker>,
}

impl Shared {
    fn policy(&self) -> Arc<NamePolicy> {
        // A poisoned lock still holds a whole policy (it is only swapped).
        match self.policy.read() {
            Ok(p) => p.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn tracker(&self) -> std::sync::MutexGuard<'_, Tracker> {
        self.tracker.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn report(&self, name: String, qtype: String) {
        bump(&self.counters.denied);
        if self.events.try_send(DeniedQuery { name, qtype }).is_err() {
            bump(&self.counters.events_dropped);
        }
    }

    /// Replaces the names, taking back what the old ones opened and the
    /// new ones do not.
    pub async fn set_policy(&self, policy: NamePolicy) -> Result<()> {
        let _exclusive = self.learning.write().await;
        let revoke = self.tracker().narrow(&policy, std::time::Instant::now());
        match self.policy.write() {
            Ok(mut p) => *p = Arc::new(policy),
            Err(poisoned) => *poisoned.into_inner() = Arc::new(policy),
        }
        let netns = self.netns.clone();
        blocking(move || match revoke {
            Revoke::All => flush_learned(&netns),
            Revoke::Entries(entries) => forget_learned(&netns, &entries),
        })
        .await
    }

    /// Adds back what was learned and has not expired.
    pub async fn restore(&self) -> Result<()> {
        let _shared = self.learning.read().await;
        let live = self.tracker().live(std::time::Instant::now());
        let netns = self.netns.clone();
        blocking(move || add_learned(&netns, &live)).await
    }

    /// Forwards an allowed query and returns the reply for the guest (at
    /// most `limit` bytes), after adding the addresses it opens.
    async fn resolve(&self, f: &Forward, limit: usize) -> Vec<u8> {
        let Some(answer) =
            upstream::forward(&self.upstreams, self.upstream_timeout, &f.query).await
        else {
            bump(&self.counters.upstream_failures);
            return wire::reply(&f.request, ResponseCode::ServFail);
        };
        let addresses = wire::addresses(&answer, &f.name);
        let learned = wire::learned(&addresses, &f.ports, &self.ceiling);
        let _shared = self.learning.read().await;
        if !self.policy().allows(&f.name) {
            // Narrowed while the query was upstream.
            bump(&self.counters.denied);
            return wire::reply(&f.request, ResponseCode::NXDomain);
        }
        if !learned.is_empty() {
            // Added before the answer goes out: the guest connects as soon
            // as it has it.
            let netns = self.netns.clone();
            let entries: Vec<Learned> = learned.clone();
            match blocking(move || add_learned(&netns, &entries)).await {
                Ok(()) => self
                    .tracker()
                    .record(&f.name, &learned, std::time::Instant::now()),
                Err(e) => {
                    tracing::warn!(netns = %self.netns, name = %f.name, error = %e, "could not allow the addresses of a resolved name");
                }
            }
        }
        bump(&self.counters.answered);
        wire::guest_reply(&answer, &f.request, limit)
    }

    /// Triage: the reply to send now, a query to forward, or nothing.
    fn triage(&self, bytes: &[u8]) -> Triage {
        match wire::decide(bytes, &self.policy(), self.ipv6) {
            Decision::Drop => {
                bump(&self.counters.malformed);
                Triage::Nothing
            }
            Decision::Refused(reply) => {
                bump(&self.counters.malformed);
                Triage::Reply(reply)
            }
            Decision::Denied { name, qtype, reply } => {
                self.report(name, qtype);
                Triage::Reply(reply)
            }
            Decision::NoData(reply) => {
                bump(&self.counters.answered);
                Triage::Reply(reply)
            }
            Decision::Forward(f) => match self.in_flight.clone().try_acquire_owned() {
                Ok(permit) => Triage::Forward(f, permit),
                Err(_) => {
                    bump(&self.counters.overloaded);
                    Triage::Nothing
                }
            },
        }
    }
}

enum Triage {
    Nothing,
    Reply(Vec<u8>),
    Forward(Box<Forward>, tokio::sync::OwnedSemaphorePermit),
}

/// Runs `f` on tokio's blocking pool (an `nft` run).
async fn blocking(f: impl FnOnce() -> Result<()> + Send + 'static) -> Result<()> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Network(format!("the nft task of the DNS resolver failed: {e}")))?
}

/// Binds UDP and TCP at `addr` inside namespace `netns`, on a thread of its
/// own that joins the namespace and ends (a socket stays in the namespace
/// it was made in).
pub async fn bind_in_netns(
    netns: &str,
    addr: SocketAddrV4,
) -> Result<(std::net::UdpSocket, std::net::TcpListener)> {
    let path = format!("/run/netns/{netns}");
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("dns-bind".into())
        .spawn(move || {
            let _ = tx.send(bind_here(&path, addr));
        })
        .map_err(|e| Error::io("starting a thread to bind the DNS resolver", e))?;
    rx.await
        .map_err(|_| Error::Network("the thread binding the DNS resolver died".into()))?
}

fn bind_here(
    path: &str,
    addr: SocketAddrV4,
) -> Result<(std::net::UdpSocket, std::net::TcpListener)> {
    let ns = File::open(path).map_err(|e| {
        Error::io(
            format!("opening the VM's network namespace {path} (was the VM's network made?)"),
            e,
        )
    })?;
    // SAFETY: `ns` is an open namespace file for the call's duration;
    // setns changes only this thread's network namespace, and this thread
    // ends once the sockets are made.
    let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(Error::io(
            format!("joining the network namespace {path} (setns needs CAP_SYS_ADMIN)"),
            std::io::Error::last_os_error(),
        ));
    }
    let context = |proto: &str| format!("binding the DNS resolver to {proto} {addr} in {path}");
    let udp = std::net::UdpSocket::bind(addr).map_err(|e| Error::io(context("UDP"), e))?;
    udp.set_nonblocking(true)
        .map_err(|e| Error::io(context("UDP"), e))?;
    let tcp = std::net::TcpListener::bind(addr).map_err(|e| Error::io(context("TCP"), e))?;
    tcp.set_nonblocking(true)
        .map_err(|e| Error::io(context("TCP"), e))?;
    Ok((udp, tcp))
}

/// Serves datagrams until aborted (its forwarding tasks end with it).
pub async fn serve_udp(shared: Arc<Shared>, sock: UdpSocket) {
    let sock = Arc::new(sock);
    let mut tasks = JoinSet::new();
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        tokio::select! {
            received = sock.recv_from(&mut buf) => {
                let Ok((n, from)) = received else {
                    // ICMP errors of earlier replies: nothing to do.
                    continue;
                };
                match shared.triage(buf.get(..n).unwrap_or_default()) {
                    Triage::Nothing => {}
                    // Never waits: a reply the socket cannot take now is dropped.
                    Triage::Reply(reply) => drop(sock.try_send_to(&reply, from)),
                    Triage::Forward(f, permit) => {
                        let (shared, sock) = (shared.clone(), sock.clone());
                        tasks.spawn(async move {
                            let reply = shared.resolve(&f, wire::udp_limit(&f.request)).await;
                            drop(permit);
                            let _ = sock.send_to(&reply, from).await;
                        });
                    }
                }
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
}

/// Serves TCP connections until aborted (its connections end with it).
pub async fn serve_tcp(shared: Arc<Shared>, listener: TcpListener) {
    let connections = Arc::new(Semaphore::new(MAX_TCP_CONNECTIONS));
    let mut tasks = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    // Out of descriptors, most likely: give it a moment.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let Ok(permit) = connections.clone().try_acquire_owned() else {
                    bump(&shared.counters.overloaded);
                    continue;
                };
                let shared = shared.clone();
                tasks.spawn(async move {
                    serve_connection(&shared, stream).await;
                    drop(permit);
                });
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
}

async fn serve_connection(shared: &Shared, mut stream: TcpStream) {
    for _ in 0..MAX_TCP_MESSAGES {
        let mut len = [0u8; 2];
        if !matches!(
            tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut len)).await,
            Ok(Ok(_))
        ) {
            return;
        }
        let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
        if !matches!(
            tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut msg)).await,
            Ok(Ok(_))
        ) {
            return;
        }
        let reply = match shared.triage(&msg) {
            Triage::Nothing => return,
            Triage::Reply(reply) => reply,
            Triage::Forward(f, permit) => {
                let reply = shared.resolve(&f, usize::from(u16::MAX)).await;
                drop(permit);
                reply
            }
        };
        let Ok(n) = u16::try_from(reply.len()) else {
            return;
        };
        let mut out = Vec::with_capacity(reply.len() + 2);
        out.extend_from_slice(&n.to_be_bytes());
        out.extend_from_slice(&reply);
        if !matches!(
            tokio::time::timeout(TCP_IDLE, stream.write_all(&out)).await,
            Ok(Ok(()))
        ) {
            return;
        }
    }
}
