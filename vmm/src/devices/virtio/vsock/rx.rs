//! The guest's receive queue: control packets, then host data within
//! each connection's credit.

use super::*;

impl Vsock {
    /// Fills guest receive buffers: control packets first, then data from
    /// host sockets within each connection's credit.
    pub fn process_rx(&mut self) -> usize {
        let Some(mem) = self.common.mem.clone() else {
            return 0;
        };
        // Credit updates the guest should hear about.
        let mut updates = Vec::new();
        for (key, c) in self.conns.iter_mut() {
            if !c.dead && c.state == ConnState::Established && c.wants_credit_update() {
                // Counted as announced now, so one update is queued at a time; the
                // packet carries the then-current count when it is sent.
                c.credit_update_needed = false;
                c.announce_fwd_cnt();
                updates.push(*key);
            }
        }
        for key in updates {
            let h = self.header(key.0, key.1, OP_CREDIT_UPDATE);
            self.push_control(h);
        }
        let mut done = 0;
        loop {
            if let Some(mut hdr) = self.rx_control.front().copied() {
                let Some(chain) = self.common.pop_chain(RX_QUEUE, &mem) else {
                    break;
                };
                let head = chain.head_index();
                if let Some(c) = self.conns.get_mut(&(hdr.src_port, hdr.dst_port)) {
                    hdr.fwd_cnt = c.announce_fwd_cnt();
                }
                let used = match Writer::new(&mem, chain) {
                    Ok(mut w) => match w.write_obj(hdr) {
                        Ok(()) => HEADER_LEN as u32,
                        Err(_) => 0,
                    },
                    Err(_) => 0,
                };
                if hdr.op == OP_RST {
                    self.stats.rst_sent += 1;
                }
                self.rx_control.pop_front();
                self.add_rx_used(&mem, head, used);
                done += 1;
                continue;
            }
            let Some(key) = self.next_readable() else {
                break;
            };
            let Some(chain) = self.common.pop_chain(RX_QUEUE, &mem) else {
                break;
            };
            let head = chain.head_index();
            match self.fill_data_packet(&mem, key, chain) {
                Some(used) => {
                    self.add_rx_used(&mem, head, used);
                    done += 1;
                }
                None => self.common.queues[RX_QUEUE].go_to_previous_position(),
            }
        }
        if done > 0 {
            self.common.signal_used_queue(RX_QUEUE);
        }
        done
    }

    pub(super) fn add_rx_used(&mut self, mem: &GuestMemoryMmap, head: u16, used: u32) {
        self.stats.rx_packets += 1;
        if let Err(e) = self.common.queues[RX_QUEUE].add_used(mem, head, used) {
            tracing::warn!(error = %e, "virtio-vsock cannot return an rx buffer");
        }
    }

    /// A connection with host data to send and guest credit to send it with.
    pub(super) fn next_readable(&self) -> Option<Key> {
        self.conns
            .iter()
            .find(|(_, c)| c.can_send_to_guest())
            .map(|(k, _)| *k)
    }

    /// Reads host data for `key` into `chain`; returns the used length, or
    /// `None` when there was nothing to send after all (the chain is unused).
    pub(super) fn fill_data_packet(
        &mut self,
        mem: &GuestMemoryMmap,
        key: Key,
        chain: DescriptorChain<&GuestMemoryMmap>,
    ) -> Option<u32> {
        let mut hdr = self.header(key.0, key.1, OP_RW);
        let c = self.conns.get_mut(&key)?;
        // A buffer with room for a header only carries no data: reading
        // zero bytes into it would look like the host's end of stream.
        let mut writer = match Writer::new(mem, chain) {
            Ok(w) if w.available_bytes() > HEADER_LEN => w,
            _ => {
                tracing::debug!("vsock rx buffer has no room for data after the header: skipped");
                return Some(0);
            }
        };
        let room = (writer.available_bytes() - HEADER_LEN)
            .min(c.peer_credit() as usize)
            .min(self.scratch.len());
        match (&c.stream).read(&mut self.scratch[..room]) {
            Ok(0) => {
                // The host shut its write side: tell the guest nothing more
                // comes. Only that: the host may still read (a half close),
                // and if it closed altogether, the guest's next write to it
                // fails and resets the connection. (Saying "nor receive" too
                // made Linux reset a connection whose host still waited for
                // the guest's answer; seen with a real guest.)
                c.host_eof = true;
                hdr.op = OP_SHUTDOWN;
                hdr.flags = SHUTDOWN_SEND;
                hdr.fwd_cnt = c.announce_fwd_cnt();
                writer.write_obj(hdr).ok()?;
                Some(HEADER_LEN as u32)
            }
            Ok(n) => {
                hdr.len = n as u32;
                hdr.fwd_cnt = c.announce_fwd_cnt();
                c.rx_cnt += Wrapping(n as u32);
                if writer.write_obj(hdr).is_err() || writer.write_all(&self.scratch[..n]).is_err() {
                    return Some(0);
                }
                Some((HEADER_LEN + n) as u32)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                c.readable = false;
                None
            }
            Err(e) => {
                tracing::debug!(error = %e, "vsock host socket read failed: reset");
                c.dead = true;
                hdr.op = OP_RST;
                writer.write_obj(hdr).ok()?;
                self.stats.rst_sent += 1;
                Some(HEADER_LEN as u32)
            }
        }
    }
}
