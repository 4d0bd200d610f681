//! The guest's transmit queue: packets the guest sends (connection
//! requests, data, credit, shutdowns and resets), and guest connections to
//! host listeners at `<uds_path>_<port>`.

use super::*;

impl Vsock {
    /// Handles every packet the guest queued for transmission.
    pub fn process_tx(&mut self) -> usize {
        let Some(mem) = self.common.mem.clone() else {
            return 0;
        };
        let mut done = 0;
        while let Some(chain) = self.common.pop_chain(TX_QUEUE, &mem) {
            let head = chain.head_index();
            self.handle_tx_packet(&mem, chain);
            self.stats.tx_packets += 1;
            if let Err(e) = self.common.queues[TX_QUEUE].add_used(&mem, head, 0) {
                tracing::warn!(error = %e, "virtio-vsock cannot return a tx buffer");
                break;
            }
            done += 1;
        }
        if done > 0 {
            self.common.signal_used_queue(TX_QUEUE);
        }
        done
    }

    pub(super) fn handle_tx_packet(
        &mut self,
        mem: &GuestMemoryMmap,
        chain: DescriptorChain<&GuestMemoryMmap>,
    ) {
        let mut reader = match Reader::new(mem, chain) {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, "vsock tx packet with bad buffers dropped");
                return;
            }
        };
        let Ok(hdr) = reader.read_obj::<PacketHeader>() else {
            tracing::debug!("vsock tx packet shorter than a header dropped");
            return;
        };
        let (src_cid, dst_cid, op, type_) = (hdr.src_cid, hdr.dst_cid, hdr.op, hdr.type_);
        let key: Key = (hdr.dst_port, hdr.src_port);
        if src_cid != self.cid || dst_cid != HOST_CID || type_ != TYPE_STREAM {
            tracing::debug!(
                src_cid,
                dst_cid,
                type_,
                "vsock packet not for the host dropped"
            );
            if op != OP_RST && type_ == TYPE_STREAM && src_cid == self.cid {
                self.send_rst(key.0, key.1);
            }
            return;
        }
        if op == OP_REQUEST {
            self.guest_connect(key, &hdr);
            return;
        }
        let Some(c) = self.conns.get_mut(&key).filter(|c| !c.dead) else {
            if op != OP_RST {
                self.send_rst(key.0, key.1);
            }
            return;
        };
        c.update_peer_credit(&hdr);
        match op {
            OP_RESPONSE if c.state == ConnState::AwaitingResponse => {
                c.state = ConnState::Established;
                let line = format!("OK {}\n", key.0);
                // A fresh socket has room for a short line; a failure ends the connection.
                if (&c.stream).write_all(line.as_bytes()).is_err() {
                    self.kill(key, true);
                }
            }
            OP_RW if c.state == ConnState::Established => {
                let len = hdr.len as usize;
                if len > reader.available_bytes() {
                    tracing::debug!(len, "vsock RW packet shorter than its length: reset");
                    self.kill(key, true);
                    return;
                }
                if !c.accept_tx(len) {
                    tracing::debug!(len, "vsock guest exceeded its credit: reset");
                    self.kill(key, true);
                    return;
                }
                let mut left = len;
                while left > 0 {
                    let n = left.min(self.scratch.len());
                    if reader.read_exact(&mut self.scratch[..n]).is_err() {
                        break;
                    }
                    c.tx_buf.extend(&self.scratch[..n]);
                    left -= n;
                }
                if c.flush_tx().is_err() {
                    self.kill(key, true);
                }
            }
            OP_CREDIT_UPDATE => {}
            OP_CREDIT_REQUEST => c.credit_update_needed = true,
            OP_SHUTDOWN => {
                let flags = hdr.flags;
                if flags & SHUTDOWN_SEND != 0 {
                    c.peer_shut_send = true;
                }
                if flags & SHUTDOWN_RCV != 0 {
                    c.peer_shut_rcv = true;
                }
                if c.peer_shut_send && c.peer_shut_rcv {
                    // Both directions closed: the connection ends with a reset from us.
                    self.kill(key, true);
                } else if c.peer_shut_send && c.tx_buf.is_empty() {
                    let _ = c.stream.shutdown(std::net::Shutdown::Write);
                }
            }
            OP_RST => self.kill(key, false),
            _ => self.kill(key, true),
        }
    }

    /// The guest connects to host port `key.0`: reach `<uds_path>_<port>`.
    pub(super) fn guest_connect(&mut self, key: Key, hdr: &PacketHeader) {
        if self.conns.get(&key).is_some_and(|c| !c.dead) || !self.connection_budget_left() {
            self.send_rst(key.0, key.1);
            return;
        }
        let mut path = self.uds_path.clone().into_os_string();
        path.push(format!("_{}", key.0));
        let stream = match connect_nonblocking(&path) {
            Ok(s) => s,
            Err(_) => {
                tracing::debug!(path = ?path, "vsock: nothing listens for the guest's connection");
                self.send_rst(key.0, key.1);
                return;
            }
        };
        // A dead connection with the same key is still waiting to be unregistered.
        if self.conns.contains_key(&key) {
            self.send_rst(key.0, key.1);
            return;
        }
        let mut c = Conn::new(stream, ConnState::Established);
        c.update_peer_credit(hdr);
        self.new_fds.push(key);
        self.conns.insert(key, c);
        let resp = self.header(key.0, key.1, OP_RESPONSE);
        self.push_control(resp);
    }
}
