//! Exposed ports of live sessions (ExposePort, UnexposePort): a node
//! listener per guest port ([`crate::network::expose`]), held with the
//! session and closed when it ends. They live in host-agent's memory: a
//! restarted host-agent has none, and the client exposes them again.

use super::*;
use crate::network::expose::{expose, ExposedPort};

/// Most ports one session may expose.
pub const MAX_EXPOSED_PORTS: usize = 64;

impl Manager {
    /// Exposes TCP `guest_port` of live session `id`; the same address again
    /// when it is already exposed.
    pub async fn expose_port(&self, id: &str, guest_port: u32, protocol: &str) -> Result<Exposed> {
        if !protocol.is_empty() && !protocol.eq_ignore_ascii_case("tcp") {
            return Err(Error::invalid(format!(
                "protocol {protocol:?}: only tcp ports are exposed"
            )));
        }
        let port = u16::try_from(guest_port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| Error::invalid(format!("guest_port {guest_port} is not 1 to 65535")))?;
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let node = self.network.clone().ok_or_else(|| {
            Error::FailedPrecondition("this node has no network configured".into())
        })?;
        let netns = {
            let i = sess.lock();
            live_network(id, &i)?;
            if let Some(e) = i.exposed.get(&port) {
                return Ok(Exposed::of(e));
            }
            if i.exposed.len() >= MAX_EXPOSED_PORTS {
                return Err(Error::ResourceExhausted(format!(
                    "session {id} already exposes {MAX_EXPOSED_PORTS} ports; unexpose one first"
                )));
            }
            i.network
                .as_ref()
                .map(|n| n.netns.clone())
                .unwrap_or_default()
        };
        let exposed = expose(&netns, port, node.expose_address()).await?;
        let out = Exposed::of(&exposed);
        sess.lock().exposed.insert(port, exposed);
        self.note(
            &sess,
            "port_exposed",
            &format!("tcp {port} at {}", out.host),
        )?;
        Ok(out)
    }

    /// Closes exposed `guest_port` of session `id` and its connections.
    pub async fn unexpose_port(&self, id: &str, guest_port: u32) -> Result<NetworkState> {
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let removed = {
            let mut i = sess.lock();
            live_network(id, &i)?;
            u16::try_from(guest_port)
                .ok()
                .and_then(|p| i.exposed.remove(&p))
        };
        let Some(removed) = removed else {
            return Err(Error::not_found("exposed port", guest_port.to_string()));
        };
        let detail = format!("tcp {} at {}", removed.guest_port, removed.host);
        removed.close().await;
        self.note(&sess, "port_unexposed", &detail)?;
        self.network_state(id)?
            .ok_or_else(|| Error::FailedPrecondition(format!("session {id} has no network")))
    }

    /// Session `id`'s network as it is now; `None` when it has none.
    pub fn network_state(&self, id: &str) -> Result<Option<NetworkState>> {
        let sess = self.session(id)?;
        let i = sess.lock();
        let Some(vm) = i.network.as_ref() else {
            return Ok(None);
        };
        Ok(Some(NetworkState {
            allow: i.net_allow.iter().map(ToString::to_string).collect(),
            deny: i.net_deny.iter().map(ToString::to_string).collect(),
            vm_address: vm.slot.vm_ip.to_string(),
            vm_address6: vm.slot.v6.map(|v6| v6.vm_ip.to_string()),
            hosts: i.net_hosts.iter().map(|h| h.host.clone()).collect(),
            exposed: i.exposed.values().map(Exposed::of).collect(),
        }))
    }
}

/// Fails unless the session is live and has a network.
fn live_network(id: &str, i: &Inner) -> Result<()> {
    if is_terminal(i.row.state) {
        return Err(Error::FailedPrecondition(format!(
            "session {id} is {}; its network is gone",
            state_name(i.row.state)
        )));
    }
    if i.network.is_none() {
        return Err(Error::FailedPrecondition(format!(
            "session {id} has no network (its image's golden snapshot has no network device)"
        )));
    }
    Ok(())
}

/// An exposed port as the API reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exposed {
    /// The guest's TCP port.
    pub guest_port: u16,
    /// `address:port` on the node.
    pub host: String,
}

impl Exposed {
    fn of(e: &ExposedPort) -> Self {
        Self {
            guest_port: e.guest_port,
            host: e.host.to_string(),
        }
    }
}
