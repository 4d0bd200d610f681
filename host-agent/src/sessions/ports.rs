//! Exposed ports of live sessions (ExposePort, UnexposePort): a node
//! listener per guest port ([`crate::network::expose`]), held with the
//! session and closed when it ends.
//!
//! Each session's exposed ports are kept in its directory
//! ([`EXPOSED_FILE`], replaced whole by a rename at every change), so a
//! restarted host-agent opens them again at the addresses its clients hold
//! ([`Manager::reopen_exposed`]). One that cannot be opened there any more
//! (the port taken meanwhile, `network.expose_address` changed) is dropped
//! with a `port_unexposed` event saying why; the session is taken back all
//! the same.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::*;
use crate::network::expose::{expose, expose_at, ExposedPort};

/// Most ports one session may expose.
pub const MAX_EXPOSED_PORTS: usize = 64;
/// The file in a session's directory that lists its exposed ports.
pub(super) const EXPOSED_FILE: &str = "exposed-ports.json";

/// An exposed port as kept on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct KeptPort {
    guest_port: u16,
    host: SocketAddr,
}

impl KeptPort {
    fn of(e: &ExposedPort) -> Self {
        Self {
            guest_port: e.guest_port,
            host: e.host,
        }
    }
}

/// Replaces the list of exposed ports kept in `dir` with `ports`: written
/// beside it, flushed, then renamed over it, so a crash at any point leaves
/// either list whole.
fn keep_exposed(dir: &Path, ports: &[KeptPort]) -> Result<()> {
    use std::io::Write;
    let path = dir.join(EXPOSED_FILE);
    let tmp = dir.join(format!(".{EXPOSED_FILE}.tmp"));
    let text = serde_json::to_vec(ports)
        .map_err(|e| Error::Network(format!("encoding the session's exposed ports: {e}")))?;
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(&text)?;
        f.sync_all()
    });
    written
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io(
                format!("keeping the exposed ports in {}", path.display()),
                e,
            )
        })
}

/// The exposed ports kept in `dir`; none when there is no list.
fn kept_exposed(dir: &Path) -> Result<Vec<KeptPort>> {
    let path = dir.join(EXPOSED_FILE);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
    };
    serde_json::from_slice(&text)
        .map_err(|e| Error::Network(format!("{} does not parse: {e}", path.display())))
}

/// Removes the list of exposed ports kept in `dir` (a session that ended).
pub(super) fn forget_exposed(dir: &Path) {
    if !dir.as_os_str().is_empty() {
        let _ = std::fs::remove_file(dir.join(EXPOSED_FILE));
    }
}

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
        let (netns, mut kept, dir) = {
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
            let netns = i
                .network
                .as_ref()
                .map(|n| n.netns.clone())
                .unwrap_or_default();
            let kept: Vec<KeptPort> = i.exposed.values().map(KeptPort::of).collect();
            (netns, kept, PathBuf::from(&i.row.dir))
        };
        let exposed = expose(&netns, port, node.expose_address()).await?;
        let out = Exposed::of(&exposed);
        // Kept before it is answered: a client never holds an address a
        // restarted host-agent would not open again. (The listener closes
        // if this fails.)
        kept.push(KeptPort::of(&exposed));
        keep_exposed(&dir, &kept)?;
        {
            let mut i = sess.lock();
            if is_terminal(i.row.state) {
                // Ended meanwhile (its vmm exited): the list went with it.
                drop(i);
                forget_exposed(&dir);
                return Err(Error::FailedPrecondition(format!(
                    "session {id} ended; its network is gone"
                )));
            }
            i.exposed.insert(port, exposed);
        }
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
        let (port, rest, dir) = {
            let i = sess.lock();
            live_network(id, &i)?;
            let port = u16::try_from(guest_port)
                .ok()
                .filter(|p| i.exposed.contains_key(p))
                .ok_or_else(|| Error::not_found("exposed port", guest_port.to_string()))?;
            let rest: Vec<KeptPort> = i
                .exposed
                .values()
                .filter(|e| e.guest_port != port)
                .map(KeptPort::of)
                .collect();
            (port, rest, PathBuf::from(&i.row.dir))
        };
        // Forgotten first: if that fails, the port stays as it is kept.
        keep_exposed(&dir, &rest)?;
        let removed = sess.lock().exposed.remove(&port);
        let Some(removed) = removed else {
            // Closed meanwhile with the session.
            return Err(Error::not_found("exposed port", guest_port.to_string()));
        };
        let detail = format!("tcp {} at {}", removed.guest_port, removed.host);
        removed.close().await;
        self.note(&sess, "port_unexposed", &detail)?;
        self.network_state(id)?
            .ok_or_else(|| Error::FailedPrecondition(format!("session {id} has no network")))
    }

    /// Opens again, after a restart, the exposed ports kept for session
    /// `sess` (taken back, with its network), each at the address it had.
    /// One that cannot be opened there is dropped from the list with a
    /// `port_unexposed` event saying why; nothing here fails the session.
    pub(super) async fn reopen_exposed(&self, sess: &Session) {
        let (dir, netns, state) = {
            let i = sess.lock();
            let netns = i.network.as_ref().map(|n| n.netns.clone());
            (PathBuf::from(&i.row.dir), netns, i.row.state)
        };
        if is_terminal(state) || state == S::Stopping as i32 {
            // Its ports close (or closed) with it.
            return;
        }
        let kept = match kept_exposed(&dir) {
            Ok(k) => k,
            Err(e) => {
                tracing::warn!(session = %sess.id, error = %e, "the session's exposed ports are not opened again");
                return;
            }
        };
        if kept.is_empty() {
            return;
        }
        let bind = self.network.as_ref().map(|n| n.expose_address());
        let mut opened = Vec::new();
        let mut dropped = Vec::new();
        for k in kept {
            let result = match (&netns, bind) {
                (None, _) | (_, None) => Err("the session's network is gone".to_string()),
                (Some(_), Some(bind)) if bind != k.host.ip() => Err(format!(
                    "network.expose_address is now {bind}; expose the port again"
                )),
                (Some(netns), Some(_)) => expose_at(netns, k.guest_port, k.host)
                    .await
                    .map_err(|e| format!("{e}; expose the port again")),
            };
            match result {
                Ok(port) => opened.push(port),
                Err(why) => dropped.push((k, why)),
            }
        }
        if !dropped.is_empty() {
            let rest: Vec<KeptPort> = opened.iter().map(KeptPort::of).collect();
            if let Err(e) = keep_exposed(&dir, &rest) {
                tracing::warn!(session = %sess.id, error = %e, "forgetting exposed ports that were not opened again");
            }
        }
        tracing::info!(
            session = %sess.id,
            opened = opened.len(),
            dropped = dropped.len(),
            "exposed ports opened again after the restart"
        );
        {
            let mut i = sess.lock();
            for port in opened {
                i.exposed.insert(port.guest_port, port);
            }
        }
        for (k, why) in dropped {
            let detail = format!(
                "tcp {} at {}: not opened again after a host-agent restart: {why}",
                k.guest_port, k.host
            );
            if let Err(e) = self.note(sess, "port_unexposed", &detail) {
                tracing::warn!(session = %sess.id, error = %e, "recording an exposed port dropped");
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kept_list_is_replaced_whole_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(kept_exposed(dir.path()).unwrap(), vec![]);
        let ports = vec![
            KeptPort {
                guest_port: 22,
                host: "127.0.0.1:40022".parse().unwrap(),
            },
            KeptPort {
                guest_port: 8080,
                host: "[::1]:48080".parse().unwrap(),
            },
        ];
        keep_exposed(dir.path(), &ports).unwrap();
        assert_eq!(kept_exposed(dir.path()).unwrap(), ports);
        keep_exposed(dir.path(), &ports[1..]).unwrap();
        assert_eq!(kept_exposed(dir.path()).unwrap(), &ports[1..]);
        // Nothing is left beside it.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, [EXPOSED_FILE]);
        forget_exposed(dir.path());
        assert_eq!(kept_exposed(dir.path()).unwrap(), vec![]);
    }

    #[test]
    fn a_list_that_does_not_parse_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(EXPOSED_FILE), "[{").unwrap();
        let e = kept_exposed(dir.path()).unwrap_err();
        assert!(e.to_string().contains(EXPOSED_FILE), "{e}");
    }
}
