//! The host side: the Unix socket host processes connect to (`CONNECT
//! <port>` lines), and the event-loop registration of every connection's
//! socket.

use super::*;

impl Vsock {
    /// A host process finished its `CONNECT <port>` line and the device may
    /// ask the guest now: send the REQUEST, which the guest must answer
    /// within [`handshake::CONNECT_TIMEOUT`].
    pub(super) fn host_connect(&mut self, stream: UnixStream, peer_port: u32) -> Key {
        let local = self.alloc_local_port();
        let key = (local, peer_port);
        let mut conn = Conn::new(stream, ConnState::AwaitingResponse);
        let deadline = Instant::now() + self.limits.connect;
        conn.deadline = Some(deadline);
        self.deadlines.arm_by(deadline);
        self.conns.insert(key, conn);
        let req = self.header(local, peer_port, OP_REQUEST);
        self.push_control(req);
        key
    }

    /// Accepts host connections on the Unix socket until none is waiting.
    /// They are accepted whether or not the guest has started the device,
    /// so that each one's wait is bounded ([`handshake::ADMISSION_LIMIT`]): a guest
    /// without a vsock driver must not leave a host process blocked for good.
    pub(super) fn accept_host_connections(&mut self, ops: &mut EventOps) {
        loop {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!(error = %e, "vsock: accept failed");
                    return;
                }
            };
            if !self.connection_budget_left() || stream.set_nonblocking(true).is_err() {
                tracing::debug!("vsock: host connection refused (too many connections)");
                continue;
            }
            let fd = stream.as_raw_fd();
            if ops
                .add(Events::new(
                    &stream,
                    EventSet::IN | EventSet::EDGE_TRIGGERED,
                ))
                .is_err()
            {
                continue;
            }
            let deadline = Instant::now() + self.limits.admission;
            self.deadlines.arm_by(deadline);
            self.pending_hosts.insert(
                fd,
                PendingHost {
                    stream,
                    line: Vec::with_capacity(MAX_CONNECT_LINE),
                    port: None,
                    deadline,
                    dead: false,
                },
            );
            self.read_connect_line(fd);
        }
    }

    /// Reads what a host socket has sent of its `CONNECT <port>\n` line.
    pub(super) fn read_connect_line(&mut self, fd: RawFd) {
        let Some(p) = self.pending_hosts.get_mut(&fd) else {
            return;
        };
        if p.port.is_some() {
            // Complete and waiting for the device: data after the line
            // stays in the socket for the guest.
            return;
        }
        let mut byte = [0u8; 1];
        // Byte by byte, so nothing after the newline is consumed.
        loop {
            match (&p.stream).read(&mut byte) {
                Ok(0) => {
                    p.dead = true;
                    return;
                }
                Ok(_) if byte[0] == b'\n' => break,
                Ok(_) if p.line.len() < MAX_CONNECT_LINE => p.line.push(byte[0]),
                Ok(_) => {
                    p.dead = true;
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => {
                    p.dead = true;
                    return;
                }
            }
        }
        let port = std::str::from_utf8(&p.line)
            .ok()
            .and_then(|l| l.strip_prefix("CONNECT "))
            .and_then(|p| p.trim().parse::<u32>().ok());
        match port {
            Some(port) => p.port = Some(port),
            None => {
                tracing::debug!("vsock: bad CONNECT line");
                p.dead = true;
            }
        }
    }

    /// Sends the guest a REQUEST for every host connection whose CONNECT
    /// line is complete, once the device is started and no restore reset
    /// holds connections back: neither one still owed (the restored VM has
    /// not run yet) nor one the guest has not taken.
    pub(super) fn admit_waiting_hosts(&mut self, ops: &mut EventOps) {
        // Runs after every event: nothing to do on the data path's usual
        // case, no host waiting.
        if self.pending_hosts.is_empty()
            || !self.is_activated()
            || self.reset_event_owed
            || self.reset_hold.holding()
        {
            return;
        }
        let ready: Vec<RawFd> = self
            .pending_hosts
            .iter()
            .filter(|(_, p)| !p.dead && p.port.is_some())
            .map(|(fd, _)| *fd)
            .collect();
        for fd in ready {
            let Some(p) = self.pending_hosts.remove(&fd) else {
                continue;
            };
            let Some(port) = p.port else {
                continue;
            };
            let key = self.host_connect(p.stream, port);
            // Same fd, now a connection: also watch for room to write.
            if let Some(c) = self.conns.get(&key) {
                let events = Events::new(
                    &c.stream,
                    EventSet::IN | EventSet::OUT | EventSet::EDGE_TRIGGERED,
                );
                if ops.modify(events).is_ok() {
                    self.conn_fds.insert(fd, key);
                } else {
                    self.kill(key, true);
                }
            }
        }
    }

    /// Watches the sockets of connections the guest opened.
    pub(super) fn watch_new_connections(&mut self, ops: &mut EventOps) {
        for key in std::mem::take(&mut self.new_fds) {
            let Some(c) = self.conns.get(&key) else {
                continue;
            };
            let fd = c.stream.as_raw_fd();
            let events = Events::new(
                &c.stream,
                EventSet::IN | EventSet::OUT | EventSet::EDGE_TRIGGERED,
            );
            if ops.add(events).is_ok() {
                self.conn_fds.insert(fd, key);
            } else {
                self.kill(key, true);
            }
        }
    }

    /// Unregisters and closes ended connections and host sockets.
    pub(super) fn reap(&mut self, ops: &mut EventOps) {
        let dead_hosts: Vec<RawFd> = self
            .pending_hosts
            .iter()
            .filter(|(_, p)| p.dead)
            .map(|(fd, _)| *fd)
            .collect();
        for fd in dead_hosts {
            if let Some(p) = self.pending_hosts.remove(&fd) {
                let _ = ops.remove(Events::new(&p.stream, EventSet::IN));
            }
        }
        let dead: Vec<Key> = self
            .conns
            .iter()
            .filter(|(_, c)| c.dead)
            .map(|(k, _)| *k)
            .collect();
        for key in dead {
            if let Some(c) = self.conns.remove(&key) {
                let fd = c.stream.as_raw_fd();
                if self.conn_fds.remove(&fd).is_some() {
                    let _ = ops.remove(Events::new(&c.stream, EventSet::IN));
                }
            }
        }
    }

    pub(super) fn on_connection_event(&mut self, fd: RawFd, set: EventSet) {
        let Some(&key) = self.conn_fds.get(&fd) else {
            return;
        };
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        if set
            .intersects(EventSet::IN | EventSet::HANG_UP | EventSet::READ_HANG_UP | EventSet::ERROR)
        {
            c.readable = true;
        }
        if set.contains(EventSet::OUT) && c.flush_tx().is_err() {
            self.kill(key, true);
        }
    }
}
