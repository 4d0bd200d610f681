//! Exposed ports: a TCP listener on the node that forwards every connection
//! to a port of the guest.
//!
//! A proxy in host-agent rather than DNAT: the node's listener is an
//! ordinary socket on the address the operator chose (`network.expose_address`),
//! and each connection to the guest is made from inside the VM's namespace
//! ([`super::netns`]), where the guest's fixed address is reachable. So the
//! guest sees connections from its gateway, the namespace's egress rules
//! stay as they are (replies to host-agent's connection are traffic the
//! namespace itself started), and nothing of the node's firewall changes.
//! Dropping an [`ExposedPort`] closes the listener and every connection.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::JoinSet;

use super::addressing::GUEST_IP;
use super::netns::in_netns;
use crate::error::{Error, Result};

/// Most connections one exposed port carries at once; more are refused
/// (closed at once), so a client cannot make host-agent hold unbounded
/// sockets and threads.
pub const MAX_CONNECTIONS: usize = 256;
/// Connections the kernel queues on an exposed port before host-agent
/// accepts them.
const LISTEN_BACKLOG: u32 = 1024;
/// How long a connection to the guest may take to be made.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// One guest port reachable at a node address.
#[derive(Debug)]
pub struct ExposedPort {
    /// The guest's TCP port.
    pub guest_port: u16,
    /// Where clients connect on the node.
    pub host: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl ExposedPort {
    /// Closes the listener and every connection, and returns once the
    /// listener is closed (dropping the port closes it soon after, on the
    /// runtime's next turn).
    pub async fn close(mut self) {
        self.task.abort();
        // Cancelled once the task's future, holding the listener, is dropped.
        let _ = (&mut self.task).await;
    }
}

impl Drop for ExposedPort {
    fn drop(&mut self) {
        // Aborting the accept loop drops its JoinSet, which aborts every
        // connection's task and closes both of its sockets.
        self.task.abort();
    }
}

/// Exposes TCP port `guest_port` of the guest in namespace `netns` on a new
/// port of `bind` (chosen by the kernel).
pub async fn expose(netns: &str, guest_port: u16, bind: IpAddr) -> Result<ExposedPort> {
    expose_at(netns, guest_port, SocketAddr::new(bind, 0)).await
}

/// Exposes TCP port `guest_port` of the guest in namespace `netns` at
/// `host` (port 0: one the kernel chooses); an exposed port taken back
/// after a restart is opened again at the address its clients hold. The
/// address is reusable at once (`SO_REUSEADDR`: connections of the earlier
/// listener may still be in TIME_WAIT), but never while another socket
/// listens on it.
pub async fn expose_at(netns: &str, guest_port: u16, host: SocketAddr) -> Result<ExposedPort> {
    if guest_port == 0 {
        return Err(Error::invalid("guest_port must be 1 to 65535"));
    }
    let listening = format!("listening on {host} for guest port {guest_port}");
    let socket = if host.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }
    .map_err(|e| Error::io(listening.clone(), e))?;
    socket
        .set_reuseaddr(true)
        .map_err(|e| Error::io(listening.clone(), e))?;
    socket
        .bind(host)
        .map_err(|e| Error::io(listening.clone(), e))?;
    let listener = socket
        .listen(LISTEN_BACKLOG)
        .map_err(|e| Error::io(listening, e))?;
    let host = listener
        .local_addr()
        .map_err(|e| Error::io("reading the exposed port's address", e))?;
    let task = tokio::spawn(serve(listener, netns.to_string(), guest_port));
    Ok(ExposedPort {
        guest_port,
        host,
        task,
    })
}

async fn serve(listener: TcpListener, netns: String, port: u16) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((client, peer)) => {
                    if conns.len() >= MAX_CONNECTIONS {
                        tracing::warn!(%peer, port, "exposed port at its connection limit; refused");
                        continue;
                    }
                    conns.spawn(forward(client, netns.clone(), port));
                }
                Err(e) => {
                    // Out of file descriptors, mostly: wait rather than spin.
                    tracing::warn!(error = %e, port, "accepting on an exposed port");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// Carries one client connection to the guest's `port` and back.
async fn forward(mut client: TcpStream, netns: String, port: u16) {
    let target = SocketAddr::from((GUEST_IP, port));
    let made = in_netns(
        &netns,
        "connecting an exposed port to the guest",
        move || {
            let s = std::net::TcpStream::connect_timeout(&target, CONNECT_TIMEOUT)
                .map_err(|e| Error::io(format!("connecting to the guest's port {port}"), e))?;
            s.set_nonblocking(true)
                .map_err(|e| Error::io("making the guest connection non-blocking", e))?;
            Ok(s)
        },
    )
    .await;
    let guest = made.and_then(|s| {
        TcpStream::from_std(s).map_err(|e| Error::io("handing the guest connection to tokio", e))
    });
    match guest {
        Ok(mut guest) => {
            let _ = client.set_nodelay(true);
            let _ = guest.set_nodelay(true);
            if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut guest).await {
                tracing::debug!(error = %e, port, "exposed port connection ended");
            }
        }
        Err(e) => tracing::info!(error = %e, port, "exposed port: no connection to the guest"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn port_zero_is_refused() {
        let err = expose("agentvm-x", 0, "127.0.0.1".parse().unwrap())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("1 to 65535"), "{err}");
    }

    #[tokio::test]
    async fn a_guest_that_cannot_be_reached_closes_the_client_and_the_port_stays() {
        let port = expose("agentvm-no-such-ns", 80, "127.0.0.1".parse().unwrap())
            .await
            .unwrap();
        for _ in 0..2 {
            use tokio::io::AsyncReadExt;
            let mut c = TcpStream::connect(port.host).await.unwrap();
            let mut b = [0u8; 1];
            // Closed without a byte: the namespace is not there.
            assert_eq!(c.read(&mut b).await.unwrap(), 0);
        }
        let host = port.host;
        port.close().await;
        assert!(TcpStream::connect(host).await.is_err());
    }

    #[tokio::test]
    async fn a_port_is_opened_again_at_its_address_but_not_while_another_listens_there() {
        let first = expose("agentvm-x", 80, "127.0.0.1".parse().unwrap())
            .await
            .unwrap();
        let host = first.host;
        // A connection host-agent closes first (no namespace to reach the
        // guest in): its end at `host` stays in TIME_WAIT.
        let mut c = TcpStream::connect(host).await.unwrap();
        let mut rest = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut c, &mut rest)
            .await
            .unwrap();
        drop(c);
        // While it listens, the address is not taken twice.
        let err = expose_at("agentvm-x", 80, host).await.unwrap_err();
        assert!(err.to_string().contains(&host.to_string()), "{err}");
        first.close().await;
        let again = expose_at("agentvm-x", 80, host).await.unwrap();
        assert_eq!(again.host, host);
        assert!(TcpStream::connect(host).await.is_ok());
    }
}
