//! The network counters of networked sessions, read for their usage
//! records: what the virtio-net device moved (the vmm's status, over its
//! control socket), the DNS queries the session's resolver refused (in
//! memory) and the packets the host-side rules dropped (the namespace's
//! `denied` counter, read with `nft`, a process per read: so less often).
//! Each reading is kept with the session; the next usage record absorbs it.

use super::*;
use crate::accounting::NetIo;

impl Manager {
    /// Reads every live networked session's counters; the namespaces'
    /// `denied` counters too when `with_denied`.
    pub async fn sample_network(&self, with_denied: bool) {
        for sess in self.all() {
            let (vmm, dns, vm, last) = {
                let i = sess.lock();
                if is_terminal(i.row.state) || i.network.is_none() {
                    continue;
                }
                (
                    i.vmm.clone(),
                    i.dns.clone(),
                    i.network.clone(),
                    i.net_reading,
                )
            };
            // What is not read now keeps its last value (no growth).
            let mut r = last.unwrap_or_default();
            let mut read = false;
            if let Some(vmm) = vmm {
                if let Ok(Some(n)) = vmm.status().await.map(|s| s.net) {
                    r.rx_bytes = n.rx_bytes;
                    r.rx_packets = n.rx_packets;
                    r.tx_bytes = n.tx_bytes;
                    r.tx_packets = n.tx_packets;
                    read = true;
                }
            }
            if let Some(dns) = dns {
                r.dns_denied = dns.stats().denied;
                read = true;
            }
            if let (true, Some(vm)) = (with_denied, vm) {
                let denied = tokio::task::spawn_blocking(move || vm.denied_packets()).await;
                if let Ok(Ok(n)) = denied {
                    r.denied_packets = n;
                    read = true;
                }
            }
            if read {
                sess.lock().net_reading = Some(r);
            }
        }
    }

    /// (guest packets the host-side rules dropped, DNS queries refused),
    /// summed over the sessions' meters.
    pub fn denied_totals(&self) -> (u64, u64) {
        let mut t = (0, 0);
        for s in self.all() {
            if let Some(n) = s.lock().meter.as_ref().map(|m| m.net()) {
                t.0 += n.denied_packets;
                t.1 += n.dns_denied;
            }
        }
        t
    }
}

/// The reading a usage record absorbs, if a new one came.
pub(super) fn take_reading(i: &mut Inner) -> Option<NetIo> {
    i.net_reading.take()
}
